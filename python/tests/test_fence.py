"""A load given up at load_timeout_ms while its copy is stalled in the agent (the agent's copy
gate, KVGATE_AGENT_TEST_COPY_GATE: copies started wait while the file exists, then land):
vLLM must not be told the request's blocks are freeable (finished_sending) before that copy
landed, or vLLM gives them to another request and the late copy writes foreign KV into it.
Driven in vLLM's call order against a real agent, TP 2 (vLLM frees once every rank reports)."""

import os
import signal
import threading
import time

import pytest

import torch

from harness import Engine, EngineSpec, TempDir, block_view, make_request, sides, start_agent, synthetic_kv

PROMPT = [(i * 7919 + 13) % 32000 for i in range(100)]  # 3 chunks of 32 tokens + a tail


@pytest.fixture()
def tmp():
    d = TempDir()
    yield d
    d.cleanup()


def given_up_load(e: Engine, gate: str):
    """Stores PROMPT's 3 chunks (r1), then stalls every copy the agent starts (the gate file) and
    prefills PROMPT again (r2): its load is given up at load_timeout_ms, every block recomputed,
    its first copy still stalled. Returns (r1, r2)."""
    r1 = e.prefill("r1", PROMPT)
    assert e.finish(r1["req"], r1["block_ids"]) is True  # saved: 3 chunks
    open(gate, "w").close()  # from here every copy the agent starts stalls
    r2 = e.prefill("r2", PROMPT)
    assert r2["matched"] == 96
    assert r2["load_errors"] == sorted(r2["block_ids"][:6])
    return r1, r2


def layer0_landed(engine: Engine, src, dst, n: int) -> bool:
    """Whether layer 0 of blocks dst[:n] holds what blocks src[:n] hold, on every rank."""
    for rank in range(len(engine.workers)):
        t = engine.tensors(rank)[0]
        for side in range(sides(engine.spec)):
            for i in range(n):
                a, b = block_view(t, engine.spec, side, src[i]), block_view(t, engine.spec, side, dst[i])
                if not torch.equal(a, b):
                    return False
    return True


def steps_until_reported(engine: Engine, rid: str, first_finished, max_steps: int, pause: float = 0.02):
    """Steps (no forward) until every worker reported `rid` in finished_sending; returns the
    number of steps it took, or None. `first_finished`: the ids vLLM names finished in step 1."""
    reported = set()
    finished = set(first_finished)
    for n in range(1, max_steps + 1):
        meta, sync = engine.schedule(finished)
        outs = engine.step(meta, finished, None, sync)
        finished = set()
        reported |= {i for i, o in enumerate(outs) if rid in o["finished_sending"]}
        if len(reported) == len(engine.workers):
            return n
        time.sleep(pause)
    return None


@pytest.mark.parametrize("ending", ["copy-lands", "agent-dies", "agent-stops"])
def test_a_timed_out_load_holds_its_requests_blocks_until_its_stalled_copy_landed(tmp, ending):
    gate = os.path.join(tmp.path, "gate")
    sock = tmp.sock(f"fence-{ending}")
    agent = start_agent(sock, None, extra={"KVGATE_AGENT_TEST_COPY_GATE": gate})
    e = Engine(EngineSpec(socket=sock, model=f"test/fence-{ending}", world=2, load_timeout_ms=300), block_order_seed=3)
    try:
        assert e.ready
        # load_timeout_ms passes with the copies stalled: every block is recomputed...
        r1, r2 = given_up_load(e, gate)
        # ...and the request ends (or is aborted): its blocks must stay vLLM's until the copy landed.
        delay, _ = e.sched.request_finished(r2["req"], r2["block_ids"])
        assert delay is True
        assert steps_until_reported(e, "r2", {"r2"}, max_steps=10) is None
        assert not layer0_landed(e, r1["block_ids"], r2["block_ids"], 6)  # its first copy is still stalled
        if ending == "copy-lands":
            os.unlink(gate)
        elif ending == "agent-stops":
            # SIGTERM: the agent closes the connection (a fence) only once the stalled copy landed.
            agent.proc.send_signal(signal.SIGTERM)
            assert steps_until_reported(e, "r2", (), max_steps=25) is None
            os.unlink(gate)
        else:
            agent.kill()  # its copies die with it
        n = steps_until_reported(e, "r2", (), max_steps=200)
        assert n is not None, "the fence never resolved"
        if ending != "agent-dies":
            # Freeable only after the stalled copy (layer 0's, started before the timeout) landed.
            assert layer0_landed(e, r1["block_ids"], r2["block_ids"], 6)
        if ending == "copy-lands":
            # The connection was kept (no reconnect, no other request failed): a load now lands.
            r3 = e.prefill("r3", PROMPT)
            assert r3["matched"] == 96 and r3["load_errors"] == []
            # A request whose load finished is held one step at most.
            delay, _ = e.sched.request_finished(r3["req"], r3["block_ids"])
            assert delay is True
            assert steps_until_reported(e, "r3", {"r3"}, max_steps=1) == 1
    finally:
        if os.path.exists(gate):
            os.unlink(gate)
        e.close()
        agent.stop()


def forward_landed(engine: Engine, tokens, block_ids, n: int) -> bool:
    """Whether layer 0 of blocks block_ids[:n] holds the KV a forward of `tokens` wrote, on every rank."""
    spec = engine.spec
    for rank in range(len(engine.workers)):
        t = engine.tensors(rank)[0]
        for side in range(sides(spec)):
            kv = synthetic_kv(spec, rank, 0, side, tokens, 0, n * spec.block_size)
            for p in range(n * spec.block_size):
                row = block_view(t, spec, side, block_ids[p // spec.block_size])[p % spec.block_size]
                if not torch.equal(row, kv[p].view(row.shape)):
                    return False
    return True


@pytest.mark.parametrize("call_order,ending", [("0.29", "copy-lands"), ("0.29", "agent-dies"), ("0.13", "copy-lands")])
def test_a_preempted_request_with_a_given_up_load_is_fenced_before_the_step_that_may_reuse_its_blocks(tmp, call_order, ending):
    # vLLM frees a preempted request's blocks at once (no request_finished, no hold) and may give
    # them to another request in the very next step. After 0.13 it calls handle_preemptions before
    # that step's loads and forward; 0.11-0.13 never do, and start_load_kv fences instead.
    gate = os.path.join(tmp.path, "gate")
    sock = tmp.sock(f"preempt-{ending}")
    agent = start_agent(sock, None, extra={"KVGATE_AGENT_TEST_COPY_GATE": gate})
    e = Engine(
        EngineSpec(socket=sock, model=f"test/preempt-{ending}", world=2, load_timeout_ms=300, call_order=call_order),
        block_order_seed=5,
    )
    try:
        assert e.ready
        r1, r2 = given_up_load(e, gate)
        assert not layer0_landed(e, r1["block_ids"], r2["block_ids"], 6)
        # r2 is preempted; the stalled copy lands (or the agent dies) 1.5 s into the next step.
        ender = threading.Timer(1.5, (lambda: os.unlink(gate)) if ending == "copy-lands" else agent.kill)
        ender.start()
        t0 = time.monotonic()
        meta, sync = e.schedule(preempted={"r2"})
        # vLLM gives r2's freed blocks to another request, computed in this very step.
        other = [(t * 31 + 5) % 32000 for t in PROMPT]
        fwd = {"tokens": other, "start": 0, "block_ids": r2["block_ids"]}
        outs = e.step(meta, (), fwd, sync)
        took = time.monotonic() - t0
        ender.join()
        # The step began only once no copy of r2's load could land any more.
        assert took >= 1.4, f"the step ran {took:.2f} s after the preemption, before r2's fence"
        for o in outs:
            assert o["forward_at"] - t0 >= 1.4, f"the forward began {o['forward_at'] - t0:.2f} s after the preemption"
        time.sleep(0.5)  # had the stalled copy not been waited for, it lands now, after the forward
        # The blocks hold what the other request's forward wrote, not r2's late copy over it.
        assert forward_landed(e, other, r2["block_ids"], 6)
    finally:
        if os.path.exists(gate):
            os.unlink(gate)
        e.close()
        agent.stop()


def test_a_request_kvgate_never_loaded_into_is_not_held(tmp):
    sock = tmp.sock("fence-miss")
    agent = start_agent(sock, None)
    e = Engine(EngineSpec(socket=sock, model="test/fence-miss"), block_order_seed=4)
    try:
        req = make_request("r1", PROMPT[:20], 16)  # under one chunk: no lookup, no load, no save
        assert e.lookup(req) == 0
        delay, _ = e.sched.request_finished(req, e.alloc(2))
        assert delay is False
    finally:
        e.close()
        agent.stop()


OTHER = [(i * 104729 + 7) % 32000 for i in range(100)]  # no prefix in common with PROMPT


def test_a_save_past_save_timeout_ms_is_cancelled_and_the_connection_kept_for_its_given_up_loads_fence(tmp):
    """A save past save_timeout_ms dropped the connection: every load given up on it (its copy
    stalled) then lost its fence, its request held for good. An agent with `cancel` has the save
    cancelled instead: the save is answered (ERR_CANCELLED) once its copy in flight landed, and
    the stalled load's answer, on the kept connection, frees its request."""
    gate = os.path.join(tmp.path, "gate")
    sock = tmp.sock("fence-save")
    agent = start_agent(sock, None, extra={"KVGATE_AGENT_TEST_COPY_GATE": gate})
    spec = EngineSpec(socket=sock, model="test/fence-save", world=2, load_timeout_ms=300, save_timeout_ms=1000)
    e = Engine(spec, block_order_seed=5)
    try:
        assert e.ready
        r1, r2 = given_up_load(e, gate)
        r3 = e.prefill("r3", OTHER)
        assert r3["matched"] == 0
        assert e.sched.request_finished(r2["req"], r2["block_ids"])[0] is True
        assert e.sched.request_finished(r3["req"], r3["block_ids"])[0] is True  # its save
        # Past save_timeout_ms (the save's copy is stalled): neither request is freeable yet.
        finished, t0 = {"r2", "r3"}, time.monotonic()
        while time.monotonic() - t0 < spec.save_timeout_ms / 1000 + 0.4:
            meta, sync = e.schedule(finished)
            outs = e.step(meta, finished, None, sync)
            finished = set()
            assert [o["finished_sending"] for o in outs] == [[], []]
            time.sleep(0.02)
        os.unlink(gate)  # the stalled copies land: the load and the cancelled save answer
        reported = {"r2": set(), "r3": set()}
        for _ in range(200):
            meta, sync = e.schedule()
            for rank, o in enumerate(e.step(meta, (), None, sync)):
                for rid in o["finished_sending"]:
                    reported[rid].add(rank)
            if all(len(r) == 2 for r in reported.values()):
                break
            time.sleep(0.02)
        assert reported["r2"] == {0, 1}, "the given-up load lost its fence"
        assert reported["r3"] == {0, 1}
        assert layer0_landed(e, r1["block_ids"], r2["block_ids"], 6)
        # The cancelled save stored no chunk whose copy landed after the cancel.
        assert e.lookup(make_request("r4", OTHER, 16)) == 0
    finally:
        if os.path.exists(gate):
            os.unlink(gate)
        e.close()
        agent.stop()


def steps_while(engine: Engine, rid: str, seconds: float, first_finished=(), until=None) -> None:
    """Steps for `seconds` (or until `until()`), asserting no worker reports `rid` freeable."""
    finished, t0 = set(first_finished), time.monotonic()
    while time.monotonic() - t0 < seconds and not (until is not None and until()):
        meta, sync = engine.schedule(finished)
        outs = engine.step(meta, finished, None, sync)
        finished = set()
        assert all(rid not in o["finished_sending"] for o in outs), f"{rid} reported freeable"
        time.sleep(0.02)


@pytest.mark.parametrize("ending", ["copy-lands-then-agent-killed", "agent-killed-while-stalled", "no-pidfd"])
def test_a_load_on_a_connection_the_connector_dropped_is_held_until_the_agent_process_exited(tmp, ending):
    """The connector drops the connection itself (a save whose cancel stays unanswered another
    save_timeout_ms, its copy stalled) while a given-up load's copy is stalled: the load's fence
    is lost, and the agent, alive, may still land that copy. Its request is freeable once the
    agent process has exited (its pidfd), and not before, even after the copy landed; where no
    pidfd can be had (pidfd_open fails) it stays held for good, counted."""
    gate = os.path.join(tmp.path, "gate")
    sock = tmp.sock(f"pidfd-{ending}")
    agent = start_agent(sock, None, extra={"KVGATE_AGENT_TEST_COPY_GATE": gate})
    spec = EngineSpec(
        socket=sock,
        model=f"test/pidfd-{ending}",
        world=2,
        load_timeout_ms=300,
        save_timeout_ms=800,
        no_pidfd=ending == "no-pidfd",
    )
    e = Engine(spec, block_order_seed=6)
    try:
        assert e.ready
        r1, r2 = given_up_load(e, gate)
        r3 = e.prefill("r3", OTHER)
        assert e.sched.request_finished(r2["req"], r2["block_ids"])[0] is True
        assert e.sched.request_finished(r3["req"], r3["block_ids"])[0] is True  # its save stalls
        # Past twice save_timeout_ms: the save's cancel went unanswered and the connector dropped
        # the connection, r2's load (its copy stalled) failed with it.
        def dropped():
            return all(w.call("fences")["loads_unfenced"] > 0 for w in e.workers)

        steps_while(e, "r2", 15.0, first_finished={"r2", "r3"}, until=dropped)
        steps_while(e, "r2", 0.5)  # held past the drop: the agent lives, its copy stalled
        fences = [w.call("fences") for w in e.workers]
        assert [f["loads_unfenced"] for f in fences] == [1, 1]
        # One pidfd per worker: the dropped connection's agent, reused by the reconnection to it.
        assert [f["pidfds"] for f in fences] == ([0, 0] if ending == "no-pidfd" else [1, 1])
        assert not layer0_landed(e, r1["block_ids"], r2["block_ids"], 6)
        if ending == "copy-lands-then-agent-killed":
            os.unlink(gate)
            # The stalled copy lands, but nothing says so any more: still held while the agent lives.
            steps_while(e, "r2", 5.0, until=lambda: layer0_landed(e, r1["block_ids"], r2["block_ids"], 6))
            assert layer0_landed(e, r1["block_ids"], r2["block_ids"], 6)
            steps_while(e, "r2", 0.5)
        agent.kill()  # SIGKILL, and reaped
        if ending == "no-pidfd":
            assert steps_until_reported(e, "r2", (), max_steps=25) is None
            fences = [w.call("fences") for w in e.workers]
            assert [f["loads_held_for_good"] for f in fences] == [1, 1]
            assert [f["loads_unfenced"] for f in fences] == [1, 1]
        else:
            assert steps_until_reported(e, "r2", (), max_steps=200) is not None, "the agent's exit did not fence"
            fences = [w.call("fences") for w in e.workers]
            assert [f["pidfds"] for f in fences] == [0, 0]  # closed once the exit was seen
            assert [f["loads_held_for_good"] for f in fences] == [0, 0]
        if ending == "agent-killed-while-stalled":
            assert not layer0_landed(e, r1["block_ids"], r2["block_ids"], 6)  # it never will
    finally:
        if os.path.exists(gate):
            os.unlink(gate)
        e.close()
        agent.stop()
