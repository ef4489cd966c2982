"""kvgate's vLLM KV connector: `--kv-transfer-config '{"kv_connector":"KVGateConnector",
"kv_connector_module_path":"kvgate_vllm","kv_role":"kv_both"}'` (docs/vllm.md)."""

from ._vllm import HAVE_VLLM, SUPPORTED_VLLM, VLLM_VERSION
from .client import AgentClient, AgentError
from .connector import ConfigurationError, KVGateConnector, KVGateMetadata, engine_settings

__version__ = "0.1.0"
__all__ = [
    "KVGateConnector",
    "KVGateMetadata",
    "AgentClient",
    "AgentError",
    "ConfigurationError",
    "engine_settings",
    "HAVE_VLLM",
    "VLLM_VERSION",
    "SUPPORTED_VLLM",
]
