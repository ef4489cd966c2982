"""The connector's block hashes equal vLLM's sha256_cbor (via cbor2, the library vLLM
uses) and kvgate's own `vllm-sha256-cbor` chain keys (computed by `kvgate keys`)."""

import hashlib
import json
import os
import random
import subprocess

import pytest

from kvgate_vllm import hashing

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_canonical_cbor_matches_cbor2():
    cbor2 = pytest.importorskip("cbor2")
    rng = random.Random(7)
    values = [
        "0",
        "",
        "seed-é",
        None,
        0,
        23,
        24,
        255,
        256,
        65535,
        65536,
        2**32 - 1,
        2**32,
        -1,
        -25,
        b"",
        bytes(range(40)),
        [],
        (bytes(32), tuple(rng.randrange(0, 2**17) for _ in range(16)), None),
        (bytes(32), (1, 2, 3), ("lora-a", 7)),
    ]
    for v in values:
        assert bytes(hashing.cbor_canonical(v)) == cbor2.dumps(v, canonical=True), v


def test_block_hashes_match_vllms_definition_with_cbor2():
    cbor2 = pytest.importorskip("cbor2")

    def vllm_sha256_cbor(x):
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    tokens = [random.Random(1).randrange(0, 128256) for _ in range(100)]
    # "0": PYTHONHASHSEED=0; "vllm-none-hash": vLLM's default seed since PR 51875 (unset).
    for seed in ("0", "vllm-none-hash"):
        parent = vllm_sha256_cbor(seed)
        expected = []
        for i in range(0, 96, 16):
            parent = vllm_sha256_cbor((parent, tuple(tokens[i : i + 16]), None))
            expected.append(parent)
        assert hashing.block_hashes(tokens, 16, seed) == expected
        assert hashing.chunk_hashes(expected, 2) == [expected[1], expected[3], expected[5]]
    # NONE_HASH of the default seed, from its CBOR text string written out by hand (0x6e: a
    # 14-byte text string), independent of both encoders.
    assert hashing.none_hash("vllm-none-hash") == hashlib.sha256(b"\x6evllm-none-hash").digest()


@pytest.mark.parametrize("seed", ["0", "vllm-none-hash"])
def test_equal_to_kvgate_vllm_sha256_cbor_keys(seed):
    tokens = [random.Random(2).randrange(0, 32000) for _ in range(80)]
    out = subprocess.run(
        [
            "node",
            "--import",
            "tsx",
            "src/cli/main.ts",
            "keys",
            "--chunk-tokens",
            "16",
            "--scheme",
            "vllm-sha256-cbor",
            "--hash-seed",
            seed,
            "--json",
            "--tokens",
            ",".join(map(str, tokens)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    ts_keys = [bytes.fromhex(k["key"]) for k in json.loads(out.stdout)["keys"]]
    assert len(ts_keys) == 5
    assert hashing.block_hashes(tokens, 16, seed) == ts_keys
    # A different seed gives different keys (the seed really enters NONE_HASH).
    assert hashing.block_hashes(tokens, 16, "1") != ts_keys
