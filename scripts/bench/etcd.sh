#!/usr/bin/env bash
# A local etcd cluster on loopback for scripts/bench.sh (the baseline leasecore is compared with).
#   scripts/bench/etcd.sh start DIR [N]   start N members (default 3) with a fresh data dir, wait
#                                         until every member is healthy and they agree on a leader
#   scripts/bench/etcd.sh stop DIR        SIGTERM the members started in DIR (SIGKILL after
#                                         ETCD_STOP_GRACE_S, default 10 s)
#   scripts/bench/etcd.sh kill DIR I      SIGKILL member I (failover experiments)
#   scripts/bench/etcd.sh restart DIR I   start member I again from its data, same flags
#   scripts/bench/etcd.sh leader DIR      print the leader's member number (1..N)
# Member I serves clients on 127.0.0.1:ETCD_BASE_PORT+2(I-1) and peers on the next port
# (ETCD_BASE_PORT defaults to 23790). DIR receives m<I>/ (data, etcd.log, pid, cmd), endpoints
# and flags. Flags: the etcd 3.4 defaults written out (--heartbeat-interval 100
# --election-timeout 1000 --snapshot-count 100000 --quota-backend-bytes 2 GiB), log level warn;
# ETCD_EXTRA_FLAGS adds more. Only pids recorded in DIR are ever signalled.
set -euo pipefail

ETCD_BIN=${ETCD_BIN:-etcd}
BASE=${ETCD_BASE_PORT:-23790}
START_TIMEOUT_S=${ETCD_START_TIMEOUT_S:-30}

cport() { echo $((BASE + 2 * ($1 - 1))); }
pport() { echo $((BASE + 2 * ($1 - 1) + 1)); }
members() { cat "$1/size"; }

# The member's own status: prints "<member_id> <leader_id>" (decimal strings) or fails.
status_of() {
  curl -fsS -m 2 -XPOST "http://127.0.0.1:$(cport "$1")/v3/maintenance/status" -d '{}' 2>/dev/null |
    python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["header"]["member_id"], s.get("leader","0"))'
}

# Member number of the leader, if every live member agrees on one (else fails).
leader_of() {
  local dir=$1 n i lid="" mine l found=""
  n=$(members "$dir")
  for i in $(seq 1 "$n"); do
    [ -e "$dir/m$i/pid" ] || continue
    read -r mine l < <(status_of "$i") || return 1
    [ "$l" != 0 ] || return 1
    if [ -z "$lid" ]; then lid=$l; elif [ "$lid" != "$l" ]; then return 1; fi
    [ "$mine" != "$l" ] || found=$i
  done
  [ -n "$found" ] || return 1
  echo "$found"
}

start_member() {
  local dir=$1 i=$2
  # shellcheck disable=SC2046
  nohup $(cat "$dir/m$i/cmd") >>"$dir/m$i/etcd.log" 2>&1 </dev/null &
  echo $! >"$dir/m$i/pid"
}

# Poll (with a deadline) until every live member answers /health and they agree on a leader.
wait_healthy() {
  local dir=$1 deadline=$((SECONDS + START_TIMEOUT_S)) i n
  n=$(members "$dir")
  while :; do
    local ok=1
    for i in $(seq 1 "$n"); do
      [ -e "$dir/m$i/pid" ] || continue
      curl -fsS -m 1 "http://127.0.0.1:$(cport "$i")/health" 2>/dev/null | grep -q '"health":"true"' || { ok=0; break; }
    done
    if [ $ok = 1 ] && leader_of "$dir" >/dev/null; then return 0; fi
    if [ $SECONDS -ge $deadline ]; then
      echo "etcd: not healthy after ${START_TIMEOUT_S}s; see $dir/m*/etcd.log" >&2
      return 1
    fi
    sleep 0.1
  done
}

alive() {  # a zombie (exited, not yet reaped by PID 1) counts as gone
  kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null
}

stop_pid() {  # stop_pid PIDFILE: TERM, wait for the grace period, then KILL; only a pid that is etcd
  local f=$1 pid
  [ -e "$f" ] || return 0
  pid=$(cat "$f")
  if grep -qa etcd "/proc/$pid/cmdline" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 $((${ETCD_STOP_GRACE_S:-10} * 10))); do alive "$pid" || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,13p' "$0"; exit 2; }
case $cmd in
  start)
    n=${3:-3}
    rm -rf "$dir"; mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
    echo "$n" >"$dir/size"
    initial="" endpoints=""
    for i in $(seq 1 "$n"); do initial+="${initial:+,}m$i=http://127.0.0.1:$(pport "$i")"; done
    token="bench-$$-$RANDOM"
    : >"$dir/flags"
    for i in $(seq 1 "$n"); do
      mkdir -p "$dir/m$i"
      c=http://127.0.0.1:$(cport "$i") p=http://127.0.0.1:$(pport "$i")
      endpoints+="${endpoints:+,}$c"
      echo "$ETCD_BIN --name m$i --data-dir $dir/m$i/data \
--listen-client-urls $c --advertise-client-urls $c \
--listen-peer-urls $p --initial-advertise-peer-urls $p \
--initial-cluster $initial --initial-cluster-token $token --initial-cluster-state new \
--heartbeat-interval 100 --election-timeout 1000 --snapshot-count 100000 \
--quota-backend-bytes 2147483648 --logger zap --log-level warn --log-outputs stderr \
${ETCD_EXTRA_FLAGS:-}" >"$dir/m$i/cmd"
      echo "m$i: $(cat "$dir/m$i/cmd")" >>"$dir/flags"
      start_member "$dir" "$i"
    done
    echo "$endpoints" >"$dir/endpoints"
    wait_healthy "$dir"
    ;;
  stop)
    [ -e "$dir/size" ] || exit 0
    for i in $(seq 1 "$(members "$dir")"); do stop_pid "$dir/m$i/pid" & done
    wait
    ;;
  kill)
    pid=$(cat "$dir/m$3/pid")
    grep -qa etcd "/proc/$pid/cmdline" && kill -KILL "$pid"
    # reap: wait until the process is gone so that its ports are free for the restart
    while alive "$pid"; do sleep 0.01; done
    rm -f "$dir/m$3/pid"
    ;;
  restart)
    start_member "$dir" "$3"
    ;;
  wait)
    wait_healthy "$dir"
    ;;
  leader)
    leader_of "$dir"
    ;;
  *)
    sed -n '2,13p' "$0"; exit 2
    ;;
esac
