#!/usr/bin/env bash
# Setup of a fresh machine. Safe to run again.
#   scripts/setup.sh           npm packages + the native addon (and its stub libcudart)
#   scripts/setup.sh --system  Debian packages the full test suite uses (root):
#                              Rust 1.63 + wasm32 std (wasm reproducibility check),
#                              Ceph mon/osd/radosgw (the real S3 for integration suites),
#                              Debian's python3-torch/msgpack/pytest/cbor2/pip/setuptools (vLLM connector harness,
#                              key vectors; they install for /usr/bin/python3)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--system" ]]; then
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "setup: --system needs root and apt-get; skipping (RGW suites and the wasm check will say what is missing)" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    rustc cargo libstd-rust-dev-wasm32 lld \
    ceph-mon ceph-osd radosgw \
    g++ make python3 \
    python3-torch python3-msgpack python3-pytest python3-cbor2 python3-pip python3-setuptools >/dev/null
  exit 0
fi

# npm install, not npm ci: the lockfile pins every version, but the registry these
# machines reach lacks biome's non-Linux optional packages, which npm ci insists on.
npm install --no-fund --no-audit

# Native addon (node-gyp against the system Node headers) + the stub libcudart
# its tests load. Fast (~5 s cold, ~0 s when up to date).
bash scripts/build-native.sh

# The wasm codec: Debian's Rust 1.63 + its wasm32 std rebuild it byte-reproducibly;
# wasm/check.sh fails when the committed wasm/kvgate_codec.wasm differs from a
# rebuild, and skips with a message when the toolchain is absent.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/bin/rustc ]; then
  { apt-get update -qq && apt-get install -y -qq rustc cargo libstd-rust-dev-wasm32 lld; } >/dev/null ||
    echo "setup: could not install Debian's Rust toolchain; wasm/check.sh will skip"
fi
bash wasm/check.sh
