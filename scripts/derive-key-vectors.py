#!/usr/bin/python3
"""Derives test/vectors/keys.json independently of the TypeScript code.

sha256-v1 follows docs/keys.md with struct + hashlib; vllm-sha256-cbor uses
cbor2 (the CBOR library vLLM uses; Debian's python3-cbor2) exactly as vLLM's
sha256_cbor does: sha256(cbor2.dumps(x, canonical=True)).
Run: /usr/bin/python3 scripts/derive-key-vectors.py > test/vectors/keys.json
"""
import hashlib
import json
import struct

import cbor2

DTYPES = {"fp16": 1, "bf16": 2, "fp32": 3}
SCHEMES = {"sha256-v1": 1, "vllm-sha256-cbor": 2}


def sha256_cbor(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def seed_preimage(ns):
    model = ns["modelId"].encode()
    seed = ns.get("hashSeed", "").encode()
    g = ns["geometry"]
    return (
        b"kvgate:ns:v1\0"
        + bytes([SCHEMES[ns.get("scheme", "sha256-v1")]])
        + struct.pack("<H", len(model)) + model
        + struct.pack("<HHHB", g["layers"], g["kvHeads"], g["headDim"], DTYPES[g["dtype"]])
        + struct.pack("<I", ns["chunkTokens"])
        + struct.pack("<H", len(seed)) + seed
    )


def chain(tokens, ns, include_partial):
    scheme = ns.get("scheme", "sha256-v1")
    seed = hashlib.sha256(seed_preimage(ns)).digest()
    if scheme == "vllm-sha256-cbor":
        parent = sha256_cbor(ns["hashSeed"])  # vLLM's NONE_HASH
    else:
        parent = seed
    c = ns["chunkTokens"]
    keys = []
    for start in range(0, len(tokens), c):
        block = tokens[start:start + c]
        if len(block) < c and not include_partial:
            break
        if scheme == "vllm-sha256-cbor":
            extra = ns.get("extraKeys")
            h = sha256_cbor((parent, tuple(block), tuple(extra) if extra is not None else None))
        else:
            h = hashlib.sha256(parent + struct.pack("<I", len(block)) + struct.pack(f"<{len(block)}I", *block)).digest()
        keys.append(h.hex())
        parent = h
    return seed.hex()[:32], keys


def lcg_tokens(n, vocab, seed):
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(x % vocab)
    return out


G8B = {"layers": 32, "kvHeads": 8, "headDim": 128, "dtype": "bf16"}
GTINY = {"layers": 5, "kvHeads": 4, "headDim": 8, "dtype": "fp16"}
cases = [
    ("empty prompt", {"modelId": "meta-llama/Llama-3.1-8B", "geometry": G8B, "chunkTokens": 256}, [], False),
    ("one full chunk of 4", {"modelId": "m", "geometry": GTINY, "chunkTokens": 4}, [1, 2, 3, 4], False),
    ("partial tail dropped", {"modelId": "m", "geometry": GTINY, "chunkTokens": 4}, [1, 2, 3, 4, 5, 6], False),
    ("partial tail kept", {"modelId": "m", "geometry": GTINY, "chunkTokens": 4}, [1, 2, 3, 4, 5, 6], True),
    ("8B, 3 chunks of 256", {"modelId": "meta-llama/Llama-3.1-8B", "geometry": G8B, "chunkTokens": 256}, lcg_tokens(800, 128256, 7), False),
    ("dtype changes the keys", {"modelId": "meta-llama/Llama-3.1-8B", "geometry": dict(G8B, dtype="fp16"), "chunkTokens": 256}, lcg_tokens(800, 128256, 7), False),
    ("big token ids", {"modelId": "x", "geometry": GTINY, "chunkTokens": 2}, [0, 4294967295, 65536, 255], False),
    ("hash seed salt", {"modelId": "m", "geometry": GTINY, "chunkTokens": 4, "hashSeed": "tenant-a"}, [9, 8, 7, 6, 5, 4, 3, 2], False),
    ("unicode model id", {"modelId": "modèle/ü", "geometry": GTINY, "chunkTokens": 3}, [10, 20, 30], False),
    ("vllm block 16, seed 0", {"modelId": "meta-llama/Llama-3.1-8B", "geometry": G8B, "chunkTokens": 16, "scheme": "vllm-sha256-cbor", "hashSeed": "0"}, lcg_tokens(40, 128256, 3), False),
    ("vllm ints across CBOR widths", {"modelId": "m", "geometry": GTINY, "chunkTokens": 6, "scheme": "vllm-sha256-cbor", "hashSeed": "42"}, [0, 23, 24, 255, 256, 65535, 65536, 4294967295, 1, 2, 3, 4], False),
    ("vllm extra keys", {"modelId": "m", "geometry": GTINY, "chunkTokens": 4, "scheme": "vllm-sha256-cbor", "hashSeed": "1", "extraKeys": ["lora-a", 7]}, [5, 6, 7, 8], False),
    ("vllm 256-token blocks", {"modelId": "m", "geometry": G8B, "chunkTokens": 256, "scheme": "vllm-sha256-cbor", "hashSeed": "12345"}, lcg_tokens(512, 128256, 11), False),
]
out = []
for name, ns, tokens, partial in cases:
    nsid, keys = chain(tokens, ns, partial)
    out.append({"name": name, "namespace": ns, "tokens": tokens, "includePartial": partial, "namespaceId": nsid, "keys": keys})
print(json.dumps({"derivedBy": "scripts/derive-key-vectors.py (Python hashlib + struct; cbor2 for vLLM)", "cases": out}, indent=1, ensure_ascii=False))
