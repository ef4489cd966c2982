"""vLLM's sha256_cbor block hashes, computed without vLLM.

A block's hash is sha256(canonical CBOR [parent_hash, token_ids, extra_keys]); the first
block's parent is NONE_HASH = sha256_cbor(PYTHONHASHSEED string). kvgate's
`vllm-sha256-cbor` chain keys are the same bytes (tests check both against cbor2).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Optional, Sequence


def _head(major: int, n: int, out: bytearray) -> None:
    m = major << 5
    if n < 24:
        out.append(m | n)
    elif n <= 0xFF:
        out += bytes((m | 24, n))
    elif n <= 0xFFFF:
        out.append(m | 25)
        out += struct.pack(">H", n)
    elif n <= 0xFFFFFFFF:
        out.append(m | 26)
        out += struct.pack(">I", n)
    else:
        out.append(m | 27)
        out += struct.pack(">Q", n)


def cbor_canonical(v, out: Optional[bytearray] = None) -> bytearray:
    """Canonical CBOR (RFC 8949 4.2.1) of the items block hashes use: ints, bytes, str, lists, None."""
    if out is None:
        out = bytearray()
    if v is None:
        out.append(0xF6)
    elif isinstance(v, bool):
        raise TypeError("booleans do not occur in block hashes")
    elif isinstance(v, int):
        if v >= 0:
            _head(0, v, out)
        else:
            _head(1, -1 - v, out)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        _head(2, len(b), out)
        out += b
    elif isinstance(v, str):
        b = v.encode("utf-8")
        _head(3, len(b), out)
        out += b
    elif isinstance(v, (list, tuple)):
        _head(4, len(v), out)
        for item in v:
            cbor_canonical(item, out)
    else:
        raise TypeError(f"cannot encode {type(v).__name__} in a block hash")
    return out


def sha256_cbor(v) -> bytes:
    return hashlib.sha256(bytes(cbor_canonical(v))).digest()


def none_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH for a fixed PYTHONHASHSEED."""
    return sha256_cbor(seed)


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: str,
    extra_keys: Optional[Iterable] = None,
) -> list:
    """Hashes of every full block of `tokens`, as vLLM computes them with sha256_cbor."""
    parent = none_hash(seed)
    extra = None if extra_keys is None else tuple(extra_keys)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = sha256_cbor((parent, tuple(int(t) for t in tokens[start : start + block_size]), extra))
        out.append(parent)
    return out


def chunk_hashes(block_hash_list: Sequence[bytes], blocks_per_chunk: int) -> list:
    """The key of each full chunk: the hash of its last block."""
    n = len(block_hash_list) // blocks_per_chunk
    return [bytes(block_hash_list[(i + 1) * blocks_per_chunk - 1]) for i in range(n)]
