#!/usr/bin/env bash
# CI check: rebuilds the codec from source in a scratch target dir and fails when
# the result differs from the committed wasm/kvgate_codec.wasm. Skips (exit 0)
# with a message when Debian's Rust toolchain is absent.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x /usr/bin/rustc ] || [ ! -x /usr/bin/cargo ] || [ ! -d /usr/lib/rustlib/wasm32-unknown-unknown ]; then
  echo "wasm/check.sh: SKIP (Debian rustc/cargo/libstd-rust-dev-wasm32 not installed)"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
CARGO_TARGET_DIR="$tmp/target" ./build.sh "$tmp/rebuilt.wasm" >/dev/null
if cmp -s "$tmp/rebuilt.wasm" kvgate_codec.wasm; then
  echo "wasm/check.sh: OK (committed kvgate_codec.wasm matches a rebuild)"
else
  echo "wasm/check.sh: MISMATCH: kvgate_codec.wasm differs from a rebuild; run wasm/build.sh and commit" >&2
  exit 1
fi
