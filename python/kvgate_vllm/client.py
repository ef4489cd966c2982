"""A thread-safe client of the kvgate agent's socket protocol (docs/agent-protocol.md).

One socket, a reader thread, requests matched to answers by id (the agent answers in
completion order), load-progress events, and reconnection: a dead agent fails every
pending request at once and the next call after `reconnect_interval` dials again.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, Optional

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024


class AgentError(Exception):
    """An error answer from the agent (`code` is stable) or a transport failure (ERR_DISCONNECTED)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} [{code}]")
        self.code = code


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
    ):
        self.path = path
        self._hello = hello
        self._on_connect = on_connect
        self._connect_timeout = connect_timeout
        self._reconnect_interval = reconnect_interval
        self._lock = threading.Lock()
        # Separate from _lock: a blocked send must never stall the reader that drains answers.
        self._send_lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._pending: Dict[int, Future] = {}
        self._progress: Dict[int, Callable[[Dict[str, Any]], None]] = {}
        self._next_id = 1
        self._last_attempt = 0.0
        self._generation = 0
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

    def ensure(self) -> bool:
        """Connected (dialing again at most once per reconnect_interval); never raises."""
        if self._sock is not None:
            return True
        now = time.monotonic()
        with self._lock:
            if self._sock is not None:
                return True
            if now - self._last_attempt < self._reconnect_interval:
                return False
            self._last_attempt = now
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(self._connect_timeout)
                s.connect(self.path)
                s.settimeout(None)
            except OSError as e:
                self.last_error = f"cannot reach the kvgate agent at {self.path}: {e}"
                return False
            self._sock = s
            self._generation += 1
            t = threading.Thread(target=self._read_loop, args=(s,), name="kvgate-agent-reader", daemon=True)
            t.start()
        try:
            self.hello_answer = self.call("hello", dict(self._hello), timeout=5.0)
            if self._on_connect is not None:
                self._on_connect(self)
        except AgentError as e:
            if e.code in ("ERR_PROTOCOL_VERSION", "ERR_MODEL_MISMATCH", "ERR_GEOMETRY_MISMATCH", "ERR_LAYOUT"):
                self.close()
                raise
            self.last_error = str(e)
            self._drop(s)
            return False
        return self._sock is not None

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            if self._sock is not s:
                return
            self._sock = None
            pending, self._pending = self._pending, {}
            self._progress = {}
        try:
            s.close()
        except OSError:
            pass
        for f in pending.values():
            if not f.done():
                f.set_exception(AgentError("ERR_DISCONNECTED", "the kvgate agent connection closed"))

    def close(self) -> None:
        s = self._sock
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(s)

    # ------------------------------------------------------------------ requests

    def request(
        self, op: str, fields: Optional[Dict[str, Any]] = None, progress: Optional[Callable] = None
    ) -> Future:
        """Sends a request; the Future resolves to the answer map or raises AgentError."""
        f: Future = Future()
        s = self._sock
        if s is None:
            f.set_exception(AgentError("ERR_DISCONNECTED", self.last_error or "not connected to the kvgate agent"))
            return f
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._pending[rid] = f
            if progress is not None:
                self._progress[rid] = progress
        body = msgpack.packb({"id": rid, "op": op, **(fields or {})}, use_bin_type=True)
        try:
            with self._send_lock:
                s.sendall(struct.pack(">I", len(body)) + body)
        except OSError:
            self._drop(s)
        return f

    def call(self, op: str, fields: Optional[Dict[str, Any]] = None, timeout: float = 30.0) -> Dict[str, Any]:
        f = self.request(op, fields)
        try:
            return f.result(timeout=timeout)
        except FutureTimeout as e:  # a distinct class before Python 3.11
            raise AgentError("ERR_TIMEOUT", f"{op}: no answer from the kvgate agent in {timeout}s") from e

    def _read_loop(self, s: socket.socket) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
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
        except (OSError, ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException):
            pass
        finally:
            self._drop(s)

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
