"""KVGateConnector driven in vLLM's call order against real `kvgate agent` and gateway
processes: engine A prefills and saves, engine B (its own cold agent) loads into other
block ids. Also TP 2, MLA, a killed / restarted agent, a down or stalled gateway."""

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from harness import (
    NULL_BLOCK,
    Engine,
    EngineSpec,
    TempDir,
    block_view,
    sides,
    start_agent,
    start_gateway,
)
from kvgate_vllm import AgentClient, ConfigurationError, KVGateConnector
from kvgate_vllm._vllm import KVConnectorRole, check_vllm_version

PROMPT = [(i * 7919 + 13) % 32000 for i in range(100)]  # 100 tokens: 3 chunks of 32 (6 blocks) + a tail


@pytest.fixture(scope="module")
def tmp():
    d = TempDir()
    yield d
    d.cleanup()


@pytest.fixture(scope="module")
def gateway():
    g = start_gateway()
    yield g
    g.stop()


def blocks_of(engine: Engine, rank: int, block_ids, n_blocks):
    """[layer][side][i] -> the bytes of block block_ids[i] (i < n_blocks)."""
    ts = engine.tensors(rank)
    return [
        [[block_view(t, engine.spec, s, block_ids[i]).clone() for i in range(n_blocks)] for s in range(sides(engine.spec))]
        for t in ts
    ]


def flush(sock: str) -> None:
    c = AgentClient(sock, {}, reconnect_interval=0)
    assert c.ensure() is False or True  # hello {} is refused; flush needs no hello
    c.close()


def agent_call(sock: str, op: str, **fields):
    """A raw protocol call (no hello needed for flush/stats)."""
    import msgpack
    import socket as so
    import struct

    s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    s.connect(sock)
    body = msgpack.packb({"id": 1, "op": op, **fields}, use_bin_type=True)
    s.sendall(struct.pack(">I", len(body)) + body)
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
        chunk = s.recv(65536)
        assert chunk, "agent closed the connection"
        buf += chunk
    s.close()
    return msgpack.unpackb(buf[4:], raw=False)


@pytest.fixture(scope="module")
def pair(tmp, gateway):
    """Two agents on one gateway, shared by tests that use distinct model ids (so B is cold for each)."""
    sa, sb = tmp.sock("pair-a"), tmp.sock("pair-b")
    agents = (start_agent(sa, gateway.ready["url"]), start_agent(sb, gateway.ready["url"]))
    yield sa, sb
    for ag in agents:
        ag.stop()


class _Shared:
    def stop(self):
        pass


def share(tmp, gateway, name, codec="raw", pair=None, **spec_kw):
    """A saves PROMPT, B (cold agent) loads it. Returns (A, B, a_result, b_result, agents)."""
    if pair is not None:
        sa, sb = pair
        agent_a, agent_b = _Shared(), _Shared()
    else:
        sa, sb = tmp.sock(f"{name}-a"), tmp.sock(f"{name}-b")
        agent_a = start_agent(sa, gateway.ready["url"], codec=codec)
        agent_b = start_agent(sb, gateway.ready["url"], codec=codec)
    # One model id per test: keys cover the model, so tests sharing the gateway stay apart.
    a = Engine(EngineSpec(socket=sa, model=f"test/{name}", **spec_kw), block_order_seed=1)
    b = Engine(EngineSpec(socket=sb, model=f"test/{name}", **spec_kw), block_order_seed=2)
    assert a.ready and b.ready, "a worker never registered with its agent"
    ra = a.prefill("r1", PROMPT)
    assert ra["matched"] == 0
    assert a.finish(ra["req"], ra["block_ids"]) is True
    assert agent_call(sa, "flush")["ok"]
    rb = b.prefill("r1", PROMPT)
    return a, b, ra, rb, (agent_a, agent_b)


# vLLM's call orders (harness docstring): 0.11-0.13, and after 0.13 (loads before the forward only
# on steps with synchronous loads, get_transfer_results).
ORDERS = [("flash-attn", "0.13"), ("flashinfer", "0.13"), ("mla", "0.13"), ("flash-attn", "0.29"), ("mla", "0.29")]


@pytest.mark.parametrize("layout,order", ORDERS)
def test_engine_b_loads_engine_a_kv_byte_for_byte(tmp, gateway, pair, layout, order):
    a, b, ra, rb, agents = share(tmp, gateway, f"share-{layout}-{order}", pair=pair, layout=layout, call_order=order)
    try:
        assert rb["matched"] == 96
        assert rb["load_errors"] == []
        # The connector sends its keys packed (one bin of 32*n bytes), never as arrays of bins.
        for sock in pair:
            st = agent_call(sock, "stats")
            assert st["packedKeyRequests"] > 0 and st["arrayKeyRequests"] == 0, st
        assert rb["block_ids"][:6] != ra["block_ids"][:6]  # different physical blocks
        A = blocks_of(a, 0, ra["block_ids"], 6)
        B = blocks_of(b, 0, rb["block_ids"], 6)
        for layer in range(len(A)):
            for s in range(len(A[layer])):
                for i in range(6):
                    assert torch.equal(A[layer][s][i], B[layer][s][i]), (layer, s, i)
        # Nothing was written into blocks outside the load.
        spare = b.free[0]
        for t in b.tensors(0):
            assert block_view(t, b.spec, 0, spare).abs().sum() == 0
    finally:
        a.close()
        b.close()
        for ag in agents:
            ag.stop()


# vLLM from 0.26 (#44455) and 0.29 (#51718): each layer a [B, H, N, C] view of one allocation,
# in each of the six physical orders, with kernel blocks or padded pages; A and B laid out
# differently (a fleet mid-upgrade shares one cache: the chunks do not depend on the layout).
# (vLLM splits blocks for the kernel only where a block is one dense page: L and B outermost.)
VIEWS = [
    ("flash-attn", {}, {"kv_order": "LBNHC"}),
    ("flash-attn", {"kv_order": "LBHNC"}, {"kv_order": "BLNHC"}),
    ("flash-attn", {"kv_order": "LHBNC"}, {"kv_order": "BHLNC"}),
    ("flash-attn", {"kv_order": "LBNHC", "kernel_block": 8}, {"kv_order": "BLHNC", "page_pad": 96}),
    ("mla", {}, {"kv_order": "LBNHC"}),
    ("mla", {"kv_order": "LBNHC", "kernel_block": 4}, {"kv_order": "BLNHC"}),
    ("mla", {"kv_order": "LHBNC"}, {}),
]


@pytest.mark.parametrize("layout,a_kw,b_kw", VIEWS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else v)
def test_vllms_per_layer_views_load_byte_for_byte(tmp, gateway, pair, layout, a_kw, b_kw):
    sa, sb = pair
    name = f"views-{layout}-{a_kw.get('kv_order')}-{b_kw.get('kv_order')}-{a_kw.get('kernel_block')}"
    a = Engine(EngineSpec(socket=sa, model=f"test/{name}", layout=layout, **a_kw), block_order_seed=1)
    b = Engine(EngineSpec(socket=sb, model=f"test/{name}", layout=layout, **b_kw), block_order_seed=2)
    try:
        assert a.ready and b.ready, "a worker never registered with its agent"
        ra = a.prefill("r1", PROMPT)
        assert a.finish(ra["req"], ra["block_ids"]) is True
        assert agent_call(sa, "flush")["ok"]
        rb = b.prefill("r1", PROMPT)
        assert rb["matched"] == 96 and rb["load_errors"] == []
        A = blocks_of(a, 0, ra["block_ids"], 6)
        B = blocks_of(b, 0, rb["block_ids"], 6)
        for layer in range(len(A)):
            for s in range(len(A[layer])):
                for i in range(6):
                    assert A[layer][s][i].abs().sum() > 0, (layer, s, i)  # the prefill wrote it
                    assert torch.equal(A[layer][s][i], B[layer][s][i]), (layer, s, i)
        # B's blocks outside what it loaded and computed are untouched (every element of them).
        used = set(rb["block_ids"])
        for t in b.tensors(0):
            for blk in range(b.spec.num_blocks):
                if blk not in used:
                    for s in range(sides(b.spec)):
                        assert block_view(t, b.spec, s, blk).abs().sum() == 0, (blk, s)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("layout", ["flash-attn", "mla"])
def test_lossy_codec_within_bound(tmp, gateway, layout):
    """MLA blocks are stored as latent chunks: the codec codes the latent (one stream per
    layer, on its own channels) at the latent budget, finer than K/V's V."""
    a, b, ra, rb, agents = share(tmp, gateway, f"lossy-{layout}", codec="kvgate", head_size=64, layout=layout)
    try:
        assert rb["matched"] == 96 and rb["load_errors"] == []
        A = blocks_of(a, 0, ra["block_ids"], 6)
        B = blocks_of(b, 0, rb["block_ids"], 6)
        worst = 0.0
        differs = False
        for layer in range(len(A)):
            assert len(A[layer]) == (1 if layout == "mla" else 2)
            for s in range(len(A[layer])):
                x = torch.stack(A[layer][s]).float()
                y = torch.stack(B[layer][s]).float()
                differs = differs or not torch.equal(x, y)
                worst = max(worst, ((x - y).pow(2).mean().sqrt() / x.pow(2).mean().sqrt()).item())
        assert differs, "the lossy codec returned exact bytes: this test did not exercise it"
        # The kvgate codec's default level on this synthetic KV: ~8 % relative RMSE per layer.
        # The model-level bar (>= 99 % next-token agreement) is test_model.py's.
        # MLA: the latent budget (ε/√(σ²+1), docs/codec.md) is ~3 % at the default level; the
        # split slab it replaced coded half of each latent at V's ~10 % (7 % worst here).
        assert worst < (0.05 if layout == "mla" else 0.12), worst
    finally:
        a.close()
        b.close()
        for ag in agents:
            ag.stop()


@pytest.mark.parametrize("dtype,codec", [("fp8", "raw"), ("fp8_e5m2", "lossless")])
def test_fp8_kv_byte_for_byte(tmp, gateway, dtype, codec):
    """fp8 caches (uint8 tensors, --kv-cache-dtype fp8*) go through the raw and lossless codecs
    byte for byte; engine B's blocks come from the gateway (its agent is cold)."""
    a, b, ra, rb, agents = share(tmp, gateway, f"fp8-{dtype}-{codec}", codec=codec, dtype=dtype)
    try:
        assert a.spec.dtype == dtype and a.tensors(0)[0].dtype == torch.uint8
        assert rb["matched"] == 96 and rb["load_errors"] == []
        A = blocks_of(a, 0, ra["block_ids"], 6)
        B = blocks_of(b, 0, rb["block_ids"], 6)
        assert any(A[0][0][i].any() for i in range(6)), "the fp8 KV is all zero: this test checks nothing"
        for layer in range(len(A)):
            for s in range(2):
                for i in range(6):
                    assert torch.equal(A[layer][s][i], B[layer][s][i]), (layer, s, i)
    finally:
        a.close()
        b.close()
        for ag in agents:
            ag.stop()


def test_fp8_kv_with_a_lossy_codec_is_refused_at_hello(tmp, gateway):
    """fp8 is never quantised again: an agent whose gateway codec is lossy refuses the engine
    at hello with a typed error, and the connector fails at start instead of sharing nothing."""
    sock = tmp.sock("fp8-lossy")
    agent = start_agent(sock, gateway.ready["url"], codec="kvgate")
    try:
        from harness import vllm_config
        from kvgate_vllm import AgentError

        with pytest.raises(AgentError) as e:
            KVGateConnector(vllm_config(EngineSpec(socket=sock, dtype="fp8", model="test/fp8-lossy")), KVConnectorRole.SCHEDULER)
        assert e.value.code == "ERR_GEOMETRY_MISMATCH" and "fp8" in str(e.value)
        # The same agent serves a 16-bit engine: only the fp8 one was refused.
        ok = KVGateConnector(vllm_config(EngineSpec(socket=sock, model="test/fp8-lossy")), KVConnectorRole.SCHEDULER)
        ok._client.close()
    finally:
        agent.stop()


def test_refuses_unknown_fp8_cache_dtypes(tmp):
    from harness import vllm_config

    cfg = vllm_config(EngineSpec(socket=tmp.sock("x"), dtype="fp8"))
    cfg.cache_config.cache_dtype = "fp8_inc"
    with pytest.raises(ConfigurationError, match="fp8_inc"):
        KVGateConnector(cfg, KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize("layout,order", [("flash-attn", "0.13"), ("mla", "0.13"), ("flash-attn", "0.29")])
def test_tensor_parallel_two_ranks(tmp, gateway, layout, order):
    name = f"tp-{layout}-{order}"
    a, b, ra, rb, agents = share(tmp, gateway, name, layout=layout, world=2, call_order=order)
    try:
        diag = [agent_call(tmp.sock(f"{name}-{x}"), "stats", spaces=True) for x in "ab"]
        assert rb["matched"] == 96 and rb["load_errors"] == [], diag
        for rank in range(2):
            A = blocks_of(a, rank, ra["block_ids"], 6)
            B = blocks_of(b, rank, rb["block_ids"], 6)
            for layer in range(len(A)):
                for s in range(len(A[layer])):
                    for i in range(6):
                        assert torch.equal(A[layer][s][i], B[layer][s][i]), (rank, layer, s, i)
        if layout != "mla":  # the ranks' shards really differ (so per-rank keys matter)
            A0 = blocks_of(a, 0, ra["block_ids"], 1)
            A1 = blocks_of(a, 1, ra["block_ids"], 1)
            assert not torch.equal(A0[0][0][0], A1[0][0][0])
        stats = agent_call(tmp.sock(f"{name}-b"), "stats")
        assert stats["spaces"] == (1 if layout == "mla" else 2)
    finally:
        a.close()
        b.close()
        for ag in agents:
            ag.stop()


def test_loads_a_vllm_starts_after_the_forward_are_reported_failed_not_served(tmp, gateway, pair):
    """A vLLM that starts a step's loads after its forward (after 0.13 it does so on steps without
    synchronous loads): the forward has read the blocks unfilled. The loads are refused and their
    blocks reported failed (vLLM recomputes them), never filled behind the forward's back."""
    sa, sb = pair
    a = Engine(EngineSpec(socket=sa, model="test/late-loads", call_order="0.29"), block_order_seed=1)
    b = Engine(EngineSpec(socket=sb, model="test/late-loads", call_order="0.29", late_loads=True), block_order_seed=2)
    try:
        assert a.ready and b.ready
        ra = a.prefill("r1", PROMPT)
        assert a.finish(ra["req"], ra["block_ids"]) is True
        assert agent_call(sa, "flush")["ok"]
        loads_before = agent_call(sb, "stats").get("loads")
        rb = b.prefill("r1", PROMPT)
        assert rb["matched"] == 96
        assert rb["load_errors"] == sorted(rb["block_ids"][:6])
        assert agent_call(sb, "stats").get("loads") == loads_before  # the agent was never asked
        for t in b.tensors(0):  # nothing copied into the blocks after the forward
            for blk in rb["block_ids"][:6]:
                assert block_view(t, b.spec, 0, blk).abs().sum() == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("order", ["0.13", "0.29"])
def test_blocks_a_sliding_window_dropped_are_never_saved(tmp, gateway, pair, order):
    """A sliding-window (or chunked local attention) model: by request_finished vLLM has put its
    null block (id 0, shared by every request, holding nothing of theirs) in the place of the
    blocks that fell out of the window. Saving those positions would store block 0's bytes as
    the prefix's KV and serve them to every engine that matches it: B must load exactly A's
    computed KV or miss."""
    sa, sb = pair
    a = Engine(EngineSpec(socket=sa, model=f"test/null-block-{order}", call_order=order), block_order_seed=1)
    b = Engine(EngineSpec(socket=sb, model=f"test/null-block-{order}", call_order=order), block_order_seed=2)
    try:
        assert a.ready and b.ready
        ra = a.prefill("r1", PROMPT)
        assert NULL_BLOCK not in ra["block_ids"]
        computed = blocks_of(a, 0, ra["block_ids"], 6)
        for t in a.tensors(0):  # the null block holds whatever another request's window left there
            for s in range(sides(a.spec)):
                block_view(t, a.spec, s, NULL_BLOCK).fill_(7)
        # The window dropped blocks 0-2 (chunk 0 and half of chunk 1).
        table = [NULL_BLOCK] * 3 + ra["block_ids"][3:]
        a.finish(ra["req"], table)
        assert agent_call(sa, "flush")["ok"]
        rb = b.prefill("r1", PROMPT)
        assert rb["load_errors"] == []
        got = blocks_of(b, 0, rb["block_ids"], rb["matched"] // 16)
        for layer in range(len(got)):
            for s in range(len(got[layer])):
                for i in range(len(got[layer][s])):
                    assert torch.equal(got[layer][s][i], computed[layer][s][i]), (layer, s, i)
        # Chunks 0 and 1 were never stored, so nothing after them can be found.
        assert rb["matched"] == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("order", ["0.13", "0.29"])
def test_agent_killed_mid_load_then_restarted(tmp, gateway, order):
    a, b, ra, rb, agents = share(tmp, gateway, f"kill-{order}", call_order=order)
    agent_a, agent_b = agents
    try:
        assert rb["matched"] == 96
        # Engine B again, new request: the agent answers the lookup, then stops before the load
        # and dies while the worker waits on it.
        req_tokens = PROMPT
        from harness import FakeBlocks, make_request

        req = make_request("r2", req_tokens, 16)
        n = b.lookup(req)
        assert n == 96
        block_ids = b.alloc(7)
        b.sched.update_state_after_alloc(req, FakeBlocks(block_ids), n)
        meta, sync = b.schedule(sync_loads=True)
        os.kill(agent_b.proc.pid, signal.SIGSTOP)
        killer = threading.Timer(0.5, agent_b.kill)
        killer.start()
        outs = b.step(meta, (), {"tokens": req_tokens, "start": n, "block_ids": block_ids}, sync)
        killer.join()
        assert outs[0]["load_errors"] == sorted(block_ids[:6])
        # With the agent gone: 0 matched tokens (full prefill), no hang.
        req3 = make_request("r3", req_tokens, 16)
        assert b.lookup(req3, timeout=5) == 0
        # Restarted agent (cold, same socket): the connector reconnects and re-registers.
        agent_b.proc = None
        agent_b.start()
        time.sleep(1.2)  # the connector's reconnect interval
        rb2 = b.prefill("r4", PROMPT)
        assert rb2["matched"] == 96 and rb2["load_errors"] == []
        A = blocks_of(a, 0, ra["block_ids"], 6)
        B = blocks_of(b, 0, rb2["block_ids"], 6)
        assert all(torch.equal(A[l][s][i], B[l][s][i]) for l in range(3) for s in range(2) for i in range(6))
    finally:
        a.close()
        b.close()
        for ag in agents:
            ag.stop()


def test_gateway_down_and_stalled(tmp):
    gw = start_gateway()
    sa = tmp.sock("gwdown-a")
    agent = start_agent(sa, gw.ready["url"], extra={"KVGATE_AGENT_LOOKUP_DEADLINE_MS": "50"})
    a = Engine(EngineSpec(socket=sa), block_order_seed=3)
    try:
        ra = a.prefill("r1", PROMPT)
        assert a.finish(ra["req"], ra["block_ids"]) is True
        # Stalled gateway (accepts, never answers): lookups answer from local tiers by the deadline.
        os.kill(gw.proc.pid, signal.SIGSTOP)
        try:
            other = [(t * 31 + 5) % 32000 for t in range(70)]
            rc = a.prefill("r2", other)
            assert rc["matched"] == 0
            rd = a.prefill("r3", PROMPT)  # in this agent's L1: served despite the gateway
            assert rd["matched"] == 96 and rd["load_errors"] == []
            assert agent_call(sa, "stats")["lookupDeadline"] >= 1
        finally:
            os.kill(gw.proc.pid, signal.SIGCONT)
        # Gateway gone: everything still works locally; saves still finish.
        gw.kill()
        re_ = a.prefill("r4", [(t * 17 + 3) % 32000 for t in range(64)])
        assert re_["matched"] == 0
        assert a.finish(re_["req"], re_["block_ids"]) is True
    finally:
        a.close()
        agent.stop()
        gw.stop()


def test_no_agent_means_full_prefill(tmp):
    e = Engine(EngineSpec(socket=tmp.sock("nobody")), block_order_seed=4, wait_registered=0)
    assert e.ready is False
    try:
        r = e.prefill("r1", PROMPT)
        assert r["matched"] == 0 and r["load_errors"] == []
        assert e.finish(r["req"], r["block_ids"]) is False  # nothing held back
    finally:
        e.close()


def test_refuses_settings_that_share_nothing(tmp, monkeypatch):
    from harness import vllm_config

    with pytest.raises(ConfigurationError, match="sha256_cbor"):
        KVGateConnector(vllm_config(EngineSpec(socket=tmp.sock("x"), hash_algo="sha256")), KVConnectorRole.SCHEDULER)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigurationError, match="PYTHONHASHSEED"):
        KVGateConnector(vllm_config(EngineSpec(socket=tmp.sock("x"))), KVConnectorRole.SCHEDULER)
    # Values Python reads as "randomize" and vLLM releases read differently: refused, not guessed.
    for value in ("", "random"):
        monkeypatch.setenv("PYTHONHASHSEED", value)
        with pytest.raises(ConfigurationError, match="PYTHONHASHSEED unset or fixed"):
            KVGateConnector(vllm_config(EngineSpec(socket=tmp.sock("x"))), KVConnectorRole.SCHEDULER)


def _fake_kv_cache_utils(monkeypatch, **attrs):
    """Installs a stand-in vllm.v1.core.kv_cache_utils with `attrs` and reads vLLM as installed."""
    import sys
    import types

    from kvgate_vllm import _vllm

    mods = {}
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["vllm"].v1 = mods["vllm.v1"]
    mods["vllm.v1"].core = mods["vllm.v1.core"]
    mods["vllm.v1.core"].kv_cache_utils = mods["vllm.v1.core.kv_cache_utils"]
    for k, v in attrs.items():
        setattr(mods["vllm.v1.core.kv_cache_utils"], k, v)
    monkeypatch.setattr(_vllm, "HAVE_VLLM", True)


def test_none_hash_seed_follows_vllm(monkeypatch):
    """vLLM with PR 51875 derives NONE_HASH from a fixed default seed when PYTHONHASHSEED is
    unset: the connector then names that seed (no PYTHONHASHSEED needed); an older vLLM draws it
    at random, and the connector refuses to start; PYTHONHASHSEED, when set, wins either way."""
    from kvgate_vllm import _vllm, connector

    def resolve(hash_fn):  # vLLM's rule for cryptographic hashes
        return os.environ.get("PYTHONHASHSEED", "vllm-none-hash")

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    _fake_kv_cache_utils(monkeypatch, DEFAULT_NONE_HASH_SEED="vllm-none-hash", resolve_none_hash_seed=resolve)
    assert _vllm.default_none_hash_seed() == "vllm-none-hash"
    assert connector.none_hash_seed() == "vllm-none-hash"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert connector.none_hash_seed() == "7"
    monkeypatch.delenv("PYTHONHASHSEED")
    # Before the PR (neither name), or the constant without the rule that goes with it: random.
    for attrs in ({}, {"DEFAULT_NONE_HASH_SEED": "vllm-none-hash"}, {"resolve_none_hash_seed": resolve}):
        _fake_kv_cache_utils(monkeypatch, **attrs)
        assert _vllm.default_none_hash_seed() is None
        with pytest.raises(ConfigurationError, match="PYTHONHASHSEED"):
            connector.none_hash_seed()


def test_default_seed_in_the_hello(tmp, monkeypatch):
    """With vLLM's default seed the settings the hello carries name it (the agent keys and
    namespaces chunks by it; test_hashing checks Node's keys for that seed against vLLM's hashes)."""
    from harness import vllm_config

    from kvgate_vllm import _vllm, connector

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(_vllm, "default_none_hash_seed", lambda: "vllm-none-hash")
    settings = connector.engine_settings(vllm_config(EngineSpec(socket=tmp.sock("x"))))
    assert settings["hashSeed"] == "vllm-none-hash"


def test_real_gpu_tp2_across_two_gpus(tmp):
    """TP 2 with rank r's KV on GPU r, one agent per engine serving both GPUs: each rank's
    tensors are opened and copied on its own GPU (the agent answers which), bytes equal."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs a node with 2 GPUs (none was lent to this task): the several-GPUs CUDA IPC path")

    def on_own_gpus(a, b):
        # Rank r's KV is on GPU r, and the agent mapped and copied it there (not on GPU 0).
        for rank in range(2):
            assert a.workers[rank].call("devices") == (rank, rank)
            assert b.workers[rank].call("devices") == (rank, rank)

    _gpu_round_trip(tmp, "gpu-tp2", world=2, check=on_own_gpus)


def test_pci_bus_id_from_device_properties():
    """The GPU identity the connector sends beside its ordinal (the agent prefers it)."""
    from types import SimpleNamespace

    from kvgate_vllm.connector import pci_bus_id

    assert pci_bus_id(SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)) == "0000:3b:00.0"
    assert pci_bus_id(SimpleNamespace(pci_domain_id=0x10001, pci_bus_id=255, pci_device_id=31)) == "10001:ff:1f.0"
    # Older torch without the fields, or nonsense values: no id (the agent falls back to `device`).
    assert pci_bus_id(SimpleNamespace(name="GPU")) is None
    assert pci_bus_id(SimpleNamespace(pci_domain_id=0, pci_bus_id=256, pci_device_id=0)) is None
    assert pci_bus_id(SimpleNamespace(pci_domain_id=0, pci_bus_id=-1, pci_device_id=0)) is None
    assert pci_bus_id(SimpleNamespace(pci_domain_id=0, pci_bus_id="x", pci_device_id=0)) is None


def test_vllm_version_check(caplog, monkeypatch):
    import kvgate_vllm._vllm as v

    with pytest.raises(RuntimeError, match="vLLM"):
        check_vllm_version("0.9.1")
    monkeypatch.setattr(v, "_warned_untested", False)
    with caplog.at_level("WARNING", logger="kvgate_vllm"):
        check_vllm_version("0.11.0")
        check_vllm_version("0.29.1")
        check_vllm_version(None)
        assert not caplog.records  # within the call orders tested
        check_vllm_version("0.30.0")  # newer: runs, says it was not tested
        check_vllm_version("0.31.0")
    assert len(caplog.records) == 1 and "newer than the KV connector call orders" in caplog.text


def test_real_gpu_ipc(tmp):
    """CUDA KV tensors: IPC handles into the agent, saved by one process, loaded by another."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU on this machine (none was lent to this task): the CUDA IPC path runs only on a GPU host")
    _gpu_round_trip(tmp, "gpu")


@pytest.mark.parametrize("kv_order", ["LBNHC", "LBHNC"])
def test_real_gpu_ipc_vllm_views(tmp, kv_order):
    """vLLM 0.29's per-layer views of one CUDA allocation (NHD and HND pages): one IPC handle for
    every layer, each view at its offset, copied by the agent as cudaMemcpy2DAsync row sets."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU on this machine (none was lent to this task): the CUDA IPC path runs only on a GPU host")
    _gpu_round_trip(tmp, f"gpu-views-{kv_order}", kv_order=kv_order)


def _gpu_round_trip(tmp, name, world=1, check=None, **spec_kw):
    """Engine A saves PROMPT from CUDA KV, engine B (its own agent) loads it: every rank's blocks
    equal A's. `check(a, b)` adds assertions while the engines run."""
    gw = start_gateway()
    try:
        a, b, ra, rb, agents = share(tmp, gw, name, device="cuda", world=world, **spec_kw)
        try:
            assert rb["matched"] == 96 and rb["load_errors"] == []
            for rank in range(world):
                A = blocks_of(a, rank, ra["block_ids"], 6)
                B = blocks_of(b, rank, rb["block_ids"], 6)
                assert all(torch.equal(A[l][s][i], B[l][s][i]) for l in range(3) for s in range(2) for i in range(6))
            if check is not None:
                check(a, b)
        finally:
            a.close()
            b.close()
            for ag in agents:
                ag.stop()
    finally:
        gw.stop()


def test_extra_config_unknown_keys_and_bad_values_are_errors(tmp):
    """A typo in kv_connector_extra_config ("sokcet") must not fall back to the default socket
    silently, and a bad value names its key (not a bare ValueError from float())."""
    from harness import vllm_config
    from kvgate_vllm import engine_settings

    def with_extra(**extra):
        cfg = vllm_config(EngineSpec(socket=tmp.sock("x")))
        cfg.kv_transfer_config.kv_connector_extra_config = extra
        return cfg

    with pytest.raises(ConfigurationError, match=r"sokcet.*did you mean 'socket'"):
        engine_settings(with_extra(sokcet="/run/kvgate/agent.sock"))
    with pytest.raises(ConfigurationError, match="lookup_wait_ms.*a number"):
        engine_settings(with_extra(lookup_wait_ms="soon"))
    with pytest.raises(ConfigurationError, match="load_timeout_ms.*a number"):
        engine_settings(with_extra(load_timeout_ms=-5))
    with pytest.raises(ConfigurationError, match="save_timeout_ms.*a number"):
        engine_settings(with_extra(save_timeout_ms=float("inf")))
    # Giving a transfer up drops the connection: a timeout shorter than a copy would drop them all.
    for key in ("save_timeout_ms", "load_timeout_ms"):
        with pytest.raises(ConfigurationError, match=f"{key}: expected a number of milliseconds >= 100, got 0"):
            engine_settings(with_extra(**{key: 0}))
        engine_settings(with_extra(**{key: 100}))
    with pytest.raises(ConfigurationError, match="layout.*flash-attn, flashinfer, mla"):
        engine_settings(with_extra(layout="paged"))
    with pytest.raises(ConfigurationError, match="socket.*a path"):
        engine_settings(with_extra(socket=7))
    s = engine_settings(with_extra(socket="/s.sock", layout="flashinfer", lookup_wait_ms="5", load_timeout_ms=100))
    assert (s["socket"], s["layout"], s["lookupWaitS"], s["loadTimeoutS"]) == ("/s.sock", "flashinfer", 0.005, 0.1)
    assert s["saveTimeoutS"] == 60.0


def test_the_layout_follows_the_attention_backend_vllm_was_told(tmp, monkeypatch):
    """vLLM after 0.13 takes the backend from --attention-backend (VllmConfig.attention_config.backend,
    an AttentionBackendEnum), VLLM_ATTENTION_BACKEND being deprecated: a FlashInfer engine so told
    has the flashinfer layout, not flash-attn (its engine failed at register)."""
    from harness import vllm_config
    from kvgate_vllm import engine_settings


    def settings(backend=None, env=None, **extra):
        cfg = vllm_config(EngineSpec(socket=tmp.sock("x")))
        cfg.kv_transfer_config.kv_connector_extra_config = extra
        cfg.attention_config = SimpleNamespace(backend=backend)
        if env is None:
            monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
        else:
            monkeypatch.setenv("VLLM_ATTENTION_BACKEND", env)
        return engine_settings(cfg)["layout"]

    assert settings(SimpleNamespace(name="FLASHINFER")) == "flashinfer"
    assert settings(SimpleNamespace(name="FLASH_ATTN")) == "flash-attn"
    assert settings(None) == "flash-attn"
    assert settings(None, env="FLASHINFER") == "flashinfer"  # older vLLM
    # The explicit backend wins over a stale environment variable; the extra config over both.
    assert settings(SimpleNamespace(name="FLASH_ATTN"), env="FLASHINFER") == "flash-attn"
    assert settings(SimpleNamespace(name="FLASHINFER"), layout="flash-attn") == "flash-attn"


def test_model_identity_names_the_weights_not_the_served_alias(tmp):
    """Two models served under one alias ("chat") with the same geometry must not share keys
    (another model's KV); one model under two aliases must (cross-node hits)."""
    from harness import vllm_config
    from kvgate_vllm import engine_settings

    def ident(model="org/base", served=None, revision=None, quantization=None, **extra):
        cfg = vllm_config(EngineSpec(socket=tmp.sock("x"), model=model))
        cfg.model_config.served_model_name = served
        cfg.model_config.revision = revision
        cfg.model_config.quantization = quantization
        cfg.kv_transfer_config.kv_connector_extra_config = {"socket": "/s.sock", **extra}
        return engine_settings(cfg)["model"]

    assert ident("org/base", "chat") != ident("org/finetune", "chat")
    assert ident("org/base", "chat") == ident("org/base", "assistant") == ident("org/base")
    assert ident(revision="abc123") != ident(revision="def456") != ident()
    assert ident(quantization="awq") != ident()
    assert ident("/models/a", model_id="team/llama-8b") == ident("/mnt/b", model_id="team/llama-8b") == "team/llama-8b"
    for bad in ("", "  ", 7):
        with pytest.raises(ConfigurationError, match="model_id"):
            ident(model_id=bad)


def test_model_identity_is_the_same_on_every_node_of_one_model(tmp):
    """What vLLM derives per node must not reach the key: the local directory it mirrors an
    object-store model's config into (its cache root differs between nodes; older vLLM used a
    fresh temp dir per process), and the kernel it picked for a quantized checkpoint (gptq_marlin
    on one GPU or vLLM version, gptq on another): the same weights, so the same keys."""
    from harness import vllm_config
    from kvgate_vllm import engine_settings

    def ident(model, weights=None, quantization=None, checkpoint_quant=None, attr="quantization_config"):
        cfg = vllm_config(EngineSpec(socket=tmp.sock("x"), model=model))
        cfg.model_config.model_weights = weights if weights is not None else ""
        cfg.model_config.quantization = quantization
        hf = SimpleNamespace() if checkpoint_quant is None else SimpleNamespace(**{attr: checkpoint_quant})
        cfg.model_config.hf_config = hf
        cfg.model_config.hf_text_config = hf
        return engine_settings(cfg)["model"]

    # vLLM's model is the local mirror of the config files; model_weights is the object-store URI.
    a = ident("/var/cache/node-a/vllm/model_streamer/1a2b3c4d", "s3://models/llama-8b")
    b = ident("/srv/node-b/.cache/vllm/model_streamer/1a2b3c4d", "s3://models/llama-8b")
    assert a == b and "s3://models/llama-8b" in a
    assert ident("/tmp/x", "s3://models/llama-8b") != ident("/tmp/x", "s3://models/other")
    # A quantized checkpoint: vLLM's kernel choice (per GPU, per version) is not the weights.
    gptq = {"quant_method": "gptq", "bits": 4}
    assert ident("org/m-gptq", quantization="gptq_marlin", checkpoint_quant=gptq) == ident(
        "org/m-gptq", quantization="gptq", checkpoint_quant=gptq
    )
    # Older compressed-tensors checkpoints name theirs compression_config (vLLM reads both).
    ct = {"quant_method": "compressed-tensors"}
    assert ident("org/m-ct", quantization="compressed-tensors", checkpoint_quant=ct, attr="compression_config") == (
        ident("org/m-ct", quantization="ascend", checkpoint_quant=ct, attr="compression_config")
    )
    # An unquantized checkpoint quantized as it loads (--quantization fp8): other weights, other keys.
    assert ident("org/m", quantization="fp8") != ident("org/m") == ident("org/m", weights="")


def test_cuda_ipc_sends_where_the_storage_ends(monkeypatch):
    """register's cuda-ipc entry carries storageEnd (storage offset + size in the allocation), so
    the agent can refuse a tensor running past its storage; offset counts the tensor's own offset."""
    from types import SimpleNamespace

    import kvgate_vllm.connector as conn

    class Storage:
        def _share_cuda_(self):
            # device, handle, storage size (bytes), storage offset in the allocation (bytes), ...
            return (1, b"h" * 64, 4096, 1024, None, None, None, False)

    class Tensor:
        def untyped_storage(self):
            return Storage()

        def storage_offset(self):
            return 8  # elements

        def element_size(self):
            return 2

    monkeypatch.setattr(conn.torch.cuda, "get_device_properties", lambda d: SimpleNamespace(name="GPU"))
    out = conn.cuda_ipc(Tensor())
    assert out == {"handle": b"h" * 64, "device": 1, "offset": 1024 + 16, "storageEnd": 1024 + 4096}
