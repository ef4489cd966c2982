#!/usr/bin/env bash
# Starts a throwaway Ceph RadosGW (one mon, one memstore OSD, one RGW) on
# loopback, in a temp dir, on free ports; creates a user and a bucket.
#
# Usage: scripts/rgw/start.sh [--bucket NAME] [--dir DIR] [--install]
# On success prints shell-style assignments on stdout (everything else goes to
# stderr), e.g.  eval "$(scripts/rgw/start.sh)"; ... ; scripts/rgw/stop.sh "$RGW_DIR"
#   RGW_ENDPOINT RGW_ACCESS_KEY RGW_SECRET_KEY RGW_BUCKET RGW_REGION RGW_DIR
# --install: apt-get install the Ceph packages when missing (needs root).
# Exit codes: 0 ready, 3 Ceph not installed (and not installable), 1 other failure.
set -euo pipefail

BUCKET=kvgate-test
DIR=
INSTALL=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bucket) BUCKET=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --install) INSTALL=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "start.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

log() { echo "rgw: $*" >&2; }

have_ceph() { command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v radosgw >/dev/null; }
if ! have_ceph; then
  if [[ $INSTALL == 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    log "installing ceph-mon ceph-osd radosgw (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # Another process may hold the dpkg lock (parallel setup): wait for it.
    apt-get -o DPkg::Lock::Timeout=300 update -qq >&2 || true
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends ceph-mon ceph-osd radosgw >&2
  fi
  if ! have_ceph; then
    log "Ceph RadosGW is not installed (apt-get install ceph-mon ceph-osd radosgw, as root)"
    exit 3
  fi
fi

[[ -n $DIR ]] || DIR=$(mktemp -d /tmp/kvgate-rgw.XXXXXX)
mkdir -p "$DIR"/{mon,osd,run,log,rgw}
CONF=$DIR/ceph.conf
FSID=$(cat /proc/sys/kernel/random/uuid)
ACCESS_KEY=kvgate$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
SECRET_KEY=$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')

# Cleans up whatever was started when we fail half-way.
fail() {
  log "failed: $*; logs in $DIR/log"
  for f in "$DIR"/log/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done
  "$(dirname "$0")/stop.sh" --keep "$DIR" >&2 || true
  exit 1
}

free_port() {
  # Binding port 0 lets the kernel pick; a tiny race remains but a retry covers it.
  python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])' 2>/dev/null ||
    node -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'
}
MON_PORT=$(free_port)
RGW_PORT=$(free_port)

cat >"$CONF" <<CONF
[global]
fsid = $FSID
mon host = v2:127.0.0.1:$MON_PORT
mon initial members = a
public addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
; with auth none every messenger mode must allow crc, or RGW loops on -13
ms mon cluster mode = crc secure
ms mon service mode = crc secure
ms mon client mode = crc secure
ms cluster mode = crc secure
ms service mode = crc secure
ms client mode = crc secure
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
; the mon data dir sits on a shared disk: do not warn / stop at 30% / 5% free
mon data avail warn = 2
mon data avail crit = 1
; pools are created one paxos round each: short rounds make startup seconds faster
paxos propose interval = 0.05
paxos min wait = 0.01
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
keyring = $DIR/keyring
[mon.a]
mon data = $DIR/mon
[osd.0]
osd data = $DIR/osd
osd objectstore = memstore
memstore device bytes = 8589934592
osd op num threads per shard = 1
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw data = $DIR/rgw
rgw thread pool size = 64
; deleted objects' tails are garbage collected after 2 h by default: in RAM
; (memstore) that fills the OSD over a few bench runs, so collect right away
rgw gc obj min wait = 0
rgw gc processor period = 5
rgw gc processor max time = 5
CONF
: >"$DIR/keyring"

log "dir $DIR, mon :$MON_PORT, rgw :$RGW_PORT"
monmaptool --create --addv a "[v2:127.0.0.1:$MON_PORT]" --fsid "$FSID" "$DIR/monmap" >/dev/null 2>&1 || fail monmaptool
ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" >/dev/null 2>&1 || fail "ceph-mon --mkfs"
ceph-mon -c "$CONF" -i a >/dev/null 2>&1 || fail "ceph-mon start"
OSD_ID=$(timeout 30 ceph -c "$CONF" osd create 2>/dev/null) || fail "ceph osd create"
ceph-osd -c "$CONF" -i "$OSD_ID" --mkfs >/dev/null 2>&1 || fail "ceph-osd --mkfs"
ceph-osd -c "$CONF" -i "$OSD_ID" >/dev/null 2>&1 || fail "ceph-osd start"
radosgw -c "$CONF" -n client.rgw >/dev/null 2>&1 || fail "radosgw start"

# RGW opens its port only after it has created its pools: wait for HTTP.
for _ in $(seq 1 240); do
  if curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$RGW_PORT/"; then break; fi
  sleep 0.25
done
curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$RGW_PORT/" || fail "rgw did not answer HTTP within 60 s"

radosgw-admin -c "$CONF" -n client.rgw user create --uid kvgate --display-name kvgate \
  --access-key "$ACCESS_KEY" --secret "$SECRET_KEY" >/dev/null 2>&1 || fail "radosgw-admin user create"

# Bucket creation over the S3 API itself (curl signs SigV4), retried while RGW settles.
ok=0
for _ in $(seq 1 40); do
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -X PUT --aws-sigv4 "aws:amz:us-east-1:s3" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" --user "$ACCESS_KEY:$SECRET_KEY" "http://127.0.0.1:$RGW_PORT/$BUCKET" || true)
  if [[ $code == 200 || $code == 409 ]]; then ok=1; break; fi
  sleep 0.25
done
[[ $ok == 1 ]] || fail "create bucket $BUCKET (last HTTP status $code)"

cat <<OUT
RGW_ENDPOINT=http://127.0.0.1:$RGW_PORT
RGW_ACCESS_KEY=$ACCESS_KEY
RGW_SECRET_KEY=$SECRET_KEY
RGW_BUCKET=$BUCKET
RGW_REGION=us-east-1
RGW_DIR=$DIR
OUT
