#!/usr/bin/env bash
# One-time setup of a fresh machine: npm packages, the native addon, and (when
# root) the Debian packages the integration suites use. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

npm ci --no-fund --no-audit

# Ceph RadosGW (a real S3) for the gateway's integration suites and bench
# (scripts/rgw/start.sh starts a throwaway one per run). Root + apt only.
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null && ! command -v radosgw >/dev/null; then
  apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
    ceph-mon ceph-osd radosgw
fi
