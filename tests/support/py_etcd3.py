"""python-etcd3 (the `etcd3` package, gRPC) against an etcd v3 server.

Run by tests/etcd_python.rs against a leasecore cluster; runs unchanged against a real etcd
(one member: `--members 1`), which is how each expectation here was checked. Every check
prints `ok: ...`; a mismatch prints `MISMATCH: ...` and the script exits 1 at the end (an
unexpected exception exits 1 too, with its traceback). Nothing here waits without a deadline.

Usage: py_etcd3.py --endpoints HOST:PORT[,HOST:PORT...] --members N [--leasecore] [--prefix P]
(`--leasecore`: expect leasecore's documented differences, i.e. no alarm can be raised.)
Each section uses keys under its own prefix (a fresh one per run), so runs do not collide.
"""

import argparse
import io
import os
import queue
import sys
import threading
import time
import uuid

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

import etcd3  # noqa: E402
import etcd3.locks  # noqa: E402
import etcd3.etcdrpc as rpc  # noqa: E402
import etcd3.exceptions as exc  # noqa: E402
import grpc  # noqa: E402
from py_checks import DEADLINE_S, FAILURES, check, section, truthy



class _TenacityShim:
    """etcd3 0.12's Lock.acquire passes tenacity a wait function of (attempt, elapsed), which
    tenacity 7 and later call with one retry state: adapt it (a client-side incompatibility
    between the two packages, the same against etcd)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def retry(self, *args, wait=None, **kwargs):
        if wait is not None and getattr(wait, "__code__", None) is not None \
                and wait.__code__.co_argcount == 2:
            old = wait
            wait = lambda state: old(state.attempt_number,  # noqa: E731
                                     state.seconds_since_start)
        return self._real.retry(*args, wait=wait, **kwargs)


etcd3.locks.tenacity = _TenacityShim(etcd3.locks.tenacity)

def rpc_error(e):
    """The gRPC error behind `e` (the library re-raises some as its own exceptions)."""
    while e is not None and not isinstance(e, grpc.RpcError):
        e = e.__context__
    return e


def raises(what, fn, kinds, status=None):
    """`fn` raises one of `kinds`; with `status` (code name, details), from that gRPC status."""
    try:
        fn()
    except kinds as e:
        if status is not None:
            err = rpc_error(e)
            got = (err.code().name, err.details()) if err is not None else None
            check(what, got, status)
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


def take(q, what):
    """The next item of a queue, within the deadline (None, recorded, when none came)."""
    try:
        return q.get(timeout=DEADLINE_S)
    except queue.Empty:
        print(f"MISMATCH: {what}: nothing within {DEADLINE_S} s")
        FAILURES.append(what)
        return None


def kv(a, b, p):
    """Put, get and their metadata on one member, read through another."""
    a.put(p + "k", "v1")
    value, meta = b.get(p + "k")
    check("get after put (other member)", value, b"v1")
    check("metadata key", meta.key, (p + "k").encode())
    check("metadata version", meta.version, 1)
    check("metadata lease", meta.lease_id, 0)
    check("create == mod revision", meta.create_revision, meta.mod_revision)
    first = meta.mod_revision
    resp = a.put(p + "k", "v2", prev_kv=True)
    check("put prev_kv value", resp.prev_kv.value, b"v1")
    check("put header revision", resp.header.revision, first + 1)
    value, meta = b.get(p + "k")
    check("version after second put", meta.version, 2)
    check("create_revision kept", meta.create_revision, first)
    check("mod_revision moved", meta.mod_revision, first + 1)
    check("get missing", a.get(p + "missing"), (None, None))
    value, _ = b.get(p + "k", serializable=True)
    truthy("serializable get answers", value in (b"v1", b"v2"), repr(value))

    blob = bytes(range(256))
    a.put(p + "bin", blob)
    check("binary value round trip", b.get(p + "bin")[0], blob)
    a.put(p + "empty", "")
    value, meta = b.get(p + "empty")
    check("empty value", value, b"")
    check("empty value exists", meta.version, 1)

    for k in ["r/a", "r/c", "r/b", "r/d"]:
        a.put(p + k, k[-1] * 2)
    keys = [m.key for _, m in b.get_prefix(p + "r/")]
    check("get_prefix in key order", keys, [(p + "r/" + c).encode() for c in "abcd"])
    keys = [m.key for _, m in b.get_prefix(p + "r/", sort_order="descend")]
    check("get_prefix descending", keys, [(p + "r/" + c).encode() for c in "dcba"])
    values = [v for v, _ in b.get_prefix(p + "r/", sort_order="ascend", sort_target="value")]
    check("get_prefix by value", values, [b"aa", b"bb", b"cc", b"dd"])
    mods = [m.mod_revision for _, m in b.get_prefix(p + "r/", sort_order="descend",
                                                     sort_target="mod")]
    check("get_prefix by mod descending", mods, sorted(mods, reverse=True))
    keys = [m.key for _, m in b.get_range(p + "r/b", p + "r/d")]
    check("get_range [b, d)", keys, [(p + "r/b").encode(), (p + "r/c").encode()])
    keys = [m.key for _, m in b.get_all()]
    truthy("get_all holds the keys", (p + "r/a").encode() in keys and (p + "k").encode() in keys)
    check("get_prefix keys_only", [v for v, _ in b.get_prefix(p + "r/", keys_only=True)],
          [b""] * 4)

    check("put_if_not_exists (new)", a.put_if_not_exists(p + "once", "1"), True)
    check("put_if_not_exists (exists)", a.put_if_not_exists(p + "once", "2"), False)
    check("value kept", b.get(p + "once")[0], b"1")
    check("replace (matches)", a.replace(p + "once", "1", "2"), True)
    check("replace (stale)", a.replace(p + "once", "1", "3"), False)
    check("value replaced", b.get(p + "once")[0], b"2")

    check("delete existing", a.delete(p + "once"), True)
    check("delete missing", a.delete(p + "once"), False)
    resp = a.delete(p + "k", prev_kv=True, return_response=True)
    check("delete response deleted", resp.deleted, 1)
    check("delete prev_kv", [kv.value for kv in resp.prev_kvs], [b"v2"])
    resp = a.delete_prefix(p + "r/")
    check("delete_prefix deleted", resp.deleted, 4)
    check("prefix empty after", list(b.get_prefix(p + "r/")), [])


def txn(a, b, p):
    """Transactions: each compare target, each op, nested transactions."""
    t = a.transactions
    a.put(p + "x", "1")
    a.put(p + "y", "1")
    _, mx = a.get(p + "x")
    ok, responses = a.transaction(
        compare=[
            t.value(p + "x") == "1",
            t.version(p + "x") > 0,
            t.create(p + "x") == mx.create_revision,
            t.mod(p + "x") < mx.mod_revision + 1,
            t.value(p + "y") != "2",
        ],
        success=[t.put(p + "x", "2"), t.get(p + "y"), t.delete(p + "y")],
        failure=[t.put(p + "x", "failed")],
    )
    check("txn succeeded", ok, True)
    check("txn response count", len(responses), 3)
    check("txn range answer", [v for v, _ in responses[1]], [b"1"])
    check("txn wrote", b.get(p + "x")[0], b"2")
    check("txn deleted", b.get(p + "y"), (None, None))

    ok, responses = a.transaction(
        compare=[t.value(p + "x") == "1"],
        success=[t.put(p + "x", "never")],
        failure=[t.get(p + "x"), t.put(p + "z", "from-failure")],
    )
    check("txn failed compare", ok, False)
    check("failure branch range", [v for v, _ in responses[0]], [b"2"])
    check("failure branch put", b.get(p + "z")[0], b"from-failure")

    ok, responses = a.transaction(
        compare=[t.version(p + "nope") == 0],
        success=[
            t.txn(
                compare=[t.value(p + "x") == "2"],
                success=[t.put(p + "nested", "yes")],
                failure=[],
            )
        ],
        failure=[],
    )
    check("outer txn", ok, True)
    check("nested txn succeeded", responses[0].response_txn.succeeded, True)
    check("nested txn wrote", b.get(p + "nested")[0], b"yes")

    ok, _ = a.transaction(compare=[t.value(p + "x") > "1"], success=[], failure=[])
    check("value > compare", ok, True)
    ok, _ = a.transaction(compare=[t.mod(p + "missing") == 0], success=[], failure=[])
    check("mod of a missing key is 0", ok, True)
    # A key written twice in one txn is refused, as etcd refuses it.
    raises("duplicate key in a txn", lambda: a.transaction(
        compare=[], success=[t.put(p + "d", "1"), t.put(p + "d", "2")], failure=[]),
        (grpc.RpcError, exc.Etcd3Exception),
        ("INVALID_ARGUMENT", "etcdserver: duplicate key given in txn request"))


def leases(a, b, p):
    lease = a.lease(30)
    check("granted ttl", lease.granted_ttl, 30)
    truthy("remaining ttl", 0 < lease.remaining_ttl <= 30, repr(lease.remaining_ttl))
    a.put(p + "leased", "v", lease=lease)
    _, meta = b.get(p + "leased")
    check("key's lease id", meta.lease_id, lease.id)
    check("lease keys", lease.keys, [(p + "leased").encode()])
    refreshed = lease.refresh()
    check("refresh answers one response", len(refreshed), 1)
    check("refresh ttl", refreshed[0].TTL, 30)
    check("refresh id", refreshed[0].ID, lease.id)
    info = b.get_lease_info(lease.id)
    check("lease info id (other member)", info.ID, lease.id)
    lease.revoke()
    check("key deleted by revoke", b.get(p + "leased"), (None, None))
    check("revoked lease ttl", b.get_lease_info(lease.id).TTL, -1)
    raises("revoke again", lambda: a.revoke_lease(lease.id), (grpc.RpcError, exc.Etcd3Exception),
           ("NOT_FOUND", "etcdserver: requested lease not found"))
    refreshed = a.refresh_lease(lease.id)
    check("refresh a revoked lease: ttl 0", [r.TTL for r in refreshed], [0])

    wanted = 0x1000 + int(uuid.uuid4().int % 0xFFFFFF)
    mine = a.lease(20, lease_id=wanted)
    check("lease with a chosen id", mine.id, wanted)
    raises("lease id taken", lambda: a.lease(20, lease_id=wanted),
           (grpc.RpcError, exc.Etcd3Exception),
           ("FAILED_PRECONDITION", "etcdserver: lease already exists"))
    mine.revoke()

    # A short lease expires by itself: its key goes, as a watch sees.
    short = a.lease(2)
    a.put(p + "short", "v", lease=short)
    event = b.watch_once(p + "short", timeout=DEADLINE_S)
    check("expired lease deletes its key", type(event).__name__, "DeleteEvent")
    check("expired lease ttl", b.get_lease_info(short.id).TTL, -1)


def watches(a, b, p):
    got = queue.Queue()
    events, cancel = b.watch(p + "w")

    def drain():
        for e in events:
            got.put(e)
        got.put("done")

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    a.put(p + "w", "1")
    a.put(p + "w-other", "ignored")
    a.put(p + "w", "2")
    a.delete(p + "w")
    seen = [take(got, "watch event") for _ in range(3)]
    check("watch event types", [type(e).__name__ for e in seen],
          ["PutEvent", "PutEvent", "DeleteEvent"])
    check("watch event values", [e.value for e in seen[:2] if e], [b"1", b"2"])
    check("watch event keys", {e.key for e in seen if e}, {(p + "w").encode()})
    cancel()
    check("cancel ends the iterator", take(got, "end of iterator"), "done")

    events, cancel = b.watch_prefix(p + "pre/")
    a.put(p + "pre/1", "a")
    a.put(p + "pre/2", "b")
    first = next(events)
    second = next(events)
    check("watch_prefix keys", [first.key, second.key],
          [(p + "pre/1").encode(), (p + "pre/2").encode()])
    cancel()

    raises("watch_once times out", lambda: b.watch_once(p + "quiet", timeout=0.5),
           exc.WatchTimedOut)
    # The put may land before or after the watch exists: from the next revision, it is seen
    # either way.
    after = a.put(p + "once-mark", "x").header.revision + 1
    threading.Timer(0.3, lambda: a.put(p + "once", "now")).start()
    event = b.watch_once(p + "once", timeout=DEADLINE_S, start_revision=after)
    check("watch_once event", (type(event).__name__, event.value), ("PutEvent", b"now"))

    calls = queue.Queue()
    watch_id = b.add_watch_callback(p + "cb", calls.put)
    a.put(p + "cb", "1")
    response = take(calls, "callback")
    check("callback events", [e.value for e in response.events], [b"1"])
    b.cancel_watch(watch_id)
    a.put(p + "cb", "2")
    # Another watch on the same stream sees a later put: by then a callback would have come.
    fence = a.put(p + "cb-fence", "x").header.revision
    b.watch_once(p + "cb-fence", timeout=DEADLINE_S, start_revision=fence)
    check("no callback after cancel_watch", calls.qsize(), 0)

    calls = queue.Queue()
    watch_id = b.add_watch_prefix_callback(p + "cbp/", calls.put)
    a.put(p + "cbp/x", "1")
    response = take(calls, "prefix callback")
    check("prefix callback key", [e.key for e in response.events], [(p + "cbp/x").encode()])
    b.cancel_watch(watch_id)

    # History: a watch from an old revision replays, with prev_kv and a filter.
    r1 = a.put(p + "h", "1").header.revision
    a.put(p + "h", "2")
    a.delete(p + "h")
    events, cancel = b.watch(p + "h", start_revision=r1, prev_kv=True)
    replay = [next(events) for _ in range(3)]
    cancel()
    check("replay types", [type(e).__name__ for e in replay],
          ["PutEvent", "PutEvent", "DeleteEvent"])
    check("replay prev_kv", [e.prev_value for e in replay[1:]], [b"1", b"2"])
    # (The library cannot send `filters` with protobuf 4 and later: it assigns the repeated
    # field. py_etcd3gw.py checks filters.)

    responses, cancel = b.watch_response(p + "h", start_revision=r1)
    resp = next(responses)
    cancel()
    truthy("watch_response header revision", resp.header.revision >= r1 + 2,
           repr(resp.header.revision))


def locks(a, b, p):
    name = p.strip("/").replace("/", "-") + "-lock"
    lock = a.lock(name, ttl=20)
    check("acquire", lock.acquire(timeout=5), True)
    check("is_acquired", lock.is_acquired(), True)
    check("lock refresh ttl", [r.TTL for r in lock.refresh()], [20])
    other = b.lock(name, ttl=20)
    started = time.monotonic()
    check("contended acquire times out", other.acquire(timeout=1), False)
    truthy("contended acquire waited", time.monotonic() - started >= 0.9)
    check("other is not the holder", other.is_acquired(), False)
    check("release", lock.release(), True)
    check("release again", lock.release(), False)
    check("acquire after release", other.acquire(timeout=5), True)
    other.release()

    # A waiter gets the lock when the holder releases it: its failed try waits on a watch of
    # the lock key (the library's `watch_once`), and the release wakes it. The waiter's client
    # signals once that watch exists, so the release cannot come before it (the library's
    # own race, which etcd has too) and nothing here sleeps on a guess.
    holder = a.lock(name + "-2", ttl=20)
    holder.acquire(timeout=5)
    watching = threading.Event()
    waiter_client = connect_like(b)

    def watch_once_signalling(key, timeout=None, **kwargs):
        responses = queue.Queue()
        watch_id = waiter_client.add_watch_callback(key, responses.put, **kwargs)
        watching.set()
        try:
            return responses.get(timeout=timeout).events[0]
        except queue.Empty:
            raise exc.WatchTimedOut()
        finally:
            waiter_client.cancel_watch(watch_id)

    waiter_client.watch_once = watch_once_signalling
    result = queue.Queue()
    waiter = waiter_client.lock(name + "-2", ttl=20)
    threading.Thread(target=lambda: result.put(waiter.acquire(timeout=DEADLINE_S)),
                     daemon=True).start()
    truthy("waiter watches the lock", watching.wait(DEADLINE_S))
    holder.release()
    check("waiter acquires on release", take(result, "waiter"), True)
    waiter.release()

    with a.lock(name + "-3", ttl=20) as held:
        check("context manager holds", held.is_acquired(), True)
    check("context manager releases", a.get(Lock_key(name + "-3")), (None, None))


def connect_like(client):
    """Another client of the member `client` talks to."""
    host, port = client._url.rsplit(":", 1)
    return etcd3.client(host=host, port=int(port), timeout=DEADLINE_S)


def Lock_key(name):
    return "/locks/" + name


def cluster(a, b, p, members, leasecore):
    listed = list(a.members)
    check("member count", len(listed), members)
    for m in listed:
        truthy(f"member {m.id:x} has client urls", len(m.client_urls) >= 1, repr(m.client_urls))
        truthy(f"member {m.id:x} has peer urls", len(m.peer_urls) >= 1, repr(m.peer_urls))
        truthy(f"member {m.id:x} has a name", m.name != "", repr(m.name))
    status = b.status()
    truthy("status version is 3.x", status.version.startswith("3."), status.version)
    truthy("status names the leader", status.leader is not None
           and status.leader.id in {m.id for m in listed})
    truthy("status raft term", status.raft_term >= 1, repr(status.raft_term))
    truthy("status raft index", status.raft_index >= 1, repr(status.raft_index))
    truthy("status db size", status.db_size > 0, repr(status.db_size))
    truthy("hash is an int", isinstance(a.hash(), int))

    check("no alarms", list(a.list_alarms()), [])
    check("disarming no alarm", a.disarm_alarm(), [])
    if leasecore:
        # A documented difference: leasecore has no alarms to raise, and says so.
        raises("raising an alarm", a.create_alarm, (grpc.RpcError, exc.Etcd3Exception),
               ("UNIMPLEMENTED", "leasecore raises no alarms, so none can be activated (a full "
                "storage quota refuses writes by itself, and lifts when space is freed)"))
    else:
        # etcd raises it for the member named in the request: 0, as the library sends.
        raised = a.create_alarm()
        check("alarm raised", [(x.alarm_type, x.member_id) for x in raised],
              [(rpc.NOSPACE, 0)])
        listed_alarms = list(b.list_alarms())
        check("alarm listed", len(listed_alarms) >= 1, True)
        raises("a put during a NOSPACE alarm", lambda: a.put(p + "nospace", "v"),
               (grpc.RpcError, exc.Etcd3Exception),
               ("RESOURCE_EXHAUSTED", "etcdserver: mvcc: database space exceeded"))
        for alarm in listed_alarms:
            a.disarm_alarm(alarm.member_id)
    check("no alarms after", list(b.list_alarms()), [])
    a.put(p + "after-alarm", "v")

    r1 = a.put(p + "c", "1").header.revision
    a.put(p + "c", "2")
    a.compact(r1 + 1)
    events, cancel = b.watch(p + "c", start_revision=r1 + 1)
    check("watch at the compaction mark", next(events).value, b"2")
    cancel()
    # (watch_once cannot report it: the library's callback reads `.events` of the error.)
    responses, cancel = b.watch_response(p + "c", start_revision=r1)
    raises("watch below the compaction mark", lambda: next(responses), exc.RevisionCompactedError)
    cancel()
    a.defragment()
    print("ok: defragment")
    buf = io.BytesIO()
    a.snapshot(buf)
    truthy("snapshot has bytes", buf.tell() > 0, repr(buf.tell()))


def auth(a, endpoint, p):
    host, port = endpoint.rsplit(":", 1)
    stub = rpc.AuthStub(a.channel)
    password = "pw-" + uuid.uuid4().hex[:8]
    stub.UserAdd(rpc.AuthUserAddRequest(name="root", password=password))
    stub.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
    stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
    stub.AuthEnable(rpc.AuthEnableRequest())
    try:
        root = etcd3.client(host=host, port=int(port), user="root", password=password,
                            timeout=DEADLINE_S)
        # grpcio refuses call credentials on a plaintext channel; the library also sends the
        # token as `token` metadata, which is what etcd reads, so drop the credentials.
        root.call_credentials = None
        root.watcher._credentials = None
        root.put(p + "secret", "s")
        check("authenticated get", root.get(p + "secret")[0], b"s")
        anon = etcd3.client(host=host, port=int(port), timeout=DEADLINE_S)
        raises("unauthenticated get", lambda: anon.get(p + "secret"),
               (grpc.RpcError, exc.Etcd3Exception),
               ("INVALID_ARGUMENT", "etcdserver: user name is empty"))
        raises("wrong password", lambda: etcd3.client(host=host, port=int(port), user="root",
                                                      password="wrong", timeout=DEADLINE_S),
               (grpc.RpcError, exc.Etcd3Exception),
               ("INVALID_ARGUMENT", "etcdserver: authentication failed, invalid user ID or password"))
        events, cancel = root.watch(p + "secret")
        root.put(p + "secret", "t")
        check("authenticated watch", next(events).value, b"t")
        cancel()
        lease = root.lease(10)
        check("authenticated lease refresh", [r.TTL for r in lease.refresh()], [10])
        lease.revoke()
    finally:
        token = rpc.AuthStub(a.channel).Authenticate(
            rpc.AuthenticateRequest(name="root", password=password)).token
        md = (("token", token),)
        stub.AuthDisable(rpc.AuthDisableRequest(), metadata=md)
        stub.UserDelete(rpc.AuthUserDeleteRequest(name="root"))
        stub.RoleDelete(rpc.AuthRoleDeleteRequest(role="root"))
    check("auth off again", a.get(p + "secret")[0], b"t")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoints", required=True)
    ap.add_argument("--members", type=int, required=True)
    ap.add_argument("--leasecore", action="store_true",
                    help="the server is leasecore: expect its documented differences")
    ap.add_argument("--prefix", default="/py-etcd3/" + uuid.uuid4().hex[:8] + "/")
    args = ap.parse_args()
    endpoints = args.endpoints.split(",")
    first, second = endpoints[0], endpoints[-1]

    def connect(ep):
        host, port = ep.rsplit(":", 1)
        return etcd3.client(host=host, port=int(port), timeout=DEADLINE_S)

    a, b = connect(first), connect(second)
    p = args.prefix
    section("kv", kv, a, b, p + "kv/")
    section("txn", txn, a, b, p + "txn/")
    section("leases", leases, a, b, p + "lease/")
    section("watches", watches, a, b, p + "watch/")
    section("locks", locks, a, b, p + "lock/")
    section("cluster", cluster, a, b, p + "cluster/", args.members, args.leasecore)
    section("auth", auth, a, first, p + "auth/")
    if FAILURES:
        print(f"FAILED: {len(FAILURES)} mismatches: {FAILURES}")
        sys.exit(1)
    print("all etcd3 checks passed")


if __name__ == "__main__":
    main()
