"""etcd3gw (OpenStack's client for etcd's gRPC-JSON gateway) against an etcd v3 server.

Run by tests/etcd_python.rs against a leasecore cluster; runs unchanged against a real etcd
(one member: `--members 1`), which is how each expectation here was checked. Every check
prints `ok: ...`; a mismatch prints `MISMATCH: ...` and the script exits 1 at the end (an
unexpected exception exits 1 too, with its traceback). Nothing here waits without a deadline.

Usage: py_etcd3gw.py --endpoints HOST:PORT[,HOST:PORT...] --members N [--prefix P]
"""

import argparse
import queue
import sys
import threading
import uuid

import etcd3gw
from etcd3gw import exceptions as exc
from py_checks import DEADLINE_S, FAILURES, check, section, truthy

def raises(what, fn, kinds, text=None):
    """`fn` raises one of `kinds`; with `text`, the error's detail contains it."""
    try:
        fn()
    except kinds as e:
        if text is not None and text not in str(e.detail_text if hasattr(e, "detail_text")
                                                else e):
            print(f"MISMATCH: {what}: {e!r} does not say {text!r}")
            FAILURES.append(what)
        else:
            print(f"ok: {what} ({type(e).__name__})")
        return e
    except Exception as e:  # noqa: BLE001
        print(f"MISMATCH: {what}: raised {type(e).__name__}: {e}")
        FAILURES.append(what)
        return None
    print(f"MISMATCH: {what}: did not raise")
    FAILURES.append(what)
    return None


def next_event(events, what):
    """The next event of a watch iterator, within the deadline."""
    out = queue.Queue()
    threading.Thread(target=lambda: out.put(next(events, None)), daemon=True).start()
    try:
        return out.get(timeout=DEADLINE_S)
    except queue.Empty:
        print(f"MISMATCH: {what}: no event within {DEADLINE_S} s")
        FAILURES.append(what)
        return None


def connect(endpoint, **kw):
    host, port = endpoint.rsplit(":", 1)
    return etcd3gw.client(host=host, port=int(port), timeout=DEADLINE_S, **kw)


def discovery(endpoint, p):
    c = connect(endpoint)
    check("api path discovered from /version", c.api_path, "/v3/")
    # etcd 3.4 serves its gateway under /v3beta too (as 3.3 did), and clients pinned to it
    # (api_path, or ETCD3GW_API_PATH) keep working.
    beta = connect(endpoint, api_path="/v3beta/")
    check("put through /v3beta", beta.put(p + "beta", "b"), True)
    check("get through /v3", c.get(p + "beta"), [b"b"])
    truthy("status through /v3beta", "version" in beta.status())


def kv(a, b, p):
    check("put", a.put(p + "k", "v1"), True)
    check("get (other member)", b.get(p + "k"), [b"v1"])
    [(value, meta)] = b.get(p + "k", metadata=True)
    check("value with metadata", value, b"v1")
    check("metadata key", meta["key"], (p + "k").encode())
    check("metadata version (int64 as a string)", meta["version"], "1")
    check("no lease field for lease 0", "lease" in meta, False)
    first = int(meta["mod_revision"])
    a.put(p + "k", "v2")
    [(_, meta)] = b.get(p + "k", metadata=True)
    check("create_revision kept", int(meta["create_revision"]), first)
    check("mod_revision moved", int(meta["mod_revision"]), first + 1)
    check("past revision", b.get(p + "k", revision=first), [b"v1"])
    check("get missing", a.get(p + "missing"), [])
    check("serializable get", b.get(p + "k", serializable=True) in ([b"v1"], [b"v2"]), True)
    a.put(p + "empty", "")
    check("empty value", b.get(p + "empty"), [b""])
    blob = bytes([0, 255, 128, 10])
    a.put(p + "bin", blob)
    check("binary value", b.get(p + "bin"), [blob])

    for k in ["r/b", "r/a", "r/d", "r/c"]:
        a.put(p + k, k[-1] * 2)
    keys = [m["key"] for _, m in b.get_prefix(p + "r/")]
    check("get_prefix in key order", keys, [(p + "r/" + c).encode() for c in "abcd"])
    keys = [m["key"] for _, m in b.get_prefix(p + "r/", sort_order="descend")]
    check("get_prefix descending", keys, [(p + "r/" + c).encode() for c in "dcba"])
    values = [v for v, _ in b.get_prefix(p + "r/", sort_order="descend", sort_target="value")]
    check("get_prefix by value descending", values, [b"dd", b"cc", b"bb", b"aa"])
    values = [v for v, _ in b.get_prefix(p + "r/", sort_order="ascend", sort_target="create")]
    check("get_prefix by create ascending", values, [b"bb", b"aa", b"dd", b"cc"])
    check("limit", len(b.get(p + "r/", range_end=p + "r0", limit=2)), 2)
    check("range_end", b.get(p + "r/b", range_end=p + "r/d"), [b"bb", b"cc"])
    check("keys_only", b.get(p + "r/a", keys_only=True), [b""])
    check("count_only", b.get(p + "r/", range_end=p + "r0", count_only=True), [])
    mods = [int(m["mod_revision"]) for _, m in b.get_prefix(p + "r/")]
    check("min_mod_revision", len(b.get(p + "r/", range_end=p + "r0",
                                        min_mod_revision=max(mods))), 1)
    check("max_create_revision", len(b.get(p + "r/", range_end=p + "r0",
                                           max_create_revision=min(mods))), 1)
    keys = [m["key"] for _, m in b.get_all()]
    truthy("get_all holds the keys", (p + "r/a").encode() in keys)

    check("create (new)", a.create(p + "once", "1"), True)
    check("create (exists)", a.create(p + "once", "2"), False)
    check("replace (matches)", a.replace(p + "once", "1", "2"), True)
    check("replace (stale)", a.replace(p + "once", "1", "3"), False)
    check("value after replace", b.get(p + "once"), [b"2"])
    check("delete existing", a.delete(p + "once"), True)
    check("delete missing", a.delete(p + "once"), False)
    check("delete with prev_kv", a.delete(p + "k", prev_kv=True), True)
    check("delete_prefix", a.delete_prefix(p + "r/"), True)
    check("prefix empty after", b.get_prefix(p + "r/"), [])


def txn(a, b, p):
    key = etcd3gw.utils._encode(p + "x")
    a.put(p + "x", "1")
    [(_, meta)] = a.get(p + "x", metadata=True)
    result = a.transaction({
        "compare": [
            {"key": key, "result": "EQUAL", "target": "VALUE",
             "value": etcd3gw.utils._encode("1")},
            {"key": key, "result": "GREATER", "target": "VERSION", "version": 0},
            {"key": key, "result": "EQUAL", "target": "CREATE",
             "create_revision": meta["create_revision"]},
            {"key": key, "result": "LESS", "target": "MOD",
             "mod_revision": int(meta["mod_revision"]) + 1},
            {"key": key, "result": "EQUAL", "target": "LEASE", "lease": 0},
        ],
        "success": [
            {"request_put": {"key": key, "value": etcd3gw.utils._encode("2"),
                             "prev_kv": True}},
            {"request_range": {"key": key}},
        ],
        "failure": [],
    })
    check("txn succeeded", result.get("succeeded"), True)
    responses = result.get("responses", [])
    check("txn response kinds", [sorted(r) for r in responses],
          [["response_put"], ["response_range"]])
    if len(responses) == 2:
        check("txn put prev_kv", etcd3gw.utils._decode(
            responses[0]["response_put"]["prev_kv"]["value"]), b"1")
        check("txn range sees the put", etcd3gw.utils._decode(
            responses[1]["response_range"]["kvs"][0]["value"]), b"2")
    result = a.transaction({
        "compare": [{"key": key, "result": "EQUAL", "target": "VALUE",
                     "value": etcd3gw.utils._encode("1")}],
        "success": [],
        "failure": [{"request_delete_range": {"key": key, "prev_kv": True}}],
    })
    check("failed txn omits succeeded", "succeeded" in result, False)
    deleted = result["responses"][0]["response_delete_range"]
    check("failure branch deleted", deleted.get("deleted"), "1")
    check("key gone", b.get(p + "x"), [])
    # Enum values as numbers (proto3 JSON allows both), as some gateway clients send them.
    result = a.transaction({
        "compare": [{"key": key, "result": 0, "target": 0, "version": 0}],
        "success": [{"request_put": {"key": key, "value": etcd3gw.utils._encode("n")}}],
    })
    check("numeric enums in a compare", result.get("succeeded"), True)


def leases(a, b, p):
    lease = a.lease(ttl=30)
    truthy("lease id", lease.id > 0, repr(lease.id))
    truthy("ttl", 0 < lease.ttl() <= 30, repr(lease.ttl()))
    a.put(p + "leased", "v", lease=lease)
    [(_, meta)] = b.get(p + "leased", metadata=True)
    check("key's lease", int(meta["lease"]), lease.id)
    check("lease keys", lease.keys(), [(p + "leased").encode()])
    check("refresh", lease.refresh(), 30)
    check("revoke", lease.revoke(), True)
    check("key deleted by revoke", b.get(p + "leased"), [])
    check("ttl of a revoked lease", lease.ttl(), -1)
    check("keys of a revoked lease", lease.keys(), [])
    check("refresh of a revoked lease", lease.refresh(), -1)
    raises("revoke again", lease.revoke, exc.Etcd3Exception, "requested lease not found")
    # A lease id already taken: etcd's gateway answers 412, which the library raises as its
    # PreconditionFailedError (the library's lease() always asks for id 0, hence post()).
    taken = a.lease(ttl=30)
    raises("lease id taken", lambda: a.post(a.get_url("/lease/grant"),
                                            json={"TTL": 30, "ID": taken.id}),
           exc.PreconditionFailedError, "lease already exists")
    taken.revoke()
    raises("put with an unknown lease", lambda: a.put(p + "nolease", "v", lease=lease),
           exc.Etcd3Exception, "requested lease not found")


def watches(a, b, p):
    events, cancel = b.watch(p + "w")
    a.put(p + "w", "1")
    a.put(p + "w-other", "x")
    a.delete(p + "w")
    first = next_event(events, "watch put")
    second = next_event(events, "watch delete")
    check("put event", (first or {}).get("type", "PUT"), "PUT")
    check("put event value", (first or {}).get("kv", {}).get("value"), b"1")
    check("delete event", (second or {}).get("type"), "DELETE")
    check("delete event key", (second or {}).get("kv", {}).get("key"), (p + "w").encode())
    cancel()

    events, cancel = b.watch_prefix(p + "pre/")
    a.put(p + "pre/1", "a")
    a.put(p + "pre/2", "b")
    got = [next_event(events, "prefix event") for _ in range(2)]
    check("watch_prefix keys", [e["kv"]["key"] for e in got if e],
          [(p + "pre/1").encode(), (p + "pre/2").encode()])
    cancel()

    raises("watch_once times out", lambda: b.watch_once(p + "quiet", timeout=0.5),
           exc.WatchTimedOut)
    # The put may land before or after the watch exists: from the next revision, it is seen
    # either way.
    after = int(a.status()["header"]["revision"]) + 1
    threading.Timer(0.3, lambda: a.put(p + "once", "now")).start()
    event = b.watch_once(p + "once", timeout=DEADLINE_S, start_revision=after)
    check("watch_once event", event["kv"]["value"], b"now")

    rev = int(a.get(p + "once", metadata=True)[0][1]["mod_revision"])
    a.put(p + "once", "later")
    a.delete(p + "once")
    events, cancel = b.watch(p + "once", start_revision=rev, prev_kv=True)
    replay = [next_event(events, "replayed event") for _ in range(3)]
    cancel()
    check("replay values", [e["kv"].get("value") for e in replay if e],
          [b"now", b"later", None])
    check("replay prev_kv", [e.get("prev_kv", {}).get("value") for e in replay[1:] if e],
          [etcd3gw.utils._encode("now"), etcd3gw.utils._encode("later")])
    events, cancel = b.watch(p + "once", start_revision=rev, filters=["NOPUT"])
    only = next_event(events, "filtered event")
    cancel()
    check("NOPUT filter", (only or {}).get("type"), "DELETE")


def locks(a, b, p):
    name = p.strip("/").replace("/", "-")
    lock = a.lock(name, ttl=20)
    check("acquire", lock.acquire(), True)
    check("is_acquired", lock.is_acquired(), True)
    check("lock refresh", lock.refresh(), 20)
    other = b.lock(name, ttl=20)
    check("contended acquire", other.acquire(), False)
    check("other is not the holder", other.is_acquired(), False)
    check("release", lock.release(), True)
    check("release again", lock.release(), False)
    check("acquire after release", other.acquire(), True)
    other.release()
    with a.lock(name + "-ctx", ttl=20) as held:
        check("context manager holds", held.is_acquired(), True)
    check("context manager releases", a.get("/locks/" + name + "-ctx"), [])


def cluster(a, b, members):
    listed = a.members()
    check("member count", len(listed), members)
    for m in listed:
        truthy(f"member {m.get('ID')} has an ID", int(m.get("ID", "0")) != 0)
        truthy(f"member {m.get('ID')} has clientURLs", len(m.get("clientURLs", [])) >= 1)
        truthy(f"member {m.get('ID')} has peerURLs", len(m.get("peerURLs", [])) >= 1)
        truthy(f"member {m.get('ID')} has a name", m.get("name", "") != "")
    status = b.status()
    truthy("status version is 3.x", status.get("version", "").startswith("3."))
    truthy("status names a listed leader",
           status.get("leader") in {m.get("ID") for m in listed}, repr(status.get("leader")))
    for field in ["dbSize", "raftIndex", "raftTerm", "header"]:
        truthy(f"status has {field}", field in status, repr(sorted(status)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoints", required=True)
    ap.add_argument("--members", type=int, required=True)
    ap.add_argument("--prefix", default="/py-etcd3gw/" + uuid.uuid4().hex[:8] + "/")
    args = ap.parse_args()
    endpoints = args.endpoints.split(",")
    a, b = connect(endpoints[0]), connect(endpoints[-1])
    p = args.prefix
    section("discovery", discovery, endpoints[0], p + "discovery/")
    section("kv", kv, a, b, p + "kv/")
    section("txn", txn, a, b, p + "txn/")
    section("leases", leases, a, b, p + "lease/")
    section("watches", watches, a, b, p + "watch/")
    section("locks", locks, a, b, p + "lock/")
    section("cluster", cluster, a, b, args.members)
    if FAILURES:
        print(f"FAILED: {len(FAILURES)} mismatches: {FAILURES}")
        sys.exit(1)
    print("all etcd3gw checks passed")


if __name__ == "__main__":
    main()
