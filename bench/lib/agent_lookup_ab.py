"""One block of bench/agent-ab.ts: lookups through a tree's own kvgate_vllm client (not a test).

Usage: agent_lookup_ab.py SOCKET PYTHON_PKG_DIR N KEYS_HEX_FILE
Connects with that tree's AgentClient, looks up the packed keys N times (each followed by a
ping, and by a bare Unix-socket ping-pong with a forked echo process: the machine's floor
under the same load) after a warm-up, and prints JSON lists of milliseconds.
"""

import json
import os
import socket
import sys
import time

sys.path.insert(0, sys.argv[2])
from kvgate_vllm.client import AgentClient  # noqa: E402


def echo_peer():
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        while True:
            d = b.recv(64)
            if not d:
                os._exit(0)
            b.sendall(d)
    b.close()
    return a, pid


def main():
    sock, n, keys_file = sys.argv[1], int(sys.argv[3]), sys.argv[4]
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
    out = {"lookup": [], "ping": [], "bare": []}
    hit = 0
    pc = time.perf_counter
    for i in range(50 + n):
        t = pc()
        hit = c.call("lookup", {"keys": packed})["chunks"]
        t1 = pc()
        c.call("ping")
        t2 = pc()
        peer.sendall(b"x")
        peer.recv(64)
        t3 = pc()
        if i >= 50:
            out["lookup"].append((t1 - t) * 1e3)
            out["ping"].append((t2 - t1) * 1e3)
            out["bare"].append((t3 - t2) * 1e3)
    c.close()
    peer.close()
    os.waitpid(peer_pid, 0)
    print(json.dumps({"hit": hit, **out}))


main()
