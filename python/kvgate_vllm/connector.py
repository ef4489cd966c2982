"""KVGateConnector: vLLM's KVConnectorBase_V1 forwarding to the node's kvgate agent.

Scheduler side: asynchronous lookups of the request's chunk keys (vLLM's own block
hashes), load plans for the blocks vLLM allocated, saves of finished requests (their
blocks stay allocated until the agent has copied them out). Worker side: registers the
paged KV tensors, starts loads before the forward pass, waits per layer, reports saves
finished and blocks that failed to load (vLLM recomputes those). The agent being down
means 0 matched tokens and full prefill, never a hang or wrong KV.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import reprlib
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from . import _vllm, shm
from ._vllm import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    check_vllm_version,
    hashes_cover_prompt_embeds,
)
from .client import PROTOCOL_VERSION, AgentClient, AgentError, default_socket_path

log = logging.getLogger("kvgate_vllm")

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
for _name in ("float8_e4m3fn", "float8_e5m2"):  # torch >= 2.1
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _name
# vLLM's --kv-cache-dtype values for fp8 caches (allocated as uint8 or float8 tensors): the
# format the agent stores them as, byte for byte (raw or lossless codec; a lossy one refuses).
_FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass
class LoadSpec:
    req_id: str
    keys: List[bytes]
    block_ids: List[int]
    skip_blocks: int


@dataclass
class SaveSpec:
    req_id: str
    keys: List[bytes]
    block_ids: List[int]
    first: int


@dataclass
class KVGateMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)
    # Finished requests that had a load and no save: request_finished held their blocks until
    # every worker reports them in finished_sending, once no copy of their loads can land.
    holds: List[str] = field(default_factory=list)
    # Requests vLLM preempted this step (SchedulerOutput.preempted_req_ids): their blocks are
    # freed at once, no request_finished, and may be another request's in this very step.
    preempted: List[str] = field(default_factory=list)


class ConfigurationError(ValueError):
    """A vLLM setting that would make kvgate share nothing (or the wrong KV)."""


def _packed(keys: List[bytes]) -> bytes:
    """Chunk hashes as one bin of 32*n bytes (docs/agent-protocol.md, "Keys"): one msgpack
    value for the agent to decode instead of n, so a 512-key lookup costs it no per-key objects."""
    return b"".join(keys)


def _holds(tensor_dtype: torch.dtype, name: str) -> bool:
    """Whether a KV tensor of `tensor_dtype` holds KV of the dtype `name` the agent is told at
    hello (fp8 caches are float8 or uint8 tensors: vLLM allocates them as bytes)."""
    if _DTYPES.get(tensor_dtype) == name:
        return True
    return tensor_dtype == torch.uint8 and name.startswith("float8")


def _dtype_name(d: Any) -> str:
    if isinstance(d, torch.dtype):
        if d not in _DTYPES:
            raise ConfigurationError(
                f"KV cache dtype {d} is not supported by kvgate (float16, bfloat16, float32, float8_e4m3fn, float8_e5m2)"
            )
        return _DTYPES[d]
    return str(d)


# vLLM's BlockPool keeps block 0 as its null block: the placeholder a sliding-window or chunked
# local attention manager puts in a request's block table for blocks that fell out of its
# window (their KV is gone; block 0 holds nothing of the request's). Such positions are never
# saved from nor loaded into. The null blocks of a table are always its leading ones.
NULL_BLOCK = 0


def _after_null_blocks(block_ids: List[int]) -> int:
    """The index after the last null block of `block_ids` (0 when it has none)."""
    for i in range(len(block_ids) - 1, -1, -1):
        if block_ids[i] == NULL_BLOCK:
            return i + 1
    return 0


_LAYOUTS = ("flash-attn", "flashinfer", "mla")
# kv_connector_extra_config keys and their defaults (docs/vllm.md lists them).
_EXTRA_MS_DEFAULTS = {"lookup_wait_ms": 2, "lookup_timeout_ms": 1000, "load_timeout_ms": 30000, "save_timeout_ms": 60000}
_EXTRA_KEYS = ("socket", "layout", "model_id", *_EXTRA_MS_DEFAULTS)
# A transfer given up is cancelled (or, an older agent's save, its connection dropped): one
# shorter than a chunk's copy would give up every transfer, so these have a floor.
_EXTRA_MS_MIN = {"load_timeout_ms": 100, "save_timeout_ms": 100}


def _check_extra_config(extra: Dict[str, Any]) -> Dict[str, Any]:
    """Checks kv_connector_extra_config: an unknown key (a typo such as "sokcet" would otherwise
    fall back to the default socket in silence) or a bad value is a ConfigurationError naming it.
    Returns the timeouts in seconds."""
    where = "kv_connector_extra_config"
    for key in extra:
        if key not in _EXTRA_KEYS:
            near = difflib.get_close_matches(str(key), _EXTRA_KEYS, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigurationError(f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(_EXTRA_KEYS)}")
    socket = extra.get("socket")
    if socket is not None and (not isinstance(socket, str) or not socket):
        raise ConfigurationError(f"{where}: socket: expected a path to the agent's Unix socket, got {socket!r}")
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        raise ConfigurationError(f"{where}: model_id: expected a non-empty string naming the weights, got {model_id!r}")
    layout = extra.get("layout")
    if layout is not None and layout not in _LAYOUTS:
        raise ConfigurationError(f"{where}: layout: expected one of {', '.join(_LAYOUTS)}, got {layout!r}")
    out = {}
    for key, default in _EXTRA_MS_DEFAULTS.items():
        v = extra.get(key, default)
        try:
            ms = float(v) if not isinstance(v, bool) else math.nan
        except (TypeError, ValueError):
            ms = math.nan
        least = _EXTRA_MS_MIN.get(key, 0)
        if not math.isfinite(ms) or ms < least:
            raise ConfigurationError(f"{where}: {key}: expected a number of milliseconds >= {least}, got {v!r}")
        out[key] = ms / 1000
    return out


def _checkpoint_quantized(model: Any) -> bool:
    """Whether the checkpoint carries its own quantization config (where vLLM reads it: the HF
    config's quantization_config, or compression_config, or its text config's)."""
    hf = getattr(model, "hf_config", None)
    for cfg in (hf, getattr(hf, "text_config", None), getattr(model, "hf_text_config", None)):
        if cfg is not None and any(getattr(cfg, k, None) for k in ("quantization_config", "compression_config")):
            return True
    return False


def model_identity(model: Any, extra: Dict[str, Any]) -> str:
    """The model id chunk keys are mixed with: what names the weights, never the alias clients
    use. `--served-model-name` is often the same ("default", "chat") for different models or
    fine-tunes of one base with the same geometry, which would then share keys: another model's
    KV. The model's path or Hugging Face id, with its revision and quantization when set; or the
    operator's `model_id` (for weights whose path differs between nodes).

    Nothing vLLM derives per node may enter it (keys must agree on every node of one model):
    for a model in object storage vLLM's `model` is the local directory it mirrored the config
    into (under its cache root; a temp dir in older vLLM) and `model_weights` the URI; and for a
    quantized checkpoint `quantization` is the kernel vLLM picked for this GPU and version
    (gptq_marlin or gptq), while the path already names the weights. Only a quantization applied
    as an unquantized checkpoint loads (--quantization fp8) changes them."""
    explicit = extra.get("model_id")
    if explicit is not None:
        return str(explicit)
    weights = getattr(model, "model_weights", None)
    ident = str(weights) if isinstance(weights, str) and weights else str(model.model)
    revision = getattr(model, "revision", None)
    if revision:
        ident += f"@{revision}"
    quantization = getattr(model, "quantization", None)
    if quantization and not _checkpoint_quantized(model):
        ident += f"+{quantization}"
    return ident


def check_kv_cache_groups(kv_cache_config: Any) -> None:
    """Refuses vLLM's hybrid KV cache manager (more than one KV cache group: full attention beside
    sliding window or Mamba layers). Its blocks come one list per group and its requests finish
    once for all groups (SupportsHMA); kvgate reads one group's blocks, so the others' KV would be
    neither saved nor loaded while their tokens counted as loaded."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        raise ConfigurationError(
            f"KVGateConnector does not support vLLM's hybrid KV cache manager ({len(groups)} KV cache groups): "
            "run vLLM with --disable-hybrid-kv-cache-manager"
        )


def none_hash_seed() -> str:
    """The seed vLLM derives its first block's parent hash (NONE_HASH) from: PYTHONHASHSEED when
    set, else the fixed default of a vLLM that has one (PR 51875). kvgate names it in the agent's
    hello, so it keys chunks and namespaces as this engine's block hashes do."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        default = _vllm.default_none_hash_seed()
        if default is not None:
            return default
        raise ConfigurationError(
            "KVGateConnector needs a fixed PYTHONHASHSEED (e.g. PYTHONHASHSEED=0) in vLLM's environment, the same "
            "on every node: this vLLM draws its first block hash at random per process without it, so no prefix "
            "would ever be shared (vLLM releases with PR 51875, from 2026-08, derive it from a fixed default instead)"
        )
    if seed in ("", "random"):
        # Python takes both as "randomize"; vLLM hashes the string itself, and an open vLLM change
        # (PR 53307) would make "" random per process: refused rather than guessed.
        raise ConfigurationError(
            f"KVGateConnector needs PYTHONHASHSEED unset or fixed (e.g. PYTHONHASHSEED=0), not {seed!r}: "
            "vLLM releases disagree on what NONE_HASH that value gives"
        )
    return seed


def engine_settings(vllm_config: Any) -> Dict[str, Any]:
    """What the agent must know about this engine, read from vLLM's config (and checked)."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    par = vllm_config.parallel_config
    algo = getattr(cache, "prefix_caching_hash_algo", None)
    if algo != "sha256_cbor":
        raise ConfigurationError(
            f"KVGateConnector needs `--prefix-caching-hash-algo sha256_cbor` (this engine uses {algo!r}): "
            "kvgate keys chunks by vLLM's block hashes, and only sha256_cbor hashes agree across processes and nodes"
        )
    seed = none_hash_seed()
    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    waits = _check_extra_config(extra)
    use_mla = bool(getattr(model, "use_mla", False))
    layout = extra.get("layout")
    if layout is None:
        # vLLM after 0.13 takes the backend from --attention-backend (attention_config.backend, an
        # AttentionBackendEnum; None: vLLM picks), VLLM_ATTENTION_BACKEND being deprecated.
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        backend = getattr(backend, "name", backend) if backend is not None else None
        if backend is None:
            backend = os.environ.get("VLLM_ATTENTION_BACKEND", "")
        if use_mla:
            layout = "mla"
        elif "FLASHINFER" in str(backend).upper():
            layout = "flashinfer"
        else:
            layout = "flash-attn"
    dtype = getattr(cache, "cache_dtype", "auto")
    if dtype in (None, "auto"):
        dtype = model.dtype
    if isinstance(dtype, str) and dtype.startswith("fp8"):
        if dtype not in _FP8_CACHE_DTYPES:
            raise ConfigurationError(
                f"--kv-cache-dtype {dtype} is not supported by kvgate (fp8, fp8_e4m3, fp8_e5m2, or auto)"
            )
        dtype = _FP8_CACHE_DTYPES[dtype]
    world = int(getattr(par, "tensor_parallel_size", 1))
    if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1:
        # Each stage holds other layers but would register and store them under the same chunk
        # keys (the namespace has the TP shard, not the stage): one stage would load another's KV.
        raise ConfigurationError(
            "KVGateConnector does not support pipeline parallelism (--pipeline-parallel-size > 1): "
            "its stages would share chunk keys for different layers"
        )
    for knob in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(par, knob, 1) or 1) > 1:
            # Each rank holds every n-th token of a block, and vLLM hashes blocks of block_size * n
            # tokens: neither the chunk keys nor the blocks' bytes would be what kvgate assumes.
            raise ConfigurationError(
                f"KVGateConnector does not support context parallelism (--{knob.replace('_', '-')} > 1): "
                "its ranks split each block's tokens and vLLM hashes larger blocks"
            )
    return {
        "model": model_identity(model, extra),
        "socket": extra.get("socket") or default_socket_path(),
        "hashSeed": seed,
        "blockSize": int(cache.block_size),
        "layout": layout,
        "layers": int(model.get_num_layers(par)),
        "kvHeads": 1 if layout == "mla" else int(model.get_num_kv_heads(par)),
        "headSize": int(model.get_head_size()),
        "dtype": _dtype_name(dtype),
        "world": world,
        "rank": int(getattr(par, "rank", 0)) % world,
        "lookupWaitS": waits["lookup_wait_ms"],
        "lookupTimeoutS": waits["lookup_timeout_ms"],
        "loadTimeoutS": waits["load_timeout_ms"],
        "saveTimeoutS": waits["save_timeout_ms"],
    }


def _layout_shape(layout: str, shape: List[int], s: Dict[str, Any]) -> Tuple[int, List[int]]:
    """The number of blocks a KV layer of `shape` holds in `layout`, and the shape it must then
    have (vLLM's per-layer paged KV tensors)."""
    if layout == "flash-attn":
        num_blocks = shape[1] if len(shape) > 1 else -1
        return num_blocks, [2, num_blocks, s["blockSize"], s["kvHeads"], s["headSize"]]
    num_blocks = shape[0] if shape else -1
    if layout == "flashinfer":
        return num_blocks, [num_blocks, 2, s["blockSize"], s["kvHeads"], s["headSize"]]
    return num_blocks, [num_blocks, s["blockSize"], s["headSize"]]


def _view_blocks(shape: List[int], s: Dict[str, Any]) -> Optional[int]:
    """The number of vLLM blocks a KV layer holds when `shape` is the per-layer view vLLM's
    attention backends hand over since PR #44455 (0.26): [blocks, kv_heads, block_size, C], C
    the K and V halves of each token's head side by side (MLA: kv_heads 1, C the latent). Since
    #51718 (0.29) each layer is such a view into one allocation, in any of six physical orders,
    and its block_size may be a kernel block size dividing vLLM's (`--block-size` above the
    attention kernel's): block b is then kernel blocks b*r .. b*r+r-1. None for other shapes."""
    mla = s["layout"] == "mla"
    if len(shape) != 4 or shape[3] != (1 if mla else 2) * s["headSize"] or shape[1] != (1 if mla else s["kvHeads"]):
        return None
    kernel = shape[2]
    if kernel <= 0 or s["blockSize"] % kernel or shape[0] % (s["blockSize"] // kernel):
        return None
    return shape[0] // (s["blockSize"] // kernel)


def pci_bus_id(props: Any) -> Optional[str]:
    """The GPU's PCI bus id ("0000:3b:00.0") from torch's device properties, or None when this
    torch does not expose it. The agent resolves it to its own device ordinal, which differs
    from the engine's when their CUDA_VISIBLE_DEVICES differ (vLLM gives each rank its GPU)."""
    try:
        domain, bus, dev = (int(getattr(props, a)) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    except (AttributeError, TypeError, ValueError):
        return None
    if not (0 <= domain <= 0xFFFFFFFF and 0 <= bus <= 0xFF and 0 <= dev <= 0xFF):
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def cuda_ipc(t: torch.Tensor) -> Dict[str, Any]:
    """The CUDA IPC handle of the allocation holding `t`, `t`'s byte offset in it, and its GPU:
    the engine's ordinal and, when torch knows it, the PCI bus id (which the agent prefers)."""
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    shared = storage._share_cuda_()
    device, handle, storage_bytes, storage_offset = shared[0], shared[1], shared[2], shared[3]
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != 64:
        raise ConfigurationError("this torch build returned no 64-byte CUDA IPC handle for the KV cache")
    out: Dict[str, Any] = {
        "handle": bytes(handle),
        "device": int(device),
        "offset": int(storage_offset) + t.storage_offset() * t.element_size(),
        # Where the storage ends in the allocation: the agent refuses a tensor that runs past it
        # (it cannot ask CUDA an allocation's size; a copy past it would hit other GPU memory).
        "storageEnd": int(storage_offset) + int(storage_bytes),
    }
    bus = pci_bus_id(torch.cuda.get_device_properties(int(device)))
    if bus is not None:
        out["pciBusId"] = bus
    return out


def _prompt_tokens(request: Any) -> int:
    """The prompt's length: vLLM's num_prompt_tokens (prompt_token_ids is None for a prompt
    given as embeddings; its block hashes cover them)."""
    n = getattr(request, "num_prompt_tokens", None)
    return n if type(n) is int else len(request.prompt_token_ids or ())


def _no_layer_hook_will_wait(forward_context: Any) -> bool:
    """Whether the forward may run without calling wait_for_layer_load: a FULL CUDA graph replay
    (vLLM's ForwardContext.cudagraph_runtime_mode, a CUDAGraphMode: NONE, PIECEWISE or FULL;
    absent before 0.11), or a forward context without attention metadata. vLLM's V2 runner
    starts a FULL replay's loads outside any forward context, under the stand-in
    set_forward_context(None, ...) of ActiveKVConnector._start_load_kv (mode NONE, no
    metadata), and vLLM's layer hooks skip a context without attention metadata."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    if getattr(mode, "name", None) == "FULL":
        return True
    return forward_context is not None and getattr(forward_context, "attn_metadata", ...) is None


def _fenced(f: Future) -> bool:
    """Whether no copy of this load can land any more: the agent answered it (after its last copy)
    or closed the connection (it died, or answered every load first). When this side dropped the
    connection the agent starts no copy, but one running may still land: only the agent process's
    exit (its pidfd, checked without blocking) then fences it."""
    if not f.done():
        return False
    e = f.exception()
    if not (isinstance(e, AgentError) and e.dropped_here):
        return True
    return e.agent is not None and e.agent.exited()


def _never_fenced(f: Future) -> bool:
    """A load failed by a connection this side dropped whose agent process cannot be watched: no
    fence will ever come for it."""
    e = f.exception() if f.done() else None
    if not (isinstance(e, AgentError) and e.dropped_here):
        return False
    return e.agent is None or not e.agent.watchable


class _LoadState:
    def __init__(self, spec: LoadSpec, num_layers: int):
        self.spec = spec
        self.layers = 0
        self.num_layers = num_layers
        # Why the agent's load-progress events for this load cannot be believed (None: they can).
        # Such a load is failed as one past load_timeout_ms is: its blocks recomputed, the agent
        # asked to cancel it, its answer awaited as its fence. The connection stays.
        self.bad: Optional[str] = None
        self.cond = threading.Condition()
        self.future: Optional[Future] = None

    def on_progress(self, ev: Dict[str, Any]) -> None:
        """A load-progress event, on the thread reading the socket: never raises (an exception
        there would drop the connection, and with it every load's fence but the agent's exit).
        `layers` must be a layer count of this engine: anything else (a string, a float, a count
        past the model's layers) would let a layer's wait pass before its copy landed."""
        n = ev.get("layers")
        with self.cond:
            if self.bad is None:
                if type(n) is int and 0 <= n <= self.num_layers:
                    self.layers = max(self.layers, n)
                else:
                    self.bad = f"load-progress layers {reprlib.repr(n)}"  # bounded, whatever was sent
            self.cond.notify_all()

    def wake(self) -> None:
        """The load was answered (or failed): its waiters look again."""
        with self.cond:
            self.cond.notify_all()

    def _settled(self) -> bool:
        return self.bad is not None or (self.future is not None and self.future.done())

    def wait_layer(self, n: int, deadline: float) -> None:
        with self.cond:
            while self.layers < n and not self._settled():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(min(left, 0.05))

    def wait_settled(self, deadline: float) -> None:
        """Until the load is answered, its progress turned out malformed, or `deadline`."""
        with self.cond:
            while not self._settled():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(min(left, 0.05))


class KVGateConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        check_kv_cache_groups(kv_cache_config)
        self._settings = s = engine_settings(vllm_config)
        self._block_size = s["blockSize"]
        self._hello = {
            "protocol": PROTOCOL_VERSION,
            "model": s["model"],
            "hashSeed": s["hashSeed"],
            "geometry": {
                k: s[k] for k in ("layout", "dtype", "layers", "kvHeads", "headSize", "blockSize", "world")
            },
        }
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        self._client = AgentClient(s["socket"], self._hello, on_connect=self._on_connect)
        # scheduler state
        # request id -> (the lookup's answer, when it was sent, how many chunk keys it asked)
        self._lookups: Dict[str, Tuple[Future, float, int]] = {}
        self._hits: Dict[str, int] = {}
        self._computed: Dict[str, int] = {}
        # request id -> the block ids its load fills, and blocks per chunk (to find the first
        # chunk a load error names: the request's save starts there)
        self._load_blocks: Dict[str, Tuple[List[int], int]] = {}
        self._pending_loads: List[LoadSpec] = []
        self._pending_saves: List[SaveSpec] = []
        self._pending_holds: List[str] = []
        self._warned_hash_size = False
        # Whether vLLM's block hashes tell prompts given as embeddings apart (_chunk_keys).
        self._embeds_hashed = hashes_cover_prompt_embeds()
        self._warned_late_loads = False
        # worker state
        self._register_msg: Optional[Dict[str, Any]] = None
        self._worker_id: Optional[int] = None
        self.agent_device: Optional[int] = None
        self._worker_generation = -1
        self._layer_index: Dict[str, int] = {}
        # The GPU of the registered KV (None: host tensors), whose stream the agent's copies follow.
        self._kv_device: Optional[torch.device] = None
        self._loads: List[_LoadState] = []
        # When this step's loads must have landed: one load_timeout_ms for the whole step
        # (every layer's wait and the final one), not one per layer and per load.
        self._load_deadline = 0.0
        # request id -> the save's answer and when it must have come: its blocks are held by vLLM
        # until then (an agent alive but stalled would hold them for ever).
        self._saves: Dict[str, Tuple[Future, float]] = {}
        # Saves past save_timeout_ms the agent was asked to cancel (their deadline is then the
        # cancel's: past it the connection is dropped).
        self._saves_cancelled: Set[str] = set()
        self._saves_done: Set[str] = set()
        self._finished_seen: Set[str] = set()
        self._load_errors: Set[int] = set()
        # request id -> its loads whose copies may still land (given up at load_timeout_ms, or
        # failed by a connection this side dropped): the request's blocks are not reported
        # freeable (finished_sending) while one is here. A load leaves once the agent answered it
        # (the answer comes after its last copy landed) or the agent closed or died.
        self._fences: Dict[str, List[Future]] = {}
        # Loads failed by a connection this side dropped (the agent may still be copying): their
        # requests' blocks stay allocated until the agent process exits (its pidfd), counted here
        # and logged; where no pidfd could be had, for good (a bounded leak), also counted in
        # loads_held_for_good.
        self.loads_unfenced = 0
        self.loads_held_for_good = 0
        # Loads failed because the agent's load-progress event for them was malformed (the
        # connection kept: each such load is cancelled and its answer awaited as its fence).
        self.loads_bad_progress = 0
        self._bad_progress_logged = -math.inf
        self._unfenced_seen: Set[int] = set()
        # Whether the forward of the bound step has run (a layer hook was called): loads started
        # after it would fill blocks the forward already read (vLLM after 0.13 starts a step's
        # loads after the forward when the step has no synchronous load).
        self._forward_ran = False
        # The metadata whose preempted requests were fenced (handle_preemptions or, on vLLM 0.11-0.13,
        # which never call it, start_load_kv): once per bound metadata, whichever comes first.
        self._preemptions_fenced: Optional[Any] = None
        # Saves whose blocks were released unstored (no agent, or it died or refused before it
        # answered): the blocks are never held for an agent that is gone, but the loss is counted.
        self.saves_not_stored = 0
        # At start an agent that refuses this engine fails it with the agent's message; later
        # (an agent restarted with other settings) it means running without kvgate.
        self._client.ensure(raise_refusal=True)

    @property
    def requires_kv_delivery(self) -> bool:
        # vLLM after 0.13 recomputes a preempted request whose hand-off is pending when this is
        # True (its default for kv_both). kvgate is a cache: a save not made is a later miss.
        return False

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._forward_ran = False
        # After 0.13 vLLM calls handle_preemptions(metadata) just before binding that metadata:
        # its fence stands for this step. Any other metadata is a new step's, not fenced yet.
        if connector_metadata is not self._preemptions_fenced:
            self._preemptions_fenced = None

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._forward_ran = False
        self._preemptions_fenced = None

    # ------------------------------------------------------------------ shared

    def _on_connect(self, client: AgentClient) -> None:
        answer = client.hello_answer or {}
        proto = answer.get("protocol")
        if type(proto) is not int:
            raise AgentError("ERR_BAD_ANSWER", f"hello answered protocol {proto!r}")
        if proto != PROTOCOL_VERSION:  # a refusal: the engine fails at start, later runs without kvgate
            raise AgentError(
                "ERR_PROTOCOL_VERSION",
                f"the agent answered hello for protocol {proto}; this connector speaks {PROTOCOL_VERSION}",
            )
        # Checked before anything uses it: chunk keys are cut by this size.
        ct = answer.get("chunkTokens")
        if type(ct) is not int or ct <= 0 or ct % self._block_size != 0:
            raise AgentError(
                "ERR_BAD_ANSWER", f"hello answered chunkTokens {ct!r}: not a multiple of {self._block_size}"
            )
        if self._register_msg is not None:
            ans = client.call("register", self._register_msg, timeout=10.0)
            worker = ans.get("worker")
            if type(worker) is not int:
                raise AgentError("ERR_BAD_ANSWER", f"register answered worker {worker!r}")
            self._worker_id = worker
            self._worker_generation = client.generation
            # The agent's ordinal of this rank's GPU (None for host tensors): where it maps and copies.
            self.agent_device = ans.get("device")

    @property
    def _chunk_tokens(self) -> Optional[int]:
        a = self._client.hello_answer
        return int(a["chunkTokens"]) if a else None

    def _blocks_per_chunk(self) -> Optional[int]:
        ct = self._chunk_tokens
        return None if ct is None else ct // self._block_size

    def _chunk_keys(self, request: Any, bpc: int, tokens: Optional[int] = None) -> List[bytes]:
        # Only vLLM's own block hashes: they mix in the LoRA adapter, images, cache_salt and
        # prompt embeddings, which hashes of the token ids alone would not (another request's KV).
        hashes = getattr(request, "block_hashes", None)
        if hashes is None:
            return []
        # A prompt given as embeddings, where vLLM hashes only its placeholder token ids: every
        # such prompt of one length has the same hashes (another prompt's KV). A miss instead.
        if getattr(request, "prompt_embeds", None) is not None and not self._embeds_hashed:
            return []
        # One hash per block_size tokens, or a chunk would be keyed by a prefix longer than the
        # blocks it holds (vLLM hashes blocks of its scheduler's block size, which another
        # setting can make larger): no keys then, a miss and no save.
        num_tokens = getattr(request, "num_tokens", None)
        if type(num_tokens) is int and len(hashes) != num_tokens // self._block_size:
            if not self._warned_hash_size:
                self._warned_hash_size = True
                log.warning(
                    "kvgate: vLLM gave %d block hashes for %d tokens, not one per %d-token block: "
                    "running without kvgate for such requests",
                    len(hashes),
                    num_tokens,
                    self._block_size,
                )
            return []
        n = len(hashes) // bpc
        if tokens is not None:
            n = min(n, tokens // (bpc * self._block_size))
        out = []
        for i in range(n):
            h = hashes[(i + 1) * bpc - 1]
            if not isinstance(h, (bytes, bytearray)) or len(h) != 32:
                raise ConfigurationError(
                    "vLLM's block hashes are not 32-byte sha256_cbor digests: this vLLM is too old for kvgate_vllm"
                )
            out.append(bytes(h))
        return out

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        rid = request.request_id
        prompt = _prompt_tokens(request)
        self._computed[rid] = num_computed_tokens
        st = self._lookups.get(rid)
        if st is None:
            if not self._client.ensure():
                return 0, False
            bpc = self._blocks_per_chunk()
            keys = self._chunk_keys(request, bpc, prompt) if bpc else []
            if not keys:
                self._hits[rid] = 0
                return 0, False
            # Waited on at once: this thread reads the answer itself when nothing else is in flight.
            f = self._client.request("lookup", {"keys": _packed(keys)}, wait_here=True)
            st = (f, time.monotonic(), len(keys))
            self._lookups[rid] = st
            try:
                f.result(timeout=self._settings["lookupWaitS"])
            except AgentError:
                pass
            except Exception:  # still pending: the scheduler asks again next step
                return None, False
        f, t0, asked = st
        if not f.done():
            if time.monotonic() - t0 < self._settings["lookupTimeoutS"]:
                return None, False
            chunks = 0
        else:
            try:
                chunks = f.result().get("chunks")
            except AgentError:
                chunks = 0
            if type(chunks) is not int or not 0 <= chunks <= asked:
                chunks = 0  # a malformed answer is a miss, never tokens vLLM would skip computing
        self._hits[rid] = chunks
        ct = self._chunk_tokens or 0
        tokens = chunks * ct
        if tokens >= prompt:
            tokens = prompt - 1  # vLLM computes at least the last prompt token itself
        return max(0, tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0:
            return
        bpc = self._blocks_per_chunk()
        chunks = self._hits.get(rid, 0)
        if not bpc or chunks == 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        keys = self._chunk_keys(request, bpc)
        chunks = min(chunks, len(block_ids) // bpc, len(keys))
        keys = keys[:chunks]
        # Blocks vLLM computed itself (its prefix cache) and null blocks (out of a sliding window):
        # nothing is copied into them.
        skip = max(self._computed.get(rid, 0) // self._block_size, _after_null_blocks(block_ids[: chunks * bpc]))
        self._pending_loads.append(LoadSpec(rid, keys, block_ids[: chunks * bpc], min(skip, chunks * bpc)))
        self._load_blocks[rid] = (block_ids[: chunks * bpc], bpc)

    def build_connector_meta(self, scheduler_output: Any) -> KVGateMetadata:
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        meta = KVGateMetadata(
            loads=self._pending_loads,
            saves=self._pending_saves,
            holds=self._pending_holds,
            preempted=sorted(r for r in preempted if isinstance(r, str)),
        )
        self._pending_loads = []
        self._pending_saves = []
        self._pending_holds = []
        if (meta.loads or meta.saves) and hasattr(scheduler_output, "has_sync_kv_loads"):
            # vLLM after 0.13 starts a step's loads before its forward only when this is set. The
            # scheduler sets it for kvgate's (synchronous) loads itself; set here too so no step
            # carrying them can start late, and for saves: started after the forward, they would
            # wait for it on the engine's stream before the agent copies.
            scheduler_output.has_sync_kv_loads = True
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        # Blocks the workers could not load (vLLM recomputes them): the request's save must
        # store their chunks, which request_finished would otherwise skip as loaded from kvgate.
        # A block id reused since by another request's load at most saves a chunk again.
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        for rid, (ids, bpc) in self._load_blocks.items():
            for i, b in enumerate(ids):
                if b in invalid:
                    self._hits[rid] = min(self._hits.get(rid, 0), i // bpc)
                    break

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._computed.pop(rid, None)
        # A request kvgate loaded into: a copy of its load may still be in flight on a worker
        # (given up at load_timeout_ms, the agent stalled): its blocks are held until every
        # worker says none can land (one step when its loads finished).
        loaded = self._load_blocks.pop(rid, None) is not None
        first = self._hits.pop(rid, 0)
        bpc = self._blocks_per_chunk()
        if not bpc or not self._client.ensure():
            return self._hold(rid, loaded)
        keys = self._chunk_keys(request, bpc)
        # Only chunks whose every token's KV vLLM computed: a request ends with a sampled token
        # that never went through the model, so when it completes a chunk (its block has a hash)
        # that chunk's last slot holds whatever the block held before. (vLLM's own prefix cache
        # caches by num_computed_tokens likewise; a request without it saves nothing.)
        computed = getattr(request, "num_computed_tokens", 0)
        computed = computed if type(computed) is int else 0
        n = min(len(keys), len(block_ids) // bpc, computed // (bpc * self._block_size))
        # vLLM after 0.13: only the first num_publishable_block_hashes hashes may key stored KV
        # (with EAGLE the draft model's KV of a block is materialised a step later).
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if type(publishable) is int:
            n = min(n, max(0, publishable) // bpc)
        # A chunk with a null block (its KV fell out of a sliding window) is never stored: block
        # 0's bytes would be served as that prefix's KV. Chunks after it are stored (a node that
        # holds the chunks before them serves them).
        first = max(first, -(-_after_null_blocks(list(block_ids[: n * bpc])) // bpc))
        if n <= first:
            return self._hold(rid, loaded)
        # A save holds the blocks too: the workers report it once it is stored and no load
        # copy of the request can land.
        self._pending_saves.append(SaveSpec(rid, keys[:n], list(block_ids[: n * bpc]), first))
        return True, None

    def _hold(self, rid: str, loaded: bool) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """request_finished's answer for a request with no save: held when kvgate loaded into it."""
        if not loaded:
            return False, None
        self._pending_holds.append(rid)
        return True, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        s = self._settings
        names = list(kv_caches)
        if len(names) != s["layers"]:
            raise ConfigurationError(f"vLLM registered {len(names)} KV layers; the model config says {s['layers']}")
        self._layer_index = {n: i for i, n in enumerate(names)}
        first = kv_caches[names[0]]
        layout = s["layout"]
        got = list(first.shape)
        # vLLM from 0.26: a 4-D view per layer; before, the backend's own shape. Both may be
        # views into a larger allocation (any strides): the agent copies through the strides.
        num_blocks = _view_blocks(got, s)
        want = got if num_blocks is not None else _layout_shape(layout, got, s)[1]
        if num_blocks is None:
            num_blocks = _layout_shape(layout, got, s)[0]
        tensors = []
        for n in names:
            t = kv_caches[n]
            if list(t.shape) != want or list(t.stride()) != list(first.stride()) or (t.dim() and t.stride()[-1] != 1):
                # The layout is inferred from the backend vLLM was told; one vLLM picked itself
                # (FlashInfer by default on some GPUs) is not known at start.
                got = list(t.shape)
                other = [o for o in ("flash-attn", "flashinfer") if o != layout and got == _layout_shape(o, got, s)[1]]
                hint = (
                    f': this is the {other[0]} layout, set "layout": "{other[0]}" in kv_connector_extra_config'
                    if other
                    else ' (kv_connector_extra_config "layout" names the backend\'s: flash-attn, flashinfer or mla)'
                )
                view = [-1, 1 if layout == "mla" else s["kvHeads"], s["blockSize"], (1 if layout == "mla" else 2) * s["headSize"]]
                raise ConfigurationError(
                    f"KV layer {n} has shape {got} and strides {list(t.stride())}; kvgate expects every layer alike "
                    f"(the strides of the first, the last dimension contiguous) in the {layout} layout {want} or, from "
                    f"vLLM 0.26, the per-layer view {view}{hint}"
                )
            # The agent cuts and labels blocks by the dtype the config named (hello): another one
            # would be stored as that dtype (and shared with engines really using it) or cut wrong.
            if not _holds(t.dtype, s["dtype"]):
                raise ConfigurationError(
                    f"KV layer {n} holds {t.dtype}; vLLM's config says the KV cache dtype is {s['dtype']}"
                )
            if t.is_cuda:
                tensors.append({"kind": "cuda-ipc", "shape": want, "strides": list(t.stride()), **cuda_ipc(t)})
                continue
            where = shm.describe(t)
            if where is None:
                raise ConfigurationError(
                    f"KV layer {n} is not in host shared memory: on a CPU engine allocate it with kvgate_vllm.shm"
                )
            tensors.append(
                {"kind": "shm", "path": where["path"], "offset": where["offset"], "shape": want, "strides": list(t.stride())}
            )
        self._register_msg = {"rank": s["rank"], "numBlocks": num_blocks, "tensors": tensors}
        self._kv_device = first.device if first.is_cuda else None
        if self._client.connected:
            try:
                self._on_connect(self._client)
            except AgentError as e:
                log.warning("kvgate: register failed: %s", e)
                self._client.close()
        else:
            self._client.ensure(raise_refusal=True)

    def _worker_ready(self) -> bool:
        if not self._client.ensure():
            return False
        return self._worker_id is not None and self._worker_generation == self._client.generation

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        # vLLM 0.11-0.13 never call handle_preemptions: the preempted requests' blocks may be
        # another request's in this step, so they are fenced here, before any load or forward.
        self._fence_preempted(meta)
        ready = self._worker_ready()
        if ready and (meta.loads or meta.saves) and self._kv_device is not None:
            # The agent copies on its own stream, unordered with vLLM's. With async scheduling
            # the previous step's kernels may still be writing the blocks: a finished request's
            # last tokens (its save would store what was there before) or a freed block now
            # allocated to a load (its kernel would overwrite what the agent loaded).
            torch.cuda.current_stream(self._kv_device).synchronize()
        late = bool(meta.loads) and self._forward_ran
        if late and not self._warned_late_loads:
            self._warned_late_loads = True
            log.warning(
                "kvgate: vLLM started this step's loads after its forward (a step without synchronous "
                "loads): their blocks are reported failed and vLLM recomputes them"
            )
        if meta.loads and not self._loads:
            self._load_deadline = time.monotonic() + self._settings["loadTimeoutS"]
        for spec in meta.loads:
            if not ready or late:
                self._load_errors.update(spec.block_ids[spec.skip_blocks :])
                continue
            st = _LoadState(spec, self._settings["layers"])
            st.future = self._client.request(
                "load",
                {
                    "worker": self._worker_id,
                    "keys": _packed(spec.keys),
                    "blockIds": spec.block_ids,
                    "skipBlocks": spec.skip_blocks,
                },
                progress=st.on_progress,
            )
            st.future.add_done_callback(lambda _f, st=st: st.wake())
            self._loads.append(st)
        if self._loads and _no_layer_hook_will_wait(forward_context):
            # The forward replays a FULL CUDA graph: its attention layers' Python, and so
            # wait_for_layer_load, does not run (vLLM issue 29608; FULL_AND_PIECEWISE is the
            # default before vLLM added requires_piecewise_for_cudagraph). vLLM's V2 runner
            # tells it only by starting the loads without attention metadata. The loads must
            # be in place before it starts: no layer overlap for this step, but no race.
            for st in self._loads:  # a failure, malformed progress or the deadline: reported by _finish_loads
                st.wait_settled(self._load_deadline)
        # Reported by get_finished once no copy of the request's loads can land (no save to wait for).
        self._saves_done.update(meta.holds)
        skip_saves = self._settings["layout"] == "mla" and self._settings["rank"] != 0
        for spec in meta.saves:
            if not ready or skip_saves:  # MLA: rank 0 stores the one shared copy
                self._saves_done.add(spec.req_id)
                self.saves_not_stored += not ready and not skip_saves
                continue
            self._saves[spec.req_id] = (
                self._client.request(
                    "save",
                    {"worker": self._worker_id, "keys": _packed(spec.keys), "blockIds": spec.block_ids, "from": spec.first},
                ),
                time.monotonic() + self._settings["saveTimeoutS"],
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._forward_ran = True
        idx = self._layer_index.get(layer_name)
        if idx is None or not self._loads:
            return
        for st in self._loads:
            st.wait_layer(idx + 1, self._load_deadline)

    def finish_forward(self) -> None:
        # vLLM's V2 model runner (after 0.13) calls this once the step's forward is launched, also
        # when a FULL CUDA graph replays it and no layer hook runs.
        self._forward_ran = True
        parent = getattr(super(), "finish_forward", None)
        if parent is not None:
            parent()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Saves happen once per finished request (request_finished), from the blocks vLLM keeps for us.
        self._forward_ran = True

    def _finish_loads(self) -> None:
        loads, self._loads = self._loads, []
        late: List[Future] = []
        bad: List[_LoadState] = []
        timed_out = 0
        for st in loads:
            want = st.spec.block_ids[st.spec.skip_blocks :]
            try:
                # Not the answer's own wait: a load whose progress turns out malformed meanwhile
                # must not hold the step until the deadline.
                st.wait_settled(self._load_deadline)
                if st.bad is not None:
                    bad.append(st)
                    raise ValueError(st.bad)
                ans = st.future.result(timeout=max(0.0, self._load_deadline - time.monotonic()))
                failed = ans.get("failedBlocks")
                # Blocks not named are taken as filled: only a well-formed list may say so.
                if not isinstance(failed, list) or any(type(b) is not int for b in failed):
                    raise ValueError(f"load answered failedBlocks {failed!r}")
                mine = set(want)
                self._load_errors.update(b for b in failed if b in mine)
            except Exception:
                self._load_errors.update(want)
            if not _fenced(st.future):
                # Its blocks are reported failed (vLLM recomputes them: a late copy then writes
                # the stored KV of the same tokens), but the request's blocks must not go to another
                # request while a copy may still land: held until the fence (get_finished).
                self._fences.setdefault(st.spec.req_id, []).append(st.future)
                if not st.future.done():
                    late.append(st.future)
                    timed_out += st.bad is None
        if bad:
            self._bad_progress(bad)
        if late:
            self._cancel(late, timed_out)

    def _bad_progress(self, bad: List["_LoadState"]) -> None:
        """Counts loads failed by a malformed load-progress event; logs at most once a minute
        (an agent sending them on every load must not flood vLLM's log), the value cut short."""
        self.loads_bad_progress += len(bad)
        now = time.monotonic()
        if now - self._bad_progress_logged < 60.0:
            return
        self._bad_progress_logged = now
        log.warning(
            "kvgate: the agent sent a malformed event for a load (%s): its blocks are recomputed, the agent is "
            "asked to cancel it and the connection is kept (%d such loads so far; check the agent's version)",
            bad[0].bad,
            self.loads_bad_progress,
        )

    def _cancel(self, late: List[Future], timed_out: int) -> None:
        """Asks the agent to start no more copies for loads given up (`timed_out` of them at
        load_timeout_ms, the others for malformed progress). The connection stays: other requests
        on it carry on, and each load's own answer, which comes once its copies in flight landed,
        is its fence. An agent without `cancel` (older than this connector) still answers each
        load after its last copy: the fence only comes later."""
        ids = [f.request_id for f in late if getattr(f, "request_id", None) is not None]
        can = self._agent_cancels()
        if timed_out > 0:
            log.warning(
                "kvgate: %d load(s) did not finish within load_timeout_ms: their blocks are recomputed%s; their "
                "requests' blocks stay allocated until the agent answers them (a copy may still be in flight)",
                timed_out,
                ", and the agent is asked to cancel them" if can else " (this agent has no cancel: it finishes them)",
            )
        if can and ids:
            self._client.request("cancel", {"ids": ids})  # the answer says nothing the loads' own will not

    def _agent_cancels(self) -> bool:
        """Whether the agent of this connection has `cancel` (hello's features)."""
        features = (self._client.hello_answer or {}).get("features")
        return isinstance(features, list) and "cancel" in features

    def _unfenced(self, rid: str) -> bool:
        """Whether a load of request `rid` may still write its blocks (this step's loads included:
        vLLM may ask get_finished before wait_for_save)."""
        if any(st.spec.req_id == rid and not st.future.done() for st in self._loads):
            return True
        fences = self._fences.get(rid)
        if fences is None:
            return False
        left = [f for f in fences if not _fenced(f)]
        for f in fences:
            if id(f) in self._unfenced_seen and not any(f is g for g in left):
                # Counted while its agent lived: fenced by that process's exit. Forgotten here, or a
                # later load's Future at the same address would go uncounted.
                self._unfenced_seen.discard(id(f))
                log.info(
                    "kvgate: the agent process (pid %d) exited: a load of request %s it may have been copying is "
                    "fenced, the request's blocks are released",
                    f.exception().agent.pid,
                    rid,
                )
        for f in left:
            if f.done() and id(f) not in self._unfenced_seen:
                self._unfenced_seen.add(id(f))
                self.loads_unfenced += 1
                agent = f.exception().agent
                if agent is not None and agent.watchable:
                    until = f"until the agent process (pid {agent.pid}) exits (restarting the agent reclaims them)"
                else:
                    self.loads_held_for_good += 1
                    why = agent.why_not if agent is not None else "no agent process known"
                    until = f"for good, as its process's exit cannot be watched ({why}; restarting vLLM reclaims them)"
                log.warning(
                    "kvgate: the agent connection was dropped on this side while a load of request %s could still be "
                    "copying: the request's blocks stay allocated %s rather than risk another request's KV "
                    "(%d such loads so far; the agent stopped reading or answered garbage: check it)",
                    rid,
                    until,
                    self.loads_unfenced,
                )
        if left:
            self._fences[rid] = left
        else:
            del self._fences[rid]
        return bool(left)

    def handle_preemptions(self, preempted: Any) -> None:
        """vLLM frees a preempted request's blocks at once (no request_finished, so no hold) and may
        hand them to another request in this very step; it calls this before the step's loads and
        forward. A load of a preempted request given up at load_timeout_ms may still be copying
        into them: wait here until none can land (the agent's answer after its last copy, or its
        process's exit). vLLM passes this step's connector metadata (after 0.13: `preempted`,
        from SchedulerOutput.preempted_req_ids) or, in some versions, the set of ids itself.
        Versions that never call it (0.11-0.13) get the same wait at start_load_kv."""
        if isinstance(preempted, (set, frozenset, list, tuple)):
            self._wait_all_fenced(preempted)
        else:
            self._fence_preempted(preempted)

    def _fence_preempted(self, meta: Any) -> None:
        """Waits for the fences of `meta`'s preempted requests, once per metadata: the first of
        handle_preemptions and start_load_kv for a step does (bind_connector_metadata keeps the
        mark only for the metadata it was made for)."""
        if meta is None or meta is self._preemptions_fenced:
            return
        self._wait_all_fenced(getattr(meta, "preempted", None) or ())
        self._preemptions_fenced = meta

    def _wait_all_fenced(self, ids: Any) -> None:
        for rid in ids:
            if isinstance(rid, str):
                self._wait_fenced(rid)

    def _wait_fenced(self, rid: str) -> None:
        """Blocks until no load of `rid` can land. Warns every 5 s with what to do; raises when the
        fence can never come (a connection this side dropped, the agent's exit not watchable):
        stopping the engine is better than letting another request's KV be overwritten."""
        started = warned = time.monotonic()
        while self._unfenced(rid):
            fences = self._fences.get(rid, [])
            pending = [f for f in fences if not f.done()]
            if not pending and any(_never_fenced(f) for f in fences):
                raise RuntimeError(
                    f"kvgate: request {rid} was preempted while a load given up on an agent connection this "
                    "side dropped may still be copying into its blocks, and the agent process's exit cannot be "
                    "watched; vLLM is about to give those blocks to another request. Stopping rather than risk "
                    "wrong KV: restart vLLM (and check the kvgate agent, which stopped answering)."
                )
            if pending:
                try:
                    pending[0].result(timeout=0.05)
                except Exception:
                    pass
            else:
                time.sleep(0.05)  # the agent's pidfd, polled by _unfenced
            now = time.monotonic()
            if now - warned >= 5.0:
                warned = now
                log.warning(
                    "kvgate: preempted request %s waits %.0f s for a given-up load's copy to land before vLLM "
                    "reuses its blocks; the kvgate agent is stalled: restarting it ends its copies",
                    rid,
                    now - started,
                )

    def wait_for_save(self) -> None:
        self._finish_loads()

    def _give_up_late_saves(self, now: float) -> None:
        """Ends saves past save_timeout_ms: their blocks are held by vLLM until they answer (an
        agent alive but stalled would hold them for ever). An agent with `cancel` is asked to
        cancel them and the connection stays: the save answers (ERR_CANCELLED) once its copies
        in flight landed, and the connection's other requests carry on, loads given up at
        load_timeout_ms keeping their fence. A save still unanswered another save_timeout_ms
        after its cancel (the agent stalled), or on an agent without `cancel`, is ended by
        closing the connection: the agent then starts no copy out of its blocks and stores no
        chunk whose copy ended after the close, so vLLM may reuse them; but every request
        pending on it fails, and its given-up loads stay held for good (loads_unfenced)."""
        late = [(rid, f) for rid, (f, deadline) in self._saves.items() if not f.done() and now >= deadline]
        if not late:
            return
        to_cancel = [(rid, f) for rid, f in late if rid not in self._saves_cancelled] if self._agent_cancels() else []
        ids = [f.request_id for _, f in to_cancel if getattr(f, "request_id", None) is not None]
        if ids:
            log.warning(
                "kvgate: %d save(s) did not finish within save_timeout_ms: the agent is asked to cancel them "
                "(their blocks are released once it answers)",
                len(ids),
            )
            self._client.request("cancel", {"ids": ids})  # each save's own answer is its fence
            for rid, f in to_cancel:
                self._saves_cancelled.add(rid)
                self._saves[rid] = (f, now + self._settings["saveTimeoutS"])
        if len(ids) == len(late):
            return
        # Not while this step's loads copy (vLLM asks this before wait_for_save with speculative
        # decoding): their own deadline ends them, and a close would leave a copy in flight into
        # blocks vLLM then recomputes.
        if any(not st.future.done() for st in self._loads if st.future is not None):
            return
        log.warning("kvgate: a save did not finish within save_timeout_ms; dropping the agent connection")
        self._client.close()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        self._finished_seen.update(finished_req_ids)
        self._give_up_late_saves(time.monotonic())
        for rid, (f, _) in list(self._saves.items()):
            if f.done():
                del self._saves[rid]
                self._saves_cancelled.discard(rid)
                self._saves_done.add(rid)
                if f.exception() is not None:
                    self.saves_not_stored += 1
                    log.warning(
                        "kvgate: the save of request %s was not stored (%s); its blocks are released "
                        "(%d saves not stored so far)",
                        rid,
                        f.exception(),
                        self.saves_not_stored,
                    )
        done = {r for r in self._saves_done if r in self._finished_seen and not self._unfenced(r)}
        self._saves_done -= done
        for r in done:
            self._fences.pop(r, None)
        # Only ids whose save is still copying or whose load may still land are kept: vLLM names
        # every finished request here once, in the step whose metadata carries its save or hold
        # (start_load_kv registered it).
        self._finished_seen = {r for r in self._finished_seen if r in self._saves or r in self._saves_done}
        return (done or None), None

    def get_transfer_results(self, finished_req_ids: Optional[Set[str]] = None) -> Any:
        # vLLM after 0.13 asks this instead of get_finished; a finished save it never hears of
        # would hold the request's blocks for ever. kvgate's loads are synchronous: no recvs.
        sending, _ = self.get_finished(set(finished_req_ids or ()))
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set())

    def get_block_ids_with_load_errors(self) -> Set[int]:
        self._finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._client.shutdown()
