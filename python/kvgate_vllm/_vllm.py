"""vLLM's connector base classes when vLLM is installed, stand-ins when it is not.

The stand-ins carry the same constructor and metadata plumbing so the connector can be
driven by a test harness in vLLM's call order on machines without vLLM (and without a GPU).
"""

from __future__ import annotations

import enum
import re
from typing import Any, Optional

# vLLM releases whose KVConnectorBase_V1 and Request.block_hashes this connector targets.
MIN_VLLM = (0, 10, 2)
MAX_TESTED_VLLM = (0, 13)
SUPPORTED_VLLM = ">=0.10.2 (tested API: 0.11-0.13)"


def _version_tuple(v: str) -> tuple:
    parts = re.findall(r"\d+", v)[:3]
    return tuple(int(p) for p in parts)


try:  # pragma: no cover - exercised only where vLLM is installed
    import vllm  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    VLLM_VERSION: Optional[str] = getattr(vllm, "__version__", "0")
    HAVE_VLLM = True
except ImportError:
    VLLM_VERSION = None
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in with vLLM's constructor and metadata binding (no vLLM installed)."""

        def __init__(self, vllm_config: Any, role: "KVConnectorRole", kv_cache_config: Any = None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


def hashes_cover_prompt_embeds() -> bool:
    """Whether vLLM's block hashes mix in a prompt given as embeddings (vLLM PR 27219, after
    0.11.0). Before it such a prompt hashed as its placeholder token ids (zeros), so every one
    of a length had the same hashes. Told by the helper that PR added: a vLLM that renamed it
    reads as not covering them (a miss for such prompts, never another prompt's KV)."""
    if not HAVE_VLLM:
        return True  # no vLLM: the tests' harness hands the connector its own hashes
    try:
        from vllm.v1.core import kv_cache_utils  # type: ignore
    except ImportError:
        return False
    return hasattr(kv_cache_utils, "_gen_prompt_embeds_extra_hash_keys")


def check_vllm_version(version: Optional[str] = VLLM_VERSION) -> None:
    """Fails with a clear message on a vLLM older than this connector's API."""
    if version is None:
        return
    v = _version_tuple(version)
    if v and v < MIN_VLLM:
        raise RuntimeError(
            f"kvgate_vllm needs vLLM {SUPPORTED_VLLM}; this is vLLM {version}, whose KV connector API "
            "lacks Request.block_hashes / async lookups. Upgrade vLLM."
        )
