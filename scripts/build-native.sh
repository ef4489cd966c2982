#!/usr/bin/env bash
# Builds the native addon (native/build/Release/kvgate_native.node) with node-gyp
# against the system Node headers, and (in a checkout) the stub libcudart the tests load.
# Runs in a checkout and inside an installed package (npx kvgate build-native).
#   scripts/build-native.sh             build (incremental)
#   scripts/build-native.sh --clean     rebuild from scratch
#   scripts/build-native.sh --if-needed skip when outputs are newer than sources;
#                                       a failed build warns and exits 0 (npm pretest)
#   scripts/build-native.sh --prebuild  build, then copy the addon to prebuilds/<platform>-<arch>/
#                                       (npm prepack: the packed tarball ships it)
set -uo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
addon=native/build/Release/kvgate_native.node
stub=native/test-stub/build/libcudart_stub.so
# The same stub without cudaMemcpy2DAsync: the addon's per-row fallback is tested against it.
stub_no2d=native/test-stub/build/libcudart_stub_no2d.so

stale() { # stale OUTPUT SOURCES... : true when OUTPUT is missing or older than a source
  local out="$1"; shift
  [[ -f "$out" ]] || return 0
  [[ -n "$(find "$@" -newer "$out" -print -quit 2>/dev/null)" ]]
}

fail() { echo "build-native: $*" >&2; return 1; }

# node-gyp: the project's own (a checkout), one installed beside kvgate, or the copy
# that ships inside npm itself; never downloaded.
find_gyp() {
  local p
  p=$(node -e 'try { console.log(require.resolve("node-gyp/bin/node-gyp.js", { paths: [process.cwd()] })) } catch {}')
  if [[ -n "$p" ]]; then echo "$p"; return 0; fi
  if [[ -n "${npm_config_node_gyp:-}" && -f "${npm_config_node_gyp}" ]]; then echo "$npm_config_node_gyp"; return 0; fi
  local npm_cli
  npm_cli=$(readlink -f "$(command -v npm 2>/dev/null)" 2>/dev/null || true)
  if [[ -n "$npm_cli" ]]; then
    p="$(dirname "$(dirname "$npm_cli")")/node_modules/node-gyp/bin/node-gyp.js"
    if [[ -f "$p" ]]; then echo "$p"; return 0; fi
  fi
  return 1
}

# Every step checks its status explicitly: `set -e` does not apply inside a function
# called from a condition (`if ! build`), which let a failed build pass silently before.
build() {
  # node-gyp must never download headers: the system Node ships them under /usr.
  local nodedir="${KVGATE_NODEDIR:-}"
  if [[ -z "$nodedir" ]]; then
    for d in /usr /usr/local "$(dirname "$(dirname "$(command -v node)")")"; do
      if [[ -f "$d/include/node/node_api.h" ]]; then nodedir="$d"; break; fi
    done
  fi
  [[ -n "$nodedir" ]] ||
    fail "Node headers not found (looked for include/node/node_api.h under /usr, /usr/local and node's prefix); set KVGATE_NODEDIR" || return 1
  command -v make >/dev/null || fail "make not found (Debian: apt-get install make g++ python3)" || return 1
  command -v "${CXX:-g++}" >/dev/null || fail "${CXX:-g++} not found (Debian: apt-get install g++)" || return 1
  command -v python3 >/dev/null || fail "python3 not found (node-gyp needs it)" || return 1
  node -e 'require.resolve("node-addon-api", { paths: [process.cwd() + "/native"] })' 2>/dev/null ||
    fail "node-addon-api is not installed (npm install)" || return 1
  local gypjs
  gypjs=$(find_gyp) || fail "node-gyp not found (neither in node_modules nor inside npm)" || return 1
  if [[ "$mode" == "--clean" ]]; then rm -rf native/build native/test-stub/build; fi
  local gyp=(node "$gypjs" --nodedir="$nodedir" --directory=native)
  if [[ "$mode" == "--clean" || ! -f native/build/Makefile ]]; then
    "${gyp[@]}" configure --loglevel=warn || fail "node-gyp configure failed (output above)" || return 1
  fi
  if stale "$addon" native/src native/binding.gyp || [[ "$mode" == "--clean" ]]; then
    "${gyp[@]}" build -j "$(nproc 2>/dev/null || echo 2)" --loglevel=warn ||
      fail "node-gyp build failed (compiler output above)" || return 1
  fi
  # The stub libcudart is a test fixture: only a checkout has its source.
  local out flags
  for out in "$stub" "$stub_no2d"; do
    if [[ -f native/test-stub/cudart_stub.cc ]] && { stale "$out" native/test-stub/cudart_stub.cc || [[ "$mode" == "--clean" ]]; }; then
      mkdir -p "$(dirname "$out")" || return 1
      flags=()
      if [[ "$out" == "$stub_no2d" ]]; then flags=(-DKVGATE_STUB_NO_MEMCPY2D); fi
      "${CXX:-g++}" -std=c++17 -O2 -Wall -shared -fPIC -pthread "${flags[@]}" -o "$out.tmp" native/test-stub/cudart_stub.cc ||
        fail "building the stub libcudart ($out) failed" || return 1
      mv "$out.tmp" "$out" || return 1
    fi
  done
}

case "$mode" in
  --if-needed)
    if ! stale "$addon" native/src native/binding.gyp &&
      { [[ ! -f native/test-stub/cudart_stub.cc ]] ||
        { ! stale "$stub" native/test-stub/cudart_stub.cc && ! stale "$stub_no2d" native/test-stub/cudart_stub.cc; }; }; then
      exit 0
    fi
    if ! build; then
      echo "build-native: WARNING: the native addon was NOT built (reason above); kvgate runs without pinned L1 and O_DIRECT, and native tests report the loader error. Retry: bash scripts/build-native.sh" >&2
    fi
    exit 0
    ;;
  --prebuild)
    build || exit 1
    dest="prebuilds/$(node -p 'process.platform + "-" + process.arch')"
    mkdir -p "$dest" && cp "$addon" "$dest/kvgate_native.node" || exit 1
    # Symbols are not needed to load it: the tarball stays small.
    if command -v strip >/dev/null; then strip --strip-unneeded "$dest/kvgate_native.node" || true; fi
    echo "build-native: $dest/kvgate_native.node (ships in the packed tarball)"
    ;;
  ""|--clean)
    build || exit 1
    echo "build-native: $addon is up to date"
    ;;
  *)
    echo "build-native: unknown option '$mode' (use --clean, --if-needed or --prebuild)" >&2
    exit 2
    ;;
esac
