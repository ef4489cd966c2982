#!/usr/bin/env bash
# One-time setup of a fresh machine: npm packages, the native addon, and (when
# root) the Debian packages the integration suites use. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

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
