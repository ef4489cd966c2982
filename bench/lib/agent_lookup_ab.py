"""bench/agent-ab.ts's lookups (not a test): two agents, each through its own tree's client.

Usage: agent_lookup_ab.py N KEYS_HEX_FILE SOCKET_A CLIENT_PY_A SOCKET_B CLIENT_PY_B
Loads each tree's kvgate_vllm/client.py as a module of its own (it imports only the standard
library and msgpack), connects each to its agent and, after a warm-up, runs N rounds: in each,
both agents' lookup of the packed keys and a ping, the order alternating, then one bare
Unix-socket ping-pong with a forked echo process (the machine's floor under the same load).
Lookups of the two agents are thus interleaved one by one: the machine's load, which moves
within seconds, falls on both alike. Prints JSON lists of milliseconds per agent.
"""

import importlib
import json
import os
import socket
import sys
import time
import types


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


def load_client(path, name):
    """The AgentClient of one tree's kvgate_vllm/client.py, as a module of a package of its own
    (client.py imports its siblings relatively), without running the package's __init__ (torch)."""
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.dirname(path)]
    sys.modules[name] = pkg
    return importlib.import_module(f"{name}.client").AgentClient


def main():
    n, keys_file = int(sys.argv[1]), sys.argv[2]
    pairs = [(sys.argv[3], sys.argv[4]), (sys.argv[5], sys.argv[6])]
    with open(keys_file) as f:
        packed = bytes.fromhex(f.read().strip())
    hello = {
        "protocol": 1,
        "model": "bench/tiny",
        "hashSeed": "0",
        "geometry": {"layout": "flash-attn", "dtype": "float16", "layers": 1, "kvHeads": 1, "headSize": 8, "blockSize": 16},
    }
    peer, peer_pid = echo_peer()  # forked before any client starts a thread
    clients = []
    for i, (sock, client_py) in enumerate(pairs):
        c = load_client(client_py, f"kvgate_ab_client_{i}")(sock, hello)
        if not c.ensure():
            raise SystemExit(c.last_error)
        clients.append(c)
    out = [{"lookup": [], "ping": []} for _ in clients]
    bare = []
    hits = [0, 0]
    pc = time.perf_counter
    for i in range(100 + n):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            c = clients[k]
            t = pc()
            hits[k] = c.call("lookup", {"keys": packed})["chunks"]
            t1 = pc()
            c.call("ping")
            t2 = pc()
            if i >= 100:
                out[k]["lookup"].append((t1 - t) * 1e3)
                out[k]["ping"].append((t2 - t1) * 1e3)
        t = pc()
        peer.sendall(b"x")
        peer.recv(64)
        if i >= 100:
            bare.append((pc() - t) * 1e3)
    for c in clients:
        c.close()
    peer.close()
    os.waitpid(peer_pid, 0)
    print(json.dumps({"hits": hits, "agents": out, "bare": bare}))


main()
