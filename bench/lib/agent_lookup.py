"""Lookup latency as vLLM's connector sees it (bench/agent.ts runs this; not a test).

Usage: agent_lookup.py SOCKET PYTHON_PKG_DIR N KEYS_HEX_FILE
Connects with kvgate_vllm's own AgentClient (the engine's path), looks up the 512 packed
keys N times and prints JSON: the round-trip times' p50/p99 and a ping's, each as the
engine waits (the caller reads its own answer) and, in alternate blocks, with the answer
handed through the client's reader thread to a Future (the same-run baseline: the client
before it let a lone waiting caller read); and a bare Unix-socket ping-pong between two
Python processes (the machine's floor for any socket round trip), one beside each lookup
so that it sees the same load.

Blocks, not request by request: right after a reader-thread answer that thread is still
finishing (holding the GIL) when the next caller's answer comes in, which is the tail of
neither path. The first calls of each block are not counted.
"""

import json
import os
import socket
import sys
import time
from concurrent.futures import Future

sys.path.insert(0, sys.argv[2])
from kvgate_vllm.client import AgentClient  # noqa: E402


def q(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


BLOCK = 250
SETTLE = 5


def echo_peer():
    """A forked process echoing bytes: the floor's other end (forked before any thread starts)."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()  # else the parent's close never reads as EOF here
        while True:
            d = b.recv(64)
            if not d:
                os._exit(0)
            b.sendall(d)
    b.close()
    return a, pid


def main():
    sock, _, n, keys_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(keys_file) as f:
        packed = bytes.fromhex(f.read().strip())
    hello = {
        "protocol": 1,
        "model": "bench/tiny",
        "hashSeed": "0",
        "geometry": {"layout": "flash-attn", "dtype": "float16", "layers": 1, "kvHeads": 1, "headSize": 8, "blockSize": 16},
    }
    peer, peer_pid = echo_peer()
    c = AgentClient(sock, hello)
    if not c.ensure():
        raise SystemExit(c.last_error)

    def hop(op, fields=None):
        # Future.result, not the client's: the answer comes through the reader thread.
        return Future.result(c.request(op, fields), timeout=30)

    def bare():
        peer.sendall(b"x")
        peer.recv(64)

    for _ in range(50):
        c.call("lookup", {"keys": packed})
        hop("lookup", {"keys": packed})
    out = {k: [] for k in ("lookup", "ping", "lookupHop", "pingHop", "bare")}
    hit = 0

    def timed(key, fn, counted):
        t = time.perf_counter()
        r = fn()
        if counted:
            out[key].append((time.perf_counter() - t) * 1e3)
        return r

    for b in range(2 * ((n + BLOCK - SETTLE - 1) // (BLOCK - SETTLE))):
        via_reader = b % 2 == 1
        for i in range(BLOCK):
            counted = i >= SETTLE and len(out["lookupHop" if via_reader else "lookup"]) < n
            if via_reader:
                timed("lookupHop", lambda: hop("lookup", {"keys": packed}), counted)
                if i % 2 == 0:
                    timed("pingHop", lambda: hop("ping"), counted)
            else:
                hit = timed("lookup", lambda: c.call("lookup", {"keys": packed}), counted)["chunks"]
                if i % 2 == 0:
                    timed("ping", lambda: c.call("ping"), counted)
                timed("bare", bare, counted)
    c.close()
    peer.close()
    os.waitpid(peer_pid, 0)
    stats = {k: {"p50": q(v, 0.5), "p99": q(v, 0.99)} for k, v in out.items()}
    print(
        json.dumps(
            {
                "hit": hit,
                "n": n,
                **stats,
            }
        )
    )


main()
