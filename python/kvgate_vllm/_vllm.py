"""vLLM's connector base classes when vLLM is installed, stand-ins when it is not.

The stand-ins carry the same constructor and metadata plumbing so the connector can be
driven by a test harness in vLLM's call order on machines without vLLM (and without a GPU).
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Set

# vLLM releases whose KVConnectorBase_V1 and Request.block_hashes this connector targets. The
# harness drives it in the call orders of 0.11-0.13 and of 0.29 (loads started after the forward
# on steps without synchronous loads, get_transfer_results), both as read from vLLM's source
# (docs/vllm.md, "vLLM versions"): not run against a real vLLM here.
MIN_VLLM = (0, 10, 2)
MAX_TESTED_VLLM = (0, 29)
SUPPORTED_VLLM = (
    ">=0.10.2 (tested against the call orders of 0.11-0.13 and 0.29 as read from vLLM's source; "
    "not run against a real vLLM here)"
)

log = logging.getLogger("kvgate_vllm")


def _version_tuple(v: str) -> tuple:
    parts = re.findall(r"\d+", v)[:3]
    return tuple(int(p) for p in parts)


HAVE_VLLM_TRANSFER_RESULTS = False
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
    HAVE_VLLM = False
if HAVE_VLLM:  # pragma: no cover - exercised only where vLLM is installed
    # After 0.13 the worker asks get_transfer_results instead of get_finished. vLLM's own result
    # class where it is found (its defaults for the fields kvgate leaves alone), else a stand-in
    # with the fields vLLM's runners read.
    for _module in ("vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.v1.outputs"):
        try:
            KVConnectorTransferResults = getattr(__import__(_module, fromlist=["_"]), "KVConnectorTransferResults")
        except (ImportError, AttributeError):
            continue
        HAVE_VLLM_TRANSFER_RESULTS = True
        break
else:
    VLLM_VERSION = None

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

        # Hooks vLLM's base class has after 0.13, with its defaults (the harness calls them).
        def handle_preemptions(self, connector_metadata) -> None:
            return None

        def build_connector_worker_meta(self):
            return None

        def finish_forward(self) -> None:  # vLLM's V2 runner: the step's forward was launched
            return None


if not HAVE_VLLM_TRANSFER_RESULTS:

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Stand-in for vLLM's (after 0.13) result of get_transfer_results."""

        finished_sending: Set[str] = field(default_factory=set)
        finished_recving: Set[str] = field(default_factory=set)
        failed_recving: Set[str] = field(default_factory=set)
        prefix_replay_checkpoints: Any = None  # read by vLLM 0.29's runners; kvgate has none


_warned_untested = False


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


def default_none_hash_seed() -> Optional[str]:
    """The seed this vLLM derives NONE_HASH from under sha256_cbor when PYTHONHASHSEED is unset,
    or None where that NONE_HASH is random per process (vLLM before PR 51875, merged 2026-08-11)
    or unknown (no vLLM). Since that PR, `kv_cache_utils.resolve_none_hash_seed` returns
    PYTHONHASHSEED when set, else `DEFAULT_NONE_HASH_SEED` for cryptographic hashes (sha256,
    sha256_cbor): told by both names, so a vLLM that has the constant without that rule reads
    as random (a refused start, never keys that differ from vLLM's)."""
    if not HAVE_VLLM:
        return None
    try:
        from vllm.v1.core import kv_cache_utils  # type: ignore
    except ImportError:
        return None
    seed = getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", None)
    if not callable(getattr(kv_cache_utils, "resolve_none_hash_seed", None)) or not isinstance(seed, str) or not seed:
        return None
    return seed


def check_vllm_version(version: Optional[str] = VLLM_VERSION) -> None:
    """Fails with a clear message on a vLLM older than this connector's API; warns (once) on one
    newer than the call orders it was tested against."""
    global _warned_untested
    if version is None:
        return
    v = _version_tuple(version)
    if v and v < MIN_VLLM:
        raise RuntimeError(
            f"kvgate_vllm needs vLLM {SUPPORTED_VLLM}; this is vLLM {version}, whose KV connector API "
            "lacks Request.block_hashes / async lookups. Upgrade vLLM."
        )
    if v and v[:2] > MAX_TESTED_VLLM and not _warned_untested:
        _warned_untested = True
        log.warning(
            "kvgate_vllm: vLLM %s is newer than the KV connector call orders kvgate_vllm was tested against "
            "(%s); it refuses at start the modes it knows it cannot serve",
            version,
            SUPPORTED_VLLM,
        )
