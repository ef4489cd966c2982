#!/usr/bin/env bash
# One-time setup of a fresh machine: npm packages, the native addon, and (when
# root) the Debian packages the integration suites use. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

npm install --no-fund --no-audit

# Native addon (node-gyp against the system Node headers) + the stub libcudart
# its tests load. Fast (~5 s cold, ~0 s when up to date).
bash scripts/build-native.sh
