//! Watch batches bounded by bytes, from a black-box campaign against the real binary: a
//! watcher resuming from an old revision with more than one message's worth of events after
//! it must get past them (etcd delivers them: its responses are bounded, and `fragment` splits
//! a revision too large alone), from the in-memory history and from the on-disk one alike,
//! through the etcd API and `/v1`, never missing an event nor seeing one twice. Also the JSON
//! gateway's answer to a body over its limit, and a Range at a past revision over the answer
//! budget.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::TestCluster;
use common::etcdctl::{endpoint, etcd_cluster, etcd_cluster_tweaked};
use etcd_client::{Client, WatchOptions};
use futures::StreamExt;
use leasecore_etcd_api::etcdserverpb::kv_client::KvClient;
use leasecore_etcd_api::etcdserverpb::watch_client::WatchClient;
use leasecore_etcd_api::etcdserverpb::{
    PutRequest, RangeRequest, RequestOp, TxnRequest, WatchCancelRequest, WatchCreateRequest,
    WatchRequest, WatchResponse, request_op, watch_request,
};
use serde_json::Value;
use tonic::Code;
use tonic::transport::Channel;

/// Values of 1 MiB (the largest a value may be) under `big/`: 12 MiB, three times the etcd
/// API's 4 MiB message.
const BIG_VALUES: usize = 12;
const MIB: usize = 1 << 20;
/// The bound of a watch batch's keys and values (`domain::watch_batch::BATCH_BYTES`).
const BATCH_BYTES: usize = 3 << 19;
const WAIT: Duration = Duration::from_secs(20);

async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap()
}

/// A KV client that sends and accepts any size: limits must come from the server.
async fn kv_client(addr: &str) -> KvClient<Channel> {
    KvClient::new(channel(addr).await)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

fn value(i: usize, len: usize) -> Vec<u8> {
    vec![b'a' + (i % 26) as u8; len]
}

fn put(key: &str, value: Vec<u8>) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.as_bytes().to_vec(),
            value,
            ..Default::default()
        })),
    }
}

/// Write `big/00`.. with 1 MiB values, one revision each; their revisions.
async fn write_big_values(kv: &mut KvClient<Channel>) -> Vec<i64> {
    let mut revisions = Vec::new();
    for i in 0..BIG_VALUES {
        let resp = kv
            .put(PutRequest {
                key: format!("big/{i:02}").into_bytes(),
                value: value(i, MIB),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        revisions.push(resp.header.unwrap().revision);
    }
    revisions
}

/// The first revision of the key-value store (etcd's revisions start at 1, and the cluster
/// wrote nothing before the test).
const FIRST: i64 = 1;

/// Follow an etcd-client watch of `big/` from `FIRST` until `last`; (revision, key, value
/// length, value's first byte) of each event, and the events each response held.
async fn follow(client: &mut Client, last: i64) -> (Vec<(i64, String, usize, u8)>, Vec<usize>) {
    let mut stream = client
        .watch(
            "big/",
            Some(WatchOptions::new().with_prefix().with_start_revision(FIRST)),
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut per_response = Vec::new();
    while got
        .last()
        .is_none_or(|e: &(i64, String, usize, u8)| e.0 < last)
    {
        let resp = tokio::time::timeout(WAIT, stream.message())
            .await
            .unwrap_or_else(|_| panic!("no watch response within {WAIT:?}; so far {got:?}"))
            .unwrap_or_else(|e| panic!("the watch stream failed after {got:?}: {e:?}"))
            .expect("the watch stream stays open");
        assert!(!resp.canceled(), "canceled: {}", resp.cancel_reason());
        if resp.events().is_empty() {
            continue; // its creation
        }
        per_response.push(resp.events().len());
        for e in resp.events() {
            let kv = e.kv().unwrap();
            got.push((
                kv.mod_revision(),
                kv.key_str().unwrap().to_string(),
                kv.value().len(),
                kv.value()[0],
            ));
        }
    }
    (got, per_response)
}

fn expected(revisions: &[i64]) -> Vec<(i64, String, usize, u8)> {
    revisions
        .iter()
        .enumerate()
        .map(|(i, r)| (*r, format!("big/{i:02}"), MIB, value(i, 1)[0]))
        .collect()
}

/// A watch from revision 1 over 12 MiB of values was ended with `OutOfRange` ("encoded
/// message length too large") every time it was retried: the whole span went into one
/// response. Now responses are bounded (one 1 MiB value each here), and every event arrives
/// once, in order: from the in-memory history on one node, and on another after a restart
/// (which reads the on-disk history, the in-memory one starting at the restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_etcd_watch_from_an_old_revision_gets_past_more_than_a_message_of_events() {
    let mut c = etcd_cluster().await;
    let mut kv = kv_client(&endpoint(&c, 1)).await;
    let revisions = write_big_values(&mut kv).await;
    let last = *revisions.last().unwrap();

    let mut on_2 = Client::connect([endpoint(&c, 2)], None).await.unwrap();
    let (got, per_response) = follow(&mut on_2, last).await;
    assert_eq!(got, expected(&revisions));
    assert!(
        per_response.iter().all(|n| *n == 1),
        "two 1 MiB values pass the {BATCH_BYTES}-byte bound: {per_response:?}"
    );

    // Node 3 restarted: its in-memory history starts at the restart, the watch reads disk.
    c.stop(3).await;
    c.restart(3).await;
    c.leader().await;
    let (_, _, in_memory_from, _) = c.nodes[&3].watch_hub().stats();
    assert!(
        in_memory_from.0 >= revisions[0] as u64,
        "the restarted node's memory starts at {in_memory_from}: the first event is on disk only"
    );
    let mut on_3 = Client::connect([endpoint(&c, 3)], None).await.unwrap();
    let (got, per_response) = follow(&mut on_3, last).await;
    assert_eq!(got, expected(&revisions));
    assert!(per_response.iter().all(|n| *n == 1), "{per_response:?}");
    c.shutdown().await;
}

/// A raw watch stream (the client accepts any size): its responses after the creation, until
/// `done` says enough.
async fn raw_watch(
    addr: &str,
    create: WatchCreateRequest,
    mut done: impl FnMut(&[WatchResponse]) -> bool,
) -> Vec<WatchResponse> {
    let mut client = WatchClient::new(channel(addr).await).max_decoding_message_size(usize::MAX);
    let request = WatchRequest {
        request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
    };
    // The request stream stays open: its end would end the session.
    let requests = futures::stream::iter([request]).chain(futures::stream::pending());
    let mut stream = client.watch(requests).await.unwrap().into_inner();
    let mut got: Vec<WatchResponse> = Vec::new();
    while !done(&got) {
        let resp = tokio::time::timeout(WAIT, stream.next())
            .await
            .unwrap_or_else(|_| panic!("no watch response within {WAIT:?}"))
            .expect("the watch stream stays open")
            .unwrap_or_else(|e| panic!("the watch stream failed: {e:?}"));
        assert!(!resp.canceled, "canceled: {}", resp.cancel_reason);
        if !resp.created {
            got.push(resp);
        }
    }
    got
}

/// A watch stream's next answer, which must come within [`WAIT`].
async fn next_answer(stream: &mut tonic::Streaming<WatchResponse>) -> WatchResponse {
    tokio::time::timeout(WAIT, stream.next())
        .await
        .expect("an answer")
        .expect("the stream stays open")
        .unwrap()
}

fn events_in(responses: &[WatchResponse]) -> usize {
    responses.iter().map(|r| r.events.len()).sum()
}

/// A small change after a large version: the batch is small, but with `prev_kv` each event
/// carries 1 MiB. The response is bounded by its encoded events too (one here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prev_kv_of_large_versions_is_bounded_too() {
    let c = etcd_cluster().await;
    let mut kv = kv_client(&endpoint(&c, 1)).await;
    write_big_values(&mut kv).await;
    // A read answers more than a message of 4 MiB, as etcd's does (Kubernetes lists pages
    // of tens of MiB): the 12 MiB range whole, at a node's default limit.
    let all = kv
        .range(RangeRequest {
            key: b"big/".to_vec(),
            range_end: b"big0".to_vec(),
            ..Default::default()
        })
        .await
        .expect("a 12 MiB range is answered")
        .into_inner();
    assert_eq!((all.kvs.len(), all.more), (BIG_VALUES, false));
    // So does a transaction that only reads: it is served as a read, as etcd serves it.
    let read_only = kv
        .txn(TxnRequest {
            success: vec![RequestOp {
                request: Some(request_op::Request::RequestRange(RangeRequest {
                    key: b"big/".to_vec(),
                    range_end: b"big0".to_vec(),
                    ..Default::default()
                })),
            }],
            ..Default::default()
        })
        .await
        .expect("a read-only txn of 12 MiB is answered")
        .into_inner();
    let Some(request_op_response) = read_only.responses[0].response.as_ref() else {
        panic!("no answer to the range");
    };
    match request_op_response {
        leasecore_etcd_api::etcdserverpb::response_op::Response::ResponseRange(r) => {
            assert_eq!(r.kvs.len(), BIG_VALUES)
        }
        other => panic!("{other:?}"),
    }
    let mut small = Vec::new();
    for i in 0..BIG_VALUES {
        let resp = kv
            .put(PutRequest {
                key: format!("big/{i:02}").into_bytes(),
                value: b"small".to_vec(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        small.push(resp.header.unwrap().revision);
    }
    let create = WatchCreateRequest {
        key: b"big/".to_vec(),
        range_end: b"big0".to_vec(),
        start_revision: small[0],
        prev_kv: true,
        ..Default::default()
    };
    let got = raw_watch(&endpoint(&c, 2), create, |got| events_in(got) >= BIG_VALUES).await;
    let revisions: Vec<i64> = got
        .iter()
        .flat_map(|r| r.events.iter().map(|e| e.kv.as_ref().unwrap().mod_revision))
        .collect();
    assert_eq!(revisions, small, "each once, in order");
    for r in &got {
        assert_eq!(r.events.len(), 1, "each response within the bound");
        let prev = r.events[0].prev_kv.as_ref().expect("prev_kv");
        assert_eq!(prev.value.len(), MIB);
    }
    c.shutdown().await;
}

/// One revision larger than the bound (a Txn of three 1 MiB puts) goes alone: whole to a
/// watcher that did not ask for fragments, even past the 4 MiB message (with `prev_kv`: 6
/// MiB, as etcd sends it), and in fragments of at most about 1.5 MiB to one that asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revision_larger_than_the_bound_goes_alone_whole_or_in_fragments() {
    let c = etcd_cluster().await;
    let mut kv = kv_client(&endpoint(&c, 1)).await;
    let keys = ["one/a", "one/b", "one/c"];
    let txn = |i: usize| TxnRequest {
        success: keys.iter().map(|k| put(k, value(i, MIB))).collect(),
        ..Default::default()
    };
    let first = kv.txn(txn(0)).await.unwrap().into_inner();
    let first = first.header.unwrap().revision;
    let second = kv.txn(txn(1)).await.unwrap().into_inner();
    let second = second.header.unwrap().revision;
    let watch = |start_revision, prev_kv, fragment| WatchCreateRequest {
        key: b"one/".to_vec(),
        range_end: b"one0".to_vec(),
        start_revision,
        prev_kv,
        fragment,
        ..Default::default()
    };
    let addr = endpoint(&c, 3);

    // Whole: each revision in one response of its own.
    let got = raw_watch(&addr, watch(first, false, false), |got| got.len() >= 2).await;
    assert_eq!(
        got.iter().map(|r| r.events.len()).collect::<Vec<_>>(),
        [3, 3]
    );
    assert!(got.iter().all(|r| !r.fragment));
    // With prev_kv the second is 6 MiB: sent whole too.
    let got = raw_watch(&addr, watch(second, true, false), |got| !got.is_empty()).await;
    assert_eq!(got[0].events.len(), 3);
    assert!(
        got[0]
            .events
            .iter()
            .all(|e| e.prev_kv.as_ref().unwrap().value.len() == MIB)
    );

    // In fragments: all but the last marked, every event once, each part within the bound.
    let got = raw_watch(&addr, watch(second, true, true), |got| {
        got.last().is_some_and(|r| !r.fragment)
    })
    .await;
    assert!(got.len() >= 3, "6 MiB in parts of 1.5 MiB: {}", got.len());
    assert_eq!(events_in(&got), 3);
    for (i, part) in got.iter().enumerate() {
        assert_eq!(part.fragment, i + 1 < got.len());
        for e in &part.events {
            assert_eq!(e.kv.as_ref().unwrap().mod_revision, second);
        }
    }
    c.shutdown().await;
}

/// A `/v1` long poll answer for one watch call.
async fn long_poll(c: &TestCluster, id: u64, from: i64) -> (i64, Vec<Value>, usize) {
    let url = format!(
        "{}/v1/watch?prefix=big/&from_revision={from}&timeout_ms=5000",
        c.url(id)
    );
    let resp = reqwest::get(&url).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.bytes().await.unwrap();
    let v: Value = serde_json::from_slice(&body).unwrap();
    let events = v["events"].as_array().unwrap().clone();
    (v["revision"].as_i64().unwrap(), events, body.len())
}

/// `/v1`'s long poll shares the batches: each answer is bounded, resuming from its
/// `revision + 1` reads every event once; one revision larger than the bound is answered
/// whole, alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn v1_long_polls_are_bounded_and_answer_a_large_revision_whole() {
    let c = etcd_cluster().await;
    let mut kv = kv_client(&endpoint(&c, 1)).await;
    let revisions = write_big_values(&mut kv).await;
    let last = *revisions.last().unwrap();
    let large = kv
        .txn(TxnRequest {
            success: (0..3)
                .map(|i| put(&format!("big/z{i}"), value(i, MIB)))
                .collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let large = large.header.unwrap().revision;

    let mut from = FIRST;
    let mut seen: BTreeMap<i64, usize> = BTreeMap::new();
    let mut order = Vec::new();
    while from <= large {
        let (through, events, body) = long_poll(&c, 2, from).await;
        assert!(
            !events.is_empty(),
            "a long poll from {from} answered nothing"
        );
        assert!(through >= from);
        let revs: Vec<i64> = events
            .iter()
            .map(|e| e["revision"].as_i64().unwrap())
            .collect();
        if revs.iter().all(|r| *r == revs[0]) && revs[0] == large {
            assert_eq!(revs.len(), 3, "the large revision whole");
        } else {
            assert_eq!(revs.len(), 1, "one 1 MiB value per answer: {revs:?}");
            assert!(body < 2 * BATCH_BYTES, "{body} bytes");
        }
        for r in revs {
            *seen.entry(r).or_default() += 1;
            order.push(r);
        }
        from = through + 1;
    }
    let mut want = revisions.clone();
    want.extend([large; 3]);
    assert_eq!(order, want, "every event once, in order");
    assert!(seen[&last] == 1);
    c.shutdown().await;
}

/// The gateway answered a body over its 4 MiB limit with 413 and a plain-text body. Now it is
/// etcd's gateway answer to a message over its limit: 429 with the gRPC code
/// `ResourceExhausted` (8) in etcd's JSON error shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_a_body_over_its_limit_in_json() {
    let c = etcd_cluster().await;
    let url = format!("http://{}/v3/kv/put", endpoint(&c, 1));
    let body = format!(
        "{{\"key\":\"aw==\",\"value\":\"{}\"}}",
        "QUFB".repeat((5 * MIB) / 4)
    );
    let http = reqwest::Client::new();
    let resp = http.post(&url).body(body).send().await.unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "application/json"
    );
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["code"], 8, "{v}");
    let message = v["message"].as_str().unwrap();
    assert!(message.contains("larger than max"), "{v}");
    assert_eq!(v["error"], v["message"]);
    // Nothing was written.
    let mut kv = kv_client(&endpoint(&c, 1)).await;
    let got = kv
        .range(RangeRequest {
            key: b"k".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(got.kvs.is_empty());
    c.shutdown().await;
}

/// A Range at a past revision over more than an answer may hold is refused (the read stops
/// once over the budget); narrowed it is answered, as a Range of the present is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_range_at_a_past_revision_over_the_budget_is_refused_and_narrowed_is_answered() {
    // A read's budget of 4 MiB (the least it may be), below the 12 MiB written.
    let c = etcd_cluster_tweaked(|cfg| cfg.limits.max_read_answer_bytes = 4 << 20).await;
    let mut kv = kv_client(&endpoint(&c, 1)).await;
    let revisions = write_big_values(&mut kv).await;
    // Move on, so that the range reads the history.
    kv.put(PutRequest {
        key: b"later".to_vec(),
        value: b"x".to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    let at = *revisions.last().unwrap();
    let range = RangeRequest {
        key: b"big/".to_vec(),
        range_end: b"big0".to_vec(),
        revision: at,
        ..Default::default()
    };
    let err = kv.range(range.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("too large"), "{err:?}");
    let some = kv
        .range(RangeRequest {
            limit: 2,
            ..range.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (some.kvs.len(), some.more, some.count),
        (2, true, BIG_VALUES as i64)
    );
    assert_eq!(some.kvs[1].value.len(), MIB);
    let keys = kv
        .range(RangeRequest {
            keys_only: true,
            ..range.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(keys.kvs.len(), BIG_VALUES);
    assert!(keys.kvs.iter().all(|kv| kv.value.is_empty()));
    let count = kv
        .range(RangeRequest {
            count_only: true,
            ..range.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(count.count, BIG_VALUES as i64);
    // An earlier revision that held only three of them is answered whole.
    let three = kv
        .range(RangeRequest {
            revision: revisions[2],
            ..range
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(three.kvs.len(), 3);
    c.shutdown().await;
}

/// A watch whose range ends at or before its start is refused as etcd refuses it (created,
/// canceled, watch id -1, "mvcc: watcher range is empty"): it was accepted, and never fired.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_empty_watch_range_is_refused_as_etcd_refuses_it() {
    let c = etcd_cluster().await;
    let addr = endpoint(&c, 1);
    let mut client = WatchClient::new(channel(&addr).await);
    for (key, end) in [("wz", "wa"), ("same", "same")] {
        let create = WatchCreateRequest {
            key: key.as_bytes().to_vec(),
            range_end: end.as_bytes().to_vec(),
            ..Default::default()
        };
        let request = WatchRequest {
            request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
        };
        let requests = futures::stream::iter([request]).chain(futures::stream::pending());
        let mut stream = client.watch(requests).await.unwrap().into_inner();
        let resp = tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("an answer to the create")
            .expect("the stream stays open")
            .unwrap();
        assert!(resp.created && resp.canceled, "[{key}, {end}): {resp:?}");
        assert_eq!(resp.watch_id, -1);
        assert_eq!(resp.cancel_reason, "mvcc: watcher range is empty");
    }
    // "\0" as the end still means every key from the start.
    let mut kv = kv_client(&addr).await;
    let put = kv
        .put(PutRequest {
            key: b"wzz".to_vec(),
            value: b"v".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let from_key = WatchCreateRequest {
        key: b"wz".to_vec(),
        range_end: vec![0],
        start_revision: put.header.unwrap().revision,
        ..Default::default()
    };
    let got = raw_watch(&addr, from_key, |got| events_in(got) > 0).await;
    assert_eq!(got[0].events[0].kv.as_ref().unwrap().key, b"wzz");

    // A cancel of an id the stream does not hold gets no answer, as in etcd; a cancel of one
    // it holds is answered. So the answer after both cancels is the second's.
    let (send, requests) = futures::channel::mpsc::unbounded();
    let mut stream = client.watch(requests).await.unwrap().into_inner();
    let union = watch_request::RequestUnion::CreateRequest(WatchCreateRequest {
        key: b"wc".to_vec(),
        ..Default::default()
    });
    send.unbounded_send(WatchRequest {
        request_union: Some(union),
    })
    .unwrap();
    let created = next_answer(&mut stream).await;
    assert!(created.created, "{created:?}");
    for id in [created.watch_id + 99, created.watch_id] {
        let cancel =
            watch_request::RequestUnion::CancelRequest(WatchCancelRequest { watch_id: id });
        send.unbounded_send(WatchRequest {
            request_union: Some(cancel),
        })
        .unwrap();
    }
    let canceled = next_answer(&mut stream).await;
    assert!(canceled.canceled, "{canceled:?}");
    assert_eq!(canceled.watch_id, created.watch_id, "{canceled:?}");
    c.shutdown().await;
}

/// A progress request is answered with the store's current revision once every watcher of
/// the stream has delivered through it, as etcd answers it, also when one watcher follows keys
/// nobody writes. It answered the lowest revision any watcher had delivered, which a watcher
/// on idle keys held at its creation: below events the stream had already sent, so that
/// Kubernetes' consistent reads from its watch cache never saw the cache fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_progress_request_answers_the_current_revision_past_idle_watchers() {
    let c = etcd_cluster().await;
    let addr = endpoint(&c, 1);
    let mut kv = kv_client(&addr).await;
    let mut put = async |key: &str| {
        kv.put(PutRequest {
            key: key.as_bytes().to_vec(),
            value: b"v".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .header
        .unwrap()
        .revision
    };
    let mut client = WatchClient::new(channel(&addr).await);
    let (send, requests) = futures::channel::mpsc::unbounded();
    let mut stream = client.watch(requests).await.unwrap().into_inner();
    for prefix in ["idle/", "busy/"] {
        let create = WatchCreateRequest {
            key: prefix.as_bytes().to_vec(),
            range_end: prefix_end(prefix),
            ..Default::default()
        };
        send.unbounded_send(WatchRequest {
            request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
        })
        .unwrap();
        assert!(next_answer(&mut stream).await.created);
    }
    let mut busy = 0;
    for i in 0..3 {
        put(&format!("busy/{i}")).await;
    }
    while busy < 3 {
        let r = next_answer(&mut stream).await;
        assert_eq!(r.watch_id, 1, "only the busy watcher has events: {r:?}");
        busy += r.events.len();
    }
    let mut current = 0;
    for i in 0..3 {
        current = put(&format!("other/{i}")).await;
    }
    let progress = watch_request::RequestUnion::ProgressRequest(Default::default());
    send.unbounded_send(WatchRequest {
        request_union: Some(progress),
    })
    .unwrap();
    let answer = next_answer(&mut stream).await;
    assert_eq!(answer.watch_id, -1, "{answer:?}");
    assert!(answer.events.is_empty(), "{answer:?}");
    assert_eq!(answer.header.unwrap().revision, current);
    c.shutdown().await;
}

/// `prefix`'s etcd range end: the prefix with its last byte raised.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    end
}

/// etcd's `hasleader` metadata (Go's `WithRequireLeader`, on every Kubernetes watch): a watch
/// stream opened with it on a member that loses its leader ends with `Unavailable`
/// `etcdserver: no leader`, so that the client reconnects to another member and resumes, and
/// a call with it on that member is refused at once. The metadata was ignored: such a watch
/// stayed open and silent while the majority went on writing without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hasleader_watches_end_and_calls_are_refused_on_a_member_without_a_leader() {
    let mut c = etcd_cluster().await;
    let leader = c.leader().await;
    let survivor = (1..=3).find(|id| *id != leader).unwrap();
    let addr = endpoint(&c, survivor);
    let mut client = WatchClient::new(channel(&addr).await);
    let (send, requests) = futures::channel::mpsc::unbounded();
    let mut stream = client
        .watch(requiring_a_leader(tonic::Request::new(requests)))
        .await
        .unwrap()
        .into_inner();
    let create = WatchCreateRequest {
        key: b"hl/".to_vec(),
        range_end: b"hl0".to_vec(),
        ..Default::default()
    };
    send.unbounded_send(WatchRequest {
        request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
    })
    .unwrap();
    assert!(next_answer(&mut stream).await.created);
    // The same through etcd's JSON gateway, which passes `Grpc-Metadata-<name>` headers on
    // as metadata: a watch opened so ends too.
    let http = reqwest::Client::new();
    let mut gateway_watch = http
        .post(format!("http://{addr}/v3/watch"))
        .header("Grpc-Metadata-Hasleader", "true")
        .body(r#"{"create_request":{"key":"aGwv","range_end":"aGww"}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(gateway_watch.status(), 200);
    let first = gateway_watch
        .chunk()
        .await
        .unwrap()
        .expect("the created line");
    assert!(
        String::from_utf8_lossy(&first).contains("\"created\":true"),
        "{first:?}"
    );

    for id in (1..=3).filter(|id| *id != survivor) {
        c.stop(id).await;
    }
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match stream.next().await {
                Some(Ok(_)) => continue,
                Some(Err(status)) => return Some(status),
                None => return None,
            }
        }
    })
    .await
    .expect("the hasleader watch ends once its member has no leader");
    let status = ended.expect("with an error, not a clean end");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "etcdserver: no leader");
    let mut rest = Vec::new();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(30), gateway_watch.chunk())
        .await
        .expect("the gateway's hasleader watch ends too")
        .unwrap()
    {
        rest.extend_from_slice(&chunk);
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("etcdserver: no leader"), "{rest}");

    // A call with the metadata is refused within a short deadline (a linearizable read
    // without it waits for its own request timeout).
    let mut kv = kv_client(&addr).await;
    let mut range = requiring_a_leader(tonic::Request::new(RangeRequest {
        key: b"hl/a".to_vec(),
        ..Default::default()
    }));
    range.set_timeout(Duration::from_secs(1));
    let err = kv.range(range).await.unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (Code::Unavailable, "etcdserver: no leader")
    );
    // And a gateway call with the header, in the gateway's JSON: even a serializable read,
    // which the member would answer from its own state without the header.
    let refused = http
        .post(format!("http://{addr}/v3/kv/range"))
        .header("Grpc-Metadata-Hasleader", "true")
        .timeout(Duration::from_secs(1))
        .body(r#"{"key":"aGwvYQ==","serializable":true}"#)
        .send()
        .await
        .expect("refused at once, not after the read's own timeout");
    assert_eq!(refused.status(), 503);
    let v: Value = refused.json().await.unwrap();
    assert_eq!(
        (v["code"].as_i64(), v["message"].as_str()),
        (Some(14), Some("etcdserver: no leader")),
        "{v}"
    );
    c.shutdown().await;
}

/// `req` with etcd's `hasleader: true` metadata.
fn requiring_a_leader<T>(mut req: tonic::Request<T>) -> tonic::Request<T> {
    req.metadata_mut()
        .insert("hasleader", "true".parse().unwrap());
    req
}
