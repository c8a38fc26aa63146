#!/usr/bin/env bash
# Measure leader failover: SIGKILL the leader of a local 3-node cluster, time until the first
# successful write through a surviving node, restart the victim, repeat.
#   scripts/failover.sh [ROUNDS]      (default 20; PROFILE=release for an optimized build)
# Prints one line per kill and min/median/max at the end. Uses its own ports (7101-7103) and
# directory, so it does not disturb a cluster started with scripts/cluster.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-20}
export LEASECORE_CLUSTER_DIR=${LEASECORE_CLUSTER_DIR:-.failover}
export LEASECORE_BASE_PORT=${LEASECORE_BASE_PORT:-7101}
P=$LEASECORE_BASE_PORT
rm -rf "$LEASECORE_CLUSTER_DIR"
scripts/cluster.sh start 3 >/dev/null
trap 'scripts/cluster.sh stop >/dev/null' EXIT

now_ms() { date +%s%3N; }
leader() {
  curl -fsS "http://127.0.0.1:$P/v1/cluster" 2>/dev/null | sed -n 's/.*"leader_id":\([0-9]*\).*/\1/p' ||
  curl -fsS "http://127.0.0.1:$((P + 1))/v1/cluster" | sed -n 's/.*"leader_id":\([0-9]*\).*/\1/p'
}
healthy() {  # every node answers and agrees on a leader
  local l; l=$(leader) || return 1
  [ -n "$l" ] || return 1
  for i in 0 1 2; do
    curl -fsS "http://127.0.0.1:$((P + i))/v1/cluster" 2>/dev/null | grep -q "\"leader_id\":$l" || return 1
  done
}

times=()
for round in $(seq 1 "$ROUNDS"); do
  deadline=$((SECONDS + 60))
  until healthy; do [ $SECONDS -lt $deadline ] || { echo "cluster not healthy" >&2; exit 1; }; sleep 0.1; done
  victim=$(leader)
  survivor=$(( victim % 3 + 1 ))
  curl -fsS -XPUT "http://127.0.0.1:$((P + survivor - 1))/v1/kv/failover/warm" -d '{"value":"x"}' >/dev/null
  t0=$(now_ms)
  scripts/cluster.sh kill "$victim"
  until curl -fsS -m 10 -XPUT "http://127.0.0.1:$((P + survivor - 1))/v1/kv/failover/$round" \
        -d '{"value":"x"}' >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { echo "no write within 60 s" >&2; exit 1; }
    sleep 0.01
  done
  t=$(( $(now_ms) - t0 ))
  times+=("$t")
  echo "kill $round: leader $victim down, first write after ${t} ms (new leader $(curl -fsS "http://127.0.0.1:$((P + survivor - 1))/v1/cluster" | sed -n 's/.*"leader_id":\([0-9]*\).*/\1/p'))"
  scripts/cluster.sh restart "$victim"
done
sorted=$(printf '%s\n' "${times[@]}" | sort -n)
n=${#times[@]}
echo "failover over $n kills: min $(echo "$sorted" | head -1) ms, median $(echo "$sorted" | sed -n "$(( (n + 1) / 2 ))p") ms, max $(echo "$sorted" | tail -1) ms"
