#!/usr/bin/env bash
# Memory under etcd's own data-scale check, leasecore against etcd 3.4 in the same run:
#   scripts/bench-memory.sh [ROUNDS]        default 1 round of each
# Each round starts a fresh 3-node leasecore cluster (its etcd API on 127.0.0.1:9651..9655),
# runs `etcdctl check datascale --load $LOAD` (default m: 100,000 puts of 537-byte binary keys
# with 512-byte values from 200 clients, then one delete of them all) against it, and stops it;
# then the same against a fresh etcd cluster (scripts/bench/etcd.sh, 127.0.0.1:12379..).
# Prints what datascale reports (the first endpoint's resident memory after the puts minus
# before) and every node's peak resident memory (VmHWM, the delete included).
# LEASECORE_BIN (default target/release/leasecore, built if missing); etcd and etcdctl from
# PATH (Debian: etcd-server, etcd-client). Loopback only; the data lives in .bench/memory.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
load=${LOAD:-m}
bin=${LEASECORE_BIN:-${CARGO_TARGET_DIR:-target}/release/leasecore}
root=.bench/memory
for tool in etcd etcdctl; do
  command -v "$tool" >/dev/null || { echo "$tool not found (Debian: apt-get install etcd-server etcd-client)" >&2; exit 1; }
done
[ -x "$bin" ] || cargo build --release --quiet
bin=$(realpath "$bin")
mkdir -p "$root"

lc() { LEASECORE_BASE_PORT=7651 LEASECORE_ETCD_BASE_PORT=9651 LEASECORE_BIN=$bin \
  LEASECORE_CLUSTER_DIR="$root/leasecore" scripts/cluster.sh "$@"; }
etcd_ctl() { ETCD_BASE_PORT=12379 scripts/bench/etcd.sh "$@"; }
cleanup() { lc stop >/dev/null 2>&1 || true; etcd_ctl stop "$root/etcd" >/dev/null 2>&1 || true; }
trap cleanup EXIT

# The peak resident memory of each pid, in MB.
peaks() { for p in "$@"; do awk '/VmHWM/ { printf " %d", $2 / 1024 }' "/proc/$p/status"; done; }

# Run datascale against $1 (comma-separated endpoints): print its report, MB.
datascale() {
  etcdctl --endpoints="$1" check datascale --load "$load" 2>&1 | tr '\r' '\n' |
    sed -n 's/.*Approximate system memory used : \([0-9.]*\) MB.*/\1/p'
}

# Wait until $1 answers a linearizable read through the etcd API (a leader is elected).
ready() {
  for _ in $(seq 1 150); do
    etcdctl --endpoints="$1" get ready --command-timeout=1s >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "no answer from $1" >&2; return 1
}

for r in $(seq 1 "$rounds"); do
  rm -rf "${root:?}/leasecore"
  lc start 3 >/dev/null
  eps=127.0.0.1:9651,127.0.0.1:9653,127.0.0.1:9655
  ready "$eps"
  mb=$(datascale "$eps")
  pids=$(cat "$root"/leasecore/node-*.pid)
  printf 'round %s  leasecore  datascale %8s MB  peak RSS per node (MB):%s\n' "$r" "${mb:-?}" "$(peaks $pids)"
  lc stop >/dev/null

  rm -rf "${root:?}/etcd"
  etcd_ctl start "$root/etcd" 3 >/dev/null
  eps=$(cat "$root/etcd/endpoints")
  mb=$(datascale "$eps")
  pids=$(cat "$root"/etcd/m*/pid)
  printf 'round %s  etcd       datascale %8s MB  peak RSS per node (MB):%s\n' "$r" "${mb:-?}" "$(peaks $pids)"
  etcd_ctl stop "$root/etcd" >/dev/null
done
