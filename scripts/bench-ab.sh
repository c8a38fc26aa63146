#!/usr/bin/env bash
# Two builds of leasecore, A and B, under the same load in the same run: for what one change
# costs or gains (MVCC history, a storage change...). Each round starts a fresh 3-node cluster
# of A, measures every workload, stops it, then does the same for B; rounds alternate A B A B.
#   scripts/bench-ab.sh BIN_A BIN_B [SECONDS]        default 10 s per workload
# WORKLOADS (default "put:1 put:16 put:64"): `leasecore bench` workloads with their connection
# counts. BENCH_ARGS: more `leasecore bench` flags for every run (e.g. "--keys 1000000").
# ROUNDS (default 3). Clusters live in .bench/ab-{a,b} on ports 7301..; loopback only.
# Prints each run, then per workload the mean throughput and p99 of each, and B / A.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,9p' "$0"; exit 2; }
bin_a=$(realpath "$1") bin_b=$(realpath "$2")
secs=${3:-10}
rounds=${ROUNDS:-3}
workloads=${WORKLOADS:-put:1 put:16 put:64}
export LEASECORE_BASE_PORT=7301 LEASECORE_ETCD_BASE_PORT=0
root=.bench/ab
mkdir -p "$root"

cluster() { LEASECORE_BIN=$2 LEASECORE_CLUSTER_DIR="$root/$1" scripts/cluster.sh "${@:3}"; }
cleanup() { cluster a "$bin_a" stop >/dev/null 2>&1 || true; cluster b "$bin_b" stop >/dev/null 2>&1 || true; }
trap cleanup EXIT

eps="127.0.0.1:7301,127.0.0.1:7302,127.0.0.1:7303"
declare -A ops p99
for r in $(seq 1 "$rounds"); do
  for side in a b; do
    bin=$bin_a; [ "$side" = b ] && bin=$bin_b
    rm -rf "${root:?}/$side"
    cluster "$side" "$bin" start 3 >/dev/null
    for w in $workloads; do
      name=${w%%:*} conns=${w##*:}
      read -r o p50 p < <("$bin_a" bench "$name" -c "$conns" -d "$secs" ${BENCH_ARGS:-} --endpoints "$eps" --json \
        | sed -n 's/.*"throughput":\([0-9.]*\).*"p50_ms":\([0-9.]*\),"p99_ms":\([0-9.]*\).*/\1 \2 \3/p')
      printf 'round %s  %s  %-10s  %8.0f ops/s  p50 %6.2f ms  p99 %6.2f ms\n' "$r" "$side" "$w" "$o" "$p50" "$p"
      ops[$side-$w]=$(awk -v a="${ops[$side-$w]:-0}" -v b="$o" 'BEGIN { print a + b }')
      p99[$side-$w]=$(awk -v a="${p99[$side-$w]:-0}" -v b="$p" 'BEGIN { print a + b }')
    done
    cluster "$side" "$bin" stop >/dev/null
  done
done
for w in $workloads; do
  awk -v w="$w" -v n="$rounds" -v oa="${ops[a-$w]}" -v ob="${ops[b-$w]}" -v pa="${p99[a-$w]}" -v pb="${p99[b-$w]}" \
    'BEGIN { printf "%-10s  A %8.0f ops/s p99 %6.2f ms | B %8.0f ops/s p99 %6.2f ms | B/A throughput %.2f\n", w, oa/n, pa/n, ob/n, pb/n, ob/oa }'
done
