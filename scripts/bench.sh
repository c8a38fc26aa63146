#!/usr/bin/env bash
# The benchmark suite: leasecore against etcd 3.4 on this machine, in one run, with the same load
# generator (wrk + scripts/bench/wrk.lua) and the same connection counts, on loopback only.
#
#   scripts/bench.sh [--smoke] [--write] [--reps N] [--duration S] [--only W1,W2,...]
#
# Throughput workloads (leasecore and etcd alternately, A B A B, over --reps repetitions of
# --duration seconds; a FRESH cluster of each system for every single run, the other system
# stopped meanwhile; wrk -t1 -cN --timeout 5s, 256-byte values):
#   put (1, 16, 64 connections), get (linearizable, 64), get-local (local / serializable, 64),
#   lease-grant (register / grant, 64), lease-refresh (refresh / keepalive, 64),
#   put-follower (put sent to a follower, 64)
# Every response is checked (status and body), and after each write workload the stored keys
# (or leases) are counted on the system itself: stored >= acknowledged and the excess <= the
# connection count (requests in flight when wrk stopped), or the run FAILS.
# leasecore only (leasecore bench --json): flease (Flease acquire vs Raft lease register at 64,
#   same cluster, same target; PaxosLease too), flease-contended (16; PaxosLease too), watch
#   (wake-up latency at 1,000 and 10,000 watchers: a long poll each, an SSE stream each, and
#   spread over 10 multi-watch streams), flease-memory (per idle resource at 1,000,000, Flease
#   and PaxosLease; the nodes run with a 120 s lease time, BENCH_FLEASE_LEASE_MS, so that no
#   cell is collected meanwhile, and Flease answers only after as long on a fresh cluster)
# etcd-api: etcd's v3 gRPC API of both systems (leasecore's --etcd-listen, etcd itself) driven by
#   one gRPC client, `leasecore bench --etcd LEADER W -c 64 --json` (a channel per connection, one
#   request in flight each; tonic clients generated from etcd's protos): put, range (linearizable),
#   range-serializable, txn (compare-and-set), lease-grant, lease-keepalive (a stream each), A B
#   A B on fresh clusters as above. Every response is checked and, after put/txn/lease-grant, the
#   client looks for the writes in the store (put: keys under the run's prefix, acknowledged <=
#   stored <= acknowledged + failed; txn: the versions of its keys, the same; lease-grant: every
#   acknowledged lease listed). Needs only etcd (not wrk). The summary's table gives leasecore / etcd,
#   and the servers' CPU time per request (3 nodes, from /proc), which a shared machine's noise
#   moves far less than throughput.
# Both systems, own tools: expiry (lateness at 10,000 leases, TTL 5 s, one key each; per rep),
#   memory (RSS per node at 100,000 leases with one key each), failover (kill -9 of the leader
#   until the first successful write, 20 kills; leasecore through scripts/failover.sh).
# Workload names for --only: put get get-local lease-grant lease-refresh put-follower etcd-api
#   flease flease-contended watch expiry memory flease-memory failover
#   (e.g. scripts/bench.sh --only etcd-api --reps 2)
#
# --smoke: leasecore only, one cluster, 2 s per workload, small counts (the test suite runs it
#   through tests/bench_smoke.rs); uses wrk when installed, else `leasecore bench`. Exits non-zero
#   if any workload fails a response, has no success, or fails its stored-count check.
# --write: also write BENCHMARKS.md and bench/throughput.svg at the repository root.
#
# Missing etcd-server / wrk are installed with apt-get (and the script says so); when that is
# impossible etcd is skipped (and the script says so). Output: .bench/<timestamp>/ with
# results.jsonl (raw, one JSON line per run), summary.md, machine.json, flags.txt, logs.
# Env: LEASECORE_BIN (default: cargo build --release), BENCH_LEASECORE_PORT (7201: 7201-7203),
#   BENCH_ETCD_PORT (23790: 23790-23795), BENCH_RUN_DIR, BENCH_KEYSPACE (1000 preloaded keys),
#   BENCH_FAILOVER_KILLS (20), BENCH_INSTALL=0 (never install), BENCH_DRIVER=leasecore-bench
#   (use `leasecore bench` even where wrk is installed: the smoke mode's fallback).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
HERE=$ROOT/scripts/bench
CTL=(python3 "$HERE/benchctl.py")

SMOKE=0 WRITE=0 REPS=3 DURATION=10 ONLY=""
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --write) WRITE=1 ;;
    --reps) REPS=$2; shift ;;
    --duration) DURATION=$2; shift ;;
    --only) ONLY=$2; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case $REPS in ''|*[!0-9]*|0) echo "--reps needs a positive integer" >&2; exit 2 ;; esac
case $DURATION in ''|*[!0-9]*|0) echo "--duration needs a positive whole number of seconds" >&2; exit 2 ;; esac
if [ $SMOKE = 1 ] && [ $WRITE = 1 ]; then echo "--write publishes a full run: not with --smoke" >&2; exit 2; fi
ALL_WORKLOADS="put get get-local lease-grant lease-refresh put-follower etcd-api flease flease-contended watch expiry memory flease-memory failover"
for w in ${ONLY//,/ }; do
  case " $ALL_WORKLOADS " in *" $w "*) ;; *) echo "unknown workload $w; known: $ALL_WORKLOADS" >&2; exit 2 ;; esac
done
wanted() { [ -z "$ONLY" ] || case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# ------------------------------------------------------------------ settings
LC_PORT=${BENCH_LEASECORE_PORT:-7201}
ETCD_PORT=${BENCH_ETCD_PORT:-23790}
KEYSPACE=${BENCH_KEYSPACE:-1000}
CONNS=64 PUT_CONNS="1 16 64" LEASE_TTL_S=60 REFRESH_TTL_S=30
WATCHERS="1000 10000" WATCH_EVENTS=20 EXP_LEASES=10000 EXP_TTL_MS=5000 EXP_CONNS=16
MEM_LEASES=100000 FLEASE_RESOURCES=1000000 KILLS=${BENCH_FAILOVER_KILLS:-20} FRESH=1
if [ $SMOKE = 1 ]; then
  REPS=1 DURATION=2 CONNS=16 PUT_CONNS=16 KEYSPACE=${BENCH_KEYSPACE:-200}
  WATCHERS=200 WATCH_EVENTS=5 EXP_LEASES=200 EXP_TTL_MS=2000 EXP_CONNS=8
  MEM_LEASES=2000 FLEASE_RESOURCES=2000 KILLS=${BENCH_FAILOVER_KILLS:-1} FRESH=0
fi
RUN_DIR=${BENCH_RUN_DIR:-$ROOT/.bench/$(date +%Y%m%d-%H%M%S)$([ $SMOKE = 1 ] && echo -smoke || true)}
case $RUN_DIR in *' '*) echo "the run directory must not contain spaces: $RUN_DIR" >&2; exit 2 ;; esac
mkdir -p "$RUN_DIR"
RESULTS=$RUN_DIR/results.jsonl
: >"$RESULTS"
FAILURES=()
log() { echo "[bench $(date +%H:%M:%S)] $*" >&2; }
fail() { FAILURES+=("$*"); echo "[bench] FAILED: $*" >&2; }

# ------------------------------------------------------------------ tools
for t in python3 curl; do
  command -v $t >/dev/null || { echo "bench.sh needs $t" >&2; exit 1; }
done
install_pkgs() {  # apt-get install PKG...; says what it does; fails if impossible
  if [ "${BENCH_INSTALL:-1}" = 0 ]; then return 1; fi
  if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then return 1; fi
  log "installing $* with apt-get (Debian packages)"
  apt-get install -y --no-install-recommends "$@" >"$RUN_DIR/apt.log" 2>&1 ||
    { apt-get update >>"$RUN_DIR/apt.log" 2>&1 && apt-get install -y --no-install-recommends "$@" >>"$RUN_DIR/apt.log" 2>&1; }
}
ETCD=0
if [ $SMOKE = 0 ]; then
  missing=()
  command -v wrk >/dev/null || missing+=(wrk)
  command -v etcd >/dev/null || missing+=(etcd-server)
  if [ ${#missing[@]} -gt 0 ] && [ "${BENCH_INSTALL:-1}" = 0 ]; then
    log "missing ${missing[*]}; not installing (BENCH_INSTALL=0)"
  elif [ ${#missing[@]} -gt 0 ] && ! install_pkgs "${missing[@]}"; then
    log "could not install ${missing[*]} (needs root, apt-get and Debian's package archive; see $RUN_DIR/apt.log)"
  fi
  if command -v etcd >/dev/null && command -v wrk >/dev/null; then
    ETCD=1
  else
    log "ETCD IS SKIPPED$(command -v etcd >/dev/null && echo ' (but not in etcd-api)'): $(command -v etcd >/dev/null || echo 'etcd is not installed; ')$(command -v wrk >/dev/null || echo 'wrk is not installed')"
  fi
fi
# The etcd-api group drives etcd with `leasecore bench --etcd`: it needs etcd only.
ETCD_API=0
if [ $SMOKE = 0 ] && command -v etcd >/dev/null; then ETCD_API=1; fi
if [ -n "${BENCH_DRIVER:-}" ]; then DRIVER=$BENCH_DRIVER   # wrk | leasecore-bench (for testing the fallback)
elif command -v wrk >/dev/null; then DRIVER=wrk; else DRIVER=leasecore-bench; fi
[ "$DRIVER" = leasecore-bench ] || [ "$DRIVER" = wrk ] || { echo "BENCH_DRIVER must be wrk or leasecore-bench" >&2; exit 2; }
[ "$DRIVER" = leasecore-bench ] && [ $ETCD = 1 ] && { log "ETCD IS SKIPPED: etcd is only driven with wrk"; ETCD=0; }
log "throughput driver: $DRIVER$([ $DRIVER = wrk ] || echo ' (wrk is not installed: falling back to leasecore bench)')"
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true   # 10,000 watchers need as many descriptors

if [ -n "${LEASECORE_BIN:-}" ]; then
  BIN=$LEASECORE_BIN
else
  log "building leasecore (cargo build --release)"
  cargo build --release --quiet
  BIN=${CARGO_TARGET_DIR:-target}/release/leasecore
fi
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
[ -x "$BIN" ] || { echo "no leasecore binary at $BIN" >&2; exit 1; }
export LEASECORE_BIN=$BIN

# ------------------------------------------------------------------ clusters
LC_ENDPOINTS="http://127.0.0.1:$LC_PORT,http://127.0.0.1:$((LC_PORT + 1)),http://127.0.0.1:$((LC_PORT + 2))"
ETCD_ENDPOINTS="http://127.0.0.1:$ETCD_PORT,http://127.0.0.1:$((ETCD_PORT + 2)),http://127.0.0.1:$((ETCD_PORT + 4))"
LC_DIR="" ETCD_DIR=""   # the running cluster of each system (empty: none)
LEADER="" FOLLOWER=""   # of the cluster just started

# lease-grant registers 60 s leases at up to 20,000 a second for 10 s: more than the default
# --max-leases (200,000), whose 429s would be counted as failures. etcd has no such quota, so
# leasecore runs with one the workload cannot reach.
LC_MAX_LEASES=2000000
lc_cluster() { LEASECORE_MAX_LEASES=$LC_MAX_LEASES LEASECORE_CLUSTER_DIR=$LC_DIR LEASECORE_BASE_PORT=$LC_PORT "$ROOT/scripts/cluster.sh" "$@"; }
# leasecore's etcd API: scripts/cluster.sh puts node i's on client port + 2000 + (i - 1).
lc_etcd_ports() { echo $((LC_PORT + 2000)) $((LC_PORT + 2002)) $((LC_PORT + 2004)); }
etcd_api_of() {  # etcd_api_of SYSTEM URL: the etcd API endpoint (host:port) of that node
  local port=${2##*:}
  if [ "$1" = leasecore ]; then echo "127.0.0.1:$((LC_PORT + 2000 + 2 * (port - LC_PORT)))"; else echo "127.0.0.1:$port"; fi
}

find_leader() {  # find_leader SYSTEM: sets LEADER and FOLLOWER, polling until all agree
  local sys=$1 eps deadline=$((SECONDS + 30)) out
  [ "$sys" = leasecore ] && eps=$LC_ENDPOINTS || eps=$ETCD_ENDPOINTS
  until out=$("${CTL[@]}" leader --system "$sys" --endpoints "$eps" 2>/dev/null) && agree "$sys" "${out%%$'\n'*}"; do
    [ $SECONDS -lt $deadline ] || { echo "$sys: no agreed leader within 30 s" >&2; return 1; }
    sleep 0.1
  done
  LEADER=${out%%$'\n'*} FOLLOWER=${out##*$'\n'}
}
agree() {  # every leasecore node names the same leader (etcd.sh start already checks etcd)
  [ "$1" = leasecore ] || return 0
  local views
  views=$(for p in 0 1 2; do curl -fsS -m 2 "http://127.0.0.1:$((LC_PORT + p))/v1/cluster" | grep -o '"leader_id":[0-9][0-9]*'; done) || return 1
  [ "$(wc -l <<<"$views")" = 3 ] && [ "$(sort -u <<<"$views" | wc -l)" = 1 ]
}

start_system() {  # start_system SYSTEM NAME: a fresh 3-node cluster in $RUN_DIR/NAME
  local sys=$1 name=$2
  stop_system leasecore; stop_system etcd
  if [ "$sys" = leasecore ]; then
    # A node started late can find its two peers already agreed on a leader and refuse to join
    # with an empty data dir (see its log): start the whole fresh cluster again, at most twice.
    local attempt
    for attempt in 1 2 3; do
      "${CTL[@]}" ports-free "$LC_PORT" "$((LC_PORT + 1))" "$((LC_PORT + 2))" $(lc_etcd_ports)
      LC_DIR=$RUN_DIR/$name; rm -rf "$LC_DIR"
      if lc_cluster start 3 >/dev/null && find_leader leasecore; then return 0; fi
      [ $attempt -lt 3 ] || return 1
      log "leasecore: the fresh cluster $name did not come up whole (attempt $attempt; logs kept in $name.failed-$attempt); starting it again"
      stop_system leasecore
      rm -rf "$RUN_DIR/$name.failed-$attempt"; mv "$RUN_DIR/$name" "$RUN_DIR/$name.failed-$attempt"
      echo "leasecore: cluster $name restarted after a failed start (attempt $attempt)" >>"$RUN_DIR/flags.txt"
    done
  else
    "${CTL[@]}" ports-free $(seq "$ETCD_PORT" "$((ETCD_PORT + 5))")
    ETCD_DIR=$RUN_DIR/$name
    ETCD_BASE_PORT=$ETCD_PORT "$HERE/etcd.sh" start "$ETCD_DIR" 3
  fi
  find_leader "$sys"
}
stop_system() {  # stop_system SYSTEM: stop it if it runs; keep the logs, drop the data
  if [ "$1" = leasecore ] && [ -n "$LC_DIR" ]; then
    stop_pids "$LC_DIR"/node-*.pid
    rm -rf "$LC_DIR"/node-[0-9]
    LC_DIR=""
  elif [ "$1" = etcd ] && [ -n "$ETCD_DIR" ]; then
    # its data is deleted next, so a short grace: a member that has not stopped after 2 s is
    # killed (etcd members stopping together can take 8 s otherwise)
    ETCD_STOP_GRACE_S=2 ETCD_BASE_PORT=$ETCD_PORT "$HERE/etcd.sh" stop "$ETCD_DIR" || true
    rm -rf "$ETCD_DIR"/m*/data
    ETCD_DIR=""
  fi
}
alive() {  # a zombie (exited, not yet reaped) counts as gone
  kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null
}
stop_pids() {  # stop_pids PIDFILE...: SIGTERM, up to 10 s to exit, then SIGKILL (as cluster.sh stop)
  local f pid pids=()
  for f in "$@"; do [ -e "$f" ] && pids+=("$(cat "$f")") && rm -f "$f"; done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do alive "$pid" || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}
cleanup() {
  set +e
  stop_system leasecore; stop_system etcd
}
trap cleanup EXIT
trap 'exit 130' INT TERM

pids_of() {  # pids_of SYSTEM: the pids of the running cluster's processes
  if [ "$1" = leasecore ]; then cat "$LC_DIR"/node-*.pid; else cat "$ETCD_DIR"/m*/pid; fi
}
lc_revision() { curl -fsS -m 5 "$1/metrics" | sed -n 's/^leasecore_store_revision \([0-9]*\).*/\1/p'; }

# ------------------------------------------------------------------ machine, versions, flags
git_rev=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ] || git_rev+="+uncommitted"
M_DATE=$(date -Is) M_CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') \
M_KERNEL=$(uname -srm) M_OS=$(. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-unknown}") \
M_DISK=$(findmnt -n -o SOURCE,FSTYPE --target "$RUN_DIR" 2>/dev/null | tr -s ' ' || echo unknown) \
M_FSYNC=$("${CTL[@]}" fsync --dir "$RUN_DIR") M_REV=$git_rev M_BIN=$BIN \
M_ETCD=$({ [ $ETCD = 1 ] || [ $ETCD_API = 1 ]; } && etcd --version 2>&1 | sed -n '1s/etcd Version: //p' || echo skipped) \
M_WRK=$(command -v wrk >/dev/null && { wrk -v 2>&1 || true; } | head -1 | cut -d' ' -f1-2 || echo none) \
M_PY=$(python3 -V 2>&1) M_MODE=$([ $SMOKE = 1 ] && echo smoke || echo full) M_REPS=$REPS M_DURATION=$DURATION \
M_DRIVER=$DRIVER M_FRESH=$FRESH M_KEYSPACE=$KEYSPACE M_TTL=$LEASE_TTL_S M_RTTL=$REFRESH_TTL_S \
python3 - "$RUN_DIR/machine.json" <<'EOF_PY'
import json, os, sys
e = os.environ
m = {"date": e["M_DATE"], "nproc": os.cpu_count(), "cpu": e["M_CPU"],
     "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
     "kernel": e["M_KERNEL"], "os": e["M_OS"], "disk": e["M_DISK"], "fsync": json.loads(e["M_FSYNC"]),
     "leasecore_rev": e["M_REV"], "leasecore_bin": e["M_BIN"], "etcd": e["M_ETCD"], "wrk": e["M_WRK"],
     "python": e["M_PY"], "mode": e["M_MODE"], "reps": int(e["M_REPS"]), "duration_s": float(e["M_DURATION"]),
     "driver": e["M_DRIVER"], "fresh_cluster_per_run": e["M_FRESH"] == "1",
     "wrk_flags": f"wrk -t1 -cN -d{e['M_DURATION']}s --timeout 5s -s scripts/bench/wrk.lua",
     "value_bytes": 256, "keyspace": int(e["M_KEYSPACE"]), "lease_grant_ttl_s": int(e["M_TTL"]),
     "refresh_ttl_s": int(e["M_RTTL"])}
json.dump(m, open(sys.argv[1], "w"), indent=1)
EOF_PY
log "run directory $RUN_DIR; leasecore $BIN; etcd $([ $ETCD = 1 ] && echo on || echo skipped)$([ $ETCD = 0 ] && [ $ETCD_API = 1 ] && echo " (but used in etcd-api)" || true)"
flags_noted=""
note_flags() {  # record each system's command lines once
  case " $flags_noted " in *" $1 "*) return ;; esac
  flags_noted+=" $1"
  if [ "$1" = leasecore ]; then
    for f in "$LC_DIR"/node-*.pid; do echo "leasecore: $(tr '\0' ' ' <"/proc/$(cat "$f")/cmdline")"; done
    echo "leasecore: defaults in force: --heartbeat-ms 100 --election-min-ms 400 --election-max-ms 1000 --snapshot-threshold 10000 (see leasecore serve --help); LEASECORE_MAX_LEASES=$LC_MAX_LEASES (--max-leases)"
    grep -h -m1 "async workers" "$LC_DIR"/node-1.log | sed 's/^.*INFO [^ ]* /leasecore: node 1: /' || true
  else
    sed 's/^/etcd /' "$ETCD_DIR/flags"
  fi | sed "s#$RUN_DIR/#RUN/#g; s#$ROOT/##g" >>"$RUN_DIR/flags.txt"
}

# ------------------------------------------------------------------ one throughput run
lcbench_name() { case $1 in put|put-follower) echo put ;; *) echo "$1" ;; esac; }

run_tp() {  # run_tp SYSTEM WORKLOAD CONNS REP
  local sys=$1 wl=$2 c=$3 rep=$4 op target prefix="b/$2-$3-$4-" leases="" out res stored="" check=n/a rev0=""
  if [ $FRESH = 1 ] || { [ "$sys" = leasecore ] && [ -z "$LC_DIR" ]; }; then
    start_system "$sys" "$sys-$wl-c$c-r$rep"
  fi
  note_flags "$sys"
  op=$(lcbench_name "$wl")
  target=$LEADER; [ "$wl" = put-follower ] && target=$FOLLOWER
  if [ "$DRIVER" = wrk ]; then
    case $wl in
      get|get-local)
        "${CTL[@]}" preload --system "$sys" --endpoint "$LEADER" --prefix "pre-$rep/" --n "$KEYSPACE"
        prefix="pre-$rep/" ;;
      lease-refresh)
        leases=$("${CTL[@]}" grant --system "$sys" --endpoint "$LEADER" --n "$c" --ttl-s "$REFRESH_TTL_S" --prefix "ka-$rep-") ;;
      lease-grant) prefix="lg-$c-$rep-" ;;
    esac
    out=$(SYSTEM=$sys OP=$op KEY_PREFIX=$prefix KEYSPACE=$KEYSPACE VALUE_SIZE=256 TTL_S=$LEASE_TTL_S \
          LEASES=$leases LABEL="$wl" wrk -t1 -c"$c" -d"${DURATION}s" --timeout 5s -s "$HERE/wrk.lua" "$target")
  else
    rev0=$(lc_revision "$LEADER")
    out=$("$BIN" bench "$op" --endpoints "$target" -c "$c" -d "$DURATION" --keys "$([ "$wl" = lease-refresh ] && echo "$c" || echo "$KEYSPACE")" \
          --value-size 256 --json) || true
  fi
  res=$(grep -E '^(RESULT_JSON |\{)' <<<"$out" | tail -1)
  [ -n "$res" ] || { fail "$sys $wl c=$c rep $rep: no result (output: $out)"; return; }
  local ok failed
  ok=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1].removeprefix("RESULT_JSON ")); print(d["ok"], d.get("failed", d.get("errors")))' "$res")
  failed=${ok#* } ok=${ok% *}
  # the stored-count check after a write workload
  case $DRIVER:$wl in
    wrk:put|wrk:put-follower)
      stored=$("${CTL[@]}" count --system "$sys" --endpoint "$LEADER" --prefix "$prefix") ;;
    wrk:lease-grant)
      stored=$("${CTL[@]}" lease-count --system "$sys" --endpoint "$LEADER" --prefix "$prefix") ;;
    leasecore-bench:put|leasecore-bench:put-follower|leasecore-bench:lease-grant)
      stored=$(( $(lc_revision "$LEADER") - rev0 )) ;;  # one store revision per put / registration
  esac
  if [ -n "$stored" ]; then
    if "${CTL[@]}" check-stored --ok "$ok" --stored "$stored" --conns "$c" --what "$sys $wl c=$c rep $rep"; then
      check=ok
    else
      check=FAILED; fail "$sys $wl c=$c rep $rep: stored $stored for $ok acknowledged"
    fi
  fi
  [ "$failed" = 0 ] || fail "$sys $wl c=$c rep $rep: $failed failed responses"
  [ "$ok" -gt 0 ] || fail "$sys $wl c=$c rep $rep: no successful response"
  sed 's/^RESULT_JSON //' <<<"$res" | "${CTL[@]}" emit --out "$RESULTS" --stdin kind=throughput system="$sys" \
    workload="$wl" conns="$c" rep="$rep" target="$([ "$wl" = put-follower ] && echo follower || echo leader)" \
    driver="$DRIVER" stored="${stored:-null}" check="$check" >/dev/null
  log "$sys $wl c=$c rep $rep: $(tail -1 "$RESULTS" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.0f ok/s, p50 %.2f ms, p99 %.2f ms" % (d["ok_rps"], d["p50_ms"], d["p99_ms"]))'), ok $ok, failed $failed, stored ${stored:-n/a}"
}

run_lcbench() {  # run_lcbench LABEL REP ENDPOINTS ARGS...: leasecore bench --json, recorded
  local label=$1 rep=$2 eps=$3 out; shift 3
  if ! out=$("$BIN" bench "$@" --endpoints "$eps" --json 2>"$RUN_DIR/lcbench.err"); then
    fail "leasecore bench $* : $(tail -3 "$RUN_DIR/lcbench.err" | tr '\n' ' ')"
    return 1
  fi
  out=$(tail -1 <<<"$out")
  "${CTL[@]}" emit --out "$RESULTS" --stdin kind=leasecore system=leasecore workload="$label" rep="$rep" <<<"$out" >/dev/null
  log "leasecore $label rep $rep: $out"
  if ! python3 - "$out" <<'EOF'; then
import json, sys
d = json.loads(sys.argv[1])
bad = d.get("errors", 0) > 0 or d.get("ok", 1) == 0 or d.get("early", 0) > 0 \
    or ("observed" in d and d["observed"] < d["leases"]) \
    or ("deliveries" in d and d["deliveries"] < d["watchers"] * d["events"])
sys.exit(1 if bad else 0)
EOF
    fail "leasecore $label rep $rep: errors or no success: $out"
    return 1
  fi
}

# ------------------------------------------------------------------ the throughput matrix
SYSTEMS="leasecore"; [ $ETCD = 1 ] && SYSTEMS="leasecore etcd"
for wl in put get get-local lease-grant lease-refresh put-follower; do
  wanted "$wl" || continue
  conns_list=$CONNS; [ "$wl" = put ] && conns_list=$PUT_CONNS
  for c in $conns_list; do
    for rep in $(seq 1 "$REPS"); do
      for sys in $SYSTEMS; do run_tp "$sys" "$wl" "$c" "$rep"; done
    done
  done
done

# ------------------------------------------------------------------ etcd's gRPC API (both)
run_etcd_api() {  # run_etcd_api SYSTEM WORKLOAD REP: leasecore bench --etcd against the leader
  local sys=$1 wl=$2 rep=$3 ep out
  ep=$(etcd_api_of "$sys" "$LEADER")
  if ! out=$("$BIN" bench --etcd "$ep" "$wl" -c "$CONNS" -d "$DURATION" --keys "$KEYSPACE" --value-size 256 \
             --cpu-pids "$(pids_of "$sys" | paste -sd, -)" --json 2>"$RUN_DIR/etcd-api.err"); then
    fail "$sys etcd-api $wl rep $rep: $(tail -3 "$RUN_DIR/etcd-api.err" | tr '\n' ' ')"
    return 0
  fi
  out=$(tail -1 <<<"$out")
  "${CTL[@]}" emit --out "$RESULTS" --stdin kind=etcd-api system="$sys" workload="$wl" rep="$rep" \
    target=leader endpoint="$ep" <<<"$out" >/dev/null
  log "$sys etcd-api $wl rep $rep: $(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print("%.0f ok/s, p50 %.2f ms, p99 %.2f ms, ok %d, errors %d, stored %s (%s), server %s, server CPU %s us/op, client CPU %s us/op" % (d["throughput"], d["p50_ms"], d["p99_ms"], d["ok"], d["errors"], d["stored"], d["stored_check"], d["server_version"], round(d.get("server_cpu_us_per_op") or 0), round(d.get("client_cpu_us_per_op") or 0)))' "$out")"
  python3 -c 'import json,sys; d=json.loads(sys.argv[1]); sys.exit(0 if d["errors"] == 0 and d["ok"] > 0 and d["stored_check"] != "failed" else 1)' "$out" ||
    fail "$sys etcd-api $wl rep $rep: errors, no success or a failed stored-count check: $out"
}
if wanted etcd-api; then
  API_SYSTEMS=leasecore; [ $ETCD_API = 1 ] && API_SYSTEMS="leasecore etcd"
  [ $SMOKE = 1 ] || [ $ETCD_API = 1 ] || log "etcd-api: etcd is not installed, leasecore only"
  for wl in put range range-serializable txn lease-grant lease-keepalive; do
    for rep in $(seq 1 "$REPS"); do
      for sys in $API_SYSTEMS; do
        if [ $FRESH = 1 ] || { [ "$sys" = leasecore ] && [ -z "$LC_DIR" ]; }; then
          start_system "$sys" "$sys-api-$wl-r$rep"
        fi
        note_flags "$sys"
        run_etcd_api "$sys" "$wl" "$rep"
      done
    done
  done
fi

# ------------------------------------------------------------------ leasecore only
fresh_lc() { if [ $FRESH = 1 ] || [ -z "$LC_DIR" ]; then start_system leasecore "$1"; fi; note_flags leasecore; }
# Flease answers 503 no_quorum until its acceptors' restart wait has passed (also on a fresh
# cluster): poll an acquisition of a probe resource until it is granted, record how long that
# took, and release it.
wait_flease() {  # wait_flease [DEADLINE_S]
  local t0 limit=${1:-60} deadline body='{"owner":"bench-probe"}'
  deadline=$((SECONDS + limit))
  t0=$(date +%s%3N)
  until curl -fsS -m 10 -XPOST "$LEADER/v1/flease/bench-probe/acquire" -d "$body" 2>/dev/null | grep -q '"granted":true'; do
    [ $SECONDS -lt $deadline ] || { fail "Flease did not grant within $limit s of the cluster's start"; return 1; }
    sleep 0.1
  done
  "${CTL[@]}" emit --out "$RESULTS" kind=flease-ready system=leasecore workload=flease-ready \
    ms=$(( $(date +%s%3N) - t0 )) flease_lease_ms="${LEASECORE_FLEASE_LEASE_MS:-10000}" >/dev/null
  curl -fsS -m 10 -XPOST "$LEADER/v1/flease/bench-probe/release" -d "$body" >/dev/null
}
if wanted flease; then
  for rep in $(seq 1 "$REPS"); do
    fresh_lc "leasecore-flease-r$rep"
    wait_flease || continue
    run_lcbench flease-acquire "$rep" "$LEADER" flease-acquire -c "$CONNS" -d "$DURATION" || true
    run_lcbench paxoslease-acquire "$rep" "$LEADER" paxoslease-acquire -c "$CONNS" -d "$DURATION" || true
    rev0=$(lc_revision "$LEADER")
    if run_lcbench lease-grant-lcbench "$rep" "$LEADER" lease-grant -c "$CONNS" -d "$DURATION"; then
      ok=$(tail -1 "$RESULTS" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ok"])')
      "${CTL[@]}" check-stored --ok "$ok" --stored $(( $(lc_revision "$LEADER") - rev0 )) --conns "$CONNS" \
        --what "leasecore lease-grant (leasecore bench) rep $rep, by store revision" ||
        fail "leasecore lease-grant (leasecore bench) rep $rep: stored-count check"
    fi
  done
fi
if wanted flease-contended; then
  for rep in $(seq 1 "$REPS"); do
    fresh_lc "leasecore-flease-contended-r$rep"
    wait_flease || continue
    run_lcbench flease-contended "$rep" "$LC_ENDPOINTS" flease-contended -c 16 -d "$DURATION" || true
    run_lcbench paxoslease-contended "$rep" "$LC_ENDPOINTS" paxoslease-contended -c 16 -d "$DURATION" || true
  done
fi
if wanted watch; then
  for w in $WATCHERS; do
    # Three ways to follow: a long poll per watcher, an SSE stream per watcher, and the
    # watchers spread over 10 multi-watch streams (POST /v1/watches; etcd's model). A
    # connection per watcher needs a connection cap above the default 4,096 (the nodes evict
    # the longest-idle connection at the cap): LEASECORE_MAX_CONNECTIONS for these clusters.
    export LEASECORE_MAX_CONNECTIONS=$((w + 1000))
    echo "leasecore watch clusters at $w watchers: LEASECORE_MAX_CONNECTIONS=$LEASECORE_MAX_CONNECTIONS" >>"$RUN_DIR/flags.txt"
    fresh_lc "leasecore-watch-$w"
    run_lcbench "watch-$w" 1 "$LEADER" watch --watchers "$w" --events "$WATCH_EVENTS" || true
    fresh_lc "leasecore-watch-sse-$w"
    run_lcbench "watch-sse-$w" 1 "$LEADER" watch --sse --watchers "$w" --events "$WATCH_EVENTS" || true
    fresh_lc "leasecore-watch-streams-$w"
    run_lcbench "watch-streams-$w" 1 "$LEADER" watch --streams 10 --watchers "$w" --events "$WATCH_EVENTS" || true
  done
  unset LEASECORE_MAX_CONNECTIONS
fi
if wanted flease-memory; then
  if "$BIN" bench --help 2>&1 | grep -q -- '--resources'; then
    # Cells are collected when their lease time passes: the nodes run with a lease time longer
    # than the experiment (LEASECORE_FLEASE_LEASE_MS), and Flease's restart wait on a fresh
    # cluster is as long, so this waits that long before it starts.
    lease_ms=${BENCH_FLEASE_LEASE_MS:-$([ $SMOKE = 1 ] && echo 5000 || echo 120000)}
    log "flease-memory: a cluster with a Flease lease time of $((lease_ms / 1000)) s; waiting for Flease to answer"
    LEASECORE_FLEASE_LEASE_MS=$lease_ms start_system leasecore leasecore-flease-memory
    echo "leasecore (flease-memory cluster only): LEASECORE_FLEASE_LEASE_MS=$lease_ms (--flease-lease-ms)" >>"$RUN_DIR/flags.txt"
    if LEASECORE_FLEASE_LEASE_MS=$lease_ms wait_flease $((lease_ms / 1000 + 60)); then
      run_lcbench flease-memory 1 "$LEADER" flease-memory --resources "$FLEASE_RESOURCES" || true
      run_lcbench paxoslease-memory 1 "$LEADER" paxoslease-memory --resources "$FLEASE_RESOURCES" || true
    fi
    stop_system leasecore
  else
    log "flease-memory SKIPPED: this leasecore has no 'bench flease-memory --resources N'"
  fi
fi

# ------------------------------------------------------------------ expiry lateness (both)
if wanted expiry; then
  for rep in $(seq 1 "$REPS"); do
    fresh_lc "leasecore-expiry-r$rep"
    run_lcbench expiry "$rep" "$LEADER" expiry --leases "$EXP_LEASES" --ttl-ms "$EXP_TTL_MS" -c "$EXP_CONNS" || true
    if [ $ETCD = 1 ]; then
      start_system etcd "etcd-expiry-r$rep"
      if out=$("${CTL[@]}" expiry --endpoint "$LEADER" --n "$EXP_LEASES" --ttl-s $((EXP_TTL_MS / 1000)) --conns "$EXP_CONNS"); then
        "${CTL[@]}" emit --out "$RESULTS" --stdin kind=etcd system=etcd workload=expiry rep="$rep" <<<"$out" >/dev/null
        log "etcd expiry rep $rep: $out"
        grep -q '"early": 0' <<<"$out" || fail "etcd expiry rep $rep: early deletions"
      else
        fail "etcd expiry rep $rep"
      fi
    fi
  done
fi

# ------------------------------------------------------------------ memory (both)
rss_json() { "${CTL[@]}" rss $(pids_of "$1"); }
if wanted memory; then
  fresh_lc leasecore-memory
  before=$(rss_json leasecore)
  if run_lcbench lease-memory 1 "$LEADER" lease-memory --leases "$MEM_LEASES"; then
    "${CTL[@]}" emit --out "$RESULTS" kind=memory system=leasecore workload=memory leases="$MEM_LEASES" \
      rss_before="$before" rss_after="$(rss_json leasecore)" >/dev/null
  fi
  if [ $ETCD = 1 ]; then
    start_system etcd etcd-memory
    before=$(rss_json etcd)
    if "${CTL[@]}" fill-leases --endpoint "$LEADER" --n "$MEM_LEASES" --conns 32; then
      "${CTL[@]}" emit --out "$RESULTS" kind=memory system=etcd workload=memory leases="$MEM_LEASES" \
        rss_before="$before" rss_after="$(rss_json etcd)" >/dev/null
      log "etcd memory: RSS before $before after $(rss_json etcd)"
    else
      fail "etcd memory: granting $MEM_LEASES leases with keys"
    fi
  fi
fi

# ------------------------------------------------------------------ failover (both)
probe_write() {  # probe_write URL KEY TIMEOUT_S T0_MS OUTFILE: put until one succeeds; ms after T0
  local deadline=$((SECONDS + 60))
  until curl -fsS -m "$3" -XPOST "$1/v3/kv/put" -d "{\"key\":\"$2\",\"value\":\"eA==\"}" 2>/dev/null | grep -q '"header"'; do
    [ $SECONDS -lt $deadline ] || { echo none >"$5"; return 1; }
    sleep 0.01
  done
  echo $(( $(date +%s%3N) - $4 )) >"$5"
}
etcd_failover() {  # the procedure of scripts/failover.sh, on etcd
  local dir=$RUN_DIR/etcd-failover round victim survivor url t0 t10 t1
  start_system etcd etcd-failover || { fail "etcd failover: the cluster did not start"; return 1; }
  note_flags etcd
  for round in $(seq 1 "$KILLS"); do
    # (called under ||, so set -e is off here: every step checks itself)
    ETCD_BASE_PORT=$ETCD_PORT "$HERE/etcd.sh" wait "$dir" || { fail "etcd failover: cluster not healthy"; return 1; }
    victim=$(ETCD_BASE_PORT=$ETCD_PORT "$HERE/etcd.sh" leader "$dir") || { fail "etcd failover: no leader"; return 1; }
    survivor=$((victim % 3 + 1))
    url=http://127.0.0.1:$((ETCD_PORT + 2 * (survivor - 1)))
    curl -fsS -m 10 -XPOST "$url/v3/kv/put" -d '{"key":"ZmFpbG92ZXIvd2FybQ==","value":"eA=="}' >/dev/null ||
      { fail "etcd failover: warm-up write failed"; return 1; }
    t0=$(date +%s%3N)
    ETCD_BASE_PORT=$ETCD_PORT "$HERE/etcd.sh" kill "$dir" "$victim" || { fail "etcd failover: kill failed"; return 1; }
    # Two writers through the survivor at once: with a 10 s client timeout as scripts/failover.sh
    # (the comparable figure), and with 1 s, retried: etcd holds a write it could not deliver to
    # the dead leader for its request timeout (5 s + 2 election timeouts = 7 s) before it fails.
    probe_write "$url" ZmFpbG92ZXIvYQ== 10 "$t0" "$dir/t10" & local p10=$!
    probe_write "$url" ZmFpbG92ZXIvYg== 1 "$t0" "$dir/t1" & local p1=$!
    wait $p10 || { fail "etcd failover: no write within 60 s"; return 1; }
    wait $p1 || true
    t10=$(cat "$dir/t10") t1=$(cat "$dir/t1")
    echo "kill $round: member $victim down, first write after ${t10} ms (client timeout 10 s), ${t1} ms (client timeout 1 s)"
    "${CTL[@]}" emit --out "$RESULTS" kind=failover system=etcd workload=failover rep="$round" ms="$t10" \
      ms_client_timeout_1s="$t1" >/dev/null
    ETCD_BASE_PORT=$ETCD_PORT "$HERE/etcd.sh" restart "$dir" "$victim" || { fail "etcd failover: restart failed"; return 1; }
  done
  stop_system etcd
}
if wanted failover; then
  stop_system leasecore
  "${CTL[@]}" ports-free "$LC_PORT" "$((LC_PORT + 1))" "$((LC_PORT + 2))"
  log "leasecore failover: $KILLS kills (scripts/failover.sh)"
  if LEASECORE_CLUSTER_DIR=$RUN_DIR/leasecore-failover LEASECORE_BASE_PORT=$LC_PORT \
       "$ROOT/scripts/failover.sh" "$KILLS" >"$RUN_DIR/failover-leasecore.txt" 2>&1; then
    sed -n 's/^kill \([0-9]*\):.* after \([0-9]*\) ms.*/\1 \2/p' "$RUN_DIR/failover-leasecore.txt" |
      while read -r round ms; do
        "${CTL[@]}" emit --out "$RESULTS" kind=failover system=leasecore workload=failover rep="$round" ms="$ms" >/dev/null
      done
    log "$(tail -1 "$RUN_DIR/failover-leasecore.txt")"
  else
    fail "leasecore failover (see $RUN_DIR/failover-leasecore.txt)"
  fi
  rm -rf "$RUN_DIR"/leasecore-failover/node-[0-9]
  if [ $ETCD = 1 ]; then
    log "etcd failover: $KILLS kills"
    etcd_failover >"$RUN_DIR/failover-etcd.txt" 2>&1 || fail "etcd failover (see $RUN_DIR/failover-etcd.txt)"
    tail -1 "$RUN_DIR/failover-etcd.txt" >&2
  fi
fi
stop_system leasecore; stop_system etcd

# ------------------------------------------------------------------ report
python3 "$HERE/report.py" "$RUN_DIR" >"$RUN_DIR/summary.md"
cat "$RUN_DIR/summary.md"
if [ ${#FAILURES[@]} -gt 0 ]; then
  echo >&2
  echo "BENCHMARK FAILED: ${#FAILURES[@]} check(s) failed:" >&2
  printf '  - %s\n' "${FAILURES[@]}" >&2
  [ $WRITE = 0 ] || echo "BENCHMARKS.md not written (a check failed); raw data in $RUN_DIR" >&2
  exit 1
fi
if [ $WRITE = 1 ]; then
  python3 "$HERE/report.py" "$RUN_DIR" --write "$ROOT"
  log "wrote BENCHMARKS.md and bench/throughput.svg"
fi
log "all checks passed; raw results in $RESULTS"
