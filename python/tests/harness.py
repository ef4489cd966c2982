"""An engine harness that drives KVGateConnector in vLLM's call order, without vLLM.

Two call orders (EngineSpec.call_order), as read from vLLM's source: "0.13" (0.11-0.13: bind,
start_load_kv, forward, wait_for_save, get_finished) and "0.29" (after 0.13: handle_preemptions,
bind, start_load_kv before the forward only on a step with synchronous loads, else after it,
wait_for_save, get_transfer_results, build_connector_worker_meta). `late_loads` plays a vLLM
that starts every step's loads after its forward.

The scheduler connector runs in the test process; each TP worker is a separate process
(spawned, as vLLM's workers are) holding its paged KV cache in /dev/shm tensors, which the
kvgate agent maps. Services (a gateway, agents) are real `kvgate` processes.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch

from fake_agent import pidfds_open
from kvgate_vllm import hashing
from kvgate_vllm._vllm import KVConnectorRole

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SEED = "0"
NULL_BLOCK = 0  # vLLM's null block id
os.environ.setdefault("PYTHONHASHSEED", SEED)

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# fp8 caches as vLLM allocates them with --kv-cache-dtype fp8*: uint8 tensors (this torch has no float8).
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
for _d in FP8:
    TORCH_DTYPES[_d] = torch.uint8


# ---------------------------------------------------------------------------- services


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A kvgate child process that prints one JSON line when ready."""

    def __init__(self, args: List[str], env: Dict[str, str], ready_key: str):
        self.args = args
        self.env = env
        self.ready_key = ready_key
        self.proc: Optional[subprocess.Popen] = None
        self.ready: Dict[str, Any] = {}
        self.start()

    def start(self) -> None:
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            ["node", "--import", "tsx", os.path.join(REPO, "src/cli/main.ts"), *self.args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvgate {self.args[0]} exited before it was ready")
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if self.ready_key in msg:
                self.ready = msg
                return
        raise RuntimeError(f"kvgate {self.args[0]} not ready in 60 s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_gateway() -> Service:
    port = free_port()
    return Service(["serve", "--store", "memory", "-p", str(port), "--log", "error"], {}, "url")


def start_agent(sock: str, gateway_url: Optional[str], codec: str = "raw", chunk_tokens: int = 32, extra=None) -> Service:
    env = {
        "KVGATE_MEMORY_BYTES": "32MiB",
        "KVGATE_DISK": "off",
        "KVGATE_REMOTE_CODEC": codec,
        # Generous: these machines are shared and loaded; the deadline paths have their own tests.
        "KVGATE_AGENT_LOOKUP_DEADLINE_MS": "5000",
        # The agent's gateway lookup (250 ms by default) shares two loaded cores with the agent's
        # codec worker loading under tsx at start: a late answer would read as 0 matched tokens.
        "KVGATE_REMOTE_LOOKUP_TIMEOUT_MS": "5000",
    }
    if gateway_url:
        env["KVGATE_REMOTE_URL"] = gateway_url
    else:
        env["KVGATE_REMOTE"] = "off"
    env.update(extra or {})
    return Service(["agent", "--socket", sock, "--chunk-tokens", str(chunk_tokens)], env, "socket")


# ---------------------------------------------------------------------------- vLLM stand-ins


@dataclass
class EngineSpec:
    socket: str
    layout: str = "flash-attn"
    layers: int = 3
    kv_heads: int = 2  # per rank
    head_size: int = 16  # latent dim for MLA
    block_size: int = 16
    dtype: str = "float16"
    world: int = 1
    num_blocks: int = 64
    model: str = "test/synthetic"
    hash_algo: str = "sha256_cbor"
    weights: Optional[str] = None  # a llama2.c checkpoint: run the real model
    device: str = "cpu"  # "cuda": KV in GPU memory, registered through CUDA IPC handles
    call_order: str = "0.13"  # or "0.29" (module docstring)
    late_loads: bool = False  # "0.29" order, loads always started after the forward
    load_timeout_ms: int = 20000
    save_timeout_ms: int = 60000
    # Workers whose os.pidfd_open fails (EPERM, as under a seccomp filter): no agent exit is watchable.
    no_pidfd: bool = False
    # vLLM from 0.26/0.29: every layer a [B, H, N, C] view of one allocation laid out in this
    # physical order of [L, B, H, N, C] (KV_ORDERS); None: one tensor per layer, vLLM ≤ 0.25.
    kv_order: Optional[str] = None
    # The attention kernel's block size when smaller than block_size (vLLM then splits blocks).
    kernel_block: Optional[int] = None
    # Bytes of padding after every page (vLLM's page_size_padded); only with L and B outermost.
    page_pad: int = 0


def vllm_config(spec: EngineSpec, rank: int = 0) -> Any:
    model_config = SimpleNamespace(
        model=spec.model,
        served_model_name=None,
        dtype=torch.float16 if spec.dtype in FP8 else TORCH_DTYPES[spec.dtype],
        use_mla=spec.layout == "mla",
        get_num_layers=lambda par: spec.layers,
        get_num_kv_heads=lambda par: spec.kv_heads,
        get_head_size=lambda: spec.head_size,
    )
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(
            block_size=spec.block_size,
            cache_dtype=spec.dtype if spec.dtype in FP8 else "auto",
            prefix_caching_hash_algo=spec.hash_algo,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=spec.world, rank=rank),
        kv_transfer_config=SimpleNamespace(
            kv_connector="KVGateConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"socket": spec.socket, "layout": spec.layout, "lookup_timeout_ms": 10000, "load_timeout_ms": spec.load_timeout_ms, "save_timeout_ms": spec.save_timeout_ms},
        ),
    )


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: List[int]
    block_hashes: List[bytes]
    all_token_ids: List[int] = field(default_factory=list)
    # Tokens whose KV the engine computed (vLLM's Request.num_computed_tokens): set by prefill.
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:  # vLLM's: prompt and output tokens
        return len(self.all_token_ids) or len(self.prompt_token_ids)


class FakeBlocks:
    def __init__(self, ids: List[int]):
        self._ids = ids

    def get_block_ids(self):
        return (list(self._ids),)


# vLLM's physical orders of the logical per-allocation axes [L, B, H, N, C]
# (vllm/v1/kv_cache_layout.py, KVCacheLayout): a tuple lists the logical axes outermost first.
KV_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def view_allocation(spec: EngineSpec):
    """vLLM's one allocation for every layer (create_kv_cache_views, compute_layout_strides):
    (bytes, the logical [L, B, H, N, C-bytes] shape, its byte strides, where the views start)."""
    e = torch.empty((), dtype=TORCH_DTYPES[spec.dtype]).element_size()
    kernel = spec.kernel_block or spec.block_size
    r = spec.block_size // kernel
    heads = 1 if spec.layout == "mla" else spec.kv_heads
    shape = [spec.layers, spec.num_blocks * r, heads, kernel, sides(spec) * spec.head_size * e]
    order = KV_ORDERS[spec.kv_order]
    grid_end = max(order.index(0), order.index(1)) + 1
    strides = [0] * 5
    cur = 1
    for phys in range(4, -1, -1):
        if spec.page_pad and phys == grid_end - 1:
            assert grid_end == 2, "page padding needs L and B outermost"
            cur += spec.page_pad
        strides[order[phys]] = cur
        cur *= shape[order[phys]]
    start = 64  # the views start inside the allocation, as a group's offset
    return start + cur, shape, strides, start


def kv_views(raw: torch.Tensor, spec: EngineSpec) -> List[torch.Tensor]:
    """Per-layer [B, H, N, C] views of the int8 allocation `raw`, as vLLM makes them."""
    _, shape, strides, start = view_allocation(spec)
    five = torch.as_strided(raw, size=shape, stride=strides, storage_offset=raw.storage_offset() + start)
    return [five[i].view(TORCH_DTYPES[spec.dtype]) for i in range(spec.layers)]


def alloc_caches(spec: EngineSpec, names: List[str], device: Optional[str] = None):
    """The layers' KV as vLLM allocates it: (caches by name, the tensors to share or free)."""
    from kvgate_vllm import shm

    dtype = TORCH_DTYPES[spec.dtype]
    if spec.kv_order is not None:
        nbytes = view_allocation(spec)[0]
        raw = torch.zeros(nbytes, dtype=torch.int8, device=device) if device else shm.shm_tensor([nbytes], torch.int8)
        return dict(zip(names, kv_views(raw, spec))), [raw]
    if device:
        caches = {n: torch.zeros(layer_shape(spec), dtype=dtype, device=device) for n in names}
    else:
        caches = {n: shm.shm_tensor(layer_shape(spec), dtype) for n in names}
    return caches, list(caches.values())


def layer_shape(spec: EngineSpec) -> List[int]:
    if spec.layout == "flash-attn":
        return [2, spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_size]
    if spec.layout == "flashinfer":
        return [spec.num_blocks, 2, spec.block_size, spec.kv_heads, spec.head_size]
    return [spec.num_blocks, spec.block_size, spec.head_size]


def block_view(t: torch.Tensor, spec: EngineSpec, side: int, block: int) -> torch.Tensor:
    """Block `block`'s K (side 0), V (1) or latent as a [block_size, heads, head] ([block_size,
    latent] for MLA) view of the layer tensor `t`: writes through it land in the engine's KV."""
    if spec.kv_order is not None:
        kernel = t.shape[2]
        r = spec.block_size // kernel
        d = spec.head_size
        part = t[block * r : (block + 1) * r, :, :, side * d : (side + 1) * d]  # [r, H, N, d]
        rows = part.permute(0, 2, 1, 3).view(spec.block_size, t.shape[1], d)  # a view or an error
        return rows[:, 0] if spec.layout == "mla" else rows
    if spec.layout == "flash-attn":
        return t[side, block]
    if spec.layout == "flashinfer":
        return t[block, side]
    return t[block]


def sides(spec: EngineSpec) -> int:
    return 1 if spec.layout == "mla" else 2


# ---------------------------------------------------------------------------- worker process


def synthetic_kv(spec: EngineSpec, rank: int, layer: int, side: int, tokens: List[int], start: int, end: int):
    """Deterministic KV of positions [start, end): a function of (token, position, layer, side, rank)."""
    pos = torch.arange(start, end, dtype=torch.float64)
    tok = torch.tensor(tokens[start:end], dtype=torch.float64)
    width = (1 if spec.layout == "mla" else spec.kv_heads) * spec.head_size
    ch = torch.arange(width, dtype=torch.float64)
    phase = tok[:, None] * 0.731 + pos[:, None] * 0.113 + ch[None, :] * 0.071 + layer * 1.37 + side * 2.9 + (0 if spec.layout == "mla" else rank * 0.5)
    x = torch.sin(phase) * 3.0 + torch.cos(phase * 1.7)
    if spec.dtype in FP8:  # opaque bytes: only byte-for-byte equality is checked
        return torch.remainder(torch.round(x * 40.0), 256).to(torch.uint8)
    return x.to(TORCH_DTYPES[spec.dtype])


def _no_pidfd(pid: int, flags: int = 0) -> int:
    raise PermissionError(1, "Operation not permitted")


def _worker_main(conn, spec: EngineSpec, rank: int) -> None:
    torch.set_num_threads(1)
    if spec.no_pidfd:
        os.pidfd_open = _no_pidfd
    from kvgate_vllm import KVGateConnector, shm

    names = [f"model.layers.{i}.self_attn" for i in range(spec.layers)]
    if spec.device == "cuda":
        # As vLLM does on a multi-GPU node: TP rank r on GPU r (wrapping when there are fewer GPUs).
        gpu = f"cuda:{rank % torch.cuda.device_count()}"
        caches, owned = alloc_caches(spec, names, gpu)
    else:
        caches, owned = alloc_caches(spec, names)
    model = None
    if spec.weights:
        from llama2c import Llama2c

        model = Llama2c(spec.weights)
    conn.send({"paths": [] if spec.device == "cuda" else [shm.describe(t)["path"] for t in owned]})
    conn_ = None
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "init":
                conn_ = KVGateConnector(vllm_config(spec, rank), KVConnectorRole.WORKER)
                try:
                    conn_.register_kv_caches(caches)
                    # A loaded machine can be slow to answer the first hello: wait (bounded) so
                    # tests start registered; a connector that is not gives up saves/loads by design.
                    deadline = time.monotonic() + cmd[1]
                    while not conn_._worker_ready() and time.monotonic() < deadline:
                        time.sleep(0.2)
                    conn.send({"ok": True, "ready": conn_._worker_ready()})
                except Exception as e:  # surfaced to the test
                    conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
            elif cmd[0] == "step":
                _, meta, finished, fwd, sync = cmd
                new_order = spec.call_order != "0.13"
                # After 0.13 loads start before the forward only on a step with synchronous loads.
                before = not new_order or (sync and not spec.late_loads)
                # vLLM 0.29's V2 runner passes the batch's request rows as keyword arguments.
                load_kw = {"request_ids": [], "request_state_indices": None, "attn_metadata": {}} if new_order else {}
                if new_order:
                    conn_.handle_preemptions(meta)
                conn_.bind_connector_metadata(meta)
                if before:
                    conn_.start_load_kv(None, **load_kw)
                # When the forward began (CLOCK_MONOTONIC: comparable with the test process's).
                out: Dict[str, Any] = {"forward_at": time.monotonic()}
                if model is not None and fwd is not None:
                    out["logits"] = model.forward_paged(
                        fwd["tokens"], fwd["start"], fwd["block_ids"], caches, names, spec, conn_.wait_for_layer_load
                    )
                else:
                    for li, n in enumerate(names):
                        conn_.wait_for_layer_load(n)
                        if fwd is not None:
                            _write_synthetic(caches[n], spec, rank, li, fwd)
                if new_order:
                    conn_.finish_forward()  # vLLM's V2 runner
                if not before:
                    conn_.start_load_kv(None, **load_kw)
                conn_.wait_for_save()
                if new_order:
                    sending = conn_.get_transfer_results(set(finished)).finished_sending
                else:
                    sending, _ = conn_.get_finished(set(finished))
                out["finished_sending"] = sorted(sending or [])
                out["load_errors"] = sorted(conn_.get_block_ids_with_load_errors())
                if new_order:
                    conn_.build_connector_worker_meta()
                conn_.clear_connector_metadata()
                conn.send(out)
            elif cmd[0] == "dump":
                conn.send([caches[n].cpu() for n in names])
            elif cmd[0] == "devices":  # (the engine's GPU index, the agent's ordinal of it)
                first = caches[names[0]]
                conn.send((first.device.index, conn_.agent_device if conn_ is not None else None))
            elif cmd[0] == "fences":  # the worker connector's counters, and the pidfds it holds
                conn.send(
                    {
                        "loads_unfenced": conn_.loads_unfenced,
                        "loads_held_for_good": conn_.loads_held_for_good,
                        "pidfds": pidfds_open(),
                    }
                )
            elif cmd[0] == "stop":
                break
    finally:
        if conn_ is not None:
            conn_.shutdown()
        if spec.device != "cuda":
            for t in owned:
                shm.unlink(t)
        conn.close()


def _write_synthetic(t: torch.Tensor, spec: EngineSpec, rank: int, layer: int, fwd: Dict[str, Any]) -> None:
    tokens, start, block_ids = fwd["tokens"], fwd["start"], fwd["block_ids"]
    end = len(tokens)
    for side in range(sides(spec)):
        kv = synthetic_kv(spec, rank, layer, side, tokens, start, end)
        for p in range(start, end):
            blk = block_view(t, spec, side, block_ids[p // spec.block_size])
            blk[p % spec.block_size].copy_(kv[p - start].view(blk.shape[1:]))


_CTX = None


def _mp_context():
    """Workers fork from a forkserver that imported torch once (a spawn per worker costs seconds)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["harness"])
    return _CTX


class WorkerProc:
    def __init__(self, spec: EngineSpec, rank: int):
        ctx = _mp_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, rank), daemon=True)
        self.proc.start()
        child.close()
        self.paths = self.conn.recv()["paths"]

    def call(self, *cmd, timeout: float = 120.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker did not answer {cmd[0]} in {timeout} s")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------------- engine


class Engine:
    """One vLLM engine: a scheduler-side connector here, `spec.world` worker processes."""

    def __init__(self, spec: EngineSpec, block_order_seed: int, wait_registered: float = 45.0):
        from kvgate_vllm import KVGateConnector

        self.spec = spec
        self.workers = [WorkerProc(spec, r) for r in range(spec.world)]
        self.ready = True
        for w in self.workers:
            r = w.call("init", wait_registered)
            if not r["ok"]:
                raise RuntimeError(r["error"])
            self.ready = self.ready and r["ready"]
        self.sched = KVGateConnector(vllm_config(spec, 0), KVConnectorRole.SCHEDULER)
        g = torch.Generator().manual_seed(block_order_seed)
        # Block 0 is never a request's: vLLM's BlockPool keeps it as its null block (the
        # placeholder for blocks a sliding window dropped), as here.
        self.free = [b for b in torch.randperm(spec.num_blocks, generator=g).tolist() if b != NULL_BLOCK]

    def alloc(self, n: int) -> List[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def schedule(self, finished=(), sync_loads: bool = False, preempted=()):
        """build_connector_meta as vLLM's scheduler calls it. After 0.13 its SchedulerOutput says
        whether a request of the step loads synchronously (`sync_loads`: vLLM's own reckoning,
        which the connector may raise). Returns (metadata, has_sync_kv_loads)."""
        out = SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted))
        if self.spec.call_order != "0.13":
            out.has_sync_kv_loads = sync_loads
        meta = self.sched.build_connector_meta(out)
        return meta, getattr(out, "has_sync_kv_loads", True)

    def step(self, meta, finished=(), fwd=None, sync=True) -> List[Dict[str, Any]]:
        return [w.call("step", meta, list(finished), fwd, sync) for w in self.workers]

    def lookup(self, req: FakeRequest, computed: int = 0, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while True:
            n, is_async = self.sched.get_num_new_matched_tokens(req, computed)
            assert is_async is False
            if n is not None:
                return n
            assert time.monotonic() < deadline, "lookup never answered"
            time.sleep(0.005)

    def prefill(self, rid: str, tokens: List[int], extra_blocks: int = 0, fwd_extra=None) -> Dict[str, Any]:
        """Lookup, allocate, load what matched, compute the rest (one step)."""
        req = make_request(rid, tokens, self.spec.block_size)
        n = self.lookup(req)
        block_ids = self.alloc(math.ceil(len(tokens) / self.spec.block_size) + extra_blocks)
        self.sched.update_state_after_alloc(req, FakeBlocks(block_ids), n)
        meta, sync = self.schedule(sync_loads=n > 0)
        fwd = {"tokens": tokens, "start": n, "block_ids": block_ids, **(fwd_extra or {})}
        outs = self.step(meta, (), fwd, sync)
        # The whole prompt went through the model (the first sampled token is not in `tokens`).
        req.num_computed_tokens = len(tokens)
        errors = sorted({b for o in outs for b in o["load_errors"]})
        return {"req": req, "matched": n, "block_ids": block_ids, "load_errors": errors, "outs": outs}

    def finish(self, req: FakeRequest, block_ids: List[int], max_steps: int = 400) -> bool:
        """request_finished, then steps until every worker reports the save finished."""
        delay, _ = self.sched.request_finished(req, block_ids)
        if not delay:
            return False
        reported = set()
        finished = {req.request_id}
        for _ in range(max_steps):
            meta, sync = self.schedule(finished)
            outs = self.step(meta, finished, None, sync)
            finished = set()
            for i, o in enumerate(outs):
                if req.request_id in o["finished_sending"]:
                    reported.add(i)
            if len(reported) == len(self.workers):
                return True
            time.sleep(0.01)
        raise AssertionError("save never reported finished")

    def tensors(self, rank: int = 0):
        from kvgate_vllm import shm

        if self.spec.device == "cuda":
            return self.workers[rank].call("dump")

        if self.spec.kv_order is not None:
            (path,) = self.workers[rank].paths
            return kv_views(shm.attach(path, [view_allocation(self.spec)[0]], torch.int8), self.spec)
        return [shm.attach(p, layer_shape(self.spec), TORCH_DTYPES[self.spec.dtype]) for p in self.workers[rank].paths]

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.sched.shutdown()


def make_request(rid: str, tokens: List[int], block_size: int) -> FakeRequest:
    return FakeRequest(rid, list(tokens), hashing.block_hashes(tokens, block_size, SEED), list(tokens))


class TempDir:
    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="kvgate-py-")

    def sock(self, name: str) -> str:
        return os.path.join(self.path, f"{name}.sock")

    def cleanup(self):
        shutil.rmtree(self.path, ignore_errors=True)
