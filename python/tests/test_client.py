"""AgentClient's reading against a scripted fake agent (no torch, no Node): a caller that waits
reads its own answer on its thread, others' answers and progress events it meets reach their
owners, a timed-out wait hands the reading to the reader thread, and a dead agent fails every
pending request (ERR_DISCONNECTED) without a hang."""

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from fake_agent import ScriptedAgent, pidfds_open
from kvgate_vllm.client import AgentClient, AgentError


def FakeAgent(handle, listening=None, says_pid=True) -> ScriptedAgent:
    """A fake agent that answers hello itself (with its pid, as the agent does) and each other
    request with `handle(agent, conn, req)`."""

    def script(agent, conn, req, n):
        if req["op"] == "hello":
            return {"ok": True, "pid": os.getpid()} if says_pid else {"ok": True}
        handle(agent, conn, req)
        return None

    return ScriptedAgent(script, listening=listening)


def connect(agent: ScriptedAgent) -> AgentClient:
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0)
    assert c.ensure(), c.last_error
    return c


def echo(agent, conn, req):
    agent.send(conn, {"id": req["id"], "ok": True, "echo": req.get("n")})


def test_two_threads_get_their_own_answers():
    # Answers come back late and out of order (each after a random short delay), so each
    # thread's reads meet the other's answers.
    def late(agent, conn, req):
        threading.Timer((req["n"] % 7) / 2000, echo, (agent, conn, req)).start()

    agent = FakeAgent(late)
    c = connect(agent)
    wrong = []

    def worker(base):
        for i in range(300):
            n = base + i
            if c.call("echo", {"n": n}, timeout=5)["echo"] != n:
                wrong.append(n)

    ts = [threading.Thread(target=worker, args=(b,)) for b in (0, 100_000)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a caller hung"
    assert wrong == []
    c.close()
    agent.close()


def test_a_lone_caller_reads_its_own_answer_and_events_on_its_thread():
    def script(agent, conn, req):
        agent.send(conn, {"id": req["id"], "event": "progress", "layers": 7})
        agent.send(conn, {"id": req["id"], "ok": True, "chunks": 3})

    agent = FakeAgent(script)
    c = connect(agent)
    seen = []

    def progress(ev):
        seen.append((ev["layers"], threading.current_thread()))

    for _ in range(3):
        f = c.request("lookup", {}, progress=progress, wait_here=True)
        assert f.result(timeout=5)["chunks"] == 3
    # No hop through the reader thread when nothing else is in flight.
    assert seen == [(7, threading.current_thread())] * 3
    c.close()
    agent.close()


def test_progress_events_between_answers_reach_their_request():
    # A load gets events before and after a lookup's answer; each reaches its own request.
    load_req = {}

    def script(agent, conn, req):
        if req["op"] == "load":
            load_req["id"] = req["id"]
            return
        agent.send(conn, {"id": load_req["id"], "event": "progress", "layers": 1})
        agent.send(conn, {"id": req["id"], "event": "progress", "layers": 7})
        agent.send(conn, {"id": req["id"], "ok": True, "chunks": 3})
        agent.send(conn, {"id": load_req["id"], "event": "progress", "layers": 2})
        agent.send(conn, {"id": load_req["id"], "ok": True, "layers": 2})

    agent = FakeAgent(script)
    c = connect(agent)
    load_events, own_events = [], []
    load = c.request("load", {}, progress=load_events.append)
    deadline = time.monotonic() + 5
    while "id" not in load_req and time.monotonic() < deadline:
        time.sleep(0.001)
    f = c.request("lookup", {}, progress=own_events.append, wait_here=True)
    assert f.result(timeout=5)["chunks"] == 3
    assert load.result(timeout=5)["layers"] == 2
    assert [e["layers"] for e in own_events] == [7]
    assert [e["layers"] for e in load_events] == [1, 2]
    c.close()
    agent.close()


def test_a_timed_out_wait_hands_the_answer_to_the_reader_thread():
    def slow(agent, conn, req):
        threading.Timer(0.3, echo, (agent, conn, req)).start()

    agent = FakeAgent(slow)
    c = connect(agent)
    f = c.request("lookup", {"n": 5}, wait_here=True)
    with pytest.raises(Exception):
        f.result(timeout=0.02)
    # Nobody calls result() again: the reader thread must read the late answer.
    deadline = time.monotonic() + 5
    while not f.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert f.done() and f.result()["echo"] == 5
    with pytest.raises(AgentError) as e:
        c.call("lookup", {"n": 6}, timeout=0.02)
    assert e.value.code == "ERR_TIMEOUT"
    c.close()
    agent.close()


@pytest.mark.parametrize("caller_reads", [True, False])
def test_agent_death_mid_call_fails_every_pending_request(caller_reads):
    def die(agent, conn, req):
        if req["op"] == "lookup":
            conn.shutdown(socket.SHUT_RDWR)

    agent = FakeAgent(die)
    c = connect(agent)
    load = c.request("load", {})  # pending, its answer never comes
    t0 = time.monotonic()
    with pytest.raises(AgentError) as e:
        if caller_reads:
            c.call("lookup", {}, timeout=10)
        else:
            c.request("lookup", {}).result(timeout=10)
    assert e.value.code == "ERR_DISCONNECTED"
    assert time.monotonic() - t0 < 5
    with pytest.raises(AgentError) as e:
        load.result(timeout=5)
    assert e.value.code == "ERR_DISCONNECTED"
    assert not c.connected
    agent.close()


def test_agent_death_while_idle_is_noticed_by_the_next_ensure():
    # Nobody reads while nothing is pending: ensure() must still see the EOF and dial again.
    a1 = FakeAgent(echo)
    c = connect(a1)
    assert c.call("echo", {"n": 1})["echo"] == 1
    gen = c.generation
    a1.close()
    os.unlink(a1.path)
    a2 = FakeAgent(echo)
    a2.srv.close()
    a2.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    a2.srv.bind(a1.path)
    a2.srv.listen(4)
    a2.path = a1.path
    threading.Thread(target=a2._accept, daemon=True).start()
    time.sleep(0.05)
    assert c.ensure()
    assert c.generation == gen + 1
    assert c.call("echo", {"n": 2}, timeout=5)["echo"] == 2
    c.close()
    a2.close()


@pytest.mark.parametrize("caller_reads", [True, False])
@pytest.mark.parametrize(
    "bad",
    [
        struct.pack(">I", 64 * 1024 * 1024),  # oversized length
        struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # undecodable body (0xc1 is never used)
    ],
)
def test_a_bad_frame_from_the_agent_drops_the_connection(bad, caller_reads):
    def garbage(agent, conn, req):
        agent.send_raw(conn, bad)

    agent = FakeAgent(garbage)
    c = connect(agent)
    with pytest.raises(AgentError) as e:
        if caller_reads:
            c.call("lookup", {}, timeout=10)
        else:
            c.request("lookup", {}).result(timeout=10)
    assert e.value.code == "ERR_DISCONNECTED"
    assert not c.connected
    agent.close()


# ---------------------------------------------------------------------------- the agent process (pidfd)

needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open (Linux 5.3+, Python 3.9+)")


def never_answered(agent, conn, req):
    if req["op"] == "garbage":
        agent.send_raw(conn, struct.pack(">I", 64 * 1024 * 1024))  # oversized: this side drops


def dropped_here_error(c: AgentClient) -> AgentError:
    """A load pending when this side drops the connection (the agent sends a bad frame)."""
    assert c.ensure(), c.last_error
    load = c.request("load", {})
    c.request("garbage", {})
    with pytest.raises(AgentError) as e:
        load.result(timeout=10)
    assert e.value.code == "ERR_DISCONNECTED" and e.value.dropped_here
    return e.value


@needs_pidfd
def test_connections_dropped_here_keep_one_pidfd_of_the_agent_process_until_shutdown():
    before = pidfds_open()
    agent = FakeAgent(never_answered)  # in this process: its pid is ours, and it never exits
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0)
    errors = []
    for _ in range(5):
        errors.append(dropped_here_error(c))
        # The same live process on every connection: its one pidfd is reused, not one per drop.
        assert pidfds_open() == before + 1
    assert all(e.agent is errors[0].agent for e in errors)
    assert errors[0].agent.pid == os.getpid() and errors[0].agent.watchable
    assert not errors[0].agent.exited()
    assert c.ensure() and pidfds_open() == before + 1  # the live connection shares it
    c.shutdown()
    assert pidfds_open() == before
    assert not errors[0].agent.watchable and not errors[0].agent.exited()
    agent.close()


@needs_pidfd
def test_a_connection_the_agent_closed_or_dropped_idle_keeps_no_pidfd():
    before = pidfds_open()
    agent = FakeAgent(never_answered)
    c = connect(agent)
    assert pidfds_open() == before + 1  # the live connection's
    load = c.request("load", {})
    agent.drop_all()  # the agent closed: its copies ended with it, nothing to watch
    with pytest.raises(AgentError) as e:
        load.result(timeout=10)
    assert not e.value.dropped_here and e.value.agent is None
    assert pidfds_open() == before
    assert c.ensure()
    c.close()  # nothing pending: no copy can be running
    assert pidfds_open() == before
    agent.close()


@needs_pidfd
def test_the_pidfd_of_an_agent_process_that_exited_is_closed_at_the_next_dial(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # The tests' directory and the package's (python/): the child's cwd is the caller's.
            "import os, sys, threading; sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]; "
            "from test_client import FakeAgent, "
            "never_answered; a = FakeAgent(never_answered); print(a.path, flush=True); threading.Event().wait()",
            here,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    path = ""
    try:
        path = child.stdout.readline().strip()
        before = pidfds_open()
        c = AgentClient(path, {"protocol": 1}, reconnect_interval=0)
        e = dropped_here_error(c)
        assert e.agent.pid == child.pid and not e.agent.exited()
        assert pidfds_open() == before + 1
        child.kill()
        child.wait(10)
        other = FakeAgent(never_answered)
        c.path = other.path  # a restarted agent: the dial finds the old one exited and closes its pidfd
        assert c.ensure()
        assert pidfds_open() == before + 1  # the new connection's only
        assert e.agent.exited()  # and stays so, with its pidfd closed
        c.shutdown()
        assert pidfds_open() == before
        other.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if path:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # the killed fake agent's


@pytest.mark.parametrize("why", ["EPERM", "no pidfd_open", "pid 0"])
def test_without_a_pidfd_a_load_dropped_here_names_why_its_agent_cannot_be_watched(monkeypatch, why):
    from kvgate_vllm import client as client_mod

    if why == "EPERM":

        def refuse(pid, flags=0):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "pidfd_open", refuse, raising=False)
    elif why == "no pidfd_open":
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    else:
        monkeypatch.setattr(client_mod, "peer_pid", lambda s: 0)
    before = pidfds_open() if os.path.isdir("/proc/self/fd") else 0
    agent = FakeAgent(never_answered)
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0)
    e = dropped_here_error(c)
    assert e.agent is not None and not e.agent.watchable and not e.agent.exited()
    want = {"EPERM": "Operation not permitted", "no pidfd_open": "no pidfd_open", "pid 0": "pid namespace"}[why]
    assert want in e.agent.why_not
    if os.path.isdir("/proc/self/fd"):
        assert pidfds_open() == before
    c.shutdown()
    agent.close()


@needs_pidfd
def test_the_agent_process_of_a_socket_is_its_peer_and_a_pid_without_a_process_is_not_watchable():
    from kvgate_vllm.agent_process import AgentProcess, peer_pid

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert peer_pid(a) == os.getpid()
    finally:
        a.close()
        b.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:  # no peer: no pid
        assert peer_pid(tcp) == 0
    assert not AgentProcess.open(0).watchable
    # A reaped child's pid names no process (ESRCH): never a pidfd of whatever takes it later.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    gone = AgentProcess.open(child.pid)
    assert not gone.watchable and "pidfd_open" in gone.why_not and not gone.exited()


# A listener that hands its socket to the agent serving it, and stays (for now): SO_PEERCRED names it.
HANDED_OVER = """
import os, socket, subprocess, sys, tempfile, threading
d = tempfile.mkdtemp(prefix="kvgate-handover-")
path = os.path.join(d, "agent.sock")
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(8)
serve = (
    "import os, socket, sys, threading; sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]; from test_client import FakeAgent, never_answered; "
    "a = FakeAgent(never_answered, listening=socket.socket(fileno=int(sys.argv[2]))); threading.Event().wait()"
)
b = subprocess.Popen([sys.executable, "-c", serve, sys.argv[1], str(srv.fileno())], pass_fds=[srv.fileno()])
srv.close()
print(path, b.pid, flush=True)
threading.Event().wait()
"""


@needs_pidfd
def test_a_socket_served_by_another_process_than_its_listener_is_not_fenced_by_the_listeners_exit():
    """A socket handed over (a restart passing it on, a child inheriting it, socket activation):
    the peer credentials name the listener, whose exit ends no copy of the process serving."""
    here = os.path.dirname(os.path.abspath(__file__))
    listener = subprocess.Popen([sys.executable, "-c", HANDED_OVER, here], stdout=subprocess.PIPE, text=True)
    server_pid = 0
    path = ""
    try:
        path, pid = listener.stdout.readline().split()
        server_pid = int(pid)
        before = pidfds_open()
        c = AgentClient(path, {"protocol": 1}, reconnect_interval=0)
        e = dropped_here_error(c)
        assert e.agent.pid == listener.pid  # what SO_PEERCRED says
        assert not e.agent.watchable and f"not the agent answering (pid {server_pid})" in e.agent.why_not
        assert pidfds_open() == before  # none kept for it
        listener.kill()
        listener.wait(10)
        os.kill(server_pid, 0)  # the server lives on: its copies may still land
        assert not e.agent.exited()
        c.shutdown()
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait(10)
        if server_pid:
            os.kill(server_pid, signal.SIGKILL)
        if path:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@needs_pidfd
def test_an_agent_that_does_not_say_its_pid_in_hello_is_not_watched():
    before = pidfds_open()
    agent = FakeAgent(never_answered, says_pid=False)
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0)
    e = dropped_here_error(c)
    assert not e.agent.watchable and "did not say its pid" in e.agent.why_not
    assert pidfds_open() == before
    c.shutdown()
    agent.close()


@needs_pidfd
def test_a_pidfd_closed_under_the_agent_process_does_not_read_as_its_exit():
    from kvgate_vllm.agent_process import AgentProcess

    a = AgentProcess.open(os.getpid())
    assert a.watchable and not a.exited()
    os.close(a._fd)  # a double close elsewhere: poll answers POLLNVAL, not "exited"
    assert not a.exited()
    a._fd = None


@needs_pidfd
def test_a_connection_dropped_before_hello_answered_keeps_no_pidfd():
    """Nothing proved the pidfd's process serves it: a drop then (a garbage answer to hello) keeps
    none, however often the dial is retried."""

    def garbage_hello(agent, conn, req, n):
        agent.send_raw(conn, struct.pack(">I", 64 * 1024 * 1024))

    before = pidfds_open()
    agent = ScriptedAgent(garbage_hello)
    c = AgentClient(agent.path, {"protocol": 1}, reconnect_interval=0)
    for _ in range(3):
        c._backoff = 0.0
        assert not c.ensure()
        assert pidfds_open() == before and c._dropped_agents == []
    c.shutdown()
    agent.close()


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or not hasattr(os, "pidfd_open"):
        return False
    cmd = ["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", "pass"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged pid namespace (unshare -Urpf)")
def test_an_agent_in_a_child_pid_namespace_is_proved_by_its_own_pid_and_its_exit_fences():
    """Its hello says its pid there (1); SO_PEERCRED says its pid here: the pidfd's NSpid ties them."""
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [
            "unshare", "-Urpf", "--mount-proc", sys.executable, "-c",
            "import os, sys, threading; sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]; from test_client import FakeAgent, "
            "never_answered; a = FakeAgent(never_answered); print(a.path, os.getpid(), flush=True); "
            "threading.Event().wait()",
            here,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    path = ""
    try:
        path, inner = child.stdout.readline().split()
        assert inner == "1"
        before = pidfds_open()
        c = AgentClient(path, {"protocol": 1}, reconnect_interval=0)
        e = dropped_here_error(c)
        assert e.agent.watchable, e.agent.why_not
        assert e.agent.pid not in (0, 1) and e.agent.own_namespace_pid() == 1
        assert pidfds_open() == before + 1 and not e.agent.exited()
        os.kill(e.agent.pid, signal.SIGKILL)  # the agent (pid 1 there): the namespace ends with it
        deadline = time.monotonic() + 10
        while not e.agent.exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert e.agent.exited()
        c.shutdown()
        assert pidfds_open() == before
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
        if path:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
