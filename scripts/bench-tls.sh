#!/usr/bin/env bash
# What TLS costs: put and linearizable get against a 3-node cluster with TLS off, then on
# (client TLS + mutual peer TLS), in the same run with the same binary, and the ratio on/off.
#   scripts/bench-tls.sh [SECONDS] [CONNECTIONS]     defaults: 10 s, 64 connections
# Uses the release binary (builds it unless LEASECORE_BIN names one). ROUNDS=N repeats the
# off/on pair N times (default 1). Clusters live in .bench/tls-{off,on} on ports 7101.. and
# are stopped at the end. Needs openssl (scripts/certs.sh) and curl.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
conns=${2:-64}
rounds=${ROUNDS:-1}
if [ -z "${LEASECORE_BIN:-}" ]; then
  cargo build --release --quiet --bin leasecore
  target_dir=$(cargo metadata --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  export LEASECORE_BIN="$target_dir/release/leasecore"
fi
export LEASECORE_BASE_PORT=7101
root=.bench/tls
mkdir -p "$root"

cluster() { LEASECORE_CLUSTER_DIR="$root/$1" scripts/cluster.sh "${@:2}"; }
cleanup() { cluster off stop >/dev/null 2>&1 || true; cluster on stop >/dev/null 2>&1 || true; }
trap cleanup EXIT

# bench MODE WORKLOAD: one run's throughput, p50 and p99 as "ops p50 p99".
bench() {
  local mode=$1 workload=$2 eps="" tls=()
  for i in 1 2 3; do eps="$eps${eps:+,}127.0.0.1:$((LEASECORE_BASE_PORT + i - 1))"; done
  if [ "$mode" = on ]; then
    tls=(--cacert "$root/on/certs/ca.pem")
    eps=$(echo "$eps" | sed 's#\([^,]*\)#https://\1#g')
  fi
  "$LEASECORE_BIN" bench "$workload" -c "$conns" -d "$secs" --endpoints "$eps" "${tls[@]}" --json \
    | sed -n 's/.*"throughput":\([0-9.]*\).*"p50_ms":\([0-9.]*\),"p99_ms":\([0-9.]*\).*/\1 \2 \3/p'
}

declare -A sum
for r in $(seq 1 "$rounds"); do
  for mode in off on; do
    rm -rf "${root:?}/$mode"
    if [ "$mode" = on ]; then cluster on start 3 --tls >/dev/null; else cluster off start 3 >/dev/null; fi
    for w in put get; do
      read -r ops p50 p99 < <(bench "$mode" "$w")
      printf 'round %s  TLS %-3s  %-4s  %8.0f ops/s  p50 %6.2f ms  p99 %6.2f ms\n' "$r" "$mode" "$w" "$ops" "$p50" "$p99"
      sum[$mode-$w]=$(awk -v a="${sum[$mode-$w]:-0}" -v b="$ops" 'BEGIN { print a + b }')
    done
    cluster "$mode" stop >/dev/null
  done
done
for w in put get; do
  off=${sum[off-$w]} on=${sum[on-$w]}
  awk -v w="$w" -v on="$on" -v off="$off" 'BEGIN { printf "%-4s  TLS on / off throughput: %.2f\n", w, on / off }'
done
