#!/usr/bin/env bash
# Stops a RadosGW started by start.sh (by the pid files in its dir) and removes
# the dir. Usage: scripts/rgw/stop.sh [--keep] DIR   (--keep leaves the dir, for logs)
set -uo pipefail
KEEP=0
if [[ ${1:-} == --keep ]]; then KEEP=1; shift; fi
DIR=${1:?usage: stop.sh [--keep] DIR}
[[ -f $DIR/ceph.conf ]] || { echo "stop.sh: $DIR is not an RGW dir" >&2; exit 2; }

pids=()
for name in client.rgw osd.0 mon.a; do
  f=$DIR/run/$name.pid
  [[ -f $f ]] || continue
  pid=$(cat "$f")
  # Only signal a process that still runs out of this dir's config (pid reuse).
  if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$DIR/ceph.conf"; then
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
  fi
done
for _ in $(seq 1 50); do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [[ $alive == 0 ]] && break
  sleep 0.1
done
for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
[[ $KEEP == 1 ]] || rm -rf "$DIR"
exit 0
