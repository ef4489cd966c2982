#!/usr/bin/env bash
# Builds the native addon (native/build/Release/kvgate_native.node) with node-gyp
# against the system Node headers, and the stub libcudart the tests load.
#   scripts/build-native.sh             build (incremental)
#   scripts/build-native.sh --clean     rebuild from scratch
#   scripts/build-native.sh --if-needed skip when outputs are newer than sources;
#                                       a failed build only warns (npm pretest)
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
addon=native/build/Release/kvgate_native.node
stub=native/test-stub/build/libcudart_stub.so

stale() { # stale OUTPUT SOURCES... : true when OUTPUT is missing or older than a source
  local out="$1"; shift
  [[ -f "$out" ]] || return 0
  [[ -n "$(find "$@" -newer "$out" -print -quit 2>/dev/null)" ]]
}

build() {
  # node-gyp must never download headers: the system Node ships them under /usr.
  local nodedir="${KVGATE_NODEDIR:-}"
  if [[ -z "$nodedir" ]]; then
    for d in /usr /usr/local "$(dirname "$(dirname "$(command -v node)")")"; do
      if [[ -f "$d/include/node/node_api.h" ]]; then nodedir="$d"; break; fi
    done
  fi
  if [[ -z "$nodedir" ]]; then
    echo "build-native: Node headers not found (looked for include/node/node_api.h under /usr, /usr/local and node's prefix); set KVGATE_NODEDIR" >&2
    return 1
  fi
  if [[ "$mode" == "--clean" ]]; then rm -rf native/build native/test-stub/build; fi
  local gyp=(node node_modules/node-gyp/bin/node-gyp.js --nodedir="$nodedir" --directory=native)
  if [[ "$mode" == "--clean" || ! -f native/build/Makefile ]]; then
    "${gyp[@]}" configure --loglevel=warn
  fi
  if stale "$addon" native/src native/binding.gyp || [[ "$mode" == "--clean" ]]; then
    "${gyp[@]}" build -j "$(nproc 2>/dev/null || echo 2)" --loglevel=warn
  fi
  if stale "$stub" native/test-stub/cudart_stub.cc || [[ "$mode" == "--clean" ]]; then
    mkdir -p "$(dirname "$stub")"
    "${CXX:-g++}" -std=c++17 -O2 -Wall -shared -fPIC -pthread -o "$stub.tmp" native/test-stub/cudart_stub.cc
    mv "$stub.tmp" "$stub"
  fi
}

if [[ "$mode" == "--if-needed" ]]; then
  if ! stale "$addon" native/src native/binding.gyp && ! stale "$stub" native/test-stub/cudart_stub.cc; then
    exit 0
  fi
  if ! build; then
    echo "build-native: build failed; native tests will report the loader error (run scripts/build-native.sh)" >&2
  fi
  exit 0
fi
build
echo "build-native: $addon and $stub are up to date"
