"""Lookup latency as vLLM's connector sees it (bench/agent.ts runs this; not a test).

Usage: agent_lookup.py SOCKET PYTHON_PKG_DIR N KEYS_HEX_FILE
Connects with kvgate_vllm's own AgentClient (the engine's path), looks up the 512 packed
keys N times and prints JSON: the round-trip times' p50/p99 and a ping's, each as the
engine waits (the caller reads its own answer) and, interleaved request by request, with
the answer handed through the client's reader thread to a Future (the same-run baseline:
the client before it let a lone waiting caller read), and a bare Unix-socket ping-pong
between two Python processes (the machine's floor for any socket round trip).
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


def bare_ping_pong(n):
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
    r = []
    for _ in range(n):
        t = time.perf_counter()
        a.sendall(b"x")
        a.recv(64)
        r.append((time.perf_counter() - t) * 1e3)
    a.close()
    os.waitpid(pid, 0)
    return r


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
    c = AgentClient(sock, hello)
    if not c.ensure():
        raise SystemExit(c.last_error)
    def hop(op, fields=None):
        # Future.result, not the client's: the answer comes through the reader thread.
        return Future.result(c.request(op, fields), timeout=30)

    for _ in range(50):
        c.call("lookup", {"keys": packed})
        hop("lookup", {"keys": packed})
    rtt, ping, rtt_hop, ping_hop = [], [], [], []
    hit = 0
    for i in range(n):
        t = time.perf_counter()
        hit = c.call("lookup", {"keys": packed})["chunks"]
        rtt.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        hop("lookup", {"keys": packed})
        rtt_hop.append((time.perf_counter() - t) * 1e3)
        if i % 2 == 0:
            t = time.perf_counter()
            c.call("ping")
            ping.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            hop("ping")
            ping_hop.append((time.perf_counter() - t) * 1e3)
    c.close()
    bare = bare_ping_pong(n)
    print(
        json.dumps(
            {
                "hit": hit,
                "n": n,
                "lookup": {"p50": q(rtt, 0.5), "p99": q(rtt, 0.99)},
                "ping": {"p50": q(ping, 0.5), "p99": q(ping, 0.99)},
                "lookupHop": {"p50": q(rtt_hop, 0.5), "p99": q(rtt_hop, 0.99)},
                "pingHop": {"p50": q(ping_hop, 0.5), "p99": q(ping_hop, 0.99)},
                "bare": {"p50": q(bare, 0.5), "p99": q(bare, 0.99)},
            }
        )
    )


main()
