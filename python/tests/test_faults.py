"""KVGateConnector against a scripted fake agent that misbehaves: it stalls, answers garbage,
refuses after a restart, or stops reading. Whatever it does, vLLM's scheduler and workers get
an answer within their deadlines (0 matched tokens, blocks reported as load errors), never an
exception and never a hang; and nothing is saved that vLLM has not computed."""

import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fake_agent import ScriptedAgent
from harness import EngineSpec, FakeBlocks, make_request, vllm_config
from kvgate_vllm import KVGateConnector, hashing, shm
from kvgate_vllm._vllm import KVConnectorRole
from kvgate_vllm.connector import KVGateMetadata, LoadSpec, SaveSpec

CHUNK = 32  # tokens: 2 blocks of 16
HELLO_OK = {"ok": True, "protocol": 1, "chunkTokens": CHUNK, "blocksPerChunk": 2, "pid": os.getpid()}


def well_behaved(agent, conn, req, n):
    op = req["op"]
    if op == "hello":
        return HELLO_OK
    if op == "register":
        return {"ok": True, "worker": 1, "chunkTokens": CHUNK, "blocksPerChunk": 2, "device": None}
    if op == "lookup":
        return {"ok": True, "chunks": len(req["keys"]) // 32, "tokens": 0, "source": "all"}
    return None


def spec_for(agent, **kw) -> EngineSpec:
    return EngineSpec(socket=agent.path, model="test/faults", **kw)


def config(agent, load_timeout_ms=20000, lookup_timeout_ms=10000, save_timeout_ms=None, **kw):
    cfg = vllm_config(spec_for(agent, **kw))
    cfg.kv_transfer_config.kv_connector_extra_config.update(
        load_timeout_ms=load_timeout_ms, lookup_timeout_ms=lookup_timeout_ms
    )
    if save_timeout_ms is not None:
        cfg.kv_transfer_config.kv_connector_extra_config["save_timeout_ms"] = save_timeout_ms
    return cfg


def scheduler(agent, **kw) -> KVGateConnector:
    c = KVGateConnector(config(agent, **kw), KVConnectorRole.SCHEDULER)
    c._client._reconnect_interval = 0
    return c


def worker(agent, layers=3, **kw):
    spec = spec_for(agent, layers=layers)
    shape = [2, spec.num_blocks, 16, spec.kv_heads, spec.head_size]
    caches = {f"l{i}": shm.shm_tensor(shape, torch.float16) for i in range(layers)}
    c = KVGateConnector(config(agent, layers=layers, **kw), KVConnectorRole.WORKER)
    c._client._reconnect_interval = 0
    c.register_kv_caches(caches)
    return c, caches


def drop_caches(caches):
    for t in caches.values():
        shm.unlink(t)


def lookup(conn, req, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        n, is_async = conn.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n
        assert time.monotonic() < deadline, "lookup never answered"
        time.sleep(0.005)


PROMPT = [(i * 7919 + 13) % 32000 for i in range(100)]


def run_load(c, names, spec: LoadSpec):
    c.bind_connector_metadata(KVGateMetadata(loads=[spec]))
    c.start_load_kv(None)
    for n in names:
        c.wait_for_layer_load(n)
    c.wait_for_save()
    c.get_finished(set())
    errors = c.get_block_ids_with_load_errors()
    c.clear_connector_metadata()
    return errors


def load_spec(chunks=2):
    req = make_request("r", PROMPT, 16)
    keys = [req.block_hashes[(i + 1) * 2 - 1] for i in range(chunks)]
    return LoadSpec("r", keys, list(range(10, 10 + 2 * chunks)), 0)


# ---------------------------------------------------------------------------- deadlines


def test_a_stalled_load_costs_one_load_timeout_per_step_not_one_per_layer():
    """The agent takes the load and never answers: the forward pass waits at most
    load_timeout_ms in all (not per layer, then once more per load), and every block is an error."""

    def stall(agent, conn, req, n):
        return None if req["op"] == "load" else well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(stall)
    c, caches = worker(agent, layers=8, load_timeout_ms=250)
    try:
        assert c._worker_ready()
        t0 = time.monotonic()
        errors = run_load(c, list(caches), load_spec())
        took = time.monotonic() - t0
        assert errors == set(range(10, 14))
        # One timeout is 0.25 s; per layer and per load it was 8 x 0.25 + 0.25 = 2.25 s.
        assert took < 1.2, took
        # The connection stays (its other requests carry on); the load, unanswered, is the
        # request's fence: its blocks are not reported freeable while it may still copy.
        assert c._client.connected
        assert c._unfenced("r")
    finally:
        c.shutdown()
        drop_caches(caches)
        agent.close()


def until(fn, timeout=5.0):
    """fn() until it returns something truthy or `timeout` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while not (v := fn()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return v


def hold_step(c, holds, finished):
    """One worker step carrying `holds` (request_finished held them: no save); returns finished_sending."""
    c.bind_connector_metadata(KVGateMetadata(holds=list(holds)))
    c.start_load_kv(None)
    c.wait_for_save()
    sending, _ = c.get_finished(set(finished))
    c.get_block_ids_with_load_errors()
    c.clear_connector_metadata()
    return sending or set()


@pytest.mark.parametrize("features", [["cancel"], None])
def test_a_timed_out_load_is_cancelled_and_its_request_held_until_the_agent_answers_it(features):
    """An agent that has `cancel` is asked to cancel the given-up load (by its request id) and
    the connection is kept: a save on it still completes. The request is reported freeable only
    once the load is answered (the agent's fence). An older agent is not sent `cancel`: its own
    answer to the load is the fence."""
    held = {}

    def script(agent, conn, req, n):
        if req["op"] == "hello":
            return {**HELLO_OK, "features": features} if features else HELLO_OK
        if req["op"] == "load":
            held["load"] = (conn, req["id"])
            return None
        if req["op"] == "cancel":
            held["cancel"] = req["ids"]
            return {"ok": True, "cancelled": req["ids"]}
        if req["op"] == "save":
            return {"ok": True, "chunks": 1, "stored": 1, "present": 0, "skipped": 0}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    c, caches = worker(agent, load_timeout_ms=150)
    try:
        assert c._worker_ready()
        assert run_load(c, list(caches), load_spec()) == set(range(10, 14))
        if features:
            until(lambda: "cancel" in held)
        assert held.get("cancel") == ([held["load"][1]] if features else None)
        assert ("load" in held) and c._client.connected
        # Another request of the connection: its save completes and is reported.
        c.bind_connector_metadata(KVGateMetadata(saves=[SaveSpec("s", load_spec(1).keys, [30, 31], 0)]))
        c.start_load_kv(None)
        c.wait_for_save()
        finished = [{"s"}]
        sending = until(lambda: c.get_finished(finished.pop() if finished else set())[0])
        c.clear_connector_metadata()
        assert sending == {"s"}
        # The given-up request ends: held while its load is unanswered...
        assert hold_step(c, ["r"], ["r"]) == set()
        assert hold_step(c, [], []) == set()
        # ...reported once the agent answers it (after its last copy landed).
        conn, rid = held["load"]
        agent.send(conn, {"id": rid, "ok": True, "chunks": 0, "tokens": 0, "failedBlocks": list(range(10, 14)), "error": "cancelled"})
        assert until(lambda: hold_step(c, [], [])) == {"r"}
        assert c.loads_unfenced == 0
    finally:
        c.shutdown()
        drop_caches(caches)
        agent.close()


@pytest.mark.parametrize("who", ["agent", "connector"])
def test_a_load_failed_by_a_dropped_connection_is_a_fence_only_when_the_agent_closed_it(who, caplog):
    """The agent closing (or dying) ends its copies: the given-up load's request is freed. This
    side dropping the connection (a garbage frame, a stalled send, a save past save_timeout_ms)
    leaves the agent's running copies running: the request stays held until the agent process exits
    (this fake agent is this process: never), counted and logged."""
    agent = ScriptedAgent(lambda agent, conn, req, n: None if req["op"] == "load" else well_behaved(agent, conn, req, n))
    c, caches = worker(agent, load_timeout_ms=150)
    try:
        assert c._worker_ready()
        run_load(c, list(caches), load_spec())
        assert hold_step(c, ["r"], ["r"]) == set()
        if who == "agent":
            agent.drop_all()
        else:
            c._client.close()
        # Held after this side's drop: a second of steps shows it.
        sending = until(lambda: hold_step(c, [], []), timeout=5.0 if who == "agent" else 1.0)
        if who == "agent":
            assert sending == {"r"} and c.loads_unfenced == 0
        else:
            assert sending == set() and c.loads_unfenced == 1
            if hasattr(os, "pidfd_open"):
                assert c.loads_held_for_good == 0
                assert f"until the agent process (pid {os.getpid()}) exits" in caplog.text
            else:
                assert c.loads_held_for_good == 1 and "stay allocated for good" in caplog.text
            # That process exiting fences the load (a stand-in: this fake agent is this process).
            caplog.set_level(logging.INFO, logger="kvgate_vllm")
            (fence,) = c._fences["r"]
            fence.exception().agent = SimpleNamespace(pid=4242, watchable=True, exited=lambda: True)
            assert until(lambda: hold_step(c, [], []), timeout=5.0) == {"r"}
            assert "the agent process (pid 4242) exited" in caplog.text
            assert c._unfenced_seen == set() and c._fences == {}
    finally:
        c.shutdown()
        drop_caches(caches)
        agent.close()


@pytest.mark.parametrize("form", ["metadata", "ids"])
def test_a_preempted_request_whose_given_up_load_can_never_be_fenced_stops_the_step(form):
    """vLLM frees a preempted request's blocks at once and may write them in the step that follows
    handle_preemptions. A load given up on a connection this side dropped, its agent's exit not
    watchable, can never be fenced: the step must not go on (an error), not return as if safe. Both
    forms vLLM passes are understood: this step's metadata, or the set of preempted ids."""
    agent = ScriptedAgent(lambda agent, conn, req, n: None if req["op"] == "load" else well_behaved(agent, conn, req, n))
    c, caches = worker(agent, load_timeout_ms=150)
    try:
        assert c._worker_ready()
        run_load(c, list(caches), load_spec())
        c._client.close()
        (fence,) = c._fences["r"]
        until(lambda: fence.done() or None, timeout=5.0)
        fence.exception().agent = SimpleNamespace(pid=0, watchable=False, why_not="pid 0", exited=lambda: False)
        arg = KVGateMetadata(preempted=["r"]) if form == "metadata" else {"r"}
        with pytest.raises(RuntimeError, match="preempted"):
            c.handle_preemptions(arg)
        # Once the agent's exit is seen, the same preemption goes on at once.
        fence.exception().agent = SimpleNamespace(pid=4242, watchable=True, exited=lambda: True)
        t0 = time.monotonic()
        c.handle_preemptions(arg)
        assert time.monotonic() - t0 < 1.0 and "r" not in c._fences
        # A request with nothing in flight is not waited for.
        c.handle_preemptions(KVGateMetadata(preempted=["other"]))
    finally:
        c.shutdown()
        drop_caches(caches)
        agent.close()


def test_preempted_requests_are_fenced_once_per_bound_metadata_whichever_hook_comes_first(monkeypatch):
    """After 0.13 vLLM calls handle_preemptions(metadata) and then binds it; 0.11-0.13 only bind
    and start_load_kv. The step's fence is waited for by the first of them, once: not again at
    start_load_kv for the metadata handle_preemptions had, and afresh for the next step's."""
    agent = ScriptedAgent(well_behaved)
    c, caches = worker(agent)
    waited = []
    monkeypatch.setattr(c, "_wait_fenced", waited.append)
    try:
        assert c._worker_ready()
        m1 = KVGateMetadata(preempted=["a"])
        c.handle_preemptions(m1)  # after 0.13: before the bind
        c.bind_connector_metadata(m1)
        c.start_load_kv(None)
        c.clear_connector_metadata()
        assert waited == ["a"]
        m2 = KVGateMetadata(preempted=["b"])
        c.bind_connector_metadata(m2)  # 0.11-0.13: no handle_preemptions
        c.start_load_kv(None)
        c.start_load_kv(None)
        assert waited == ["a", "b"]
        c.clear_connector_metadata()
        # The same metadata bound again is another step: fenced again.
        c.bind_connector_metadata(m2)
        c.start_load_kv(None)
        assert waited == ["a", "b", "b"]
        c.clear_connector_metadata()
        # A set of ids (some versions) is waited for as given; the bound metadata still is once.
        m3 = KVGateMetadata(preempted=["c"])
        c.handle_preemptions({"c"})
        c.bind_connector_metadata(m3)
        c.start_load_kv(None)
        assert waited == ["a", "b", "b", "c", "c"]
    finally:
        c.shutdown()
        drop_caches(caches)
        agent.close()


def test_an_agent_that_stops_reading_never_blocks_the_scheduler():
    """A stalled agent (alive, socket open, not reading): lookups fill its socket buffer.
    The scheduler's sends must give up (the connection is dropped), not block vLLM forever."""
    agent = ScriptedAgent(well_behaved, read=False)
    c = scheduler(agent, lookup_timeout_ms=50)
    done = threading.Event()
    errors = []

    def go():
        try:
            for i in range(400):
                # 4096 blocks of 16 = 2048 chunk keys: 64 KiB a lookup.
                toks = [(i * 1000003 + j) % 32000 for j in range(16 * 4096)]
                req = make_request(f"r{i}", toks, 16)
                assert lookup(c, req) == 0
                if not c._client.connected:
                    break
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    try:
        assert done.wait(30), "the scheduler blocked in a send to a stalled agent"
        assert errors == []
        assert not c._client.connected
    finally:
        c.shutdown()
        agent.close()


def test_a_connection_dropped_on_a_stalled_send_is_closed_for_the_agent_too():
    """A send the agent does not drain within the send timeout drops the connection and fails
    its pending loads (vLLM recomputes or reuses their blocks): the agent must see the close,
    which is what stops its copies into them. A plain close() of the socket while the reader
    thread sat in recv() on it left the connection open (the kernel keeps a socket a blocked
    recv uses): the agent saw no hang-up until it next sent something."""
    import select

    from kvgate_vllm.client import AgentClient

    agent = ScriptedAgent(lambda agent, conn, req, n: HELLO_OK if req["op"] == "hello" else None, read=False)
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0, send_timeout=0.2)
    try:
        assert c.ensure()
        pending = c.request("load", {"keys": b""})  # the reader thread now waits in recv()
        time.sleep(0.2)
        big = b"x" * (1 << 20)
        for _ in range(64):  # fill the socket buffers until a send gives up
            c.request("save", {"keys": big})
            if not c.connected:
                break
        assert not c.connected
        assert pending.done()
        conn = agent.conns[-1]
        p = select.poll()
        p.register(conn, select.POLLRDHUP)
        assert p.poll(3000), "the agent never saw the engine hang up"
    finally:
        c.close()
        agent.close()


def test_a_request_racing_a_dropped_connection_fails_at_once():
    """request() read the socket, then the connection dropped (the reader thread saw EOF, a load
    timed out) before it registered its answer: it joined the next connection's pending map and
    its send failed on the dead socket without failing it, so it waited for ever (a save's blocks
    held until save_timeout_ms, then a needless reconnect). It fails at once instead."""
    from kvgate_vllm.client import AgentClient, AgentError

    agent = ScriptedAgent(well_behaved)
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0)
    real = c._lock
    fired = []

    class DropFirst:
        """The client's lock, with the connection dropped just before the first acquire."""

        def __enter__(self):
            if not fired:
                fired.append(True)
                c._drop(c._sock)
            return real.__enter__()

        def __exit__(self, *a):
            return real.__exit__(*a)

    try:
        assert c.ensure()
        c._lock = DropFirst()
        f = c.request("save", {"keys": b""})
        c._lock = real
        assert fired
        assert f.done(), "the request waits for an answer on a dead connection"
        with pytest.raises(AgentError):
            f.result(timeout=0)
        assert not c._pending
    finally:
        c._lock = real
        c.close()
        agent.close()


# ---------------------------------------------------------------------------- refusals after start


def test_a_restarted_agent_that_refuses_this_engine_means_no_kvgate_not_a_crash():
    """Started fine, then the agent comes back speaking another protocol version (or for
    another model, or refusing the layout): every later call answers 0 / load errors."""

    def restarted(agent, conn, req, n):
        if not getattr(agent, "restarted", False):
            return well_behaved(agent, conn, req, n)
        if req["op"] == "hello":
            code = ["ERR_PROTOCOL_VERSION", "ERR_MODEL_MISMATCH"][n % 2]
            return {"ok": False, "error": {"code": code, "message": "refused"}}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(restarted)
    s = scheduler(agent)
    w, caches = worker(agent)
    try:
        assert s._client.connected and w._worker_ready()
        agent.restarted = True
        agent.drop_all()
        time.sleep(0.1)
        for i in range(4):
            assert lookup(s, make_request(f"x{i}", PROMPT, 16)) == 0
            assert run_load(w, list(caches), load_spec()) == set(range(10, 14))
            assert s.request_finished(make_request(f"x{i}", PROMPT, 16), list(range(8))) == (False, None)
    finally:
        s.shutdown()
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_a_register_refused_after_a_restart_means_load_errors_not_a_crash():
    def layout_refused(agent, conn, req, n):
        if getattr(agent, "restarted", False) and req["op"] == "register":
            return {"ok": False, "error": {"code": "ERR_LAYOUT", "message": "refused"}}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(layout_refused)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        agent.restarted = True
        agent.drop_all()
        time.sleep(0.1)
        for _ in range(3):
            assert run_load(w, list(caches), load_spec()) == set(range(10, 14))
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


# ---------------------------------------------------------------------------- garbage answers


@pytest.mark.parametrize(
    "hello",
    [
        {"ok": True},  # no protocol, no chunkTokens
        {"ok": True, "protocol": "1", "chunkTokens": 32},
        {"ok": True, "protocol": 1},  # no chunkTokens
        {"ok": True, "protocol": 1, "chunkTokens": "32"},
        {"ok": True, "protocol": 1, "chunkTokens": 24},  # not a whole number of 16-token blocks
        {"ok": True, "protocol": 1, "chunkTokens": -32},
        {"ok": True, "protocol": 1, "chunkTokens": 0},
    ],
)
def test_a_garbage_hello_answer_is_no_agent(hello):
    def script(agent, conn, req, n):
        return hello if req["op"] == "hello" else well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    s = scheduler(agent)
    try:
        assert lookup(s, make_request("r", PROMPT, 16)) == 0
        assert s.request_finished(make_request("r", PROMPT, 16), list(range(8))) == (False, None)
    finally:
        s.shutdown()
        agent.close()


@pytest.mark.parametrize(
    "answer",
    [
        {"ok": True},
        {"ok": True, "chunks": "3"},
        {"ok": True, "chunks": None},
        {"ok": True, "chunks": 3.5},
        {"ok": True, "chunks": -1},
        {"ok": True, "chunks": 99},  # more chunks than were asked
        {"ok": True, "chunks": True},
    ],
)
def test_a_garbage_lookup_answer_is_a_miss(answer):
    def script(agent, conn, req, n):
        return answer if req["op"] == "lookup" else well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    s = scheduler(agent)
    try:
        assert lookup(s, make_request("r", PROMPT, 16)) == 0
    finally:
        s.shutdown()
        agent.close()


@pytest.mark.parametrize(
    "answer",
    [
        {"ok": True},  # no failedBlocks: nothing says the blocks were filled
        {"ok": True, "failedBlocks": "none"},
        {"ok": True, "failedBlocks": [10, "x"]},
        {"ok": True, "failedBlocks": None},
        {"ok": True, "failedBlocks": [10.5]},
    ],
)
def test_a_garbage_load_answer_reports_every_block(answer):
    def script(agent, conn, req, n):
        return answer if req["op"] == "load" else well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        assert run_load(w, list(caches), load_spec()) == set(range(10, 14))
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_a_load_answer_naming_other_blocks_reports_only_the_loads_blocks():
    def script(agent, conn, req, n):
        if req["op"] == "load":
            return {"ok": True, "chunks": 1, "failedBlocks": [12, 13, 999, 0], "error": None}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        assert run_load(w, list(caches), load_spec()) == {12, 13}
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


@pytest.mark.parametrize(
    "event",
    [
        {"event": "load-progress", "id": [1], "layers": 1},  # an unhashable id
        {"event": "load-progress", "id": {"a": 1}, "layers": 1},
        {"id": [1], "ok": True},  # an answer with an unhashable id
    ],
)
def test_garbage_frames_drop_the_connection_and_the_load_is_reported(event):
    def script(agent, conn, req, n):
        if req["op"] == "load":
            ev = dict(event)
            ev.setdefault("id", req["id"])
            agent.send(conn, ev)
            return None  # the load's answer never comes
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent, load_timeout_ms=5000)
    try:
        assert w._worker_ready()
        t0 = time.monotonic()
        assert run_load(w, list(caches), load_spec()) == set(range(10, 14))
        assert time.monotonic() - t0 < 4, "the garbage frame did not end the load"
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


@pytest.mark.parametrize(
    "layers",
    ["x", 1.5, -1, 4, True, None, [1], 2**64 - 1, "x" * 1_000_000],  # 3 layers: 4 is past the model's
    ids=["string", "float", "negative", "past-the-layers", "bool", "missing", "list", "u64-max", "1-MB-string"],
)
def test_a_malformed_load_progress_event_fails_that_load_keeps_the_connection_and_cancels_it(layers, caplog):
    """A load-progress event whose `layers` is not a layer count of this engine: that load alone
    fails (every block an error, at once, not at load_timeout_ms), the agent is asked to cancel it
    and its answer is its fence (its request held until then), as for a load past load_timeout_ms.
    The connection stays: another load on it lands. Logged once a minute at most, the value cut short."""
    held = {}

    def script(agent, conn, req, n):
        if req["op"] == "hello":
            return {**HELLO_OK, "features": ["cancel"]}
        if req["op"] == "load":
            if "load" in held:  # the second load: well formed, answered at once
                agent.send(conn, {"event": "load-progress", "id": req["id"], "layers": 3})
                return {"ok": True, "chunks": 2, "tokens": 64, "failedBlocks": [], "error": None}
            held["load"] = (conn, req["id"])
            ev = {"event": "load-progress", "id": req["id"]}
            if layers is not None:
                ev["layers"] = layers
            agent.send(conn, ev)
            return None
        if req["op"] == "cancel":
            held["cancel"] = req["ids"]
            return {"ok": True, "cancelled": req["ids"]}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    c, caches = worker(agent, load_timeout_ms=20000)
    try:
        assert c._worker_ready()
        generation = c._client.generation
        t0 = time.monotonic()
        assert run_load(c, list(caches), load_spec()) == set(range(10, 14))
        assert time.monotonic() - t0 < 5, "the malformed event did not end the load"
        # The connection was kept: no reconnect, and another load on it lands.
        assert c._client.connected and c._client.generation == generation
        assert c.loads_bad_progress == 1 and c.loads_unfenced == 0
        assert until(lambda: "cancel" in held) and held["cancel"] == [held["load"][1]]
        assert run_load(c, list(caches), load_spec()) == set()
        # Held while the agent may still copy into its blocks, released once it answers.
        assert hold_step(c, ["r"], ["r"]) == set()
        conn, rid = held["load"]
        agent.send(conn, {"id": rid, "ok": True, "chunks": 0, "tokens": 0, "failedBlocks": list(range(10, 14)), "error": "cancelled"})
        assert until(lambda: hold_step(c, [], [])) == {"r"}
        assert c._client.generation == generation
        logged = [r.getMessage() for r in caplog.records if "malformed event" in r.getMessage()]
        assert len(logged) == 1 and len(logged[0]) < 500
    finally:
        c.shutdown()
        drop_caches(caches)
        agent.close()


def test_malformed_load_progress_is_logged_once_a_minute_and_counted_every_time(caplog):
    def script(agent, conn, req, n):
        if req["op"] == "load":
            agent.send(conn, {"event": "load-progress", "id": req["id"], "layers": "x"})
            # A well-formed event after it does not make the load's progress believable again.
            agent.send(conn, {"event": "load-progress", "id": req["id"], "layers": 3})
            return {"ok": True, "chunks": 2, "tokens": 64, "failedBlocks": [], "error": None}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    c, caches = worker(agent)
    try:
        assert c._worker_ready()
        for _ in range(3):
            # Answered as whole, but its progress cannot be believed: its blocks are recomputed.
            assert run_load(c, list(caches), load_spec()) == set(range(10, 14))
        assert c.loads_bad_progress == 3
        assert sum("malformed event" in r.getMessage() for r in caplog.records) == 1
        assert c._client.connected
    finally:
        c.shutdown()
        drop_caches(caches)
        agent.close()


# ---------------------------------------------------------------------------- saves


def test_request_finished_saves_only_chunks_whose_kv_vllm_computed():
    """A request ends when its last token is sampled; that token's KV is never computed. When it
    completes a chunk, that chunk's last slot holds whatever the block held before: not stored."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        toks = PROMPT[:64]  # 2 chunks of 32
        req = make_request("r", toks, 16)
        req.num_computed_tokens = 63  # the 64th token was sampled, not computed
        delay, _ = s.request_finished(req, list(range(1, 5)))
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids={"r"}))
        saved = [len(sp.keys) for sp in meta.saves]
        assert delay is True and saved == [1], saved
        # Every token computed: both chunks.
        req2 = make_request("r2", toks, 16)
        req2.num_computed_tokens = 64
        assert s.request_finished(req2, list(range(1, 5)))[0] is True
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids={"r2"}))
        assert [len(sp.keys) for sp in meta.saves] == [2]
        # No full chunk computed: nothing held back.
        req3 = make_request("r3", toks, 16)
        req3.num_computed_tokens = 31
        assert s.request_finished(req3, list(range(1, 5))) == (False, None)
    finally:
        s.shutdown()
        agent.close()


def test_a_prompt_given_as_embeddings_is_looked_up_loaded_and_saved():
    """With --enable-prompt-embeds vLLM's Request has prompt_token_ids None (its length is
    num_prompt_tokens; its block hashes cover the embeddings): the scheduler's calls must not
    raise on it (a TypeError there stops the engine)."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        hashes = make_request("e", PROMPT, 16).block_hashes
        req = SimpleNamespace(
            request_id="e",
            prompt_token_ids=None,
            prompt_embeds=torch.zeros(100, 8),
            num_prompt_tokens=100,
            num_tokens=100,
            block_hashes=hashes,
        )
        assert lookup(s, req) == 96
        s.update_state_after_alloc(req, FakeBlocks(list(range(1, 8))), 96)
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids=set()))
        assert [len(ld.keys) for ld in meta.loads] == [3]
        req.num_computed_tokens = 100
        # All 3 chunks came from kvgate: no save; held until the workers say no load copy can land.
        assert s.request_finished(req, list(range(1, 8))) == (True, None)
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids={"e"}))
        assert (meta.saves, meta.holds) == ([], ["e"])
        req2 = SimpleNamespace(
            request_id="e2", prompt_token_ids=None, num_prompt_tokens=100, num_tokens=100, block_hashes=hashes
        )
        req2.num_computed_tokens = 100
        assert s.request_finished(req2, list(range(1, 8)))[0] is True
    finally:
        s.shutdown()
        agent.close()


def test_a_prompt_given_as_embeddings_is_a_miss_where_vllm_does_not_hash_the_embeddings(monkeypatch):
    """vLLM 0.11.0 takes prompts as embeddings but hashes their blocks as placeholder token ids
    (zeros) until its PR 27219: every such prompt of one length has the same block hashes, so
    keys from them would load one prompt's KV for another. There: no lookup, no load, no save."""
    import kvgate_vllm.connector as connector_module

    monkeypatch.setattr(connector_module, "hashes_cover_prompt_embeds", lambda: False, raising=False)
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        hashes = make_request("e", PROMPT, 16).block_hashes
        embeds = SimpleNamespace(
            request_id="e",
            prompt_token_ids=None,
            prompt_embeds=torch.ones(100, 8),
            num_prompt_tokens=100,
            num_tokens=100,
            block_hashes=hashes,
        )
        assert lookup(s, embeds) == 0
        embeds.num_computed_tokens = 100
        assert s.request_finished(embeds, list(range(1, 8))) == (False, None)
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids=set()))
        assert (meta.loads, meta.saves) == ([], [])
        with agent.lock:
            assert not any(op in ("lookup", "save") for _, op in agent.requests)
        # A prompt of token ids is keyed as before.
        assert lookup(s, make_request("t", PROMPT, 16)) == 96
    finally:
        s.shutdown()
        agent.close()


def test_a_request_without_vllm_block_hashes_is_never_keyed_by_its_tokens_alone():
    """vLLM's block hashes mix in what else decides the KV (LoRA adapter, images, cache_salt,
    prompt embeddings). Keys made from the token ids alone would give a LoRA or image request
    the base model's or another image's KV: a request without vLLM's hashes is a miss."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        req = SimpleNamespace(
            request_id="l",
            prompt_token_ids=list(PROMPT),
            all_token_ids=list(PROMPT),
            num_prompt_tokens=100,
            num_tokens=100,
            lora_request=SimpleNamespace(lora_name="adapter-1"),
        )
        assert lookup(s, req) == 0
        req.num_computed_tokens = 100
        assert s.request_finished(req, list(range(1, 8))) == (False, None)
        assert not [op for _, op in agent.requests if op == "lookup"]
    finally:
        s.shutdown()
        agent.close()


def test_null_blocks_are_neither_loaded_into_nor_saved():
    """A sliding-window model: vLLM's block table starts with its null block (id 0) where blocks
    fell out of the window. A load copies nothing into them; a save starts after the last chunk
    holding one (block 0's bytes are nobody's KV)."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        req = make_request("r", PROMPT, 16)
        assert lookup(s, req) == 96
        blocks = [0, 0, 0, 23, 24, 25, 26]
        s.update_state_after_alloc(req, FakeBlocks(blocks), 96)
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids=set()))
        assert [(ld.block_ids, ld.skip_blocks) for ld in meta.loads] == [(blocks[:6], 3)]
        # A request that loaded nothing: chunks 0 and 1 hold null blocks, chunk 2 is saved.
        req2 = make_request("r2", PROMPT, 16)
        req2.num_computed_tokens = 100
        assert s.request_finished(req2, blocks)[0] is True
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids={"r2"}))
        assert [(len(sp.keys), sp.first) for sp in meta.saves] == [(3, 2)]
        # Every chunk out of the window: nothing held back.
        req3 = make_request("r3", PROMPT, 16)
        req3.num_computed_tokens = 100
        assert s.request_finished(req3, [0] * 6 + [26]) == (False, None)
    finally:
        s.shutdown()
        agent.close()


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, "float16"), (torch.float32, "float16"), (torch.float16, "fp8")])
def test_kv_tensors_of_another_dtype_than_the_config_are_refused_at_register(tmp_path, dtype, cache_dtype):
    """The agent sizes and labels the KV by the dtype the connector derived from vLLM's config
    (hello): tensors of another dtype (of the same width: mislabelled KV shared with engines
    that really use that dtype; another width: blocks cut at the wrong bytes) are refused."""
    from kvgate_vllm import ConfigurationError

    spec = EngineSpec(socket=str(tmp_path / "none.sock"), dtype=cache_dtype)
    c = KVGateConnector(vllm_config(spec), KVConnectorRole.WORKER)
    shape = [2, spec.num_blocks, 16, spec.kv_heads, spec.head_size]
    caches = {f"l{i}": shm.shm_tensor(shape, dtype) for i in range(spec.layers)}
    try:
        with pytest.raises(ConfigurationError, match="dtype"):
            c.register_kv_caches(caches)
        assert c._register_msg is None
    finally:
        c.shutdown()
        drop_caches(caches)


@pytest.mark.parametrize("layout,other", [("flash-attn", "flashinfer"), ("flashinfer", "flash-attn")])
def test_kv_tensors_of_the_other_paged_layout_are_refused_naming_the_layout_key(tmp_path, layout, other):
    """The layout is inferred from the attention backend vLLM was told; one vLLM picks itself
    (FlashInfer by default on some GPUs) is not known at start: the engine fails at register,
    and the error must name the fix (the `layout` key), not only the shapes."""
    from kvgate_vllm import ConfigurationError

    spec = EngineSpec(socket=str(tmp_path / "none.sock"), layout=layout)
    c = KVGateConnector(vllm_config(spec), KVConnectorRole.WORKER)
    nb, h, d = spec.num_blocks, spec.kv_heads, spec.head_size
    shape = [2, nb, 16, h, d] if other == "flash-attn" else [nb, 2, 16, h, d]
    caches = {f"l{i}": shm.shm_tensor(shape, torch.float16) for i in range(spec.layers)}
    try:
        with pytest.raises(ConfigurationError) as e:
            c.register_kv_caches(caches)
        assert f'"layout": "{other}"' in str(e.value) and "kv_connector_extra_config" in str(e.value), str(e.value)
        assert c._register_msg is None
    finally:
        c.shutdown()
        drop_caches(caches)


@pytest.mark.parametrize("layout", ["flash-attn", "flashinfer"])
@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_vllms_packed_kv_layout_registers_its_strided_views(tmp_path, layout, physical):
    """vLLM PR #44455 (0.26) packs each token's K and V into the last dimension of every attention
    backend's KV layer, (num_blocks, kv_heads, block_size, 2 * head_size), laid out HND
    (contiguous) or NHD (a permuted view), whatever backend `layout` names. The connector
    registers each layer's view as it is (shape, strides, where it starts); the agent copies
    through the strides (test_vllms_per_layer_views_load_byte_for_byte)."""
    spec = EngineSpec(socket=str(tmp_path / "none.sock"), layout=layout)
    c = KVGateConnector(vllm_config(spec), KVConnectorRole.WORKER)
    nb, h, bs, d = spec.num_blocks, spec.kv_heads, spec.block_size, spec.head_size
    if physical == "HND":
        caches = {f"l{i}": shm.shm_tensor([nb, h, bs, 2 * d], torch.float16) for i in range(spec.layers)}
        views = caches
    else:
        caches = {f"l{i}": shm.shm_tensor([nb, bs, h, 2 * d], torch.float16) for i in range(spec.layers)}
        views = {n: t.permute(0, 2, 1, 3) for n, t in caches.items()}
    try:
        c.register_kv_caches(views)
        msg = c._register_msg
        assert msg["numBlocks"] == nb
        want = [h * bs * 2 * d, bs * 2 * d, 2 * d, 1] if physical == "HND" else [bs * h * 2 * d, 2 * d, h * 2 * d, 1]
        for i, t in enumerate(msg["tensors"]):
            assert (t["kind"], t["shape"], t["strides"], t["offset"]) == ("shm", [nb, h, bs, 2 * d], want, 0)
            assert t["path"] == shm.describe(caches[f"l{i}"])["path"]
    finally:
        c.shutdown()
        drop_caches(caches)


def test_layers_laid_out_unlike_each_other_are_refused(tmp_path):
    """The agent copies every layer through one set of strides: a layer with other strides, or
    a view whose last dimension is not contiguous, is refused at register, never copied wrong."""
    from kvgate_vllm import ConfigurationError

    spec = EngineSpec(socket=str(tmp_path / "none.sock"))
    nb, h, bs, d = spec.num_blocks, spec.kv_heads, spec.block_size, spec.head_size
    caches = {f"l{i}": shm.shm_tensor([nb, bs, h, 2 * d], torch.float16) for i in range(spec.layers)}
    hnd = {f"h{i}": shm.shm_tensor([nb, h, bs, 2 * d], torch.float16) for i in range(spec.layers)}
    mixed = {"l0": caches["l0"].permute(0, 2, 1, 3), "l1": hnd["h1"], "l2": hnd["h2"]}
    strided = {n: shm.shm_tensor([nb, h, bs, 4 * d], torch.float16)[..., ::2] for n in ("s0", "s1", "s2")}
    try:
        for bad in (mixed, strided):
            c = KVGateConnector(vllm_config(spec), KVConnectorRole.WORKER)
            try:
                with pytest.raises(ConfigurationError, match="alike.*last dimension contiguous"):
                    c.register_kv_caches(bad)
                assert c._register_msg is None
            finally:
                c.shutdown()
    finally:
        drop_caches(caches)
        drop_caches(hnd)
        drop_caches({n: t for n, t in strided.items()})


def test_pipeline_parallelism_is_refused_at_start(tmp_path):
    """Every PP stage registers its own layers under the same keys (the namespace has the TP
    rank, not the stage): stage 1 would load stage 0's KV. Refused with a message, not served."""
    from kvgate_vllm import ConfigurationError, engine_settings

    cfg = vllm_config(EngineSpec(socket=str(tmp_path / "x.sock")))
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigurationError, match="pipeline"):
        engine_settings(cfg)
    cfg.parallel_config.pipeline_parallel_size = 1
    assert engine_settings(cfg)["world"] == 1


@pytest.mark.parametrize("knob", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_start(tmp_path, knob):
    """With DCP/PCP each rank holds every n-th token of a block and vLLM hashes blocks of
    block_size * n tokens: chunk keys and block contents would not match. Refused, not served."""
    from kvgate_vllm import ConfigurationError, engine_settings

    cfg = vllm_config(EngineSpec(socket=str(tmp_path / "x.sock")))
    setattr(cfg.parallel_config, knob, 2)
    with pytest.raises(ConfigurationError, match="context parallel"):
        engine_settings(cfg)
    setattr(cfg.parallel_config, knob, 1)
    assert engine_settings(cfg)["world"] == 1


def test_block_hashes_of_another_block_size_are_no_keys():
    """A chunk's key is the hash of its last block: vLLM's block hashes must be one per
    block_size tokens. Hashes of larger blocks (vLLM hashes at block_size * DCP * PCP, or a
    hash block size of its own) would key a chunk by a longer prefix than it holds: a miss
    and no save, never such a key."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        req = make_request("r", PROMPT, 16)
        req.block_hashes = hashing.block_hashes(PROMPT, 32, "0")
        assert lookup(s, req) == 0
        req.num_computed_tokens = 100
        assert s.request_finished(req, list(range(1, 8))) == (False, None)
        assert not [op for _, op in agent.requests if op == "lookup"]
        # The same request with vLLM's hashes at block_size: found, saved.
        ok = make_request("r2", PROMPT, 16)
        assert lookup(s, ok) == 96
    finally:
        s.shutdown()
        agent.close()


def test_a_hello_answered_ok_for_another_protocol_is_no_agent():
    def script(agent, conn, req, n):
        if req["op"] == "hello":
            return {**HELLO_OK, "protocol": 2}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    try:
        with pytest.raises(Exception, match="protocol"):
            scheduler(agent)  # at start: the engine fails with the reason
    finally:
        agent.close()


# ---------------------------------------------------------------------------- bounded state


def test_finished_requests_without_a_save_are_not_remembered():
    """vLLM passes every finished request to get_finished; only those with a kvgate save may be
    kept until it is done (the worker saw one id per request ever served, forever)."""

    def script(agent, conn, req, n):
        if req["op"] == "save":
            return None  # answered below, after the request finished
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        for i in range(1000):
            w.get_finished({f"plain-{i}"})
        assert len(w._finished_seen) == 0
        # A save still waits for its request's id, and is reported once both are in.
        req = make_request("s", PROMPT, 16)
        w.bind_connector_metadata(KVGateMetadata(saves=[SaveSpec("s", req.block_hashes[1:4:2], [1, 2, 3, 4], 0)]))
        w.start_load_kv(None)
        assert w.get_finished({"s"}) == (None, None)
        save_id = max(w._client._pending)
        agent.send(agent.conns[-1], {"id": save_id, "ok": True, "chunks": 2, "stored": 2, "present": 0, "skipped": 0})
        deadline = time.monotonic() + 5
        while w.get_finished(set()) == (None, None):
            assert time.monotonic() < deadline, "the save was never reported finished"
            time.sleep(0.01)
        assert len(w._finished_seen) == 0
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_requests_to_an_agent_that_reads_and_never_answers_are_bounded():
    """The client keeps at most MAX_PENDING requests waiting: beyond, a request fails at once
    (ERR_BUSY: a miss, a load error, a save not stored) instead of growing without bound."""
    from kvgate_vllm.client import MAX_PENDING, AgentClient, AgentError

    agent = ScriptedAgent(lambda agent, conn, req, n: HELLO_OK if req["op"] == "hello" else None)
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0)
    try:
        assert c.ensure()
        futures = [c.request("lookup", {"keys": b""}) for _ in range(MAX_PENDING + 10)]
        assert len(c._pending) <= MAX_PENDING
        late = futures[-1]
        assert late.done()
        with pytest.raises(AgentError) as e:
            late.result(timeout=0)
        assert e.value.code == "ERR_BUSY"
        assert c.connected  # the agent may be slow, not broken: answers still reach the others
    finally:
        c.close()
        agent.close()


def test_an_agent_that_accepts_and_never_answers_hello_is_dialed_ever_less_often():
    """Each dial of a stalled agent holds vLLM's thread for the hello timeout: after failed
    hellos the next dial waits longer and longer (a refused connect, an agent not yet
    restarted, keeps the plain interval), so the engine is not held most of the time."""
    from kvgate_vllm.client import AgentClient

    agent = ScriptedAgent(lambda agent, conn, req, n: None)  # reads, never answers
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0.01)
    c._hello_timeout = 0.05
    try:
        held = 0.0
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            assert c.ensure() is False
            held += time.monotonic() - t0
            time.sleep(0.002)
        # Every 10 ms: ~30 dials, each held 50 ms (75 % of the time). Backing off: ~8.
        assert len(agent.conns) <= 12, len(agent.conns)
        assert held < 0.8, held
    finally:
        c.close()
        agent.close()


# ---------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE", None])
def test_a_step_replaying_a_full_cuda_graph_has_its_loads_in_place_before_the_forward(mode):
    """A FULL CUDA graph replays the forward without its Python: wait_for_layer_load is never
    called (vLLM issue 29608; vLLM <= 0.13 runs uniform decode batches, a 1-token prefill after a
    full prefix load included, that way). Such a step waits for its loads in start_load_kv;
    other steps still overlap the load with the forward."""

    def slow_load(agent, conn, req, n):
        if req["op"] == "load":

            def answer():
                for layers in (1, 2, 3):
                    agent.send(conn, {"event": "load-progress", "id": req["id"], "layers": layers})
                agent.send(conn, {"id": req["id"], "ok": True, "chunks": 2, "failedBlocks": [], "error": None})

            threading.Timer(0.3, answer).start()
            return None
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(slow_load)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        fc = SimpleNamespace(cudagraph_runtime_mode=None if mode is None else SimpleNamespace(name=mode))
        w.bind_connector_metadata(KVGateMetadata(loads=[load_spec()]))
        w.start_load_kv(fc)
        landed = all(st.future.done() for st in w._loads)
        assert landed is (mode == "FULL")
        if mode != "FULL":
            for n in caches:
                w.wait_for_layer_load(n)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        w.clear_connector_metadata()
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


@pytest.mark.parametrize("attn_metadata", [None, {"model.layers.0.self_attn": object()}])
def test_a_v2_runner_full_cuda_graph_step_has_its_loads_in_place_before_the_forward(attn_metadata):
    """vLLM's V2 model runner calls pre_forward for a FULL CUDA graph replay outside any forward
    context (vllm/v1/worker/gpu/model_runner.py, execute_model), so start_load_kv gets the
    stand-in ActiveKVConnector._start_load_kv makes (vllm/v1/worker/gpu/kv_connector.py):
    set_forward_context(None, ...), mode NONE, attn_metadata None. The layer hooks skip a
    context without attention metadata and the replay runs none: the loads must have landed
    when start_load_kv returns. With attention metadata (an eager or PIECEWISE forward under
    its own context) the load still overlaps the forward."""

    def slow_load(agent, conn, req, n):
        if req["op"] == "load":

            def answer():
                agent.send(conn, {"id": req["id"], "ok": True, "chunks": 2, "failedBlocks": [], "error": None})

            threading.Timer(0.3, answer).start()
            return None
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(slow_load)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        fc = SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(name="NONE"), attn_metadata=attn_metadata)
        w.bind_connector_metadata(KVGateMetadata(loads=[load_spec()]))
        w.start_load_kv(fc, request_ids=[], request_state_indices=None)
        landed = all(st.future.done() for st in w._loads)
        assert landed is (attn_metadata is None)
        w.finish_forward()
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set()
        w.clear_connector_metadata()
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_gpu_kv_waits_for_the_engine_stream_before_the_agent_touches_its_blocks(monkeypatch):
    """The agent copies on its own CUDA stream, unordered with vLLM's: with async scheduling
    the previous step's kernels may still be writing (a finished request's last token, about
    to be saved; a freed block, about to be loaded into) when start_load_kv runs. The engine's
    stream is synchronized before a load or save is sent, and not on steps without either."""
    agent = ScriptedAgent(well_behaved)
    w, caches = worker(agent)
    order = []

    class Stream:
        def synchronize(self):
            order.append("sync")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    w._kv_device = torch.device("cuda", 0)  # as registered from CUDA tensors
    sent = w._client.request

    def request(op, *a, **kw):
        order.append(op)
        return sent(op, *a, **kw)

    monkeypatch.setattr(w._client, "request", request)
    try:
        assert w._worker_ready()
        req = make_request("s", PROMPT, 16)
        w.bind_connector_metadata(KVGateMetadata(saves=[SaveSpec("s", req.block_hashes[1:4:2], [1, 2, 3, 4], 0)]))
        w.start_load_kv(None)
        w.clear_connector_metadata()
        assert order == ["sync", "save"], order
        w.bind_connector_metadata(KVGateMetadata(loads=[load_spec()]))
        w.start_load_kv(None)
        w.clear_connector_metadata()
        assert order[2:4] == ["sync", "load"], order
        w.bind_connector_metadata(KVGateMetadata())
        w.start_load_kv(None)
        w.clear_connector_metadata()
        assert len(order) == 4, order
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_a_save_pending_when_the_agent_dies_frees_its_blocks_and_is_counted():
    """request_finished held the blocks for the save: the agent dying before it answered ends
    the save (reported finished, so vLLM frees the blocks), counted as not stored."""

    def script(agent, conn, req, n):
        return None if req["op"] == "save" else well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        req = make_request("s", PROMPT, 16)
        w.bind_connector_metadata(KVGateMetadata(saves=[SaveSpec("s", req.block_hashes[1:4:2], [1, 2, 3, 4], 0)]))
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_finished({"s"}) == (None, None)
        w.clear_connector_metadata()
        assert w.saves_not_stored == 0
        agent.close()  # the agent dies with the save unanswered
        deadline = time.monotonic() + 5
        while True:
            done, _ = w.get_finished(set())
            if done:
                break
            assert time.monotonic() < deadline, "the blocks were never released"
            time.sleep(0.01)
        assert done == {"s"}
        assert w.saves_not_stored == 1
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


@pytest.mark.parametrize("features", [None, ["cancel"]])
def test_a_save_the_agent_never_answers_frees_its_blocks_after_save_timeout_ms(features):
    """An agent alive but stalled takes a save and never answers: request_finished held the
    request's blocks for it, so they were held for ever (vLLM's free blocks shrinking with every
    finished request until nothing can be scheduled). After save_timeout_ms the save is given up:
    an agent without `cancel` by closing the connection (the agent then starts no copy out of its
    blocks and stores no chunk copied after the close); one with `cancel` is asked to cancel it,
    and the connection is closed only when that too goes unanswered for another save_timeout_ms.
    Either way it is reported finished and counted."""
    cancels = []

    def script(agent, conn, req, n):
        if req["op"] == "hello":
            return {**HELLO_OK, "features": features} if features else HELLO_OK
        if req["op"] == "cancel":
            cancels.append((time.monotonic(), req["ids"]))
            return None  # stalled: not even the cancel is answered
        return None if req["op"] == "save" else well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent, save_timeout_ms=200)
    try:
        assert w._worker_ready()
        req = make_request("s", PROMPT, 16)
        w.bind_connector_metadata(KVGateMetadata(saves=[SaveSpec("s", req.block_hashes[1:4:2], [1, 2, 3, 4], 0)]))
        t0 = time.monotonic()  # before the save is sent: its deadline is after t0 + 0.2
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_finished({"s"}) == (None, None)
        save_id = w._saves["s"][0].request_id
        w.clear_connector_metadata()
        deadline = time.monotonic() + 3
        while True:
            done, _ = w.get_finished(set())
            if done:
                break
            assert time.monotonic() < deadline, "a save never answered held its blocks for ever"
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert done == {"s"}
        assert w.saves_not_stored == 1
        assert not w._saves and not w._saves_cancelled
        conn = agent.conns[-1]
        conn.settimeout(5)
        assert conn.recv(1) == b""  # the agent sees the close
        if features:
            # Cancelled at save_timeout_ms; dropped only save_timeout_ms after that.
            assert [ids for _, ids in cancels] == [[save_id]]
            assert cancels[0][0] - t0 >= 0.2 and took >= 0.4
        else:
            assert cancels == []
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_a_save_past_save_timeout_ms_is_cancelled_and_the_connection_kept():
    """An agent with `cancel`: a save past save_timeout_ms is cancelled by its request id, not
    its connection dropped (which would fail every other request on it and strand the fences of
    loads given up on it). Its blocks are released once the agent answers it (ERR_CANCELLED:
    its copies in flight landed), counted as not stored; the connection carries on."""
    held = {}

    def script(agent, conn, req, n):
        if req["op"] == "hello":
            return {**HELLO_OK, "features": ["cancel"]}
        if req["op"] == "save":
            held["save"] = (conn, req["id"])
            return None
        if req["op"] == "cancel":
            held["cancel"] = req["ids"]
            return {"ok": True, "cancelled": req["ids"]}
        if req["op"] == "load":
            return {"ok": True, "chunks": 2, "failedBlocks": [], "error": None}
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent, save_timeout_ms=150)
    try:
        assert w._worker_ready()
        generation = w._client.generation
        req = make_request("s", PROMPT, 16)
        w.bind_connector_metadata(KVGateMetadata(saves=[SaveSpec("s", req.block_hashes[1:4:2], [1, 2, 3, 4], 0)]))
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_finished({"s"}) == (None, None)
        w.clear_connector_metadata()
        assert until(lambda: w.get_finished(set()) == (None, None) and "cancel" in held)
        assert held["cancel"] == [held["save"][1]]
        # Held until the save answers, however many steps pass; cancelled once only.
        time.sleep(0.05)
        assert w.get_finished(set()) == (None, None) and w._client.connected
        conn, rid = held["save"]
        agent.send(conn, {"id": rid, "ok": False, "error": {"code": "ERR_CANCELLED", "message": "cancelled"}})
        assert until(lambda: w.get_finished(set())[0]) == {"s"}
        assert w.saves_not_stored == 1 and not w._saves_cancelled
        assert w._client.connected and w._client.generation == generation
        # The connection serves on: a load on it lands.
        assert run_load(w, list(caches), load_spec()) == set()
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_a_save_past_save_timeout_ms_never_cuts_a_load_still_copying():
    """vLLM asks get_transfer_results before wait_for_save with speculative decoding: a save past
    its deadline then must not close the connection under this step's load (its copy would go on
    into blocks vLLM recomputes); the load ends first, then the save is given up."""

    def script(agent, conn, req, n):
        if req["op"] == "save":
            return None
        if req["op"] == "load":
            threading.Timer(0.4, agent.send, (conn, {"id": req["id"], "ok": True, "failedBlocks": []})).start()
            return None
        return well_behaved(agent, conn, req, n)

    agent = ScriptedAgent(script)
    w, caches = worker(agent, save_timeout_ms=100)
    try:
        assert w._worker_ready()
        req = make_request("s", PROMPT, 16)
        w.bind_connector_metadata(KVGateMetadata(saves=[SaveSpec("s", req.block_hashes[1:4:2], [1, 2, 3, 4], 0)]))
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_finished({"s"}) == (None, None)
        w.clear_connector_metadata()
        time.sleep(0.2)  # the save is past its deadline
        w.bind_connector_metadata(KVGateMetadata(loads=[load_spec()]))
        w.start_load_kv(None)
        assert w.get_finished(set()) == (None, None)  # asked while the load copies
        assert w._client.connected
        assert w.get_block_ids_with_load_errors() == set()  # the load ended well
        w.wait_for_save()
        assert w.get_finished(set()) == ({"s"}, None)
        assert w.saves_not_stored == 1 and not w._client.connected
        w.clear_connector_metadata()
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_an_agent_that_cannot_be_reached_is_logged_once_per_outage_naming_the_socket(caplog, tmp_path):
    """A socket path with a typo (or an agent not started) meant running without kvgate with not
    one line in vLLM's log: the operator could not tell kvgate was off. The first failed dial of
    an outage is a warning naming the path and where it is set; later dials of the same outage
    are quiet, and an outage after the agent answered again is logged again."""
    agent = ScriptedAgent(well_behaved)
    missing = str(tmp_path / "agent.sokc")
    cfg = config(agent)
    cfg.kv_transfer_config.kv_connector_extra_config["socket"] = missing
    with caplog.at_level("WARNING", logger="kvgate_vllm"):
        s = KVGateConnector(cfg, KVConnectorRole.SCHEDULER)
        s._client._reconnect_interval = 0
        try:
            for _ in range(3):
                assert not s._client.ensure()
            warned = [r.getMessage() for r in caplog.records]
            assert len(warned) == 1, warned
            assert missing in warned[0] and "KVGATE_AGENT_SOCKET" in warned[0], warned[0]
            # The agent is found (the path fixed), then goes away: that outage is logged too.
            s._client.path = agent.path
            assert s._client.ensure()
            s._client.path = missing
            s._client.close()
            assert not s._client.ensure()
            assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]
        finally:
            s.shutdown()
            agent.close()


def test_chunks_that_failed_to_load_are_saved_again():
    """The lookup found 3 chunks, chunk 1 failed to load (vLLM recomputed it): the request's
    save starts at chunk 1, not after the 3 the lookup promised, or this node never stores the
    chunk it could not load and every later request fails on it again."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        req = make_request("r", PROMPT, 16)
        assert lookup(s, req) == 96
        blocks = list(range(20, 27))
        s.update_state_after_alloc(req, FakeBlocks(blocks), 96)
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids=set()))
        assert [ld.block_ids for ld in meta.loads] == [blocks[:6]]
        # The workers reported chunk 1's first block (and an unrelated one) as not loaded.
        s.update_connector_output(SimpleNamespace(invalid_block_ids={blocks[2], 999}))
        req.num_computed_tokens = 100
        assert s.request_finished(req, blocks)[0] is True
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids={"r"}))
        assert [(len(sp.keys), sp.first) for sp in meta.saves] == [(3, 1)]
        # A load that went well: nothing saved again.
        req2 = make_request("r2", PROMPT, 16)
        assert lookup(s, req2) == 96
        s.update_state_after_alloc(req2, FakeBlocks(blocks), 96)
        s.build_connector_meta(SimpleNamespace(finished_req_ids=set()))
        s.update_connector_output(SimpleNamespace(invalid_block_ids=set()))
        req2.num_computed_tokens = 100
        assert s.request_finished(req2, blocks) == (True, None)  # held (it loaded), not saved
        meta = s.build_connector_meta(SimpleNamespace(finished_req_ids={"r2"}))
        assert (meta.saves, meta.holds) == ([], ["r2"])
    finally:
        s.shutdown()
        agent.close()


# ---------------------------------------------------------------------------- vLLM after 0.13


def test_a_step_with_kvgate_loads_or_saves_starts_them_before_the_forward():
    """After 0.13 vLLM starts a step's loads before its forward only when the SchedulerOutput
    says has_sync_kv_loads: a step carrying kvgate loads or saves says so; others are left as
    vLLM reckoned them, and an older SchedulerOutput (no such field) gets none."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        req = make_request("r", PROMPT, 16)
        assert lookup(s, req) == 96
        s.update_state_after_alloc(req, FakeBlocks(list(range(20, 27))), 96)
        out = SimpleNamespace(finished_req_ids=set(), has_sync_kv_loads=False)
        assert s.build_connector_meta(out).loads and out.has_sync_kv_loads is True
        saver = make_request("s", PROMPT, 16)
        saver.num_computed_tokens = 100
        assert s.request_finished(saver, list(range(40, 47)))[0] is True
        out = SimpleNamespace(finished_req_ids={"s"}, has_sync_kv_loads=False)
        assert s.build_connector_meta(out).saves and out.has_sync_kv_loads is True
        out = SimpleNamespace(finished_req_ids=set(), has_sync_kv_loads=False)
        meta = s.build_connector_meta(out)
        assert not meta.loads and not meta.saves and out.has_sync_kv_loads is False
        old = SimpleNamespace(finished_req_ids=set())
        s.update_state_after_alloc(req, FakeBlocks(list(range(20, 27))), 96)
        assert s.build_connector_meta(old).loads and not hasattr(old, "has_sync_kv_loads")
    finally:
        s.shutdown()
        agent.close()


def test_loads_started_after_the_forward_ran_are_reported_failed_and_never_sent():
    agent = ScriptedAgent(well_behaved)  # answers no load: the in-order step ends at its deadline
    w, caches = worker(agent, load_timeout_ms=300)
    try:
        assert w._worker_ready()
        spec = load_spec()
        w.bind_connector_metadata(KVGateMetadata(loads=[spec]))
        for n in caches:  # the forward ran first
            w.wait_for_layer_load(n)
        w.start_load_kv(None)
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set(spec.block_ids)
        assert (0, "load") not in agent.requests
        w.clear_connector_metadata()
        # The next step, in order: its load is sent and lands.
        w.bind_connector_metadata(KVGateMetadata(loads=[spec]))
        w.start_load_kv(None)
        for n in caches:
            w.wait_for_layer_load(n)
        w.wait_for_save()
        w.get_block_ids_with_load_errors()
        assert (0, "load") in agent.requests
        w.clear_connector_metadata()
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()


def test_saves_stop_at_the_hashes_vllm_lets_be_published():
    """After 0.13 request_finished's blocks may cover more than vLLM lets connectors key KV by:
    only the first num_publishable_block_hashes block hashes (with EAGLE, a block's draft KV is
    materialised a step later). Older requests have no such field: every computed chunk."""
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        for publishable, chunks in ((6, 3), (5, 2), (1, 0), (None, 3)):
            req = make_request(f"r{publishable}", PROMPT, 16)
            req.num_computed_tokens = 100
            if publishable is not None:
                req.num_publishable_block_hashes = publishable
            delay, _ = s.request_finished(req, list(range(20, 27)))
            meta = s.build_connector_meta(SimpleNamespace(finished_req_ids={req.request_id}))
            assert delay is (chunks > 0)
            assert [len(sp.keys) for sp in meta.saves] == ([chunks] if chunks else []), publishable
    finally:
        s.shutdown()
        agent.close()


def test_hybrid_kv_cache_groups_are_refused_at_start(tmp_path):
    from kvgate_vllm import ConfigurationError

    agent = ScriptedAgent(well_behaved)
    try:
        two = SimpleNamespace(kv_cache_groups=[object(), object()])
        with pytest.raises(ConfigurationError, match="--disable-hybrid-kv-cache-manager"):
            KVGateConnector(config(agent), KVConnectorRole.SCHEDULER, two)
        one = KVGateConnector(config(agent), KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[object()]))
        one.shutdown()
    finally:
        agent.close()


def test_a_pending_save_never_makes_vllm_recompute_a_preempted_request():
    agent = ScriptedAgent(well_behaved)
    s = scheduler(agent)
    try:
        assert s.requires_kv_delivery is False
    finally:
        s.shutdown()
        agent.close()


def test_loads_started_after_a_full_cuda_graph_forward_are_reported_failed():
    """A FULL CUDA graph replay runs no layer hook; vLLM's V2 runner still calls finish_forward
    once the forward is launched: loads started after it are refused like any late load."""
    agent = ScriptedAgent(well_behaved)
    w, caches = worker(agent)
    try:
        assert w._worker_ready()
        spec = load_spec()
        w.bind_connector_metadata(KVGateMetadata(loads=[spec]))
        w.finish_forward()
        w.start_load_kv(SimpleNamespace(cudagraph_runtime_mode=SimpleNamespace(name="FULL")))
        w.wait_for_save()
        assert w.get_block_ids_with_load_errors() == set(spec.block_ids)
        assert (0, "load") not in agent.requests
        w.clear_connector_metadata()
    finally:
        w.shutdown()
        drop_caches(caches)
        agent.close()
