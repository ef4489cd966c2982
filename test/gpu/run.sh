#!/usr/bin/env bash
# Runs the native addon's CUDA checks (test/gpu/*.test.ts) on a real GPU.
# Without a usable GPU it prints why and exits 0; KVGATE_GPU_REQUIRED=1 makes that a failure.
set -euo pipefail
cd "$(dirname "$0")/../.."

bash scripts/build-native.sh >/dev/null
# The stub is for GPU-less machines; here we want the real runtime.
if [[ "${KVGATE_CUDART:-}" == *libcudart_stub* ]]; then unset KVGATE_CUDART; fi

probe=$(node -e 'const s = require("./native/build/Release/kvgate_native.node").cuda.probe(); console.log(s.available ? "ok " + s.deviceCount + " device(s), runtime " + s.runtimeVersion + ", driver " + s.driverVersion + ", " + s.library : "no " + s.reason)')
if [[ "$probe" != ok* ]]; then
  echo "test/gpu: skipped — no usable CUDA: ${probe#no }"
  if [[ "${KVGATE_GPU_REQUIRED:-}" == 1 ]]; then exit 1; fi
  exit 0
fi
echo "test/gpu: CUDA ${probe#ok }"
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true; fi
KVGATE_GPU_REQUIRED=1 exec npx vitest run test/gpu/
