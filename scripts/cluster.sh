#!/usr/bin/env bash
# Run a local leasecore cluster on loopback.
#   scripts/cluster.sh start [N] [--tls]
#                                  build, then start N nodes (default 3) on 127.0.0.1:7001..
#                                  (client ports; each node's peer port is its client port + 1000;
#                                  node i serves the etcd v3 API on 127.0.0.1:2379+2(i-1), so
#                                  etcdctl's default endpoint reaches node 1);
#                                  --tls: https on the client ports and mutual TLS between peers,
#                                  with throw-away certificates from scripts/certs.sh in
#                                  $DIR/certs (clients: --cacert $DIR/certs/ca.pem)
#   scripts/cluster.sh stop        stop them (SIGTERM, then SIGKILL after 10 s)
#   scripts/cluster.sh status      show the cluster as node 1 sees it
#   scripts/cluster.sh kill ID     SIGKILL one node (for failover experiments)
#   scripts/cluster.sh restart ID  start one stopped node again from its data
#   scripts/cluster.sh clean       stop the nodes and delete the cluster's data and logs
# Data and logs live in .cluster/ (LEASECORE_CLUSTER_DIR to change). Set PROFILE=release for an
# optimized build (slower to build, faster to run), or LEASECORE_BIN=path to use a given binary.
# LEASECORE_ETCD_BASE_PORT moves the etcd ports (default 2379 with the default client ports,
# client port + 2000 otherwise); 0 turns the etcd API off.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${LEASECORE_CLUSTER_DIR:-.cluster}
PROFILE=${PROFILE:-debug}
BASE_PORT=${LEASECORE_BASE_PORT:-7001}
BIN=${LEASECORE_BIN:-${CARGO_TARGET_DIR:-target}/$PROFILE/leasecore}
if [ "$BASE_PORT" = 7001 ]; then ETCD_BASE=${LEASECORE_ETCD_BASE_PORT:-2379}
else ETCD_BASE=${LEASECORE_ETCD_BASE_PORT:-$((BASE_PORT + 2000))}; fi

build() {
  # LEASECORE_BIN names a binary built elsewhere: use it as it is.
  [ -z "${LEASECORE_BIN:-}" ] || return 0
  if ! command -v cargo >/dev/null; then
    echo "cargo is not installed: see https://rustup.rs" >&2; exit 1
  fi
  # The first build takes minutes: say so, and let cargo show its progress.
  if [ ! -x "$BIN" ]; then
    echo "building leasecore ($PROFILE; the first build takes a few minutes)..." >&2
  fi
  if [ "$PROFILE" = release ]; then cargo build --release --quiet; else cargo build --quiet; fi
}

peers() {
  local n=$1 list=""
  for i in $(seq 1 "$n"); do list="$list${list:+,}$i=127.0.0.1:$((BASE_PORT + i - 1))"; done
  echo "$list"
}

# The TLS flags of node $1 when the cluster runs with --tls (recorded in $DIR/tls).
tls_flags() {
  [ -e "$DIR/tls" ] || return 0
  local c="$DIR/certs"
  echo "--cert-file $c/node-$1.pem --key-file $c/node-$1-key.pem" \
    "--peer-cert-file $c/peer-$1.pem --peer-key-file $c/peer-$1-key.pem --peer-trusted-ca-file $c/ca.pem"
}

# The etcd API flag of node $1 (none when LEASECORE_ETCD_BASE_PORT=0).
etcd_flags() {
  [ "$ETCD_BASE" != 0 ] || return 0
  echo "--etcd-listen 127.0.0.1:$((ETCD_BASE + 2 * ($1 - 1)))"
}

scheme() { if [ -e "$DIR/tls" ]; then echo https; else echo http; fi; }
curl_tls() { if [ -e "$DIR/tls" ]; then echo "--cacert $DIR/certs/ca.pem"; fi; }

start_node() {
  local id=$1 n=$2
  mkdir -p "$DIR"
  # The peer listener binds the client port + 1000 (--peer-listen); peers find it there.
  # shellcheck disable=SC2046
  "$BIN" serve --id "$id" --listen "127.0.0.1:$((BASE_PORT + id - 1))" \
    --peer-listen "127.0.0.1:$((BASE_PORT + id - 1 + 1000))" $(tls_flags "$id") $(etcd_flags "$id") \
    --data "$DIR/node-$id" --peers "$(peers "$n")" >>"$DIR/node-$id.log" 2>&1 &
  echo $! >"$DIR/node-$id.pid"
  echo "$n" >"$DIR/size"
}

# The pids of nodes still running from an earlier start (pid files whose process is alive).
running() {
  local f pid
  for f in "$DIR"/node-*.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f")
    # A recycled pid is not our node: it must also be a `leasecore serve`.
    if kill -0 "$pid" 2>/dev/null && ps -p "$pid" -o args= 2>/dev/null | grep -q ' serve '; then
      echo "$pid"
    fi
  done
}

# Every node started by this run must still be alive: one that lost its port ("address in use")
# or refused to start has exited, and a leader answering on the port proves nothing about it.
check_alive() {
  local id pid dead=0
  for id in "$@"; do
    pid=$(cat "$DIR/node-$id.pid")
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "node $id exited; last lines of $DIR/node-$id.log:" >&2
      tail -n 5 "$DIR/node-$id.log" >&2
      rm -f "$DIR/node-$id.pid"
      dead=1
    fi
  done
  [ "$dead" = 0 ]
}

# A node answers once it has loaded its state: a moment when new, seconds with millions of keys
# (the snapshot file is read and decoded first). So: up to 120 s for node 1 to answer (sooner
# if a node exits), then up to 30 s more for a leader.
wait_ready() {
  local started=$SECONDS answered=""
  # shellcheck disable=SC2046
  until curl -fsS $(curl_tls) "$(scheme)://127.0.0.1:$BASE_PORT/v1/cluster" 2>/dev/null | grep -q '"leader_id":[0-9]'; do
    # shellcheck disable=SC2046
    if [ -z "$answered" ] && curl -fsS $(curl_tls) "$(scheme)://127.0.0.1:$BASE_PORT/livez" >/dev/null 2>&1; then
      answered=$SECONDS
    fi
    if [ -n "$answered" ] && [ $((SECONDS - answered)) -ge 30 ]; then
      echo "no leader 30 s after node 1 answered; see $DIR/*.log" >&2; exit 1
    fi
    if [ -z "$answered" ]; then
      if [ $((SECONDS - started)) -ge 120 ]; then
        echo "node 1 did not answer within 120 s; see $DIR/*.log" >&2; exit 1
      fi
      # A node that exited (a port in use, a refused data directory) will not answer: the
      # caller's check_alive says which and why.
      for f in "$DIR"/node-*.pid; do kill -0 "$(cat "$f")" 2>/dev/null || return 0; done
    fi
    sleep 0.2
  done
}

case "${1:-}" in
  start)
    shift
    n=3 tls=0
    for a in "$@"; do
      case "$a" in --tls) tls=1 ;; *) n=$a ;; esac
    done
    if [ -n "$(running)" ]; then
      echo "a cluster is already running from $DIR (pids $(running | tr '\n' ' '));" \
        "run '$0 stop' first" >&2
      exit 1
    fi
    mkdir -p "$DIR"
    if [ "$tls" = 1 ]; then
      scripts/certs.sh "$DIR/certs" "$n" >/dev/null
      touch "$DIR/tls"
    else
      rm -f "$DIR/tls"
    fi
    build
    for id in $(seq 1 "$n"); do start_node "$id" "$n"; done
    wait_ready
    if ! check_alive $(seq 1 "$n"); then
      echo "the cluster did not start cleanly; stopping the nodes that did" >&2
      "$0" stop >/dev/null
      exit 1
    fi
    echo "leasecore: $n nodes on 127.0.0.1:$BASE_PORT..$((BASE_PORT + n - 1)) (peer ports $((BASE_PORT + 1000))..$((BASE_PORT + 999 + n))); logs in $DIR/"
    if [ "$ETCD_BASE" != 0 ]; then
      echo "etcd v3 API on 127.0.0.1:$ETCD_BASE..$((ETCD_BASE + 2 * (n - 1))) (every other port): etcdctl put hello world"
    fi
    tls_opt=""; [ -e "$DIR/tls" ] && tls_opt=" $(curl_tls)"
    echo "try: curl -s$tls_opt -XPUT $(scheme)://localhost:$BASE_PORT/v1/kv/hello -d '{\"value\":\"world\"}'"
    ;;
  stop)
    for f in "$DIR"/node-*.pid; do
      [ -e "$f" ] || continue
      kill -TERM "$(cat "$f")" 2>/dev/null || true
    done
    for f in "$DIR"/node-*.pid; do
      [ -e "$f" ] || continue
      pid=$(cat "$f")
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      rm -f "$f"
    done
    echo "stopped"
    ;;
  status)
    # shellcheck disable=SC2046
    "$BIN" cluster status --endpoints "$(scheme)://127.0.0.1:$BASE_PORT" \
      $(if [ -e "$DIR/tls" ]; then echo "--cacert $DIR/certs/ca.pem"; fi)
    ;;
  kill)
    [ -n "${2:-}" ] || { echo "usage: $0 kill ID" >&2; exit 2; }
    pidfile="$DIR/node-$2.pid"
    if [ ! -e "$pidfile" ] || ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "node $2 is not running" >&2
      rm -f "$pidfile"
      exit 1
    fi
    pid=$(cat "$pidfile")
    kill -KILL "$pid" && rm -f "$pidfile"
    # Until the process is gone (a node with a large heap takes a moment to exit), so that a
    # `restart` right after finds its ports free; at most 10 s.
    for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    ;;
  clean)
    "$0" stop >/dev/null
    rm -rf "$DIR"
    echo "removed $DIR"
    ;;
  restart)
    [ -n "${2:-}" ] || { echo "usage: $0 restart ID" >&2; exit 2; }
    [ -e "$DIR/size" ] || { echo "no cluster in $DIR: run '$0 start' first" >&2; exit 1; }
    if [ -e "$DIR/node-$2.pid" ] && kill -0 "$(cat "$DIR/node-$2.pid")" 2>/dev/null; then
      echo "node $2 is already running (pid $(cat "$DIR/node-$2.pid"))" >&2
      exit 1
    fi
    start_node "$2" "$(cat "$DIR/size")"
    ;;
  *)
    sed -n '2,19p' "$0"; exit 2
    ;;
esac
