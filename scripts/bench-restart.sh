#!/usr/bin/env bash
# How long does a node holding a large state take to serve again after kill -9? (issue 15: "a
# node with 1M keys restarts and serves in under 5 s".)
#   scripts/bench-restart.sh [BIN]        default target/release/leasecore
# A fresh 3-node cluster on 127.0.0.1:7501.. loads KEYS keys (default 1000000, one version each,
# `bench mvcc-footprint`: 128 puts to a transaction), then puts go on for a few seconds so that
# the log holds entries past the last snapshot. A follower is killed with SIGKILL and started
# again from its data; the time from its start to `/readyz` answering 200 is printed, ROUNDS
# times (default 3), with the data directory's size and what the node logged of its recovery.
# Loopback only; the cluster lives in .bench/restart and is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-${CARGO_TARGET_DIR:-target}/release/leasecore}")
keys=${KEYS:-1000000}
rounds=${ROUNDS:-3}
export LEASECORE_BASE_PORT=7501 LEASECORE_ETCD_BASE_PORT=0 LEASECORE_BIN=$bin
export LEASECORE_CLUSTER_DIR=.bench/restart
eps="127.0.0.1:7501,127.0.0.1:7502,127.0.0.1:7503"
trap 'scripts/cluster.sh stop >/dev/null 2>&1 || true' EXIT

now_ms() { date +%s%3N; }
# The leader as node 1 sees it (`cluster.sh start` has waited until there is one).
leader() {
  curl -fsS "http://127.0.0.1:7501/v1/cluster" | sed -n 's/.*"leader_id":\([0-9]*\).*/\1/p'
}

rm -rf "$LEASECORE_CLUSTER_DIR"
scripts/cluster.sh start 3 >/dev/null
"$bin" bench mvcc-footprint --keys "$keys" --versions 1 --endpoints "$eps" >/dev/null
"$bin" bench put -c 16 -d 3 --value-size 256 --endpoints "$eps" >/dev/null
lead=$(leader)
victim=$(( lead % 3 + 1 ))
port=$(( 7500 + victim ))
echo "leader: node $lead; restarting node $victim (${keys} keys loaded)"
for r in $(seq 1 "$rounds"); do
  scripts/cluster.sh kill "$victim" >/dev/null
  size=$(du -sm "$LEASECORE_CLUSTER_DIR/node-$victim" | cut -f1)
  start=$(now_ms)
  scripts/cluster.sh restart "$victim" >/dev/null
  deadline=$(( start + 60000 ))
  until curl -sf -o /dev/null "http://127.0.0.1:$port/readyz"; do
    if [ "$(now_ms)" -gt "$deadline" ]; then
      echo "round $r: node $victim not ready within 60 s" >&2
      exit 1
    fi
    sleep 0.02
  done
  took=$(( $(now_ms) - start ))
  printf 'round %s: node %s served (/readyz 200) %d ms after its start; data directory %s MB\n' \
    "$r" "$victim" "$took" "$size"
  # More puts, so that the next round replays entries too.
  "$bin" bench put -c 16 -d 2 --value-size 256 --endpoints "$eps" >/dev/null
done
# What each start spent loading the state (the snapshot, then the events after it).
grep -h "state loaded" "$LEASECORE_CLUSTER_DIR/node-$victim.log" | tail -"$rounds" || true
