#!/usr/bin/env bash
# Do snapshots of a large state stall writes? (issue 15: "a snapshot at 1M keys does not stall
# writes: p99 during the snapshot within 2x of p99 without".)
#   scripts/bench-snapshot.sh [BIN] [SECONDS]     default target/release/leasecore, 40 s
# Rounds alternate two fresh 3-node clusters under the same put load (16 connections, 4 KiB
# values, so that the log outgrows the state and snapshots of it follow one another):
#   large: 1M keys loaded first (`bench mvcc-footprint --keys KEYS --versions 1`), so that each
#          snapshot copies, encodes and writes the whole state (about 160 MB) while puts go on;
#   small: no preload, so that the snapshots are of a small state.
# Prints each run's throughput, p50 and p99 and the snapshots the nodes built meanwhile (from
# their logs), then p99 large / small. KEYS (default 1000000), ROUNDS (default 2). Clusters live
# in .bench/snap-{large,small} on ports 7401..; loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-${CARGO_TARGET_DIR:-target}/release/leasecore}")
secs=${2:-40}
keys=${KEYS:-1000000}
rounds=${ROUNDS:-2}
export LEASECORE_BASE_PORT=7401 LEASECORE_ETCD_BASE_PORT=0 LEASECORE_BIN=$bin
root=.bench/snap
mkdir -p "$root"
eps="127.0.0.1:7401,127.0.0.1:7402,127.0.0.1:7403"

cluster() { LEASECORE_CLUSTER_DIR="$root/$1" scripts/cluster.sh "${@:2}"; }
cleanup() { cluster large stop >/dev/null 2>&1 || true; cluster small stop >/dev/null 2>&1 || true; }
trap cleanup EXIT
built() { cat "$root/$1"/node-*.log 2>/dev/null | grep -c "snapshot built" || true; }

declare -A p99sum
for r in $(seq 1 "$rounds"); do
  for side in large small; do
    rm -rf "${root:?}/$side"
    cluster "$side" start 3 >/dev/null
    if [ "$side" = large ]; then
      "$bin" bench mvcc-footprint --keys "$keys" --versions 1 --endpoints "$eps" >/dev/null
    fi
    before=$(built "$side")
    read -r o p50 p < <("$bin" bench put -c 16 -d "$secs" --value-size 4096 --endpoints "$eps" --json \
      | sed -n 's/.*"throughput":\([0-9.]*\).*"p50_ms":\([0-9.]*\),"p99_ms":\([0-9.]*\).*/\1 \2 \3/p')
    snaps=$(( $(built "$side") - before ))
    printf 'round %s  %-5s  %7.0f puts/s  p50 %6.2f ms  p99 %7.2f ms  snapshots built meanwhile: %s\n' \
      "$r" "$side" "$o" "$p50" "$p" "$snaps"
    p99sum[$side]=$(awk -v a="${p99sum[$side]:-0}" -v b="$p" 'BEGIN { print a + b }')
    cluster "$side" stop >/dev/null
  done
done
awk -v l="${p99sum[large]}" -v s="${p99sum[small]}" \
  'BEGIN { printf "p99 with %s-key snapshots / without: %.2f (goal: at most 2)\n", "'"$keys"'", l / s }'
