"""A scripted fake kvgate agent on a Unix socket, shared by the client and fault tests."""

import os
import socket
import struct
import tempfile
import threading

import msgpack


def pidfds_open() -> int:
    """How many pidfds this process holds (/proc/self/fd links to anon_inode:[pidfd])."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:  # the fd listdir itself used, closed since
            pass
    return n


def frame(msg) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


class ScriptedAgent:
    """A fake agent: `script(agent, conn, req, n)` answers each request (n: which connection, from 0)
    with `agent.send(conn, {...})`, or returns a map to send with the request's id. `read=False`:
    it stops reading after hello (its socket buffer fills)."""

    def __init__(self, script, read=True, listening=None):
        self.script = script
        self.read = read
        if listening is not None:  # a socket another process bound and listened on (handed over)
            self.srv = listening
            self.path = self.srv.getsockname()
            self.dir = os.path.dirname(self.path)
        else:
            self.dir = tempfile.mkdtemp(prefix="kvgate-fake-agent-")
            self.path = os.path.join(self.dir, "agent.sock")
            self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.srv.bind(self.path)
            self.srv.listen(8)
        self.conns = []
        self.requests = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def send(self, conn, msg) -> None:
        self.send_raw(conn, frame(msg))

    def send_raw(self, conn, data: bytes) -> None:
        # An answer sent late (a script's timer) may meet a connection the client or the test has
        # closed since: dropped, as a real agent's would be. Raising in that thread only made
        # pytest warn about a test that had already ended ("Bad file descriptor").
        with self.lock:
            try:
                conn.sendall(data)
            except OSError:
                pass

    def _accept(self):
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, len(self.conns) - 1), daemon=True).start()

    def _serve(self, conn, n):
        buf = b""
        try:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                    size = struct.unpack(">I", buf[:4])[0]
                    req = msgpack.unpackb(buf[4 : 4 + size], raw=False)
                    buf = buf[4 + size :]
                    self.requests.append((n, req["op"]))
                    out = self.script(self, conn, req, n)
                    if out is not None:
                        self.send(conn, {"id": req["id"], **out})
                    if not self.read and req["op"] == "hello":
                        threading.Event().wait()
        except OSError:
            return

    def drop_all(self):
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.srv.close()
        self.drop_all()
        for c in list(self.conns):
            c.close()
