#!/usr/bin/env bash
# Expiry lateness of abandoned leases while leaders keep dying (issue 10, item 5).
#   scripts/lease-churn.sh [SECONDS] [LEASES] [TTL_MS]     (defaults 40, 200, 3000)
#   LEADER_LIFE_MS=900: each leader lives a random 0..LEADER_LIFE_MS once every node follows it.
#   CHURN=pause: SIGSTOP the leader instead of killing it, and SIGCONT it (deposed) once the
#   others have a new leader; CHURN=kill (the default) SIGKILLs and restarts it.
# Starts its own 3-node cluster (ports 7201-7203, directory .lease-churn), runs
# `leasecore bench expiry-churn` (leases registered over SECONDS, never refreshed, deletions
# seen in the nodes' applied state), and meanwhile SIGKILLs the leader 0 to LEADER_LIFE_MS after every
# node follows it, restarting the victim once the survivors have committed a write through a
# new leader: back-to-back failovers.
# Prints the lateness (deletion seen - (grant reply + ttl)) p50/p99/max, early deletions (must
# be 0) and the number of leader kills. PROFILE=release is the default here.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-40}
LEASES=${2:-200}
TTL=${3:-3000}
export PROFILE=${PROFILE:-release}
export LEASECORE_CLUSTER_DIR=${LEASECORE_CLUSTER_DIR:-.lease-churn}
export LEASECORE_BASE_PORT=${LEASECORE_BASE_PORT:-7201}
P=$LEASECORE_BASE_PORT
LEADER_LIFE_MS=${LEADER_LIFE_MS:-900}
CHURN=${CHURN:-kill}
# LEASECORE_BIN runs the servers (e.g. an older build, for a baseline); the bench client is
# always this checkout's.
BENCH_BIN=${CARGO_TARGET_DIR:-target}/$PROFILE/leasecore
rm -rf "$LEASECORE_CLUSTER_DIR"
scripts/cluster.sh start 3 >/dev/null
# A paused node must be resumed to stop cleanly.
trap 'for f in "$LEASECORE_CLUSTER_DIR"/node-*.pid; do kill -CONT "$(cat "$f")" 2>/dev/null || true; done
      scripts/cluster.sh stop >/dev/null' EXIT
EPS="http://127.0.0.1:$P,http://127.0.0.1:$((P + 1)),http://127.0.0.1:$((P + 2))"

view_of() { curl -fsS -m 1 "http://127.0.0.1:$((P + $1 - 1))/v1/cluster" 2>/dev/null; }
field() { sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p"; }
agreed_leader() {  # "LEADER TERM" once every node answers and names the same leader
  local l t v
  v=$(view_of 1) || return 1; l=$(field leader_id <<<"$v"); t=$(field term <<<"$v")
  [ -n "$l" ] && [ -n "$t" ] || return 1
  for i in 2 3; do v=$(view_of "$i") || return 1; [ "$(field leader_id <<<"$v")" = "$l" ] || return 1; done
  echo "$l $t"
}
"$BENCH_BIN" bench expiry-churn --endpoints "$EPS" --leases "$LEASES" --ttl-ms "$TTL" -d "$SECS" --json \
  >"$LEASECORE_CLUSTER_DIR/result.json" &
bench=$!
kills=0
end=$((SECONDS + SECS + 5))
while kill -0 "$bench" 2>/dev/null && [ $SECONDS -lt "$end" ]; do
  # A leader that every node follows; it lives 0 to LEADER_LIFE_MS more, then dies. The victim stays
  # down until the survivors have elected a new leader and committed a write through it.
  read -r l _ < <(agreed_leader) || { sleep 0.05; continue; }
  life=$(( (RANDOM * 32768 + RANDOM) % (LEADER_LIFE_MS + 1) ))
  sleep "$((life / 1000)).$(printf %03d $((life % 1000)))"
  if [ "$CHURN" = pause ]; then
    kill -STOP "$(cat "$LEASECORE_CLUSTER_DIR/node-$l.pid")" || continue
  else
    scripts/cluster.sh kill "$l" || continue
  fi
  echo "$(date -u +%H:%M:%S.%3N) $CHURN node $l" >>"$LEASECORE_CLUSTER_DIR/kills.log"
  kills=$((kills + 1))
  s=$(( l % 3 + 1 ))
  until curl -fsS -m 2 -XPUT "http://127.0.0.1:$((P + s - 1))/v1/kv/churn/warm" -d '{"value":"x"}' >/dev/null 2>&1; do
    [ $SECONDS -lt "$end" ] || break
    sleep 0.02
  done
  if [ "$CHURN" = pause ]; then
    kill -CONT "$(cat "$LEASECORE_CLUSTER_DIR/node-$l.pid")"
  else
    scripts/cluster.sh restart "$l"
  fi
done
wait "$bench"
echo "leader ${CHURN}s: $kills"
cat "$LEASECORE_CLUSTER_DIR/result.json"
