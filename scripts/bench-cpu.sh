#!/usr/bin/env bash
# CPU per operation: the CPU time (user + system, from /proc) that a 3-node cluster spends per
# put, summed over its nodes, under `leasecore bench put` at 64 connections. Far less sensitive
# to a shared machine's noise than throughput; compare two builds by alternating them:
#   for i in 1 2 3; do scripts/bench-cpu.sh BIN_A a$i; scripts/bench-cpu.sh BIN_B b$i; done
#   scripts/bench-cpu.sh BIN LABEL [SECONDS]       default 8 s; Linux only (reads /proc)
# The cluster runs on ports 7401.. in .bench/cpu-LABEL, loopback only, and is stopped after.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,7p' "$0"; exit 2; }
bin=$(realpath "$1") label=$2 secs=${3:-8}
export LEASECORE_BASE_PORT=7401 LEASECORE_ETCD_BASE_PORT=0 LEASECORE_BIN=$bin
export LEASECORE_CLUSTER_DIR=.bench/cpu-$label
rm -rf "$LEASECORE_CLUSTER_DIR"
scripts/cluster.sh start 3 >/dev/null
trap 'scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
ticks() {
  local t=0 f stat
  for f in "$LEASECORE_CLUSTER_DIR"/node-*.pid; do
    read -r -a stat <"/proc/$(cat "$f")/stat"
    t=$((t + stat[13] + stat[14]))
  done
  echo "$t"
}
before=$(ticks)
out=$("$bin" bench put -c 64 -d "$secs" --endpoints 127.0.0.1:7401,127.0.0.1:7402,127.0.0.1:7403 --json)
after=$(ticks)
ops=$(echo "$out" | sed -n 's/.*"ok":\([0-9]*\).*/\1/p')
hz=$(getconf CLK_TCK)
awk -v l="$label" -v t=$((after - before)) -v o="$ops" -v hz="$hz" \
  'BEGIN { printf "%s  %d puts  %.0f us CPU per put (3 nodes)\n", l, o, t * 1e6 / hz / o }'
