//! Peer streams on a real 3-node cluster: Raft's appends and the forwarded calls ride them
//! (no append reaches the peer port as an HTTP request), a stream is refused to non-members,
//! every frame is checked as its HTTP route checks it, and a frame of impossible length ends
//! the stream without touching the node.
#![allow(clippy::disallowed_methods)] // tests wait against real deadlines

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually, metrics_of};
use leasecore::domain::types::NodeId;
use leasecore::raft::peer_stream::{
    self, ANSWERED, KIND_APPEND, MAX_ANSWER_FRAME, PROTOCOL, REFUSED, parse_answer, read_frame,
    request_frame, write_frame,
};
use serde_json::Value;
use tokio::io::{AsyncWriteExt, BufReader};

const SENDER: &str = "x-leasecore-node";

/// The leader, a follower, and the other follower.
async fn roles(c: &TestCluster) -> (NodeId, NodeId, NodeId) {
    let leader = c.leader().await;
    let mut followers = c.nodes.keys().copied().filter(|id| *id != leader);
    (leader, followers.next().unwrap(), followers.next().unwrap())
}

/// The value of the first metric line that starts with `prefix` (0 if none).
fn metric(page: &str, prefix: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// Ask `target`'s peer port for a stream as node `sender`: the upgraded connection, or the
/// refusal's status and body.
async fn open_stream(
    c: &TestCluster,
    target: NodeId,
    sender: &str,
) -> Result<BufReader<reqwest::Upgraded>, (u16, Value)> {
    let resp = reqwest::Client::new()
        .get(format!("{}/raft/stream", c.peer_url(target)))
        .header("connection", "upgrade")
        .header("upgrade", PROTOCOL)
        .header(SENDER, sender)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    if status == 101 {
        return Ok(BufReader::new(resp.upgrade().await.unwrap()));
    }
    let body = resp.bytes().await.unwrap();
    Err((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

async fn exchange(io: &mut BufReader<reqwest::Upgraded>, frame: &[u8]) -> (u8, Vec<u8>) {
    write_frame(io.get_mut(), frame).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), read_frame(io, MAX_ANSWER_FRAME))
        .await
        .expect("an answer within 10 s")
        .unwrap()
        .expect("an answer, not the end of the stream")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn raft_and_forwarded_calls_ride_peer_streams() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = *c.nodes.keys().find(|id| **id != leader).unwrap();
    // Writes through a follower: forwarded to the leader, replicated to both followers.
    let client = c.client_of(follower);
    for i in 0..20 {
        client.put(&format!("k{i}"), "v", None, None).await.unwrap();
    }
    for id in [1u64, 2, 3] {
        let page = metrics_of(&c, id).await;
        // No append came as an HTTP request (tunneled requests do pass the router and are
        // counted by route; appends go straight to Raft).
        let over_http = page.lines().any(|l| {
            l.starts_with("leasecore_http_requests_total") && l.contains("route=\"/raft/append\"")
        });
        assert!(!over_http, "node {id} got appends over HTTP:\n{page}");
        if id != leader {
            assert!(
                metric(&page, "leasecore_peer_streams_open") >= 1.0,
                "node {id} serves no peer stream"
            );
        }
    }
    // The leader serves the follower's forwarded proposals on a stream too (followers send
    // it nothing else).
    assert!(metric(&metrics_of(&c, leader).await, "leasecore_peer_streams_open") >= 1.0);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_are_for_members_and_every_frame_is_checked() {
    let c = TestCluster::start(3).await;
    let (_leader, target, other) = roles(&c).await;
    c.client().put("before", "v", None, None).await.unwrap();
    let revision = |c: &TestCluster| c.nodes[&target].consensus().cluster_view().revision;

    // A non-member gets no stream.
    let Err((status, doc)) = open_stream(&c, target, "99").await else {
        panic!("a non-member was given a stream");
    };
    assert_eq!(status, 403);
    assert_eq!(doc["error"]["reason"], "not_member");

    let mut io = open_stream(&c, target, &other.to_string())
        .await
        .expect("a member's stream");
    // Garbage where an append should be: refused with the route's error, stream kept.
    let (status, body) = exchange(
        &mut io,
        &peer_stream::frame(KIND_APPEND, b"\xc1junk").unwrap(),
    )
    .await;
    assert_eq!(status, REFUSED);
    let doc: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["error"]["code"], "invalid_argument", "{doc}");
    // An unknown kind: refused, stream kept.
    let (status, _) = exchange(&mut io, &peer_stream::frame(77, b"").unwrap()).await;
    assert_eq!(status, REFUSED);
    // A tunneled request to a route that does not exist: the 404 HTTP would answer.
    let (status, body) = exchange(
        &mut io,
        &request_frame("/raft/nothing-here", "application/json", b"{}").unwrap(),
    )
    .await;
    assert_eq!(status, ANSWERED);
    let (http_status, doc) = parse_answer(&body).unwrap();
    assert_eq!(http_status, 404);
    let doc: Value = serde_json::from_slice(doc).unwrap();
    assert_eq!(doc["error"]["code"], "not_found", "{doc}");
    // A forwarded command a client could not send (unguarded): the route's 400.
    let bare = br#"{"Put":{"key":"forged","value":"x","lease":null,"prev_revision":null}}"#;
    let (status, body) = exchange(
        &mut io,
        &request_frame("/raft/propose", "application/json", bare).unwrap(),
    )
    .await;
    assert_eq!(status, ANSWERED);
    let (http_status, _) = parse_answer(&body).unwrap();
    assert_eq!(http_status, 400);
    // A tunneled request's sender is the stream's: a header in the payload cannot change it,
    // and there is no way to put one there. The status route answers as it would over HTTP.
    let (status, body) = exchange(
        &mut io,
        &request_frame("/raft/read_index", "application/json", b"null").unwrap(),
    )
    .await;
    assert_eq!(status, ANSWERED);
    assert_eq!(parse_answer(&body).unwrap().0, 200);

    // A frame of impossible length ends the stream: the next read is its end.
    io.get_mut()
        .write_all(&[0xff, 0xff, 0xff, 0xff, KIND_APPEND])
        .await
        .unwrap();
    io.get_mut().flush().await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), read_frame(&mut io, 1024))
        .await
        .expect("the stream ends within 10 s");
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");

    // Nothing was written by any of it, and the cluster still works.
    c.client().put("after", "v", None, None).await.unwrap();
    let before = revision(&c);
    eventually(
        Duration::from_secs(10),
        "the write applied on the target",
        || async { (revision(&c) >= before).then_some(()) },
    )
    .await;
    let got = c.client_of(target).get("forged", false).await;
    assert!(
        got.is_err() || got.unwrap().is_none(),
        "a forged key exists"
    );
    c.shutdown().await;
}

/// A node restarts while a peer holds an idle stream to it: the peer's next call goes on a
/// new stream (the closed one is noticed before use) and is answered, rather than failing on a
/// dead connection after it may have been delivered (a forwarded write would then answer
/// `outcome_unknown`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_peer_gets_new_streams_not_dead_ones() {
    use leasecore::raft::consensus::ConsensusError;
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let target = *c.nodes.keys().find(|id| **id != leader).unwrap();
    let addr = c.addrs[&target].clone();
    let call = |c: &TestCluster| {
        let peers = c.nodes[&leader].consensus().peers().clone();
        let addr = addr.clone();
        async move {
            peers
                .post_json::<_, Result<u64, ConsensusError>>(
                    &addr,
                    "/raft/read_index",
                    &(),
                    Duration::from_secs(5),
                )
                .await
        }
    };
    // An answered call leaves its stream idle in the leader's pool.
    let _answered = call(&c).await.expect("an answer");
    c.stop(target).await;
    c.restart(target).await;
    eventually(
        Duration::from_secs(10),
        "the restarted node following",
        || async {
            let v = c.nodes[&target].consensus().cluster_view();
            (v.leader_id == Some(leader)).then_some(())
        },
    )
    .await;
    // The pooled stream's other end is gone: the call must not be sent on it.
    let _answered = call(&c).await.expect("an answer on a new stream");
    c.shutdown().await;
}

/// A peer that leaves in the middle of a request cancels it, as closing an HTTP connection
/// cancels its handler: a leadership transfer's "hold your elections" call lasts as long as the
/// leader's call does (the leader ends it by dropping the call), not until its time is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_is_dropped_when_its_sender_leaves() {
    let c = TestCluster::start(3).await;
    let (leader, target, other) = roles(&c).await;
    let term = c.nodes[&target].consensus().cluster_view().term;
    let mut io = open_stream(&c, target, &leader.to_string())
        .await
        .expect("the leader's stream");
    let hold = serde_json::json!({"term": term, "target": other, "hold_ms": 20_000});
    let frame = request_frame(
        "/raft/transfer",
        "application/json",
        hold.to_string().as_bytes(),
    )
    .unwrap();
    write_frame(io.get_mut(), &frame).await.unwrap();
    let held = || c.nodes[&target].consensus().elections_held();
    eventually(Duration::from_secs(10), "elections held", || async {
        held().then_some(())
    })
    .await;
    drop(io);
    eventually(
        Duration::from_secs(5),
        "the hold ended with its call",
        || async { (!held()).then_some(()) },
    )
    .await;
    c.shutdown().await;
}
