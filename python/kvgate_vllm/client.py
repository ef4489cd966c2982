"""A thread-safe client of the kvgate agent's socket protocol (docs/agent-protocol.md).

One socket, requests matched to answers by id (the agent answers in completion order),
load-progress events, and reconnection: a dead agent fails every pending request at once
and the next call after `reconnect_interval` dials again.

Who reads the socket: a caller that waits for its answer at once (`call`, or `request(...,
wait_here=True)` then `result()`) reads it on its own thread when no one else is reading,
dispatching any other answers and events it meets; otherwise the reader thread does. The
hop through a second thread (its wake-up, then the caller's) was most of a lookup's tail
on a busy host. The reader thread reads only while some request is pending and no caller
is reading, so it never sits in recv() where a caller would want to be.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, List, Optional, Tuple

import msgpack

from .agent_process import AgentProcess, peer_pid

log = logging.getLogger("kvgate_vllm")

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
# A send that makes no progress this long means an agent that stopped reading (stalled, not
# dead): the connection is dropped (its requests fail) rather than blocking vLLM's thread.
SEND_TIMEOUT_S = 5.0
# Requests waiting for an answer on one connection: beyond, a request fails at once (ERR_BUSY).
# An agent that reads but never answers (the connector gives up on a lookup after its
# timeout, but the answer is still awaited) would otherwise grow this without bound.
MAX_PENDING = 4096
# The longest wait between dials of an agent that accepts connections but fails their hello.
MAX_BACKOFF_S = 30.0


# Answers to hello or register that no retry on this connection changes.
REFUSALS = ("ERR_PROTOCOL_VERSION", "ERR_MODEL_MISMATCH", "ERR_GEOMETRY_MISMATCH", "ERR_LAYOUT")


class AgentError(Exception):
    """An error answer from the agent (`code` is stable) or a transport failure (ERR_DISCONNECTED)."""

    def __init__(
        self, code: str, message: str, dropped_here: bool = False, agent: Optional[AgentProcess] = None
    ):
        super().__init__(f"{message} [{code}]")
        self.code = code
        # ERR_DISCONNECTED only: this side dropped a connection the agent may still serve (a bad
        # frame, a stalled send, close()). The agent then starts no copy for its requests, but
        # copies already running may still land: a load failed so is no fence (connector.py).
        # False: the agent closed or died, and copies of its requests with it.
        self.dropped_here = dropped_here
        # dropped_here only: the agent process of that connection. Once it has exited no copy of
        # the request can land any more (connector.py's fence).
        self.agent = agent


def default_socket_path() -> str:
    env = os.environ.get("KVGATE_AGENT_SOCKET")
    if env:
        return env
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return os.path.join(run, "kvgate", "agent.sock")
    return os.path.join("/tmp", f"kvgate-{os.getuid()}", "agent.sock")


class AgentClient:
    def __init__(
        self,
        path: str,
        hello: Dict[str, Any],
        on_connect: Optional[Callable[["AgentClient"], None]] = None,
        connect_timeout: float = 1.0,
        reconnect_interval: float = 1.0,
        send_timeout: float = SEND_TIMEOUT_S,
    ):
        self.path = path
        self._hello = hello
        self._on_connect = on_connect
        self._connect_timeout = connect_timeout
        self._reconnect_interval = reconnect_interval
        # Seconds one dial may wait for hello's answer (vLLM's thread is held meanwhile).
        self._hello_timeout = 5.0
        # The wait before the next dial after failed hellos: doubles per failure up to
        # MAX_BACKOFF_S, so a stalled agent does not hold the engine for a hello every interval.
        self._backoff = 0.0
        self._send_timeout = send_timeout
        self._lock = threading.Lock()
        # Separate from _lock: a blocked send must never stall the reader that drains answers.
        self._send_lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        # Held by whichever thread reads the socket (a waiting caller or the reader thread):
        # frames arrive in pieces, so only one may recv at a time. Never held while waiting on _lock's condition.
        self._read_lock = threading.Lock()
        # On _lock: the reader thread waits here until asked to read (or its socket is gone).
        self._reader_wake = threading.Condition(self._lock)
        self._reader_wanted = False
        # The partial frame read so far, with the socket it came from: a reader still on a dropped
        # socket must never append to the next connection's bytes.
        self._buf: Tuple[Optional[socket.socket], bytearray] = (None, bytearray())
        self._pending: Dict[int, Future] = {}
        # The socket close() is dropping (AgentError.dropped_here for its requests).
        self._closing_here: Optional[socket.socket] = None
        self._progress: Dict[int, Callable[[Dict[str, Any]], None]] = {}
        self._next_id = 1
        self._last_attempt = 0.0
        self._generation = 0
        # The agent process of the live connection (one per generation), and those of connections
        # this side dropped with requests pending: their pidfds stay open until the process has
        # exited (seen at the next dial, or by a fence) or shutdown(). A dial reaching a process
        # already kept reuses its pidfd: one per agent process, however often it is dropped.
        self._agent: Optional[AgentProcess] = None
        # Whether hello's answer proved _agent is the process serving the connection (its pid):
        # until then a drop fences nothing by it, and keeps no pidfd.
        self._agent_proved = False
        self._unproved_logged = ""
        self._dropped_agents: List[AgentProcess] = []
        self.hello_answer: Optional[Dict[str, Any]] = None
        self.last_error: Optional[str] = None

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def generation(self) -> int:
        """Bumped on every successful connect: registrations belong to one generation."""
        return self._generation

    def ensure(self, raise_refusal: bool = False) -> bool:
        """Connected (dialing again at most once per reconnect_interval). Never raises, except
        with `raise_refusal` (at the engine's start) for an agent that refuses this engine
        (protocol version, model, geometry, layout): later, from vLLM's scheduler or worker
        loop, such a refusal (an agent restarted with other settings) or a malformed answer
        to hello or register is logged and means no agent, as a dead one does."""
        s = self._sock
        if s is not None and not self._closed_while_idle(s):
            return True
        now = time.monotonic()
        with self._lock:
            if self._sock is not None:
                return True
            if now - self._last_attempt < max(self._reconnect_interval, self._backoff):
                return False
            self._last_attempt = now
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(self._connect_timeout)
                s.connect(self.path)
                s.settimeout(None)
                # On the kernel's send only (recv stays blocking: a load may take long): a full
                # socket buffer that does not drain within it fails sendall with EAGAIN.
                sec = int(self._send_timeout)
                s.setsockopt(
                    socket.SOL_SOCKET,
                    socket.SO_SNDTIMEO,
                    struct.pack("ll", sec, int((self._send_timeout - sec) * 1_000_000)),
                )
            except OSError as e:
                msg = f"cannot reach the kvgate agent at {self.path}: {e}"
                # Once per outage (not per dial): a mistyped path or an agent not started would
                # otherwise run vLLM without kvgate and not one line saying so.
                if msg != self.last_error:
                    log.warning(
                        "%s; running without kvgate until it answers (start the agent, or point "
                        "kv_connector_extra_config 'socket' or KVGATE_AGENT_SOCKET at its socket)",
                        msg,
                    )
                self.last_error = msg
                return False
            # Before hello: its answer (the agent's own pid, the pidfd's) then proves the process
            # the pidfd names is the one serving, alive after the open: not a process that took a
            # pid freed meanwhile, nor a listener that handed the socket to another.
            self._agent = self._agent_of(s)
            self._agent_proved = False
            self._sock = s
            self._buf = (s, bytearray())
            self._reader_wanted = False
            self._generation += 1
            t = threading.Thread(target=self._read_loop, args=(s,), name="kvgate-agent-reader", daemon=True)
            t.start()
        try:
            self.hello_answer = self.call("hello", dict(self._hello), timeout=self._hello_timeout)
            self._prove_agent(s, self.hello_answer)
            if self._on_connect is not None:
                self._on_connect(self)
        except Exception as e:  # AgentError, or a malformed answer the callback could not use
            self.hello_answer = None
            self._drop(s)
            self._backoff = min(MAX_BACKOFF_S, max(self._reconnect_interval, 2 * self._backoff))
            self._last_attempt = time.monotonic()
            refused = isinstance(e, AgentError) and e.code in REFUSALS
            if refused and raise_refusal:
                raise
            msg = f"the kvgate agent at {self.path} {'refused this engine' if refused else 'failed'}: {e}"
            if msg != self.last_error:
                log.warning("%s; running without kvgate until it accepts", msg)
            self.last_error = msg
            return False
        self._backoff = 0.0
        self.last_error = None  # the next outage is logged again
        return self._sock is not None

    def _agent_of(self, s: socket.socket) -> AgentProcess:
        pid = peer_pid(s)
        self._dropped_agents = [a for a in self._dropped_agents if not a.exited()]
        for a in self._dropped_agents:
            if a.pid == pid:  # alive (not exited): the same process, a pid is not reused before
                return a
        return AgentProcess.open(pid)

    def _prove_agent(self, s: socket.socket, answer: Any) -> None:
        """hello's pid against the pidfd's process: the same, the connection's loads may be fenced
        by its exit; else its agent is one whose exit cannot be watched (held for good)."""
        with self._lock:
            agent = self._agent
            if self._sock is not s or agent is None:
                return
            if not agent.watchable:
                self._agent_proved = True  # nothing to prove: it fences nothing
                return
            why = agent.answers_as(answer.get("pid") if isinstance(answer, dict) else None)
            if not why:
                self._agent_proved = True
                return
            self._agent = AgentProcess(agent.pid, None, why)
            self._agent_proved = True
            close = agent not in self._dropped_agents  # a kept one still serves its fences
        if why != self._unproved_logged:  # once per cause, not per reconnection
            self._unproved_logged = why
            log.warning("kvgate: %s; loads given up on a connection dropped here stay held for good", why)
        if close:
            agent.close()

    def _closed_while_idle(self, s: socket.socket) -> bool:
        """With nothing pending nobody reads, so an agent that died idle is noticed here (one
        non-blocking peek) and the caller dials again at once, as when the reader thread saw EOF."""
        if self._pending or not self._read_lock.acquire(blocking=False):
            return False
        try:
            if self._sock is not s:
                return self._sock is None
            try:
                eof = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except (BlockingIOError, InterruptedError):
                eof = False
            except OSError:
                eof = True
        finally:
            self._read_lock.release()
        if eof:
            self._drop(s, here=False)
        return eof

    def _drop(self, s: socket.socket, here: bool = True) -> None:
        """Drops `s` and fails its pending requests; `here`: this side chose to (the agent may live on)."""
        here = here or self._closing_here is s
        with self._lock:
            if self._sock is not s:
                return
            self._sock = None
            agent, self._agent = self._agent, None
            if agent is not None and agent.watchable and not self._agent_proved:
                # Dropped before hello proved the pidfd's process serves it: no fence by that one.
                unproved, agent = agent, AgentProcess(
                    agent.pid, None, "the connection dropped before hello proved its agent process"
                )
                if unproved not in self._dropped_agents:
                    unproved.close()  # under _lock: a close takes only the agent's own lock
            # A request failed here may have a copy running in the agent: its process is kept.
            keep = here and bool(self._pending) and agent is not None and agent.watchable
            if keep and agent not in self._dropped_agents:
                self._dropped_agents.append(agent)
            # Not one a dial reused from the kept ones: that one stays for the fences it serves.
            close_agent = agent is not None and not keep and agent not in self._dropped_agents
            pending, self._pending = self._pending, {}
            self._progress = {}
            self._reader_wake.notify_all()
        # shutdown before close: a reader thread blocked in recv() on `s` keeps the kernel's socket
        # open past a bare close(), so the agent would see no hang-up (and go on copying into the
        # blocks of loads failed here) until it next sent something. shutdown also wakes that recv.
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass
        if close_agent:
            agent.close()
        for f in pending.values():
            if not f.done():
                f.set_exception(
                    AgentError(
                        "ERR_DISCONNECTED",
                        "the kvgate agent connection closed",
                        dropped_here=here,
                        agent=agent if here else None,
                    )
                )

    def close(self) -> None:
        s = self._sock
        if s is not None:
            # Before the shutdown: the reader thread then sees EOF and may drop `s` first, which
            # must not read as the agent having closed (its copies may still run).
            self._closing_here = s
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(s)

    def shutdown(self) -> None:
        """close(), and the pidfds kept for dropped connections closed: for good (the engine stops)."""
        self.close()
        with self._lock:
            kept, self._dropped_agents = self._dropped_agents, []
        for a in kept:
            a.close()

    # ------------------------------------------------------------------ requests

    def request(
        self,
        op: str,
        fields: Optional[Dict[str, Any]] = None,
        progress: Optional[Callable] = None,
        wait_here: bool = False,
    ) -> Future:
        """Sends a request; the Future resolves to the answer map or raises AgentError.

        wait_here: the caller calls result() at once; its thread then reads the answer itself
        when no one else is reading (no reader-thread hop). Its answer is read by the reader
        thread only after such a result() gives up (timeout) or while another thread reads.
        """
        s = self._sock
        f: Future = _Answer(self, s)
        if s is None:
            f.set_exception(AgentError("ERR_DISCONNECTED", self.last_error or "not connected to the kvgate agent"))
            return f
        with self._lock:
            if self._sock is not s:
                # Dropped since it was read: its pending map is the next connection's, and a send
                # on `s` failing would leave this answer there unanswered for ever.
                f.set_exception(AgentError("ERR_DISCONNECTED", self.last_error or "the kvgate agent connection closed"))
                return f
            if len(self._pending) >= MAX_PENDING:
                f.set_exception(AgentError("ERR_BUSY", f"{MAX_PENDING} requests to the kvgate agent await answers"))
                return f
            rid = self._next_id
            self._next_id += 1
            self._pending[rid] = f
            f.request_id = rid
            if progress is not None:
                self._progress[rid] = progress
        body = msgpack.packb({"id": rid, "op": op, **(fields or {})}, use_bin_type=True)
        try:
            with self._send_lock:
                s.sendall(struct.pack(">I", len(body)) + body)
        except OSError as e:  # also SO_SNDTIMEO's EAGAIN: part of a frame may be sent, so the stream is lost
            self.last_error = f"cannot send to the kvgate agent: {e}"
            # A reset or broken pipe: the agent closed; a send timeout: it is alive but stalled.
            self._drop(s, here=not isinstance(e, ConnectionError))
            return f
        if not wait_here:
            self._want_reader()
        return f

    def call(self, op: str, fields: Optional[Dict[str, Any]] = None, timeout: float = 30.0) -> Dict[str, Any]:
        f = self.request(op, fields, wait_here=True)
        try:
            return f.result(timeout=timeout)
        except FutureTimeout as e:  # a distinct class before Python 3.11
            raise AgentError("ERR_TIMEOUT", f"{op}: no answer from the kvgate agent in {timeout}s") from e

    def _want_reader(self) -> None:
        with self._lock:
            self._reader_wanted = True
            self._reader_wake.notify()

    def _read_until(self, f: Future, s: Optional[socket.socket], timeout: Optional[float]) -> Optional[float]:
        """Reads on the calling thread until `f` is done, if no one else is reading; returns
        the time left of `timeout` (None: no limit)."""
        if s is None or f.done() or not self._read_lock.acquire(blocking=False):
            return timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if deadline is not None:
                readable = select.poll()  # not select(): an engine may hold fds past FD_SETSIZE
                readable.register(s, select.POLLIN)
            while not f.done() and self._sock is s:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not readable.poll(max(1, int(left * 1000 + 0.999))):
                        break
                if not self._read_some(s):
                    break
        finally:
            self._read_lock.release()
            # After the release: a request registered while this thread held the lock had its
            # caller fall back to waiting on its Future, so someone must read for it.
            if self._pending:
                self._want_reader()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _read_some(self, s: socket.socket) -> bool:
        """One recv and the frames it completes dispatched; False (connection dropped) on EOF or a bad
        frame. Nothing the agent sends raises out of here: this runs on vLLM's threads."""
        try:
            chunk = s.recv(1 << 20)
            if not chunk:
                raise EOFError
            owner, buf = self._buf
            if owner is not s:
                return False
            buf += chunk
            while len(buf) >= 4:
                (n,) = struct.unpack_from(">I", buf, 0)
                if n > MAX_FRAME_BYTES:
                    raise ValueError("oversized frame from the agent")
                if len(buf) < 4 + n:
                    break
                msg = msgpack.unpackb(bytes(buf[4 : 4 + n]), raw=False)
                del buf[: 4 + n]
                self._dispatch(msg)
            return True
        except (EOFError, ConnectionError):  # the agent closed or died
            self._drop(s, here=False)
            return False
        except Exception:  # a bad frame, or a frame whose fields cannot be dispatched (an unhashable id)
            self._drop(s)
            return False

    def _read_loop(self, s: socket.socket) -> None:
        while True:
            with self._lock:
                while not self._reader_wanted and self._sock is s:
                    self._reader_wake.wait()
                if self._sock is not s:
                    return
                self._reader_wanted = False
            with self._read_lock:
                while self._pending and self._sock is s:
                    if not self._read_some(s):
                        return
            # A caller that found the lock held just before the release waits on its Future.
            if self._pending:
                self._want_reader()

    def _dispatch(self, msg: Dict[str, Any]) -> None:
        if not isinstance(msg, dict):
            return
        if msg.get("event") is not None:
            cb = self._progress.get(msg.get("id"))
            if cb is not None:
                cb(msg)
            return
        rid = msg.get("id")
        with self._lock:
            f = self._pending.pop(rid, None) if rid is not None else None
            self._progress.pop(rid, None)
        if f is None:
            return
        if msg.get("ok"):
            f.set_result(msg)
        else:
            err = msg.get("error") or {}
            f.set_exception(AgentError(str(err.get("code", "ERR_INTERNAL")), str(err.get("message", ""))))


class _Answer(Future):
    """A request's Future whose result() reads the socket on the waiting thread when no one
    else is reading (see AgentClient.request's wait_here)."""

    def __init__(self, client: AgentClient, sock: Optional[socket.socket]):
        super().__init__()
        self._client = client
        self._sock = sock
        # The request's id on its connection (None when it was never sent): what `cancel` names.
        self.request_id: Optional[int] = None

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self.done():
            timeout = self._client._read_until(self, self._sock, timeout)
        return super().result(timeout=timeout)
