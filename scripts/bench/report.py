#!/usr/bin/env python3
"""Summarize a scripts/bench.sh run (Python standard library only).

  report.py RUN_DIR                  print the summary (markdown) of RUN_DIR/results.jsonl
  report.py RUN_DIR --write ROOT     also write ROOT/BENCHMARKS.md and ROOT/bench/throughput.svg

Figures are medians over the repetitions; ratios are leasecore / etcd (throughput: higher is
better for leasecore; p99: lower is better).
"""
import argparse
import html
import json
import os
import shutil
import statistics
import sys

THROUGHPUT_ROWS = [  # (workload, label); put is listed per connection count
    ("put", "put"),
    ("get", "get, linearizable"),
    ("get-local", "get, local / serializable"),
    ("lease-grant", "lease register / grant"),
    ("lease-refresh", "lease refresh / keepalive"),
    ("put-follower", "put to a follower"),
]
TEMPLATES = [  # (workload, leasecore request, its success rule, etcd request, its success rule)
    ("put", "`PUT /v1/kv/{key}` `{\"value\": V}`", "200, `revision`",
     "`POST /v3/kv/put` `{\"key\", \"value\"}` (base64)", "200, `header`"),
    ("get", "`GET /v1/kv/{key}`", "200, `mod_revision`", "`POST /v3/kv/range` `{\"key\"}`", "200, `kvs`"),
    ("get-local", "`GET /v1/kv/{key}?consistency=local`", "200, `mod_revision`",
     "`POST /v3/kv/range` `{\"key\", \"serializable\": true}`", "200, `kvs`"),
    ("lease-grant", "`POST /v1/leases` `{\"name\", \"ttl_ms\": 60000}`", "201, `revision`",
     "`POST /v3/lease/grant` `{\"TTL\": 60}`", "200, `ID`"),
    ("lease-refresh", "`POST /v1/leases/{name}/refresh`", "200, `remaining_ms`",
     "`POST /v3/lease/keepalive` `{\"ID\"}`", "200, `TTL` not negative"),
    ("put-follower", "as put, sent to a follower (forwarded to the leader)", "as put",
     "as put, sent to a follower", "as put"),
]


def load(run_dir):
    rows = []
    with open(os.path.join(run_dir, "results.jsonl")) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    machine = {}
    p = os.path.join(run_dir, "machine.json")
    if os.path.exists(p):
        with open(p) as f:
            machine = json.load(f)
    flags = ""
    p = os.path.join(run_dir, "flags.txt")
    if os.path.exists(p):
        with open(p) as f:
            flags = f.read()
    return rows, machine, flags


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits=None):
    if x is None:
        return "–"
    if digits is None:
        digits = 0 if abs(x) >= 100 else (1 if abs(x) >= 10 else 2)
    return f"{x:,.{digits}f}"


def ratio(a, b, digits=2):
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.{digits}f}×"


def throughput_table(rows):
    """[(label, conns, {system: {rps, rps_min, rps_max, p50, p99, n, checks}})] in display order."""
    out = []
    tp = [r for r in rows if r.get("kind") == "throughput"]
    for wl, label in THROUGHPUT_ROWS:
        conns = sorted({r["conns"] for r in tp if r["workload"] == wl})
        for c in conns:
            per = {}
            for sysname in ("leasecore", "etcd"):
                rs = [r for r in tp if r["workload"] == wl and r["conns"] == c and r["system"] == sysname]
                if not rs:
                    continue
                per[sysname] = {
                    "rps": med([r["ok_rps"] for r in rs]), "rps_min": min(r["ok_rps"] for r in rs),
                    "rps_max": max(r["ok_rps"] for r in rs), "p50": med([r["p50_ms"] for r in rs]),
                    "p99": med([r["p99_ms"] for r in rs]), "n": len(rs),
                    "failed": sum(r.get("failed", 0) for r in rs),
                    "checks": sorted({r.get("check", "n/a") for r in rs}),
                }
            out.append((wl, label, c, per))
    return out


ETCD_API_ROWS = [  # (workload of `leasecore bench --etcd`, label)
    ("put", "KV.Put"),
    ("range", "KV.Range, linearizable"),
    ("range-serializable", "KV.Range, serializable"),
    ("txn", "KV.Txn (compare mod revision, put)"),
    ("lease-grant", "Lease.LeaseGrant"),
    ("lease-keepalive", "Lease.LeaseKeepAlive (a stream each)"),
]


def etcd_api_table(rows):
    """[(label, conns, {system: {rps, rps_min, rps_max, p50, p99, n, errors, checks}})] for the etcd-api group."""
    api = [r for r in rows if r.get("kind") == "etcd-api"]
    out = []
    for wl, label in ETCD_API_ROWS:
        per = {}
        for sysname in ("leasecore", "etcd"):
            rs = [r for r in api if r["workload"] == wl and r["system"] == sysname]
            if rs:
                per[sysname] = {
                    "rps": med([r["throughput"] for r in rs]), "rps_min": min(r["throughput"] for r in rs),
                    "rps_max": max(r["throughput"] for r in rs), "p50": med([r["p50_ms"] for r in rs]),
                    "p99": med([r["p99_ms"] for r in rs]), "n": len(rs), "conns": rs[0]["connections"],
                    "errors": sum(r.get("errors", 0) for r in rs),
                    "checks": sorted({r.get("stored_check", "n/a") for r in rs}),
                    "versions": sorted({r.get("server_version", "?") for r in rs}),
                    "cpu": med([r.get("server_cpu_us_per_op") for r in rs]),
                }
        if per:
            out.append((wl, label, per))
    return out


def g(per, sysname, field):
    return per.get(sysname, {}).get(field)


def summary_markdown(rows, machine, flags, heading="##"):
    L = []
    tt = throughput_table(rows)
    if tt:
        L.append(f"{heading} Throughput and latency (median of {max(v['n'] for _, _, _, p in tt for v in p.values())} "
                 f"runs × {machine.get('duration_s', '?')} s; ratio = leasecore / etcd)\n")
        L.append("| workload | conns | leasecore ok/s | etcd ok/s | ratio | leasecore p50 ms | etcd p50 ms "
                 "| leasecore p99 ms | etcd p99 ms | p99 ratio | failed | stored check |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for _wl, label, c, per in tt:
            checks = ",".join(sorted(set(sum((v["checks"] for v in per.values()), []))))
            L.append(f"| {label} | {c} | {fmt(g(per, 'leasecore', 'rps'))} | {fmt(g(per, 'etcd', 'rps'))} "
                     f"| {ratio(g(per, 'leasecore', 'rps'), g(per, 'etcd', 'rps'))} "
                     f"| {fmt(g(per, 'leasecore', 'p50'))} | {fmt(g(per, 'etcd', 'p50'))} "
                     f"| {fmt(g(per, 'leasecore', 'p99'))} | {fmt(g(per, 'etcd', 'p99'))} "
                     f"| {ratio(g(per, 'leasecore', 'p99'), g(per, 'etcd', 'p99'))} "
                     f"| {sum(v['failed'] for v in per.values())} | {checks} |")
        L.append("")
        L.append("Spread of ok/s over the repetitions (min–max): " + "; ".join(
            f"{label} c={c}: " + ", ".join(f"{s} {fmt(v['rps_min'])}–{fmt(v['rps_max'])}" for s, v in per.items())
            for _wl, label, c, per in tt) + ".\n")

    at = etcd_api_table(rows)
    if at:
        n = max(v["n"] for _, _, p in at for v in p.values())
        versions = ", ".join(f"{s} reports {'/'.join(v['versions'])}" for s, v in at[0][2].items())
        L.append(f"{heading} etcd v3 gRPC API, one client for both (`leasecore bench --etcd`; median of {n} runs × "
                 f"{machine.get('duration_s', '?')} s; ratio = leasecore / etcd)\n")
        L.append("| RPC | conns | leasecore ok/s | etcd ok/s | ratio | leasecore p50 ms | etcd p50 ms "
                 "| leasecore p99 ms | etcd p99 ms | leasecore CPU µs/op | etcd CPU µs/op | errors | stored check "
                 "| ≥ 2×, p99 no worse |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for _wl, label, per in at:
            checks = ",".join(sorted(set(sum((v["checks"] for v in per.values()), []))))
            lr, er = g(per, "leasecore", "rps"), g(per, "etcd", "rps")
            lp, ep = g(per, "leasecore", "p99"), g(per, "etcd", "p99")
            goal = "–" if None in (lr, er, lp, ep) else ("yes" if lr >= 2 * er and lp <= ep else "no")
            conns = next(iter(per.values()))["conns"]
            L.append(f"| {label} | {conns} | {fmt(lr)} | {fmt(er)} | {ratio(lr, er)} "
                     f"| {fmt(g(per, 'leasecore', 'p50'))} | {fmt(g(per, 'etcd', 'p50'))} "
                     f"| {fmt(lp)} | {fmt(ep)} | {fmt(g(per, 'leasecore', 'cpu'), 0)} | {fmt(g(per, 'etcd', 'cpu'), 0)} "
                     f"| {sum(v['errors'] for v in per.values())} | {checks} | {goal} |")
        L.append("")
        L.append("Spread of ok/s over the repetitions (min–max): " + "; ".join(
            f"{label}: " + ", ".join(f"{s} {fmt(v['rps_min'])}–{fmt(v['rps_max'])}" for s, v in per.items())
            for _wl, label, per in at) + f". Servers: {versions}; every connection is an HTTP/2 channel of its own "
            "with one request in flight, sent to the leader. CPU µs/op: user + system time of the three server "
            "processes during the measured interval per checked success.\n")

    def lc(workload):
        return [r for r in rows if r.get("system") == "leasecore" and r.get("workload") == workload]

    fa, lg = lc("flease-acquire"), lc("lease-grant-lcbench")
    fc = lc("flease-contended")
    pa, pc = lc("paxoslease-acquire"), lc("paxoslease-contended")
    if fa or lg or fc:
        L.append(f"{heading} leasecore only: Flease vs Raft lease register (`leasecore bench`, same cluster, same target)\n")
        L.append("| workload | conns | ok/s | p50 ms | p99 ms | max ms | fairness | runs |")
        L.append("|---|---|---|---|---|---|---|---|")
        for name, rs in (("Flease acquire (fresh resource each)", fa),
                         ("PaxosLease acquire (fresh resource each)", pa), ("Raft lease register", lg),
                         ("Flease contended (acquire + release of one resource)", fc),
                         ("PaxosLease contended (acquire + release of one resource)", pc)):
            if rs:
                L.append(f"| {name} | {rs[0]['connections']} | {fmt(med([r['throughput'] for r in rs]))} "
                         f"| {fmt(med([r['p50_ms'] for r in rs]))} | {fmt(med([r['p99_ms'] for r in rs]))} "
                         f"| {fmt(med([r['max_ms'] for r in rs]))} | {fmt(med([r.get('fairness') for r in rs]))} "
                         f"| {len(rs)} |")
        if fa and lg:
            L.append(f"\nFlease acquire / Raft register throughput: "
                     f"{ratio(med([r['throughput'] for r in fa]), med([r['throughput'] for r in lg]))}; "
                     f"p50 latency: {ratio(med([r['p50_ms'] for r in fa]), med([r['p50_ms'] for r in lg]))}.")
        if pa and lg:
            L.append(f"\nPaxosLease acquire / Raft register throughput: "
                     f"{ratio(med([r['throughput'] for r in pa]), med([r['throughput'] for r in lg]))}; "
                     f"p50 latency: {ratio(med([r['p50_ms'] for r in pa]), med([r['p50_ms'] for r in lg]))}.")
        ready = [r["ms"] for r in rows if r.get("kind") == "flease-ready" and r.get("flease_lease_ms", 10000) == 10000]
        if ready:
            L.append(f"\nOn a fresh cluster Flease answered `no_quorum` until its restart wait had passed: the first "
                     f"grant came {fmt(min(ready) / 1000, 1)}–{fmt(max(ready) / 1000, 1)} s after the cluster had a "
                     f"leader ({len(ready)} clusters, default lease time 10 s); the runs above start after it.")
        L.append("")

    watch = sorted((r for r in rows if r.get("system") == "leasecore" and str(r.get("workload", "")).startswith("watch-")),
                   key=lambda r: (r["watchers"], r.get("mode", "long-poll")))
    if watch:
        L.append(f"{heading} Watch wake-up latency (leasecore; put acknowledged → event delivered)\n")
        L.append("| watchers | how | events | deliveries | p50 ms | p99 ms | max ms | bytes per idle watcher |")
        L.append("|---|---|---|---|---|---|---|---|")
        for r in watch:
            how = {"long-poll": "a long poll each", "sse": "an SSE stream each"}.get(
                r.get("mode", "long-poll"), str(r.get("mode", "")).replace("streams-", "") + " multi-watch streams")
            L.append(f"| {r['watchers']:,} | {how} | {r['events']} | {r['deliveries']:,} | {fmt(r['p50_ms'])} "
                     f"| {fmt(r['p99_ms'])} | {fmt(r['max_ms'])} | {fmt(r.get('bytes_per_idle_watcher'), 0)} |")
        L.append("")

    exp = [r for r in rows if r.get("workload") == "expiry"]
    if exp:
        L.append(f"{heading} Lease expiry lateness (deletion seen by a watch − (grant reply + TTL); median of runs)\n")
        L.append("| system | leases | TTL ms | grant conns | observed | early | p50 ms | p99 ms | max ms | runs |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for sysname in ("leasecore", "etcd"):
            rs = [r for r in exp if r["system"] == sysname]
            if rs:
                L.append(f"| {sysname} | {rs[0]['leases']:,} | {rs[0]['ttl_ms']} | {rs[0].get('grant_connections', '')} "
                         f"| {min(r['observed'] for r in rs):,} (min) | {sum(r['early'] for r in rs)} "
                         f"| {fmt(med([r['p50_ms'] for r in rs]))} | {fmt(med([r['p99_ms'] for r in rs]))} "
                         f"| {fmt(med([r['max_ms'] for r in rs]))} | {len(rs)} |")
        L.append("")

    mem = [r for r in rows if r.get("kind") == "memory"]
    lcmem = lc("lease-memory")
    fm = lc("flease-memory") + lc("paxoslease-memory")
    if mem or fm:
        L.append(f"{heading} Memory\n")
        L.append("| system | what | per node: RSS before → after (MiB) | bytes per item, per node |")
        L.append("|---|---|---|---|")
        for r in mem:
            n = r["leases"]
            nodes = ", ".join(f"{b / 2**20:.0f} → {a / 2**20:.0f}" for b, a in zip(r["rss_before"], r["rss_after"]))
            per = ", ".join(f"{(a - b) / n:,.0f}" for b, a in zip(r["rss_before"], r["rss_after"]))
            L.append(f"| {r['system']} | {n:,} leases with one key each | {nodes} | {per} |")
        for r in lcmem:
            L.append(f"| leasecore | same, as `leasecore bench lease-memory` reports it (first endpoint, /metrics) "
                     f"| {r['rss_before'] / 2**20:.0f} → {r['rss_after'] / 2**20:.0f} | {fmt(r['bytes_per_lease'], 0)} |")
        for r in watch:
            if r.get("bytes_per_idle_watcher") is not None:
                L.append(f"| leasecore | {r['watchers']:,} idle watchers, {r.get('mode', 'long-poll')} (serving node) | – "
                         f"| {fmt(r['bytes_per_idle_watcher'], 0)} per watcher |")
        for r in fm:
            if "bytes_per_resource" in r and "rss_before" in r:
                L.append(f"| leasecore | {r.get('resources', 0):,} idle {r.get('protocol', 'flease')} resources "
                         f"({r.get('cells', 0):,.0f} acceptor cells at the end; first endpoint, /metrics) "
                         f"| {r['rss_before'] / 2**20:.0f} → {r['rss_after'] / 2**20:.0f} "
                         f"| {fmt(r['bytes_per_resource'], 0)} per cell |")
            else:
                fields = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("kind", "system", "workload", "rep"))
                L.append(f"| leasecore | idle Flease resources | – | {fields} |")
        L.append("")

    fo = [r for r in rows if r.get("kind") == "failover"]
    if fo:
        L.append(f"{heading} Leader failover (kill -9 of the leader → first successful write through a survivor)\n")
        L.append("| system | kills | min ms | median ms | max ms |")
        L.append("|---|---|---|---|---|")
        for name, sysname, field in (("leasecore", "leasecore", "ms"), ("etcd", "etcd", "ms"),
                                     ("etcd, client timeout 1 s (retried)", "etcd", "ms_client_timeout_1s")):
            ms = [r[field] for r in fo if r["system"] == sysname and isinstance(r.get(field), (int, float))]
            if ms:
                L.append(f"| {name} | {len(ms)} | {min(ms):,} | {fmt(statistics.median(ms), 0)} | {max(ms):,} |")
        L.append("\nThe writer retries every 10 ms with a 10 s client timeout (scripts/failover.sh). etcd holds a "
                 "write it could not hand to the dead leader for its request timeout (5 s + 2 election timeouts "
                 "= 7 s) before failing it, so a second etcd writer with a 1 s client timeout runs alongside.\n")

    goals = goal_rows(rows, tt, watch, exp)
    if goals:
        L.append(f"{heading} Goals of issue 6 (from this run's medians)\n")
        L.append("| goal | measured | holds |")
        L.append("|---|---|---|")
        L.extend(f"| {a} | {b} | {c} |" for a, b, c in goals)
        L.append("")

    L.append(f"{heading} Machine and versions\n")
    for k in ("date", "nproc", "cpu", "mem_gib", "kernel", "os", "disk", "fsync", "leasecore_rev", "etcd", "wrk",
              "python", "mode", "reps", "duration_s", "driver", "fresh_cluster_per_run", "wrk_flags", "value_bytes",
              "keyspace", "lease_grant_ttl_s", "refresh_ttl_s"):
        if k in machine:
            v = machine[k]
            L.append(f"- {k}: `{json.dumps(v) if isinstance(v, (dict, list)) else v}`")
    if flags.strip():
        L.append(f"\n{heading} Flags\n")
        L.append("```")
        L.append(flags.strip())
        L.append("```")
    return "\n".join(L) + "\n"


def goal_rows(rows, tt, watch, exp):
    def find(wl, c):
        for w, _l, cc, per in tt:
            if w == wl and cc == c:
                return per
        return None

    out = []

    def tput(name, wl, c, factor, p99_too=False):
        per = find(wl, c)
        if not per or "etcd" not in per:
            return
        lr, er = per["leasecore"]["rps"], per["etcd"]["rps"]
        ok = lr >= factor * er
        text = f"{lr / er:.2f}× etcd"
        if p99_too:
            lp, ep = per["leasecore"]["p99"], per["etcd"]["p99"]
            ok = ok and lp <= ep
            text += f", p99 {fmt(lp)} vs {fmt(ep)} ms"
        out.append((name, text, "yes" if ok else "no"))

    tput("put throughput ≥ 3× etcd at 64 connections, p99 no worse", "put", 64, 3, True)
    tput("lease refresh ≥ 3× etcd", "lease-refresh", 64, 3)
    tput("linearizable get ≥ 2× etcd", "get", 64, 2)
    lce = [r for r in exp if r["system"] == "leasecore" and r["leases"] >= 10000]
    if lce:
        p = med([r["p99_ms"] for r in lce])
        out.append(("expiry lateness p99 < 50 ms at 10,000 leases", f"{fmt(p)} ms", "yes" if p < 50 else "no"))
    for mode, how in (("long-poll", "a long poll each"), ("sse", "an SSE stream each"),
                      ("streams-10", "over 10 multi-watch streams")):
        w = [r for r in watch if r["watchers"] >= 10000 and r.get("mode", "long-poll") == mode]
        if w:
            p = w[-1]["p99_ms"]
            out.append((f"watch wake-up p99 < 50 ms at 10,000 watchers ({how})", f"{fmt(p)} ms",
                        "yes" if p < 50 else "no"))
    return out


# ---------------------------------------------------------------- the plot (hand-written SVG)

def svg_plot(rows):
    tt = throughput_table(rows)
    cats = [(f"{label} (c={c})", per) for _wl, label, c, per in tt]
    if not cats:
        return None
    colors = {"leasecore": "#2b6cb0", "etcd": "#dd6b20"}
    left, width, bar, gap, top = 250, 560, 11, 10, 50
    panel_h = len(cats) * (2 * bar + gap) + 40
    total_h = top + 2 * panel_h + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 120}" height="{total_h}" '
           f'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="10" y="22" font-size="15" font-weight="bold">leasecore vs etcd: median ok req/s and p99 latency '
           '(same machine, same run, wrk)</text>']
    for i, (s, col) in enumerate(colors.items()):
        out.append(f'<rect x="{left + i * 120}" y="32" width="12" height="12" fill="{col}"/>'
                   f'<text x="{left + i * 120 + 16}" y="42">{s}</text>')
    for pi, (field, title, unit) in enumerate((("rps", "Throughput, ok requests/s (higher is better)", ""),
                                               ("p99", "p99 latency, ms (lower is better)", " ms"))):
        y0 = top + pi * panel_h + 20
        out.append(f'<text x="10" y="{y0}" font-weight="bold">{html.escape(title)}</text>')
        vmax = max((v[field] for _c, per in cats for v in per.values() if v[field] is not None), default=1) or 1
        y = y0 + 12
        for label, per in cats:
            out.append(f'<text x="{left - 8}" y="{y + bar + 4}" text-anchor="end">{html.escape(label)}</text>')
            for s in ("leasecore", "etcd"):
                v = per.get(s, {}).get(field)
                if v is not None:
                    w = max(1.0, width * v / vmax)
                    out.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="{colors[s]}"/>'
                               f'<text x="{left + w + 4:.1f}" y="{y + bar - 1}" font-size="10">{fmt(v)}{unit}</text>')
                y += bar
            y += gap
        out.append(f'<line x1="{left}" y1="{y0 + 8}" x2="{left}" y2="{y - gap + 2}" stroke="#444"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- BENCHMARKS.md

def benchmarks_md(rows, machine, flags):
    m = machine
    templates = "\n".join(f"| {w} | {a} | {b} | {c} | {d} |" for w, a, b, c, d in TEMPLATES)
    fs = m.get("fsync", {})
    fsync = f"p50 {fs.get('fdatasync_4k_p50_ms', '?')} ms, p99 {fs.get('fdatasync_4k_p99_ms', '?')} ms"
    etcd_note = "" if m.get("etcd", "skipped") != "skipped" else (
        "\n**etcd was not available for this run: only leasecore's figures are shown.**\n")
    return f"""# Benchmarks: leasecore next to etcd 3.4

Measured by `scripts/bench.sh --write` on {m.get('date', '?')[:10]}: leasecore (`{m.get('leasecore_rev', '?')}`)
and etcd {m.get('etcd', '?')} on the same machine, in the same run, with the same load generator
({m.get('wrk', 'wrk')}) and the same connection counts. Figures are medians of {m.get('reps', '?')}
repetitions of {m.get('duration_s', '?')} s. They are only comparable within this run on this machine:
read the ratios, not the absolute numbers.
{etcd_note}
![throughput and p99, leasecore vs etcd](bench/throughput.svg)

## How to reproduce

```sh
scripts/bench.sh                 # full run (about 30 min): installs etcd-server and wrk with apt-get if missing
scripts/bench.sh --write         # the same, then rewrites this file and bench/throughput.svg
scripts/bench.sh --only put,get --reps 1 --duration 3    # a subset, shorter
scripts/bench.sh --only etcd-api --reps 2   # etcd's gRPC API of both, one client (leasecore bench --etcd)
scripts/bench.sh --smoke         # leasecore only, a few seconds per workload (run by the tests)
python3 scripts/bench/report.py .bench/<run> [--write .]  # re-render a run's summary
```

Raw results go to `.bench/<timestamp>/results.jsonl` (one JSON line per run; the run published here is
kept as `bench/results.jsonl`), with `summary.md`,
`machine.json`, `flags.txt` and every node's log. `--write` keeps two hand-written parts:
`bench/intro.md` (after the opening) and `bench/analysis.md` (before the machine's description).

## Method

- **Machine.** {m.get('nproc', '?')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gib', '?')} GiB, {m.get('kernel', '?')},
  {m.get('os', '?')}, disk {m.get('disk', '?')} (fdatasync of 4 KiB before the run: {fsync}).
  The load generator and the three nodes share the CPUs; nothing is pinned, so every figure is
  CPU-bound on a small machine.
- **Clusters.** Three nodes of each system on 127.0.0.1, started fresh (new data directories) for
  every single run; only the system under test runs. etcd has its 3.4 defaults written out
  (`--heartbeat-interval 100 --election-timeout 1000 --snapshot-count 100000`), log level warn,
  and is driven through its v3 JSON gateway (HTTP/JSON like leasecore's API). fsync is on for both.
- **Load.** `{m.get('wrk_flags', 'wrk')}`, closed loop, one request in flight per connection,
  leasecore and etcd alternately (A B A B) for each workload. Writes go to a new key each
  ({m.get('value_bytes', 256)}-byte values); reads hit a random key of {m.get('keyspace', 1000)} preloaded
  ones; lease grants use a TTL of {m.get('lease_grant_ttl_s', 60)} s; refreshes / keepalives cycle over one
  lease per connection (TTL {m.get('refresh_ttl_s', 30)} s). The leader is the target except for *put to a follower*.
  Latencies are wrk's percentiles over every response of a run.
- **Honesty checks.** Every response's status and body are checked in the wrk script (table
  below; a body with `"error"` fails too); only checked successes count. After each write run the keys (or leases)
  stored under the run's prefix are counted on the system itself (leasecore: `GET /v1/kv?prefix=`
  / `GET /v1/leases?prefix=`; etcd: `count_only` range / `/v3/lease/leases`), and the run fails
  unless stored ≥ acknowledged and the excess ≤ the connection count (requests still in flight
  when wrk stopped).
- **etcd's gRPC API** (its own table): both systems' etcd v3 API (leasecore's `--etcd-listen`)
  driven by one gRPC client, `leasecore bench --etcd` (messages generated from etcd's protos,
  sent by the generator's own gRPC client on `h2`, one write per request; an HTTP/2
  connection each, one request in flight each, sent to the leader), fresh
  clusters A B A B; every response checked, and after put, txn and lease-grant every
  acknowledged write must be found in the store (put: a new key each under the run's prefix;
  txn: a compare-and-set of a run-unique key per connection, counted by its version; lease-grant:
  the lease list).
- **leasecore-only workloads** use `leasecore bench --json`, which checks every response too.
  Expiry lateness: N leases with one key each, never refreshed; a watch timestamps each
  key's deletion; lateness = deletion seen − (grant reply + TTL) (etcd: the same experiment in
  `scripts/bench/benchctl.py expiry`, with the gateway's `/v3/watch` stream). Memory: resident set
  size of every node from `/proc` before and after granting the leases with one key each.
  Failover: kill -9 of the leader, time until the first successful write through a survivor,
  victim restarted, {len([r for r in rows if r.get('kind') == 'failover' and r.get('system') == 'leasecore']) or 20} times
  (leasecore: `scripts/failover.sh`; etcd: the same loop in `scripts/bench.sh`, plus a second
  writer with a 1 s client timeout, see below).

| workload | leasecore request | success | etcd request | success |
|---|---|---|---|---|
{templates}

{summary_markdown(rows, machine, flags)}"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--write", metavar="ROOT", help="write ROOT/BENCHMARKS.md and ROOT/bench/throughput.svg")
    a = p.parse_args()
    rows, machine, flags = load(a.run_dir)
    if not a.write:
        sys.stdout.write(summary_markdown(rows, machine, flags))
        return
    os.makedirs(os.path.join(a.write, "bench"), exist_ok=True)
    svg = svg_plot(rows)
    if svg:
        with open(os.path.join(a.write, "bench", "throughput.svg"), "w") as f:
            f.write(svg)
    md = benchmarks_md(rows, machine, flags)
    # A hand-written introduction (bench/intro.md) goes after the generated opening, so that a
    # new run's file keeps it; its first line, an HTML comment for its editors, is left out.
    intro = os.path.join(a.write, "bench", "intro.md")
    if os.path.exists(intro):
        with open(intro) as f:
            text = f.read()
        if text.startswith("<!--"):
            text = text.split("\n", 1)[1] if "\n" in text else ""
        cut = md.find("![throughput")
        if text.strip() and cut >= 0:
            md = md[:cut] + text.rstrip() + "\n\n" + md[cut:]
    # Hand-written findings (bench/analysis.md) go before the machine description.
    analysis = os.path.join(a.write, "bench", "analysis.md")
    if os.path.exists(analysis):
        with open(analysis) as f:
            notes = f.read().rstrip() + "\n\n"
        cut = md.find("## Machine and versions")
        md = md[:cut] + notes + md[cut:] if cut >= 0 else md + "\n" + notes
    with open(os.path.join(a.write, "BENCHMARKS.md"), "w") as f:
        f.write(md)
    # The raw results behind the published figures.
    shutil.copyfile(os.path.join(a.run_dir, "results.jsonl"), os.path.join(a.write, "bench", "results.jsonl"))


if __name__ == "__main__":
    main()
