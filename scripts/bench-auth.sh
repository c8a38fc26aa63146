#!/usr/bin/env bash
# What authentication costs on the write path: put throughput against a 3-node cluster with
# auth off, then on (a non-root user with a readwrite grant on the prefix the bench writes),
# alternating in the same run with the same binary, and the ratio on/off.
#   scripts/bench-auth.sh [SECONDS] [CONNECTIONS]     defaults: 10 s, 64 connections
# ROUNDS=N repeats the off/on pair N times (default 3). The cluster lives in .bench/auth on
# ports 7151.. and is stopped at the end. Uses the release binary (builds it unless
# LEASECORE_BIN names one).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
conns=${2:-64}
rounds=${ROUNDS:-3}
if [ -z "${LEASECORE_BIN:-}" ]; then
  cargo build --release --quiet --bin leasecore
  target_dir=$(cargo metadata --format-version 1 --no-deps \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  export LEASECORE_BIN="$target_dir/release/leasecore"
fi
export LEASECORE_BASE_PORT=7151 LEASECORE_CLUSTER_DIR=.bench/auth
P=$LEASECORE_BASE_PORT
export LEASECORE_ENDPOINTS="http://127.0.0.1:$P,http://127.0.0.1:$((P + 1)),http://127.0.0.1:$((P + 2))"
rm -rf "$LEASECORE_CLUSTER_DIR"
scripts/cluster.sh start 3 >/dev/null
trap 'scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT
lc() { "$LEASECORE_BIN" "$@" >/dev/null; }

# Users and roles can be made while auth is off; enabling and disabling then switches.
echo rootpw | lc user add root
lc user grant-role root root
echo benchpw | lc user add bench
lc role add writer
lc role grant writer readwrite bench/ --prefix
lc user grant-role bench writer

put() {  # put [--user ...]: throughput
  "$LEASECORE_BIN" bench put -c "$conns" -d "$secs" --json "$@" \
    | sed -n 's/.*"throughput":\([0-9.]*\).*/\1/p'
}
off_sum=0 on_sum=0
for r in $(seq 1 "$rounds"); do
  off=$(put)
  lc auth enable --user root:rootpw
  on=$(put --user bench:benchpw)
  lc auth disable --user root:rootpw
  printf 'round %s  auth off %8.0f ops/s  auth on %8.0f ops/s\n' "$r" "$off" "$on"
  off_sum=$(awk -v a="$off_sum" -v b="$off" 'BEGIN { print a + b }')
  on_sum=$(awk -v a="$on_sum" -v b="$on" 'BEGIN { print a + b }')
done
awk -v on="$on_sum" -v off="$off_sum" 'BEGIN { printf "put  auth on / off throughput: %.2f\n", on / off }'
