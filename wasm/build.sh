#!/usr/bin/env bash
# Builds wasm/kvgate_codec.wasm with Debian's Rust 1.63 (see FACTS.md). The build
# is byte-reproducible; the .wasm is committed so `npm install` needs no Rust.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x /usr/bin/rustc ] || [ ! -x /usr/bin/cargo ]; then
  echo "wasm/build.sh: needs Debian's toolchain: apt-get install -y rustc cargo libstd-rust-dev-wasm32 lld" >&2
  exit 2
fi
export RUSTC=/usr/bin/rustc
export RUSTFLAGS="-C target-feature=+simd128"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
/usr/bin/cargo build --release --offline --target wasm32-unknown-unknown --lib
out="${1:-kvgate_codec.wasm}"
cp "$CARGO_TARGET_DIR/wasm32-unknown-unknown/release/kvgate_codec.wasm" "$out"
echo "wasm/build.sh: wrote wasm/$out ($(wc -c <"$out") bytes, sha256 $(sha256sum "$out" | cut -c1-16))"
