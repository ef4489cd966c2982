"""The agent process at the other end of a connection, watched through a pidfd.

A load whose connection this side dropped (a garbage frame, a stalled send, a save cancel
unanswered) may still have a copy in flight in the agent, and the connection can no longer
say when it lands. The agent process exiting can: its copies end with it (docs/vllm.md,
"Loads given up"). A pidfd names that exact process (a pid is reused once the process is
reaped, a pidfd never) and reads readable once it has exited.

Where no pidfd can be had (pid 0: the agent is in a pid namespace this one cannot see; no
SO_PEERCRED or pidfd_open: not Linux, Python < 3.9, Linux < 5.3; EPERM under a seccomp
filter) `watchable` is False and the loads stay held for good, as before pidfds.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
from typing import Optional

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(sock: socket.socket) -> int:
    """The pid (in this pid namespace) of the process that called listen() on the agent's
    socket (the agent, unless socket-activated): 0 where the kernel cannot say (not visible
    here, or no SO_PEERCRED)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return 0
    try:
        pid, _, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, opt, _UCRED.size))
    except OSError:
        return 0
    return pid if pid > 0 else 0


class AgentProcess:
    """One agent process; `exited()` never blocks. Thread-safe: the fd is closed exactly once."""

    def __init__(self, pid: int, fd: Optional[int], why_not: str = ""):
        self.pid = pid
        self._fd = fd
        self._exited = False
        self._lock = threading.Lock()
        # Why no pidfd could be had (for the log line of a load then held for good).
        self.why_not = why_not

    @classmethod
    def open(cls, pid: int) -> "AgentProcess":
        if pid <= 0:
            return cls(0, None, "the agent's pid is not visible from this process (another pid namespace)")
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:
            return cls(pid, None, "this platform has no pidfd_open (Linux 5.3+, Python 3.9+)")
        try:
            return cls(pid, pidfd_open(pid))
        except OSError as e:  # ESRCH: already gone (the hello then fails); EPERM, ENOSYS: see the module doc
            return cls(pid, None, f"pidfd_open({pid}) failed: {e}")

    def own_namespace_pid(self) -> int:
        """The process's pid in its own pid namespace (what it would call its pid), from the
        pidfd's fdinfo (NSpid: this namespace's pid first, its own last); this namespace's pid
        where fdinfo says none (a kernel without it: then only an agent in this namespace
        matches); 0 without a pidfd or once the process is gone."""
        with self._lock:
            fd = self._fd
            if fd is None:
                return 0
            try:
                with open(f"/proc/self/fdinfo/{fd}") as f:
                    lines = f.read().splitlines()
            except OSError:
                return self.pid
        for line in lines:
            if line.startswith("NSpid:"):
                fields = line.split()[1:]
                try:
                    pid = int(fields[-1])
                except (IndexError, ValueError):
                    return 0
                return pid if pid > 0 else 0  # -1: exited (and reaped)
        return self.pid

    def answers_as(self, pid: object) -> str:
        """Why a connection whose agent says its pid is `pid` (hello) may not be fenced by this
        process's exit; "" when it is that process. The socket's peer credentials name the process
        that called listen(): another one may be serving it (a socket inherited by a child or
        handed over at a restart, a socket-activated agent), and it can exit while the server copies."""
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return "the agent did not say its pid in hello (an older agent): its process cannot be proved"
        mine = self.own_namespace_pid()
        if mine != pid:
            return (
                f"the socket's listener (pid {self.pid} here, {mine} in its namespace) is not the agent "
                f"answering (pid {pid}): a socket handed over, inherited or activated"
            )
        return ""

    @property
    def watchable(self) -> bool:
        """Whether its exit can be seen (a pidfd was had)."""
        return self._fd is not None or self._exited

    def exited(self) -> bool:
        """True once the process has exited (the pidfd is then closed: the answer cannot change).
        False while it runs, and always without a pidfd (its exit cannot be known)."""
        with self._lock:
            if self._fd is None:
                return self._exited
            try:
                p = select.poll()  # not select(): an engine may hold fds past FD_SETSIZE
                p.register(self._fd, select.POLLIN)
                events = p.poll(0)
            except OSError:
                return False
            # POLLIN: exited (POLLHUP too where the kernel says reaped). POLLNVAL is no exit: the
            # fd was closed under us (it would read "exited" and free blocks a copy may still fill).
            revents = events[0][1] if events else 0
            if revents & select.POLLNVAL or not revents & (select.POLLIN | select.POLLHUP):
                return False
            self._exited = True
            self._close_locked()
            return True

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
