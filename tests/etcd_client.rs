//! leasecore's etcd v3 gRPC API driven by the Rust `etcd-client` crate (crates.io), a client
//! nobody here wrote, against three real `leasecore serve` processes on loopback:
//!
//! - KV: put, get and delete over a prefix, `prev_kv`, reads at past revisions, through the
//!   leader and through followers;
//! - Txn: compares on value, version, create and mod revision with both branches, and
//!   concurrent compare-and-swap increments through every node that never lose an update;
//! - Watch: a prefix with `prev_kv`, dropped, then resumed on another node from the revision
//!   after the last one seen: exactly the missed events arrive;
//! - Watch and `/v1`: writes of every kind through both APIs on different nodes at once; an
//!   etcd watch and a `/v1` watch on two other nodes deliver exactly the same events;
//! - Lease: grant, a keepalive stream, time-to-live with keys, the list, revoke (which deletes
//!   the attached keys), and expiry;
//! - Failover: the leader is killed with SIGKILL while a writer runs; the client, given all three
//!   endpoints, goes on writing once a new leader is elected, and every acknowledged write,
//!   lease and watch survives;
//! - Binary values: bytes that are not UTF-8 (and a 1 MiB value) written and read back
//!   byte-exact through different nodes; compares in byte order; delete's `prev_kv` and a watch
//!   with `prev_kv` carry the bytes; so do election values; `/v1` shows text as written.
//!
//! The crate's build script compiles etcd's protos with `protoc` (Debian's `protobuf-compiler`,
//! which `scripts/test.sh` installs): without it this file does not build and the suite fails,
//! it never skips.
// Tests wait for conditions and processes against real deadlines.
#![allow(clippy::disallowed_methods)]

use crate::common;

use common::processes::{Cluster, NODES, WAIT};

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, GetResponse, KeyValue,
    LeaseGrantOptions, LeaseKeepAliveStream, LeaseKeeper, LeaseTimeToLiveOptions,
    LeaseTimeToLiveResponse, ProclaimOptions, PutOptions, ResponseHeader, SortOrder, SortTarget,
    Txn, TxnOp, TxnOpResponse, WatchOptions, WatchStream,
};

// ---------------------------------------------------------------------------------------------
// Small helpers over etcd-client's types.

fn rev(h: Option<&ResponseHeader>) -> i64 {
    h.expect("a response header").revision()
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).unwrap()
}

fn pair(kv: &KeyValue) -> (String, String) {
    (text(kv.key()), text(kv.value()))
}

fn pairs(kvs: &[KeyValue]) -> Vec<(String, String)> {
    kvs.iter().map(pair).collect()
}

fn owned(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn prefix() -> Option<GetOptions> {
    Some(GetOptions::new().with_prefix())
}

fn prefix_at(revision: i64) -> Option<GetOptions> {
    Some(GetOptions::new().with_prefix().with_revision(revision))
}

/// The gRPC status of a failed call (it must be one).
fn grpc(e: etcd_client::Error) -> tonic::Status {
    match e {
        etcd_client::Error::GRpcStatus(s) => s,
        other => panic!("expected a gRPC status, got {other:?}"),
    }
}

/// Reads, retried on a [`transient`] failure as etcd's own Go client retries them (a read changes
/// nothing): a healthy cluster on a loaded machine now and then fails the quorum round of a
/// linearizable read ("the leader could not reach a quorum"). Each retry is printed.
trait Reads {
    async fn read(&self, key: impl Into<Vec<u8>>, opts: Option<GetOptions>) -> GetResponse;
    async fn time_to_live(
        &self,
        id: i64,
        opts: Option<LeaseTimeToLiveOptions>,
    ) -> LeaseTimeToLiveResponse;
    async fn lease_ids(&self) -> Vec<i64>;
}

/// Whether a call failed without an answer from leasecore's logic: `Unavailable` (no quorum or
/// leader for now, or no connection), or the connection broke (tonic's "transport error").
fn transient(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Unavailable
        || (s.code() == tonic::Code::Unknown && s.message() == "transport error")
}

/// Call `f` until it succeeds or fails otherwise than [`transient`]ly, within `WAIT`.
async fn unless_unavailable<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(etcd_client::Error::GRpcStatus(s))
                if transient(&s) && Instant::now() < deadline =>
            {
                eprintln!("{what}: retried after {s:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

impl Reads for Client {
    async fn read(&self, key: impl Into<Vec<u8>>, opts: Option<GetOptions>) -> GetResponse {
        let key = key.into();
        unless_unavailable("a range", || {
            let (mut c, key, opts) = (self.clone(), key.clone(), opts.clone());
            async move { c.get(key, opts).await }
        })
        .await
    }

    async fn time_to_live(
        &self,
        id: i64,
        opts: Option<LeaseTimeToLiveOptions>,
    ) -> LeaseTimeToLiveResponse {
        unless_unavailable("a lease time-to-live", || {
            let (mut c, opts) = (self.clone(), opts.clone());
            async move { c.lease_time_to_live(id, opts).await }
        })
        .await
    }

    async fn lease_ids(&self) -> Vec<i64> {
        let all = unless_unavailable("a lease list", || {
            let mut c = self.clone();
            async move { c.leases().await }
        })
        .await;
        all.leases().iter().map(|l| l.id()).collect()
    }
}

/// A keepalive stream, reopened after a [`transient`] failure (as etcd's Go client reopens
/// its keepalive streams): a keepalive is confirmed with a quorum, which a loaded machine now
/// and then misses. Each reopening is printed.
struct Keepalive {
    client: Client,
    id: i64,
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
}

impl Keepalive {
    async fn open(client: &Client, id: i64) -> Keepalive {
        let (keeper, answers) = unless_unavailable("opening a keepalive stream", || {
            let mut c = client.clone();
            async move { c.lease_keep_alive(id).await }
        })
        .await;
        assert_eq!(keeper.id(), id);
        Keepalive {
            client: client.clone(),
            id,
            keeper,
            answers,
        }
    }

    /// Send one keepalive; the TTL answered.
    async fn once(&mut self) -> i64 {
        let deadline = Instant::now() + WAIT;
        loop {
            let answer = async {
                self.keeper.keep_alive().await?;
                self.answers.message().await
            };
            match tokio::time::timeout(WAIT, answer).await {
                Err(_) => panic!("no keepalive answer within {WAIT:?}"),
                Ok(Ok(Some(resp))) => {
                    assert_eq!(resp.id(), self.id);
                    return resp.ttl();
                }
                Ok(Ok(None)) => panic!("the keepalive stream ended"),
                Ok(Err(etcd_client::Error::GRpcStatus(s)))
                    if transient(&s) && Instant::now() < deadline =>
                {
                    eprintln!("a keepalive: the stream is reopened after {s:?}");
                    *self = Keepalive::open(&self.client, self.id).await;
                }
                Ok(Err(e)) => panic!("a keepalive: {e:?}"),
            }
        }
    }
}

/// One watch event as the tests compare them: kind, key, value, mod revision, and the value
/// (and mod revision) of `prev_kv`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Ev {
    delete: bool,
    key: String,
    value: String,
    revision: i64,
    prev: Option<(String, i64)>,
}

fn put_ev(key: &str, value: &str, revision: i64, prev: Option<(&str, i64)>) -> Ev {
    Ev {
        delete: false,
        key: key.into(),
        value: value.into(),
        revision,
        prev: prev.map(|(v, r)| (v.into(), r)),
    }
}

fn del_ev(key: &str, revision: i64, prev: (&str, i64)) -> Ev {
    Ev {
        delete: true,
        key: key.into(),
        value: String::new(),
        revision,
        prev: Some((prev.0.into(), prev.1)),
    }
}

/// The events of the next responses of `stream` (each within `WAIT`), grouped by response,
/// until `done` says the events so far are enough. Creation and progress responses carry no
/// events and are skipped; a cancellation fails the test.
async fn events_until(
    stream: &mut WatchStream,
    mut done: impl FnMut(&[Ev]) -> bool,
) -> Vec<Vec<Ev>> {
    let mut all: Vec<Ev> = Vec::new();
    let mut groups: Vec<Vec<Ev>> = Vec::new();
    for _ in 0..10_000 {
        if done(&all) {
            // A response never splits a revision's events.
            let mut split: BTreeMap<i64, BTreeSet<usize>> = BTreeMap::new();
            for (i, group) in groups.iter().enumerate() {
                for e in group {
                    split.entry(e.revision).or_default().insert(i);
                }
            }
            assert!(
                split.values().all(|responses| responses.len() == 1),
                "a revision's events came in several responses: {groups:#?}"
            );
            return groups;
        }
        let resp = tokio::time::timeout(WAIT, stream.message())
            .await
            .unwrap_or_else(|_| panic!("no watch response within {WAIT:?}; so far {all:#?}"))
            .expect("the watch stream works")
            .expect("the watch stream stays open");
        assert!(!resp.canceled(), "watch canceled: {}", resp.cancel_reason());
        let group: Vec<Ev> = resp
            .events()
            .iter()
            .map(|e| {
                let kv = e.kv().expect("an event has its kv");
                Ev {
                    delete: e.event_type() == EventType::Delete,
                    key: text(kv.key()),
                    value: text(kv.value()),
                    revision: kv.mod_revision(),
                    prev: e.prev_kv().map(|p| (text(p.value()), p.mod_revision())),
                }
            })
            .collect();
        if !group.is_empty() {
            all.extend(group.iter().cloned());
            groups.push(group);
        }
    }
    panic!("the watch never delivered what was expected: {all:#?}");
}

/// A new watch's first response must be its creation; returns the watch id.
async fn created(stream: &mut WatchStream) -> i64 {
    let resp = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("the watch is created in time")
        .expect("the watch stream works")
        .expect("the watch stream stays open");
    assert!(
        resp.created() && !resp.canceled() && resp.events().is_empty(),
        "{resp:?}"
    );
    resp.watch_id()
}

// ---------------------------------------------------------------------------------------------
// 1. KV

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_prefix_prev_kv_and_past_revisions_through_leader_and_followers() {
    let c = Cluster::start().await;
    let leader = c.leader().await;
    let (f1, f2) = c.followers(leader);
    let mut on_leader = c.client(&[leader]).await;
    let mut on_f1 = c.client(&[f1]).await;
    let mut on_f2 = c.client(&[f2]).await;

    // A key outside the prefix first, so that the revision before app/a's is a real one (0
    // would mean "now").
    on_leader.put("other", "0", None).await.unwrap();
    let put = on_leader.put("app/a", "1", None).await.unwrap();
    let r1 = rev(put.header());
    assert!(r1 >= 2);
    assert!(put.prev_key().is_none());
    // A linearizable read through a follower sees the write at once, answered by that node.
    let got = on_f1.read("app/a", None).await;
    assert_eq!(pairs(got.kvs()), owned(&[("app/a", "1")]));
    assert_eq!(got.header().unwrap().member_id(), f1 as u64);
    assert!(rev(got.header()) >= r1);

    // prev_kv through a follower: the version replaced, with its revisions.
    let put = on_f2
        .put("app/a", "2", Some(PutOptions::new().with_prev_key()))
        .await
        .unwrap();
    let r2 = rev(put.header());
    assert!(r2 > r1);
    let prev = put.prev_key().expect("prev_kv");
    assert_eq!(
        (pair(prev), prev.mod_revision(), prev.version()),
        (("app/a".into(), "1".into()), r1, 1)
    );
    // prev_kv of a key that did not exist: none.
    let put = on_f1
        .put("app/b", "3", Some(PutOptions::new().with_prev_key()))
        .await
        .unwrap();
    assert!(put.prev_key().is_none());
    let r3 = rev(put.header());
    // Keys beside the prefix: "app0" is the prefix's end, "ap" sorts before it.
    on_leader.put("app0", "out", None).await.unwrap();
    on_f2.put("ap", "out", None).await.unwrap();

    let all = on_f2.read("app/", prefix()).await;
    assert_eq!(pairs(all.kvs()), owned(&[("app/a", "2"), ("app/b", "3")]));
    assert_eq!(all.count(), 2);
    let a = &all.kvs()[0];
    assert_eq!(
        (
            a.create_revision(),
            a.mod_revision(),
            a.version(),
            a.lease()
        ),
        (r1, r2, 2, 0)
    );
    let limited = on_leader
        .read("app/", Some(GetOptions::new().with_prefix().with_limit(1)))
        .await;
    assert_eq!(
        (pairs(limited.kvs()), limited.more(), limited.count()),
        (owned(&[("app/a", "2")]), true, 2)
    );

    // The past, through each node.
    for (client, at, want) in [
        (on_leader.clone(), r1, owned(&[("app/a", "1")])),
        (on_f1.clone(), r2, owned(&[("app/a", "2")])),
        (on_f2.clone(), r3, owned(&[("app/a", "2"), ("app/b", "3")])),
        (on_f1.clone(), r1 - 1, vec![]),
    ] {
        let past = client.read("app/", prefix_at(at)).await;
        assert_eq!(pairs(past.kvs()), want, "at revision {at}");
    }
    let past = on_f2
        .read("app/a", Some(GetOptions::new().with_revision(r1)))
        .await;
    assert_eq!(
        (past.kvs()[0].version(), past.kvs()[0].mod_revision()),
        (1, r1)
    );
    // As etcd: the header of a read in the past carries the store's current revision.
    assert!(rev(past.header()) > r3, "{:?}", past.header());

    // The range options: keys only, a sort on values, a serializable read on a follower.
    let keys = on_f1
        .read(
            "app/",
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await;
    assert_eq!(pairs(keys.kvs()), owned(&[("app/a", ""), ("app/b", "")]));
    let sorted = on_leader
        .read(
            "app/",
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Value, SortOrder::Descend),
            ),
        )
        .await;
    assert_eq!(
        pairs(sorted.kvs()),
        owned(&[("app/b", "3"), ("app/a", "2")])
    );
    let local = on_f2
        .read("app/b", Some(GetOptions::new().with_serializable()))
        .await;
    assert_eq!(pairs(local.kvs()), owned(&[("app/b", "3")]));
    assert_eq!(local.header().unwrap().member_id(), f2 as u64);
    // ignore_value keeps the value (and refuses a key that does not exist).
    let kept = on_f1
        .put(
            "app/b",
            "",
            Some(PutOptions::new().with_ignore_value().with_prev_key()),
        )
        .await
        .unwrap();
    assert_eq!(pair(kept.prev_key().unwrap()), ("app/b".into(), "3".into()));
    let b = on_f2.read("app/b", None).await;
    assert_eq!(
        (text(b.kvs()[0].value()), b.kvs()[0].version()),
        ("3".into(), 2)
    );
    let missing = on_leader
        .put("app/none", "", Some(PutOptions::new().with_ignore_value()))
        .await
        .expect_err("ignore_value on a missing key");
    assert_eq!(grpc(missing).code(), tonic::Code::InvalidArgument);
    // A revision the store has not reached is refused, as etcd refuses it.
    let head = rev(on_f1.read("app/", prefix()).await.header());
    let future = grpc(
        on_f1
            .get("app/", prefix_at(head + 1000))
            .await
            .expect_err("a future revision"),
    );
    assert_eq!(future.code(), tonic::Code::OutOfRange, "{future:?}");
    assert!(future.message().contains("future revision"), "{future:?}");

    // A range delete through a follower: every key, one revision, the old versions on request.
    let del = on_f1
        .delete(
            "app/",
            Some(DeleteOptions::new().with_prefix().with_prev_key()),
        )
        .await
        .unwrap();
    assert_eq!(del.deleted(), 2);
    assert_eq!(
        pairs(del.prev_kvs()),
        owned(&[("app/a", "2"), ("app/b", "3")])
    );
    let rd = rev(del.header());
    for client in [&mut on_leader, &mut on_f1, &mut on_f2] {
        let now = client.read("app/", prefix()).await;
        assert_eq!((now.kvs().len(), now.count()), (0, 0));
        assert!(rev(now.header()) >= rd);
        let beside = client.read("ap", prefix()).await;
        assert_eq!(
            pairs(beside.kvs()),
            owned(&[("ap", "out"), ("app0", "out")])
        );
    }
    let before = on_leader.read("app/", prefix_at(rd - 1)).await;
    assert_eq!(
        before.kvs().len(),
        2,
        "both keys live just before the delete"
    );
    let at = on_f2.read("app/", prefix_at(rd)).await;
    assert!(
        at.kvs().is_empty(),
        "both gone in the delete's one revision"
    );

    // A single-key delete with prev_kv, then one of a key that is not there.
    let del = on_f2
        .delete("ap", Some(DeleteOptions::new().with_prev_key()))
        .await
        .unwrap();
    assert_eq!(
        (del.deleted(), pairs(del.prev_kvs())),
        (1, owned(&[("ap", "out")]))
    );
    let head = rev(del.header());
    let gone = on_leader.delete("ap", None).await.unwrap();
    assert_eq!(gone.deleted(), 0);
    assert_eq!(
        rev(gone.header()),
        head,
        "deleting nothing takes no revision"
    );

    // Compaction through a follower: the past below it is refused, from it on still held.
    on_f1.compact(rd, None).await.unwrap();
    let compacted = grpc(
        on_f2
            .get("app/", prefix_at(r1))
            .await
            .expect_err("a compacted revision"),
    );
    assert_eq!(compacted.code(), tonic::Code::OutOfRange, "{compacted:?}");
    assert!(compacted.message().contains("compacted"), "{compacted:?}");
    let kept = on_leader
        .read("app0", Some(GetOptions::new().with_revision(rd)))
        .await;
    assert_eq!(pairs(kept.kvs()), owned(&[("app0", "out")]));
    // A watch from below the compaction is canceled with etcd's reason and the revision to
    // resume from, the compaction's own (as etcd: its events are kept); resumed there, it
    // delivers every event from that revision on, the deletes at it included.
    let mut watch = on_f2
        .watch(
            "app",
            Some(WatchOptions::new().with_prefix().with_start_revision(r1)),
        )
        .await
        .unwrap();
    let mut canceled = None;
    for _ in 0..3 {
        let resp = tokio::time::timeout(WAIT, watch.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if resp.canceled() {
            canceled = Some(resp);
            break;
        }
    }
    let canceled = canceled.expect("the watch is canceled");
    assert!(
        canceled.cancel_reason().contains("compacted"),
        "{canceled:?}"
    );
    let resume = canceled.compact_revision();
    assert_eq!(resume, rd, "{canceled:?} (compacted at {rd})");
    let mut watch = on_f1
        .watch(
            "app",
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(resume),
            ),
        )
        .await
        .unwrap();
    created(&mut watch).await;
    let last = rev(on_leader.put("app/c", "new", None).await.unwrap().header());
    let got = events_until(&mut watch, |got| got.iter().any(|e| e.revision == last))
        .await
        .concat();
    let deleted = |key: &str| Ev {
        delete: true,
        key: key.into(),
        value: String::new(),
        revision: rd,
        prev: None,
    };
    let want = vec![
        deleted("app/a"),
        deleted("app/b"),
        put_ev("app/c", "new", last, None),
    ];
    assert_eq!(got, want);
}

// ---------------------------------------------------------------------------------------------
// 2. Txn

/// The counter's value and mod revision.
fn counter(kv: &KeyValue) -> (u64, i64) {
    (text(kv.value()).parse().unwrap(), kv.mod_revision())
}

fn txn_get(r: &TxnOpResponse) -> &GetResponse {
    match r {
        TxnOpResponse::Get(g) => g,
        other => panic!("expected a range response, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txn_compares_branches_and_concurrent_cas_increments() {
    let c = Cluster::start().await;
    let leader = c.leader().await;
    let (f1, f2) = c.followers(leader);
    let mut on_leader = c.client(&[leader]).await;
    let mut on_f1 = c.client(&[f1]).await;
    let mut on_f2 = c.client(&[f2]).await;

    let created = on_leader.put("cfg", "v1", None).await.unwrap();
    let r1 = rev(created.header());

    // Value compare holds: the success branch runs; its range sees the branch's own put.
    let t = Txn::new()
        .when([Compare::value("cfg", CompareOp::Equal, "v1")])
        .and_then([
            TxnOp::put("cfg", "v2", Some(PutOptions::new().with_prev_key())),
            TxnOp::get("cfg", None),
        ])
        .or_else([TxnOp::get("cfg", None)]);
    let resp = on_f1.txn(t).await.unwrap();
    assert!(resp.succeeded());
    let r2 = rev(resp.header());
    assert!(r2 > r1);
    let ops = resp.op_responses();
    assert_eq!(ops.len(), 2);
    match &ops[0] {
        TxnOpResponse::Put(p) => {
            assert_eq!(
                pair(p.prev_key().expect("prev_kv")),
                ("cfg".into(), "v1".into())
            )
        }
        other => panic!("expected a put response, got {other:?}"),
    }
    let seen = &txn_get(&ops[1]).kvs()[0];
    assert_eq!(
        (text(seen.value()), seen.version(), seen.mod_revision()),
        ("v2".into(), 2, r2)
    );

    // A range at a past revision inside a txn that writes, through a follower: etcd's answer
    // (v1, the past), while the txn's own put applies; a nested one too. The txn applies
    // everywhere; the member that answers reads the past from its history.
    let t = Txn::new().and_then([
        TxnOp::put("touched", "yes", None),
        TxnOp::get("cfg", Some(GetOptions::new().with_revision(r1))),
        TxnOp::txn(
            Txn::new().and_then([TxnOp::get("cfg", Some(GetOptions::new().with_revision(r1)))]),
        ),
    ]);
    let resp = on_f2
        .txn(t)
        .await
        .expect("a past range inside a writing txn");
    let r3 = rev(resp.header());
    let ops = resp.op_responses();
    assert_eq!(pairs(txn_get(&ops[1]).kvs()), owned(&[("cfg", "v1")]));
    match &ops[2] {
        TxnOpResponse::Txn(inner) => {
            assert_eq!(
                pairs(txn_get(&inner.op_responses()[0]).kvs()),
                owned(&[("cfg", "v1")])
            );
        }
        other => panic!("expected a txn response, got {other:?}"),
    }
    assert_eq!(
        pairs(on_leader.read("touched", None).await.kvs()),
        owned(&[("touched", "yes")])
    );
    // A revision after the txn's own fails it whole, with etcd's error; nothing applies.
    let t = Txn::new().and_then([
        TxnOp::put("touched", "again", None),
        TxnOp::get("cfg", Some(GetOptions::new().with_revision(r3 + 5))),
    ]);
    let refused = grpc(on_f1.txn(t).await.expect_err("a future range inside a txn"));
    assert_eq!(refused.code(), tonic::Code::OutOfRange, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("required revision is a future revision"),
        "{refused:?}"
    );
    assert_eq!(
        pairs(on_leader.read("touched", None).await.kvs()),
        owned(&[("touched", "yes")])
    );
    let past = on_f2
        .read("cfg", Some(GetOptions::new().with_revision(r1)))
        .await;
    assert_eq!(pairs(past.kvs()), owned(&[("cfg", "v1")]));
    // A txn that only reads is served as a read (as etcd does): its past ranges read the
    // past, its compares and other ranges the present, nested ones too, on any node.
    let t = Txn::new()
        .when([Compare::value("cfg", CompareOp::Equal, "v2")])
        .and_then([
            TxnOp::get("cfg", Some(GetOptions::new().with_revision(r1))),
            TxnOp::get("cfg", None),
            TxnOp::txn(
                Txn::new()
                    .when([Compare::value("cfg", CompareOp::Equal, "v1")])
                    .and_then([TxnOp::get("cfg", None)])
                    .or_else([TxnOp::get("cfg", Some(GetOptions::new().with_revision(r1)))]),
            ),
        ])
        .or_else([TxnOp::get("cfg", None)]);
    let resp = on_f1.txn(t).await.unwrap();
    assert!(resp.succeeded());
    assert_eq!(rev(resp.header()), r3, "a read writes nothing");
    let ops = resp.op_responses();
    assert_eq!(pairs(txn_get(&ops[0]).kvs()), owned(&[("cfg", "v1")]));
    assert_eq!(pairs(txn_get(&ops[1]).kvs()), owned(&[("cfg", "v2")]));
    match &ops[2] {
        TxnOpResponse::Txn(inner) => {
            assert!(!inner.succeeded(), "the nested compare sees the present");
            let past = txn_get(&inner.op_responses()[0]).kvs().to_vec();
            assert_eq!(pairs(&past), owned(&[("cfg", "v1")]));
        }
        other => panic!("expected a txn response, got {other:?}"),
    }
    // Below the history held, or in the future, it answers as a Range at that revision does.
    let t = Txn::new().and_then([TxnOp::get(
        "cfg",
        Some(GetOptions::new().with_revision(r2 + 1000)),
    )]);
    let future = grpc(on_leader.txn(t).await.expect_err("a future revision"));
    assert_eq!(future.code(), tonic::Code::OutOfRange, "{future:?}");

    // Version compare fails (the key is at version 2): the failure branch runs, nothing changes.
    let t = Txn::new()
        .when([Compare::version("cfg", CompareOp::Equal, 1)])
        .and_then([TxnOp::put("cfg", "wrong", None)])
        .or_else([TxnOp::get("cfg", None)]);
    let resp = on_f2.txn(t).await.unwrap();
    assert!(!resp.succeeded());
    assert_eq!(rev(resp.header()), r3, "a failed compare writes nothing");
    assert_eq!(
        pairs(txn_get(&resp.op_responses()[0]).kvs()),
        owned(&[("cfg", "v2")])
    );

    // Several compares must all hold: version > 1, value != "v1", the current mod revision.
    let t = Txn::new()
        .when([
            Compare::version("cfg", CompareOp::Greater, 1),
            Compare::value("cfg", CompareOp::NotEqual, "v1"),
            Compare::mod_revision("cfg", CompareOp::Equal, r2),
            Compare::create_revision("cfg", CompareOp::Equal, r1),
        ])
        .and_then([TxnOp::put("cfg", "v3", None)]);
    let resp = on_leader.txn(t).await.unwrap();
    assert!(resp.succeeded());
    let r3 = rev(resp.header());
    // A stale mod revision fails, a smaller-than compare on it holds.
    let stale = Txn::new()
        .when([Compare::mod_revision("cfg", CompareOp::Equal, r2)])
        .and_then([TxnOp::delete("cfg", None)]);
    assert!(!on_f1.txn(stale).await.unwrap().succeeded());
    let less = Txn::new()
        .when([Compare::mod_revision("cfg", CompareOp::Less, r3 + 1)])
        .and_then([TxnOp::delete(
            "cfg",
            Some(DeleteOptions::new().with_prev_key()),
        )]);
    let resp = on_f2.txn(less).await.unwrap();
    assert!(resp.succeeded());
    match &resp.op_responses()[0] {
        TxnOpResponse::Delete(d) => {
            assert_eq!(
                (d.deleted(), pairs(d.prev_kvs())),
                (1, owned(&[("cfg", "v3")]))
            )
        }
        other => panic!("expected a delete response, got {other:?}"),
    }
    // Create-if-absent (create revision 0): once only.
    for (i, want) in [(0, true), (1, false)] {
        let t = Txn::new()
            .when([Compare::create_revision("once", CompareOp::Equal, 0)])
            .and_then([TxnOp::put("once", format!("try-{i}"), None)]);
        let client = if i == 0 { &mut on_f1 } else { &mut on_f2 };
        assert_eq!(client.txn(t).await.unwrap().succeeded(), want);
    }
    let once = on_leader.read("once", None).await;
    assert_eq!(pairs(once.kvs()), owned(&[("once", "try-0")]));

    // Concurrent CAS increments: tasks on every node read, then swap on the mod revision; a
    // lost update would show as a missing or repeated value.
    const TASKS: usize = 6;
    const INCREMENTS: usize = 12;
    const MAX_ATTEMPTS: usize = 500;
    on_leader.put("counter", "0", None).await.unwrap();
    let clients = [on_leader, on_f1, on_f2];
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let mut client = clients[t % clients.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut won: Vec<(u64, i64)> = Vec::new();
            let mut conflicts = 0;
            let got = client.read("counter", None).await;
            // The value read and its mod revision.
            let mut current = counter(&got.kvs()[0]);
            for _ in 0..MAX_ATTEMPTS {
                if won.len() == INCREMENTS {
                    break;
                }
                let (n, mod_revision) = current;
                let t = Txn::new()
                    .when([Compare::mod_revision(
                        "counter",
                        CompareOp::Equal,
                        mod_revision,
                    )])
                    .and_then([TxnOp::put(
                        "counter",
                        (n + 1).to_string(),
                        Some(PutOptions::new().with_prev_key()),
                    )])
                    .or_else([TxnOp::get("counter", None)]);
                let resp = client.txn(t).await.unwrap();
                let ops = resp.op_responses();
                if resp.succeeded() {
                    let TxnOpResponse::Put(p) = &ops[0] else {
                        panic!("expected a put response")
                    };
                    let prev = p.prev_key().expect("prev_kv");
                    assert_eq!(text(prev.value()), n.to_string(), "swapped what was read");
                    assert_eq!(prev.mod_revision(), mod_revision);
                    // What this task wrote is current now, at the txn's revision.
                    current = (n + 1, rev(resp.header()));
                    won.push(current);
                } else {
                    // The failure branch read the value that won: try again from it.
                    conflicts += 1;
                    let now = counter(&txn_get(&ops[0]).kvs()[0]);
                    assert!(now.1 > mod_revision, "{now:?} after {current:?}");
                    current = now;
                }
            }
            assert_eq!(won.len(), INCREMENTS, "task {t}: {MAX_ATTEMPTS} attempts");
            (won, conflicts)
        }));
    }
    let mut all = Vec::new();
    let mut conflicts = 0;
    for t in tasks {
        let (won, c) = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("the increments finish")
            .unwrap();
        all.extend(won);
        conflicts += c;
    }
    let total = (TASKS * INCREMENTS) as u64;
    // In revision order, the values are exactly 1, 2, ..., total: none lost, none twice.
    all.sort_by_key(|(_, r)| *r);
    let values: Vec<u64> = all.iter().map(|(v, _)| *v).collect();
    assert_eq!(values, (1..=total).collect::<Vec<_>>());
    let revisions: BTreeSet<i64> = all.iter().map(|(_, r)| *r).collect();
    assert_eq!(revisions.len(), all.len(), "one revision per swap");
    let reader = c.client(&[f2]).await;
    let end = reader.read("counter", None).await;
    let kv = &end.kvs()[0];
    assert_eq!(text(kv.value()), total.to_string());
    assert_eq!(kv.version() as u64, total + 1);
    eprintln!("{total} CAS increments, {conflicts} conflicts retried");
}

// ---------------------------------------------------------------------------------------------
// 3. Watch

/// The first response of a watch that is cancelled at once: it may come after its creation.
async fn canceled_response(stream: &mut WatchStream) -> etcd_client::WatchResponse {
    for _ in 0..3 {
        let resp = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("a response in time")
            .expect("the watch stream works")
            .expect("the watch stream stays open");
        if resp.canceled() {
            return resp;
        }
        assert!(
            resp.events().is_empty(),
            "events before the cancel: {resp:?}"
        );
    }
    panic!("the watch was not canceled");
}

/// A client-chosen watch id already in use on the stream is refused as etcd refuses it: a
/// response created and canceled at once, with watch id -1 and mvcc's reason, while the
/// watch that holds the id goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_watch_id_is_refused_in_etcds_words() {
    let c = Cluster::start().await;
    let mut client = c.client(&[c.leader().await]).await;
    let mut stream = client
        .watch("dup", Some(WatchOptions::new().with_watch_id(7)))
        .await
        .unwrap();
    assert_eq!(created(&mut stream).await, 7);
    stream
        .watch("dup2", Some(WatchOptions::new().with_watch_id(7)))
        .await
        .unwrap();
    let refused = canceled_response(&mut stream).await;
    assert!(refused.created(), "{refused:?}");
    assert_eq!(refused.watch_id(), -1, "{refused:?}");
    assert_eq!(
        refused.cancel_reason(),
        "mvcc: duplicate watch ID provided on the WatchStream"
    );
    let r = rev(client.put("dup", "v", None).await.unwrap().header());
    let got = events_until(&mut stream, |got| !got.is_empty())
        .await
        .concat();
    assert_eq!(
        got,
        [put_ev("dup", "v", r, None)],
        "the first watch goes on"
    );
}

/// etcd's compaction at `R` keeps revision `R`: a watch from `R` delivers the event at `R` (on
/// every node), and one from below is canceled with `compact_revision` `R` itself, where a
/// watch can resume. (leasecore once treated `R` as compacted too and named `R + 1`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_the_compaction_revision_delivers_its_event() {
    let c = Cluster::start().await;
    let leader = c.leader().await;
    let mut writer = c.client(&[leader]).await;
    let before = rev(writer.put("cw0", "old", None).await.unwrap().header());
    let r = rev(writer.put("cw1", "v", None).await.unwrap().header());
    assert!(before < r);
    writer.compact(r, None).await.unwrap();
    for id in 1..=NODES {
        let mut client = c.client(&[id]).await;
        let kept = client
            .get("cw1", Some(GetOptions::new().with_revision(r)))
            .await
            .unwrap();
        assert_eq!(pairs(kept.kvs()), owned(&[("cw1", "v")]), "node {id}");

        let mut at = client
            .watch("cw1", Some(WatchOptions::new().with_start_revision(r)))
            .await
            .unwrap();
        created(&mut at).await;
        let got = events_until(&mut at, |got| !got.is_empty()).await.concat();
        assert_eq!(got, [put_ev("cw1", "v", r, None)], "node {id}");

        let mut below = client
            .watch(
                "cw",
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(before),
                ),
            )
            .await
            .unwrap();
        let canceled = canceled_response(&mut below).await;
        assert!(
            canceled.cancel_reason().contains("compacted"),
            "node {id}: {canceled:?}"
        );
        assert_eq!(
            canceled.compact_revision(),
            r,
            "node {id}: etcd names the compaction revision"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_resumes_on_another_node_with_exactly_the_missed_events() {
    let c = Cluster::start().await;
    let leader = c.leader().await;
    let (f1, f2) = c.followers(leader);
    let mut writer = c.client(&[leader]).await;
    let mut first_node = c.client(&[f1]).await;

    let opts = || WatchOptions::new().with_prefix().with_prev_key();
    let mut watch = first_node.watch("w/", Some(opts())).await.unwrap();
    created(&mut watch).await;

    let put = {
        let writer = writer.clone();
        move |k: &'static str, v: &'static str| {
            let mut w = writer.clone();
            async move { rev(w.put(k, v, None).await.unwrap().header()) }
        }
    };
    let a = put("w/1", "a").await;
    let b = put("w/2", "b").await;
    let c1 = put("w/1", "c").await;
    put("x/other", "unwatched").await;
    let d2 = rev(writer.delete("w/2", None).await.unwrap().header());
    // Two keys in one revision.
    let t = Txn::new().and_then([TxnOp::put("w/3", "d", None), TxnOp::put("w/4", "e", None)]);
    let both = rev(writer.txn(t).await.unwrap().header());
    let first = vec![
        put_ev("w/1", "a", a, None),
        put_ev("w/2", "b", b, None),
        put_ev("w/1", "c", c1, Some(("a", a))),
        del_ev("w/2", d2, ("b", b)),
        put_ev("w/3", "d", both, None),
        put_ev("w/4", "e", both, None),
    ];
    let groups = events_until(&mut watch, |got| got.len() >= first.len()).await;
    let got: Vec<Ev> = groups.concat();
    assert_eq!(got, first);
    let last_seen = got.last().unwrap().revision;

    // The client goes away; writes go on.
    drop(watch);
    let f = put("w/5", "f").await;
    let del = writer
        .delete("w/", Some(DeleteOptions::new().with_prefix()))
        .await
        .unwrap();
    assert_eq!(del.deleted(), 4);
    let gone = rev(del.header());
    put("x/other", "still unwatched").await;
    let g = put("w/1", "g").await;
    let missed = vec![
        put_ev("w/5", "f", f, None),
        del_ev("w/1", gone, ("c", c1)),
        del_ev("w/3", gone, ("d", both)),
        del_ev("w/4", gone, ("e", both)),
        del_ev("w/5", gone, ("f", f)),
        put_ev("w/1", "g", g, None),
    ];

    // Resumed on ANOTHER node from the revision after the last one seen: exactly what was
    // missed, then live events (a marker ends the wait: anything duplicated would precede it).
    let mut second_node = c.client(&[f2]).await;
    let mut resumed = second_node
        .watch("w/", Some(opts().with_start_revision(last_seen + 1)))
        .await
        .unwrap();
    let id = created(&mut resumed).await;
    let end = put("w/end", "marker").await;
    let got = events_until(&mut resumed, |got| got.iter().any(|e| e.key == "w/end"))
        .await
        .concat();
    let mut want = missed.clone();
    want.push(put_ev("w/end", "marker", end, None));
    assert_eq!(got, want);

    // A progress request is answered at once, at least as far as the last event.
    resumed.request_progress().await.unwrap();
    let progress = tokio::time::timeout(WAIT, resumed.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(progress.events().is_empty(), "{progress:?}");
    assert!(rev(progress.header()) >= end, "{progress:?}");

    // Cancel: the server confirms.
    resumed.cancel(id).await.unwrap();
    let resp = tokio::time::timeout(WAIT, resumed.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(resp.canceled() && resp.watch_id() == id, "{resp:?}");

    // The whole history from the first event, on the leader this time: the same events.
    let mut third_node = c.client(&[leader]).await;
    let mut replay = third_node
        .watch("w/", Some(opts().with_start_revision(a)))
        .await
        .unwrap();
    created(&mut replay).await;
    let got = events_until(&mut replay, |got| got.iter().any(|e| e.key == "w/end"))
        .await
        .concat();
    assert_eq!(got, [first, want].concat());
}

/// One event as both APIs can tell it: kind, key, value (empty for a delete) and revision.
type Plain = (bool, String, String, i64);

/// The events `GET /v1/watch?prefix=..` (long polls, on node `base`) delivers from `from`
/// until one of them is for `last`.
async fn v1_events_until(base: &str, prefix: &str, from: i64, last: &str) -> Vec<Plain> {
    let http = reqwest::Client::new();
    let (mut out, mut next) = (Vec::new(), from);
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        let resp: serde_json::Value = http
            .get(format!(
                "{base}/v1/watch?prefix={prefix}&from_revision={next}&timeout_ms=2000"
            ))
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap()
            .json()
            .await
            .unwrap();
        for e in resp["events"].as_array().unwrap() {
            out.push((
                e["type"] == "delete",
                e["key"].as_str().unwrap().to_string(),
                e["value"].as_str().unwrap_or_default().to_string(),
                e["revision"].as_i64().unwrap(),
            ));
        }
        if out.iter().any(|e| e.1 == last) {
            return out;
        }
        next = resp["revision"].as_i64().unwrap() + 1;
    }
    panic!("/v1/watch never delivered {last}: so far {out:#?}");
}

/// Writes of every kind through both APIs on different nodes at once (puts, deletes, range
/// deletes, multi-key txns, a lease revoked through etcd and one left to expire through `/v1`):
/// an etcd watch on one node and a `/v1` watch on another deliver the very same events, in the
/// same order, with the same revisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watches_see_exactly_the_v1_events() {
    let c = Cluster::start().await;
    let leader = c.leader().await;
    let (f1, f2) = c.followers(leader);
    let mut etcd_writer = c.client(&[f2]).await;
    let mut watcher = c.client(&[f1]).await;
    let v1 = |id: usize| format!("http://{}", c.addrs[id - 1]);
    let http = reqwest::Client::new();

    let start = rev(etcd_writer
        .put("m/start", "0", None)
        .await
        .unwrap()
        .header());
    let mut watch = watcher
        .watch(
            "m/",
            Some(WatchOptions::new().with_prefix().with_start_revision(start)),
        )
        .await
        .unwrap();
    created(&mut watch).await;

    // Through etcd (on a follower): puts, a delete, a range delete, a two-key txn, a lease
    // with two keys revoked.
    let etcd_side = {
        let mut w = etcd_writer.clone();
        async move {
            for i in 0..20 {
                w.put(format!("m/e/{i}"), format!("e{i}"), None)
                    .await
                    .unwrap();
                if i % 5 == 4 {
                    w.delete(format!("m/e/{}", i - 1), None).await.unwrap();
                }
                if i % 7 == 6 {
                    let t = Txn::new().and_then([
                        TxnOp::put(format!("m/t/{i}a"), "x", None),
                        TxnOp::put(format!("m/t/{i}b"), "y", None),
                    ]);
                    w.txn(t).await.unwrap();
                }
            }
            let lease = w.lease_grant(60, None).await.unwrap().id();
            for k in ["m/l/1", "m/l/2"] {
                w.put(k, "leased", Some(PutOptions::new().with_lease(lease)))
                    .await
                    .unwrap();
            }
            w.lease_revoke(lease).await.unwrap();
            w.delete("m/t/", Some(DeleteOptions::new().with_prefix()))
                .await
                .unwrap();
        }
    };
    // Through /v1 (on the leader): puts, deletes, a lease that expires with its key.
    let v1_side = {
        let (http, base) = (http.clone(), v1(leader));
        async move {
            async fn ok(r: reqwest::Response) {
                let status = r.status();
                assert!(status.is_success(), "{status}: {}", r.text().await.unwrap());
            }
            ok(http
                .post(format!("{base}/v1/leases"))
                .json(&serde_json::json!({"name": "m-short", "ttl_ms": 1500}))
                .send()
                .await
                .unwrap())
            .await;
            ok(http
                .put(format!("{base}/v1/kv/m/x/leased"))
                .json(&serde_json::json!({"value": "short", "lease": "m-short"}))
                .send()
                .await
                .unwrap())
            .await;
            for i in 0..20 {
                ok(http
                    .put(format!("{base}/v1/kv/m/v/{i}"))
                    .json(&serde_json::json!({"value": format!("v{i}")}))
                    .send()
                    .await
                    .unwrap())
                .await;
                if i % 4 == 3 {
                    ok(http
                        .delete(format!("{base}/v1/kv/m/v/{}", i - 2))
                        .send()
                        .await
                        .unwrap())
                    .await;
                }
            }
        }
    };
    tokio::join!(etcd_side, v1_side);
    // The expiry too, before the marker that ends both watches.
    common::eventually(WAIT, "the short lease's key to expire", || async {
        let kvs = etcd_writer.read("m/x/leased", None).await;
        kvs.kvs().is_empty().then_some(())
    })
    .await;
    let end = rev(etcd_writer.put("m/end", "1", None).await.unwrap().header());

    let etcd_events: Vec<Plain> =
        events_until(&mut watch, |got| got.iter().any(|e| e.key == "m/end"))
            .await
            .concat()
            .into_iter()
            .map(|e| (e.delete, e.key, e.value, e.revision))
            .collect();
    let v1_events = v1_events_until(&v1(f2), "m/", start, "m/end").await;
    assert_eq!(etcd_events, v1_events);
    // Nothing left out: every kind of change is there, from the first revision to the last.
    assert_eq!(etcd_events.first().map(|e| e.3), Some(start));
    assert_eq!(etcd_events.last().map(|e| e.3), Some(end));
    for key in ["m/e/19", "m/v/19", "m/t/6a", "m/l/2", "m/x/leased"] {
        assert!(
            etcd_events.iter().any(|e| e.1 == key),
            "{key} missing from {etcd_events:#?}"
        );
    }
    for deleted in ["m/l/1", "m/l/2", "m/x/leased", "m/t/6b", "m/v/1", "m/e/3"] {
        assert!(
            etcd_events.iter().any(|e| e.1 == deleted && e.0),
            "no delete of {deleted} in {etcd_events:#?}"
        );
    }
    let revisions: Vec<i64> = etcd_events.iter().map(|e| e.3).collect();
    assert!(revisions.windows(2).all(|w| w[0] <= w[1]), "{revisions:?}");
}

// ---------------------------------------------------------------------------------------------
// 4. Lease

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_keepalive_time_to_live_list_revoke_and_expiry() {
    let c = Cluster::start().await;
    let leader = c.leader().await;
    let (f1, f2) = c.followers(leader);
    let mut on_leader = c.client(&[leader]).await;
    let mut on_f1 = c.client(&[f1]).await;
    let mut on_f2 = c.client(&[f2]).await;

    let granted = on_f1.lease_grant(30, None).await.unwrap();
    assert_eq!(granted.ttl(), 30);
    assert!(granted.error().is_empty());
    let id = granted.id();
    assert!(id > 0);
    // An id of the client's choosing; taking it twice is refused.
    let mine = on_leader
        .lease_grant(60, Some(LeaseGrantOptions::new().with_id(0x1234)))
        .await
        .unwrap();
    assert_eq!((mine.id(), mine.ttl()), (0x1234, 60));
    let twice = grpc(
        on_f2
            .lease_grant(60, Some(LeaseGrantOptions::new().with_id(0x1234)))
            .await
            .expect_err("the id is taken"),
    );
    assert!(
        twice.message().contains("lease already exists"),
        "{twice:?}"
    );

    on_leader
        .put("job/a", "1", Some(PutOptions::new().with_lease(id)))
        .await
        .unwrap();
    on_f2
        .put("job/b", "2", Some(PutOptions::new().with_lease(id)))
        .await
        .unwrap();
    on_f1.put("job/free", "3", None).await.unwrap();
    let got = on_f1.read("job/a", None).await;
    assert_eq!(got.kvs()[0].lease(), id);

    let ttl = on_f2
        .time_to_live(id, Some(LeaseTimeToLiveOptions::new().with_keys()))
        .await;
    assert_eq!((ttl.id(), ttl.granted_ttl()), (id, 30));
    assert!((25..=30).contains(&ttl.ttl()), "{ttl:?}");
    let mut keys: Vec<String> = ttl.keys().iter().map(|k| text(k)).collect();
    keys.sort();
    assert_eq!(keys, ["job/a", "job/b"]);
    let no_keys = on_leader.time_to_live(id, None).await;
    assert!(no_keys.keys().is_empty());

    // A keepalive stream through a follower: every keepalive is answered with the full TTL.
    let mut keepalive = Keepalive::open(&on_f2, id).await;
    for _ in 0..4 {
        assert_eq!(keepalive.once().await, 30);
    }

    let listed: BTreeSet<i64> = on_f1.lease_ids().await.into_iter().collect();
    assert_eq!(listed, BTreeSet::from([id, 0x1234]));

    // Revoke through the other follower: the attached keys go with it, in one revision.
    let revoked = on_f1.lease_revoke(id).await.unwrap();
    let rr = rev(revoked.header());
    for client in [&mut on_leader, &mut on_f1, &mut on_f2] {
        let left = client.read("job/", prefix()).await;
        assert_eq!(pairs(left.kvs()), owned(&[("job/free", "3")]));
    }
    let before = on_leader.read("job/", prefix_at(rr - 1)).await;
    assert_eq!(
        before.kvs().len(),
        3,
        "the keys lived until the revoke's revision"
    );
    let ttl = on_leader.time_to_live(id, None).await;
    assert_eq!(ttl.ttl(), -1, "{ttl:?}");
    let listed = on_f2.lease_ids().await;
    assert_eq!(listed, [0x1234]);
    // The open stream now answers TTL 0, a new keeper is refused, and so is a second revoke.
    assert_eq!(keepalive.once().await, 0);
    let refused = on_leader.lease_keep_alive(id).await;
    assert!(
        matches!(refused, Err(etcd_client::Error::LeaseKeepAliveError(_))),
        "{refused:?}"
    );
    let again = grpc(on_f2.lease_revoke(id).await.expect_err("already revoked"));
    assert_eq!(again.code(), tonic::Code::NotFound);
    assert_eq!(again.message(), "etcdserver: requested lease not found");

    // Expiry: a short lease nobody keeps alive takes its key with it (a delete event).
    let short = on_f1.lease_grant(1, None).await.unwrap();
    let short_ttl = short.ttl();
    assert!(short_ttl >= 1);
    let attached = on_f1
        .put("tmp/k", "v", Some(PutOptions::new().with_lease(short.id())))
        .await
        .unwrap();
    let granted_at = Instant::now();
    let mut watch = on_f2
        .watch(
            "tmp/k",
            Some(WatchOptions::new().with_start_revision(rev(attached.header()))),
        )
        .await
        .unwrap();
    created(&mut watch).await;
    let got = events_until(&mut watch, |got| got.iter().any(|e| e.delete))
        .await
        .concat();
    assert_eq!(got.iter().filter(|e| e.delete).count(), 1, "{got:?}");
    let took = granted_at.elapsed();
    assert!(
        took < Duration::from_secs(short_ttl as u64 + 10),
        "expired after {took:?} (TTL {short_ttl} s)"
    );
    assert!(on_leader.read("tmp/k", None).await.kvs().is_empty());
    let ttl = on_f2.time_to_live(short.id(), None).await;
    assert_eq!(ttl.ttl(), -1);
}

// ---------------------------------------------------------------------------------------------
// 5. The leader dies

/// What a writer saw of each of its puts.
#[derive(Default)]
struct Outcomes {
    acked: BTreeMap<String, i64>,
    failed: BTreeSet<String>,
    errors: Failures,
}

/// The errors seen, by kind, with how many of each.
type Failures = BTreeMap<String, usize>;

/// An error's kind: its gRPC code and message, or the client's own error.
fn kind(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(s) => format!("{:?}: {}", s.code(), s.message()),
        other => other.to_string(),
    }
}

/// Call `f` until it succeeds, at most until `WAIT` has passed; counts the failures.
async fn retry<T, F, Fut>(what: &str, failures: &mut Failures, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => {
                *failures.entry(kind(&e)).or_default() += 1;
                assert!(
                    Instant::now() < deadline,
                    "{what}: still failing after {WAIT:?}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_with_every_endpoint_survives_a_sigkilled_leader() {
    let mut c = Cluster::start().await;
    let old = c.leader().await;
    let (f1, f2) = c.followers(old);
    let client = c.client(&[1, 2, 3]).await;
    let mut cl = client.clone();

    // Acknowledged before the kill.
    let mut before = BTreeMap::new();
    for i in 0..40 {
        let (k, v) = (format!("pre/{i:03}"), format!("v{i}"));
        let put = cl.put(k.clone(), v.clone(), None).await.unwrap();
        before.insert(k, (v, rev(put.header())));
    }
    let lease = cl.lease_grant(60, None).await.unwrap().id();
    let owned_put = cl
        .put(
            "owned",
            "by-lease",
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    // A watcher on a node that survives, from the revision after what was just written.
    let mut watcher = c.client(&[f1]).await;
    let mut watch = watcher
        .watch(
            "live/",
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(rev(owned_put.header()) + 1),
            ),
        )
        .await
        .unwrap();
    created(&mut watch).await;

    // A writer that goes on through the kill: one new key per attempt, so that a retry never
    // writes a key twice.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (mut client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            let mut out = Outcomes::default();
            for i in 0..100_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let key = format!("live/{i:05}");
                match client.put(key.clone(), "x", None).await {
                    Ok(put) => {
                        out.acked.insert(key, rev(put.header()));
                    }
                    Err(e) => {
                        *out.errors.entry(kind(&e)).or_default() += 1;
                        out.failed.insert(key);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            out
        })
    };
    // Let the writer get going, then kill -9 the leader.
    common::eventually(WAIT, "the writer's first writes", || {
        let mut cl = client.clone();
        async move {
            let opts = GetOptions::new().with_prefix().with_count_only();
            let n = cl.get("live/", Some(opts)).await.ok()?.count();
            (n >= 10).then_some(())
        }
    })
    .await;
    let killed_at = Instant::now();
    c.kill(old);

    // The client keeps working: a write succeeds once a new leader is elected.
    let mut failures = Failures::new();
    retry("a write after the leader died", &mut failures, || {
        let mut cl = client.clone();
        async move { cl.put("after", "kill", None).await }
    })
    .await;
    let took = killed_at.elapsed();
    let until_first: usize = failures.values().sum();
    let new = c.leader().await;
    assert_ne!(new, old);
    assert!(new == f1 || new == f2);
    // Further writes through the same client, each retried while the client may still pick
    // the dead endpoint, each within the deadline.
    for i in 0..30 {
        let key = format!("post/{i:03}");
        retry(&key, &mut failures, || {
            let (mut cl, key) = (client.clone(), key.clone());
            async move { cl.put(key, "y", None).await }
        })
        .await;
    }
    stop.store(true, Ordering::Relaxed);
    let out = tokio::time::timeout(WAIT, writer)
        .await
        .expect("the writer stops")
        .unwrap();
    assert!(!out.acked.is_empty());

    // Everything acknowledged is there, through the client and on each survivor by itself.
    let mut readers = vec![client.clone()];
    for id in [f1, f2] {
        readers.push(c.client(&[id]).await);
    }
    for reader in &readers {
        let got = retry("read pre/", &mut failures, || {
            let mut r = reader.clone();
            async move { r.get("pre/", prefix()).await }
        })
        .await;
        let seen: BTreeMap<String, (String, i64)> = got
            .kvs()
            .iter()
            .map(|kv| (text(kv.key()), (text(kv.value()), kv.mod_revision())))
            .collect();
        assert_eq!(seen, before);
        let live = retry("read live/", &mut failures, || {
            let mut r = reader.clone();
            async move { r.get("live/", prefix()).await }
        })
        .await;
        let present: BTreeMap<String, i64> = live
            .kvs()
            .iter()
            .map(|kv| (text(kv.key()), kv.mod_revision()))
            .collect();
        for (k, r) in &out.acked {
            assert_eq!(present.get(k), Some(r), "acknowledged {k} at revision {r}");
        }
        // A failed write may have happened (its outcome is unknown); nothing else is there.
        for k in present.keys() {
            assert!(out.acked.contains_key(k) || out.failed.contains(k), "{k}");
        }
    }

    // The lease outlived the failover, with its key; keepalives reach the new leader.
    let ttl = retry("lease time-to-live", &mut failures, || {
        let mut cl = client.clone();
        async move {
            let opts = LeaseTimeToLiveOptions::new().with_keys();
            cl.lease_time_to_live(lease, Some(opts)).await
        }
    })
    .await;
    assert!(ttl.ttl() > 0 && ttl.granted_ttl() == 60, "{ttl:?}");
    assert_eq!(ttl.keys(), [b"owned".to_vec()]);
    let mut keepalive = Keepalive::open(&client, lease).await;
    assert_eq!(keepalive.once().await, 60);

    // The survivor's watch went on across the election: every write that is in the store,
    // once each, in revision order, and nothing else.
    let mut stored: Vec<(String, i64)> = retry("read live/", &mut failures, || {
        let mut cl = client.clone();
        async move { cl.get("live/", prefix()).await }
    })
    .await
    .kvs()
    .iter()
    .map(|kv| (text(kv.key()), kv.mod_revision()))
    .collect();
    stored.sort_by_key(|(_, r)| *r);
    let want = stored.len();
    let got = events_until(&mut watch, |got| got.len() >= want)
        .await
        .concat();
    let seen: Vec<(String, i64)> = got.iter().map(|e| (e.key.clone(), e.revision)).collect();
    assert_eq!(seen, stored);
    assert!(got.iter().all(|e| !e.delete));
    eprintln!(
        "leader {old} killed; the first write succeeded after {took:?} ({until_first} failed \
         attempts); new leader {new}; the writer: {} acknowledged, {} failed {:?}; failed calls \
         of the checks after the kill: {failures:?}",
        out.acked.len(),
        out.failed.len(),
        out.errors,
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Binary values

/// The value of `kv`, which must be there.
fn value_of(resp: &GetResponse) -> Vec<u8> {
    assert_eq!(resp.kvs().len(), 1, "one key: {resp:?}");
    resp.kvs()[0].value().to_vec()
}

/// Values are bytes, as in etcd: random non-UTF-8 bytes (0x00 and 0xff among them), a value
/// that is UTF-8 but begins with NUL, and a binary value of the whole value limit (1 MiB) are
/// written through one follower and read back byte-exact through the other; txn compares on
/// them are byte-exact (`=`) and in byte order (`>`, `<`, and a sort by value); delete's
/// `prev_kv` and a watch from a past revision (with `prev_kv`) carry the bytes, as an
/// election's campaign and proclaimed values do. A text value reads the same through `/v1`; a
/// binary one shows there in its stored form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_values_round_trip_byte_exact() {
    use rand::Rng;
    let c = Cluster::start().await;
    let leader = c.leader().await;
    let (f1, f2) = c.followers(leader);
    let mut writer = c.client(&[f1]).await;
    let reader = c.client(&[f2]).await;

    let mut rng = rand::rng();
    let mut first = vec![0x00, 0xff, 0xfe, 0x80];
    first.extend((0..60).map(|_| rng.random::<u8>()));
    let mut second = vec![0xff, 0x00, 0xc3, 0x28];
    second.extend((0..60).map(|_| rng.random::<u8>()));
    let mut big = vec![0u8; 1 << 20];
    rng.fill(&mut big[..]);
    big[..3].copy_from_slice(&[0xff, 0x00, 0xfe]);
    assert!(std::str::from_utf8(&first).is_err() && std::str::from_utf8(&big).is_err());

    let p1 = writer.put("bin/a", first.clone(), None).await.unwrap();
    let r1 = rev(p1.header());
    let p2 = writer
        .put(
            "bin/a",
            second.clone(),
            Some(PutOptions::new().with_prev_key()),
        )
        .await
        .unwrap();
    let r2 = rev(p2.header());
    assert_eq!(p2.prev_key().map(|kv| kv.value()), Some(first.as_slice()));
    writer.put("bin/big", big.clone(), None).await.unwrap();
    // UTF-8, but beginning with NUL (the mark of a stored binary value): still bytes in, bytes out.
    writer.put("bin/nul", "\0text", None).await.unwrap();
    writer.put("txt", "héllo, wörld\n", None).await.unwrap();

    assert_eq!(value_of(&reader.read("bin/a", None).await), second);
    assert!(
        value_of(&reader.read("bin/big", None).await) == big,
        "the 1 MiB value"
    );
    assert_eq!(value_of(&reader.read("bin/nul", None).await), b"\0text");
    assert_eq!(
        value_of(&reader.read("txt", None).await),
        "héllo, wörld\n".as_bytes()
    );
    // A value over the limit is refused, binary as text.
    let over = writer
        .put("bin/over", vec![0xffu8; (1 << 20) + 1], None)
        .await;
    assert!(over.is_err(), "{over:?}");

    // Compares: `=` byte-exact, `>` and `<` in byte order.
    let holds = |cmp: Compare| {
        let mut w = writer.clone();
        async move {
            let t = Txn::new().when([cmp]);
            w.txn(t).await.unwrap().succeeded()
        }
    };
    let bin = |op: CompareOp, v: &[u8]| Compare::value("bin/a", op, v.to_vec());
    assert!(holds(bin(CompareOp::Equal, &second)).await);
    assert!(!holds(bin(CompareOp::Equal, &first)).await);
    assert!(holds(bin(CompareOp::NotEqual, &first)).await);
    assert!(holds(bin(CompareOp::Greater, &[0xff])).await);
    assert!(holds(bin(CompareOp::Greater, &[0xfe, 0xff])).await);
    assert!(!holds(bin(CompareOp::Greater, &[0xff, 0x01])).await);
    assert!(holds(bin(CompareOp::Less, &[0xff, 0x01])).await);
    assert!(!holds(bin(CompareOp::Less, &[0xff, 0x00])).await);
    // Text against bytes: "z" sorts before 0xff and after 0x01, as bytes do.
    let txt = |op: CompareOp, v: &[u8]| Compare::value("txt", op, v.to_vec());
    assert!(holds(txt(CompareOp::Less, &[0xff])).await);
    assert!(holds(txt(CompareOp::Greater, &[0x01, 0xff])).await);
    // A txn's put of bytes, guarded by a compare on bytes.
    let t = Txn::new()
        .when([bin(CompareOp::Equal, &second)])
        .and_then([TxnOp::put("bin/t", vec![0x00, 0x01, 0xff], None)]);
    assert!(writer.txn(t).await.unwrap().succeeded());
    assert_eq!(
        value_of(&reader.read("bin/t", None).await),
        [0x00, 0x01, 0xff]
    );

    // A sort by value is in byte order.
    for (k, v) in [
        ("sorted/a", vec![0xffu8]),
        ("sorted/b", b"z".to_vec()),
        ("sorted/c", vec![0x01, 0x80]),
    ] {
        writer.put(k, v, None).await.unwrap();
    }
    let sorted = reader
        .read(
            "sorted/",
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Value, SortOrder::Ascend),
            ),
        )
        .await;
    let order: Vec<String> = sorted.kvs().iter().map(|kv| text(kv.key())).collect();
    assert_eq!(order, ["sorted/c", "sorted/b", "sorted/a"]);

    // Delete with prev_kv: the bytes.
    let del = writer
        .delete("bin/a", Some(DeleteOptions::new().with_prev_key()))
        .await
        .unwrap();
    let r3 = rev(del.header());
    let prev: Vec<Vec<u8>> = del
        .prev_kvs()
        .iter()
        .map(|kv| kv.value().to_vec())
        .collect();
    assert_eq!(prev, [second.clone()]);

    // A watch from the first put, on the leader, with prev_kv: every change with its bytes.
    let mut watcher = c.client(&[leader]).await;
    let mut watch = watcher
        .watch(
            "bin/a",
            Some(WatchOptions::new().with_start_revision(r1).with_prev_key()),
        )
        .await
        .unwrap();
    created(&mut watch).await;
    type Seen = (bool, Vec<u8>, i64, Option<Vec<u8>>);
    let mut seen: Vec<Seen> = Vec::new();
    while seen.len() < 3 {
        let resp = tokio::time::timeout(WAIT, watch.message())
            .await
            .expect("a watch response in time")
            .expect("the watch stream works")
            .expect("the watch stream stays open");
        for e in resp.events() {
            let kv = e.kv().expect("an event has its kv");
            seen.push((
                e.event_type() == EventType::Delete,
                kv.value().to_vec(),
                kv.mod_revision(),
                e.prev_kv().map(|p| p.value().to_vec()),
            ));
        }
    }
    let want: Vec<Seen> = vec![
        (false, first.clone(), r1, None),
        (false, second.clone(), r2, Some(first.clone())),
        (true, Vec::new(), r3, Some(second.clone())),
    ];
    assert_eq!(seen, want);

    // Election values: a campaign's, then a proclaimed one, as the leader is answered.
    let lease = writer.lease_grant(30, None).await.unwrap().id();
    let mut campaign = writer
        .campaign("bin-election", vec![0xffu8, 0x00], lease)
        .await
        .unwrap();
    let leader_key = campaign.take_leader().expect("the campaign leads");
    let elected = |reader: &Client| {
        let mut r = reader.clone();
        async move {
            let resp = r.leader("bin-election").await.unwrap();
            resp.kv().expect("the leader's kv").value().to_vec()
        }
    };
    assert_eq!(elected(&reader).await, [0xff, 0x00]);
    writer
        .proclaim(
            vec![0x00u8, 0xfe],
            Some(ProclaimOptions::new().with_leader(leader_key)),
        )
        .await
        .unwrap();
    assert_eq!(elected(&reader).await, [0x00, 0xfe]);

    // Through `/v1`: a text value as written, a binary one in its stored form.
    let http = reqwest::Client::new();
    let v1_value = |key: &'static str| {
        let (http, base) = (http.clone(), format!("http://{}", c.addrs[f2 - 1]));
        async move {
            let doc: serde_json::Value = http
                .get(format!("{base}/v1/kv/{key}"))
                .send()
                .await
                .unwrap()
                .error_for_status()
                .unwrap()
                .json()
                .await
                .unwrap();
            doc["value"].as_str().unwrap().to_string()
        }
    };
    assert_eq!(v1_value("txt").await, "héllo, wörld\n");
    assert_eq!(v1_value("bin/t").await, "\u{0}AAH/");
    assert_eq!(v1_value("bin/nul").await, "\u{0}AHRleHQ=");
}
