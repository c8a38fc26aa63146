#!/usr/bin/env python3
"""Helpers for scripts/bench.sh (Python standard library only; loopback endpoints only).

Both systems (--system leasecore|etcd):
  count       --endpoint URL --prefix P            keys stored under P
  lease-count --endpoint URL [--prefix P]          live leases (etcd: all of them; leasecore: under P)
  preload     --endpoint URL --prefix P --n N      write P%08d for 0 <= i < N (256 B values), verify
  grant       --endpoint URL --n N --ttl-s T [--prefix P]
                                                   register N leases; print their names/ids, comma-separated
  leader      --endpoints URL,URL,...              print the leader's URL, then a follower's URL
etcd only:
  expiry      --endpoint URL --n N --ttl-s T [--conns C]
                                                   lease-expiry lateness (JSON), like `leasecore bench expiry`
  fill-leases --endpoint URL --n N [--conns C]     grant N leases with one key each (for memory)
Other:
  rss PID...                                       resident bytes of each pid (from /proc), JSON list
  check-stored --ok N --stored M --conns C --what W
                                                   the honesty rule: M >= N and M - N <= C (exit 1 if not)
  ports-free PORT...                               exit 1 (naming it) if something listens on a port
  emit --out FILE [--stdin] KEY=VALUE...           append one JSON line: the JSON object read from
                                                   stdin (a RESULT_JSON line or `leasecore bench --json`)
                                                   plus the given fields (values parsed as JSON if they can be;
                                                   they win over the object's own)
  fsync --dir DIR [--n N]                          fdatasync latency of 4 KiB writes (disk noise probe), JSON
"""
import argparse
import base64
import os
import http.client
import json
import queue
import socket
import sys
import threading
import time
from urllib.parse import quote, urlsplit

VALUE_SIZE = 256


def b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def prefix_end(p):
    b = bytearray(p.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\x00"


class Http:
    """One keep-alive connection to a loopback endpoint; retries transport errors only."""

    def __init__(self, url, timeout=30):
        u = urlsplit(url)
        if u.hostname not in ("127.0.0.1", "localhost", "::1") and not (u.hostname or "").startswith("127."):
            sys.exit(f"refusing non-loopback endpoint {url}")
        self.host, self.port, self.timeout, self.conn = u.hostname, u.port or 80, timeout, None

    def call(self, method, path, obj=None, expect=(200,)):
        body = None if obj is None else json.dumps(obj)
        for attempt in range(5):
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                self.conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                data = r.read()
            except (http.client.HTTPException, OSError):
                self.conn = None
                if attempt == 4:
                    raise
                time.sleep(0.05 * (attempt + 1))
                continue
            if r.status not in expect:
                raise RuntimeError(f"{method} {path}: HTTP {r.status} {data[:300]!r}")
            return json.loads(data) if data else {}


# ---------------------------------------------------------------- counting (honesty checks)

def lc_count_keys(url, prefix):
    """leasecore has no count call: list with a limit, and split a prefix that is cut short by
    its next character (the harness writes digits only after the prefix)."""
    h, total, todo = Http(url, 120), 0, [prefix]
    while todo:
        p = todo.pop()
        r = h.call("GET", f"/v1/kv?prefix={quote(p, safe='')}&limit=10000")
        if r["more"]:
            if len(p) > len(prefix) + 12:
                raise RuntimeError(f"cannot narrow {p!r} further")
            todo.extend(p + d for d in "0123456789")
            # keys equal to p itself would be missed by the split; there are none by construction
        else:
            total += len(r["items"])
    return total


def lc_count_leases(url, prefix):
    h, total, todo = Http(url, 120), 0, [prefix]
    while todo:
        p = todo.pop()
        r = h.call("GET", f"/v1/leases?prefix={quote(p, safe='')}&limit=10000")
        if r["more"]:
            if len(p) > len(prefix) + 12:
                raise RuntimeError(f"cannot narrow {p!r} further")
            todo.extend(p + d for d in "0123456789")
        else:
            total += len(r["leases"])
    return total


def etcd_count_keys(url, prefix):
    r = Http(url, 60).call("POST", "/v3/kv/range",
                           {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "count_only": True})
    return int(r.get("count", 0))


def etcd_count_leases(url):
    return len(Http(url, 120).call("POST", "/v3/lease/leases", {}).get("leases", []))


def cmd_count(a):
    print(lc_count_keys(a.endpoint, a.prefix) if a.system == "leasecore" else etcd_count_keys(a.endpoint, a.prefix))


def cmd_lease_count(a):
    print(lc_count_leases(a.endpoint, a.prefix) if a.system == "leasecore" else etcd_count_leases(a.endpoint))


def cmd_check_stored(a):
    excess = a.stored - a.ok
    verdict = "ok" if 0 <= excess <= a.conns else "FAILED"
    print(f"stored-count check {verdict}: {a.what}: stored {a.stored}, acknowledged {a.ok}, "
          f"excess {excess} (allowed 0..{a.conns})", file=sys.stderr)
    sys.exit(0 if verdict == "ok" else 1)


# ---------------------------------------------------------------- parallel helpers

def parallel(n_items, conns, fn, endpoint):
    """Run fn(http, i) for i in range(n_items) on `conns` threads; raise the first error."""
    q = queue.Queue()
    for i in range(n_items):
        q.put(i)
    errors, out = [], {}

    def worker():
        h = Http(endpoint)
        while not errors:
            try:
                i = q.get_nowait()
            except queue.Empty:
                return
            try:
                out[i] = fn(h, i)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

    ts = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, conns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return out


def value():
    return "".join(chr(97 + (i * 7) % 26) for i in range(1, VALUE_SIZE + 1))


def cmd_preload(a):
    v = value()
    if a.system == "leasecore":
        put = lambda h, i: h.call("PUT", f"/v1/kv/{a.prefix}{i:08d}", {"value": v})  # noqa: E731
    else:
        vb = b64(v)
        put = lambda h, i: h.call("POST", "/v3/kv/put", {"key": b64(f"{a.prefix}{i:08d}"), "value": vb})  # noqa: E731
    parallel(a.n, a.conns, put, a.endpoint)
    got = lc_count_keys(a.endpoint, a.prefix) if a.system == "leasecore" else etcd_count_keys(a.endpoint, a.prefix)
    if got != a.n:
        sys.exit(f"preload: {got} keys under {a.prefix!r}, expected {a.n}")


def cmd_grant(a):
    if a.system == "leasecore":
        def g(h, i):
            name = f"{a.prefix}{i:08d}"
            h.call("POST", "/v1/leases", {"name": name, "ttl_ms": a.ttl_s * 1000}, expect=(201,))
            return name
    else:
        def g(h, i):
            return h.call("POST", "/v3/lease/grant", {"TTL": a.ttl_s})["ID"]
    out = parallel(a.n, a.conns, g, a.endpoint)
    print(",".join(out[i] for i in range(a.n)))


def cmd_leader(a):
    urls = a.endpoints.split(",")
    leader = None
    for url in urls:
        try:
            if a.system == "leasecore":
                v = Http(url, 3).call("GET", "/v1/cluster")
                if v.get("state") == "leader":
                    leader = url
            else:
                s = Http(url, 3).call("POST", "/v3/maintenance/status", {})
                if s.get("leader") and s["leader"] == s["header"]["member_id"]:
                    leader = url
        except Exception:  # noqa: BLE001 - a member that does not answer is not the leader
            continue
    if leader is None:
        sys.exit("no leader found")
    print(leader)
    print(next(u for u in urls if u != leader))


# ---------------------------------------------------------------- etcd experiments

def pct(xs, p):
    """Nearest-rank percentile, as `leasecore bench` computes it."""
    if not xs:
        return None
    xs = sorted(xs)
    k = max(1, min(len(xs), int(-(-len(xs) * p // 100))))
    return xs[k - 1]


def watch_deletes(url, prefix, start_rev, seen, ready, stop):
    """etcd gateway watch: POST /v3/watch streams one JSON object per line."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    conn.request("POST", "/v3/watch", body=json.dumps({"create_request": {
        "key": b64(prefix), "range_end": b64(prefix_end(prefix)), "start_revision": str(start_rev)}}),
        headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    while not stop.is_set():
        line = r.readline()
        if not line:
            break
        now = time.monotonic()
        if not line.strip():
            continue
        res = json.loads(line).get("result", {})
        if res.get("created"):
            ready.set()
        for ev in res.get("events", []):
            if ev.get("type") == "DELETE":
                seen[base64.b64decode(ev["kv"]["key"]).decode()] = now
    conn.close()


def cmd_expiry(a):
    """The same experiment as `leasecore bench expiry`: N leases (TTL T, one key each), never
    refreshed; a watch on the leader timestamps each key's deletion; lateness is measured from
    the grant's reply + TTL, and a deletion before the grant's send + TTL counts as early."""
    prefix = f"bench-exp-{int(time.time() * 1e6):x}/"
    h = Http(a.endpoint)
    rev = int(h.call("POST", "/v3/kv/range", {"key": b64(prefix), "count_only": True})["header"]["revision"])
    seen, ready, stop = {}, threading.Event(), threading.Event()
    w = threading.Thread(target=watch_deletes, args=(a.endpoint, prefix, rev + 1, seen, ready, stop), daemon=True)
    w.start()
    if not ready.wait(10):
        sys.exit("expiry: the watch was not created within 10 s")
    granted = {}

    def grant(hh, i):
        key = f"{prefix}{i:06d}"
        t_send = time.monotonic()
        g = hh.call("POST", "/v3/lease/grant", {"TTL": a.ttl_s})
        t_recv = time.monotonic()
        hh.call("POST", "/v3/kv/put", {"key": b64(key), "value": b64("x"), "lease": g["ID"]})
        granted[key] = (t_send, t_recv, int(g["TTL"]))

    t0 = time.monotonic()
    parallel(a.n, a.conns, grant, a.endpoint)
    grant_s = time.monotonic() - t0
    deadline = max(t[1] + t[2] for t in granted.values()) + 30
    while len(seen) < a.n and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    late, early = [], 0
    for key, t_del in list(seen.items()):
        t_send, t_recv, ttl = granted[key]
        if t_del < t_send + ttl:
            early += 1
        late.append(max(0.0, (t_del - (t_recv + ttl)) * 1000))
    r2 = lambda x: None if x is None else round(x, 2)  # noqa: E731
    print(json.dumps({
        "leases": a.n, "ttl_ms": a.ttl_s * 1000, "grant_connections": a.conns,
        "granted_ttl_s": sorted({t[2] for t in granted.values()}), "grant_phase_s": round(grant_s, 2),
        "observed": len(seen), "early": early, "keys_remaining": etcd_count_keys(a.endpoint, prefix),
        "p50_ms": r2(pct(late, 50)), "p99_ms": r2(pct(late, 99)), "max_ms": r2(max(late) if late else None)}))
    if len(seen) < a.n:
        sys.exit(f"expiry: only {len(seen)} of {a.n} deletions seen")


def cmd_fill_leases(a):
    """Grant N long leases with one key each (the memory figure's load)."""
    prefix = f"bench-mem-{int(time.time() * 1e6):x}/"

    def one(h, i):
        g = h.call("POST", "/v3/lease/grant", {"TTL": 3600})
        h.call("POST", "/v3/kv/put", {"key": b64(f"{prefix}{i:07d}"), "value": b64("member-value-of-modest-size"),
                                      "lease": g["ID"]})

    parallel(a.n, a.conns, one, a.endpoint)
    got = etcd_count_keys(a.endpoint, prefix)
    if got != a.n:
        sys.exit(f"fill-leases: {got} keys stored, expected {a.n}")


# ---------------------------------------------------------------- process and port checks

def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cmd_rss(a):
    print(json.dumps([rss_bytes(p) for p in a.pids]))


def cmd_ports_free(a):
    busy = []
    for p in a.ports:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", p)) == 0:
                busy.append(p)
    if busy:
        sys.exit(f"port(s) already in use on 127.0.0.1: {', '.join(map(str, busy))}")


def cmd_emit(a):
    obj = {}
    if a.stdin:
        text = sys.stdin.read().strip()
        line = next((ln for ln in text.splitlines() if ln.startswith("RESULT_JSON ")), None)
        obj = json.loads(line[len("RESULT_JSON "):] if line else text.splitlines()[-1])
        if "throughput" in obj and "ok_rps" not in obj:  # `leasecore bench --json`
            obj["ok_rps"] = round(obj["throughput"], 1)
            obj["failed"] = obj.get("errors", 0)
    fields = {}
    for kv in a.fields:
        k, _, v = kv.partition("=")
        try:
            fields[k] = json.loads(v)
        except ValueError:
            fields[k] = v
    if "workload" in obj and "workload" in fields and obj["workload"] != fields["workload"]:
        obj["bench_workload"] = obj.pop("workload")  # keep the tool's name; ours labels the row
    obj.update(fields)
    line = json.dumps(obj)
    with open(a.out, "a") as f:
        f.write(line + "\n")
    print(line)


def cmd_fsync(a):
    path = os.path.join(a.dir, f"fsync-probe-{os.getpid()}.bin")
    buf, lat = os.urandom(4096), []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, 4096 * a.n)
        os.fsync(fd)
        for i in range(a.n):
            os.pwrite(fd, buf, 4096 * i)
            t = time.perf_counter()
            os.fdatasync(fd)
            lat.append((time.perf_counter() - t) * 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    print(json.dumps({"fdatasync_4k_p50_ms": round(pct(lat, 50), 3), "fdatasync_4k_p99_ms": round(pct(lat, 99), 3),
                      "n": a.n}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="cmd", required=True)

    def sub(name, f, system=True):
        x = s.add_parser(name)
        if system:
            x.add_argument("--system", choices=["leasecore", "etcd"], required=True)
        x.set_defaults(f=f)
        return x

    x = sub("count", cmd_count); x.add_argument("--endpoint", required=True); x.add_argument("--prefix", required=True)
    x = sub("lease-count", cmd_lease_count); x.add_argument("--endpoint", required=True)
    x.add_argument("--prefix", default="")
    x = sub("preload", cmd_preload); x.add_argument("--endpoint", required=True)
    x.add_argument("--prefix", required=True); x.add_argument("--n", type=int, default=1000)
    x.add_argument("--conns", type=int, default=16)
    x = sub("grant", cmd_grant); x.add_argument("--endpoint", required=True)
    x.add_argument("--n", type=int, required=True); x.add_argument("--ttl-s", type=int, default=30)
    x.add_argument("--prefix", default="bench-ka-"); x.add_argument("--conns", type=int, default=8)
    x = sub("leader", cmd_leader); x.add_argument("--endpoints", required=True)
    x = sub("expiry", cmd_expiry, system=False); x.add_argument("--endpoint", required=True)
    x.add_argument("--n", type=int, default=10000); x.add_argument("--ttl-s", type=int, default=5)
    x.add_argument("--conns", type=int, default=16)
    x = sub("fill-leases", cmd_fill_leases, system=False); x.add_argument("--endpoint", required=True)
    x.add_argument("--n", type=int, default=100000); x.add_argument("--conns", type=int, default=32)
    x = sub("rss", cmd_rss, system=False); x.add_argument("pids", type=int, nargs="+")
    x = sub("check-stored", cmd_check_stored, system=False)
    x.add_argument("--ok", type=int, required=True); x.add_argument("--stored", type=int, required=True)
    x.add_argument("--conns", type=int, required=True); x.add_argument("--what", default="")
    x = sub("ports-free", cmd_ports_free, system=False); x.add_argument("ports", type=int, nargs="+")
    x = sub("emit", cmd_emit, system=False); x.add_argument("--out", required=True)
    x.add_argument("--stdin", action="store_true"); x.add_argument("fields", nargs="*")
    x = sub("fsync", cmd_fsync, system=False); x.add_argument("--dir", required=True)
    x.add_argument("--n", type=int, default=200)
    a = p.parse_args()
    a.f(a)


if __name__ == "__main__":
    main()
