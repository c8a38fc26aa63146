//! Peer trust on a real 3-node cluster: forged peer messages (the shapes of issue 11's
//! findings) are refused, and state, leadership and term are unchanged afterwards.
#![allow(clippy::disallowed_methods)] // tests wait against real deadlines

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually, metrics_of};
use leasecore::domain::command::{Command, LeaseRef};
use leasecore::domain::flease::{Ballot, Envelope, FleaseConfig, Msg, Protocol, Slot};
use leasecore::domain::types::{NodeId, Revision, WallMillis};
use leasecore::raft::{Entry, TypeConfig};
use openraft::raft::{AppendEntriesRequest, VoteRequest};
use openraft::{CommittedLeaderId, EntryPayload, LogId, Vote};
use serde_json::Value;

const SENDER: &str = "x-leasecore-node";

/// What must not change: per node, (leader, term, last log index, revision).
fn fingerprint(c: &TestCluster) -> Vec<(Option<NodeId>, u64, u64, Revision)> {
    c.nodes
        .values()
        .map(|n| {
            let v = n.consensus().cluster_view();
            (v.leader_id, v.term, v.last_log_index, v.revision)
        })
        .collect()
}

/// The fingerprint once every node has applied the same state.
async fn settled(c: &TestCluster) -> Vec<(Option<NodeId>, u64, u64, Revision)> {
    eventually(Duration::from_secs(10), "a settled cluster", || async {
        let f = fingerprint(c);
        f.windows(2).all(|w| w[0] == w[1]).then_some(f)
    })
    .await
}

/// A request to a node's peer port, naming `sender` (None: no header).
async fn peer_post(
    c: &TestCluster,
    target: NodeId,
    path: &str,
    sender: Option<&str>,
    content_type: &str,
    body: Vec<u8>,
) -> (u16, Vec<u8>) {
    let mut req = reqwest::Client::new()
        .post(format!("{}{path}", c.peer_url(target)))
        .header("content-type", content_type)
        .body(body);
    if let Some(s) = sender {
        req = req.header(SENDER, s);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.bytes().await.unwrap().to_vec())
}

fn error_reason(body: &[u8]) -> (String, String) {
    let doc: Value = serde_json::from_slice(body).expect("a JSON error document");
    (
        doc["error"]["code"].as_str().unwrap_or("").to_string(),
        doc["error"]["reason"].as_str().unwrap_or("").to_string(),
    )
}

fn refused(page: &str, reason: &str) -> u64 {
    let prefix = format!("leasecore_peer_refused_total{{reason=\"{reason}\"}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |n| n.trim().parse().unwrap())
}

fn other_member(c: &TestCluster, not: &[NodeId]) -> NodeId {
    *c.nodes.keys().find(|id| !not.contains(id)).unwrap()
}

/// A forged append that puts `value` at the log id right after `target`'s last entry.
fn forged_append(c: &TestCluster, target: NodeId, claimed_leader: NodeId, value: &str) -> Vec<u8> {
    let v = c.nodes[&target].consensus().cluster_view();
    let leader_id = CommittedLeaderId::new(v.term, claimed_leader);
    let prev = LogId::new(leader_id, v.last_log_index);
    let log_id = LogId::new(leader_id, v.last_log_index + 1);
    let req = AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(v.term, claimed_leader),
        prev_log_id: Some(prev),
        entries: vec![Entry {
            log_id,
            payload: EntryPayload::Normal(
                Command::Put {
                    key: "diverged".into(),
                    value: value.into(),
                    lease: None,
                    prev_revision: None,
                }
                .into(),
            ),
        }],
        leader_commit: Some(log_id),
    };
    rmp_serde::to_vec_named(&req).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_appends_and_votes_change_nothing() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    c.client().put("before", "v", None, None).await.unwrap();
    let before = settled(&c).await;

    for (i, target) in [1u64, 2, 3].into_iter().enumerate() {
        let value = ["A", "B", "C"][i];
        // Divergent entries at the same log id, from a non-member...
        let body = forged_append(&c, target, 99, value);
        let (status, answer) = peer_post(
            &c,
            target,
            "/raft/append",
            Some("99"),
            "application/msgpack",
            body,
        )
        .await;
        assert_eq!(status, 403);
        assert_eq!(
            error_reason(&answer),
            ("peer_refused".into(), "not_member".into())
        );
        // ...from a member claiming another leader (99, or the real leader)...
        let member = other_member(&c, &[target, leader]);
        for claimed in [99, leader] {
            let body = forged_append(&c, target, claimed, value);
            let (status, answer) = peer_post(
                &c,
                target,
                "/raft/append",
                Some(&member.to_string()),
                "application/msgpack",
                body,
            )
            .await;
            assert_eq!(status, 403, "claimed leader {claimed}");
            assert_eq!(error_reason(&answer).1, "inconsistent");
        }
        // ...and without naming a sender at all.
        let body = forged_append(&c, target, leader, value);
        let (status, answer) = peer_post(
            &c,
            target,
            "/raft/append",
            None,
            "application/msgpack",
            body,
        )
        .await;
        assert_eq!(status, 403);
        assert_eq!(error_reason(&answer).1, "no_sender");

        // A vote in term + 1000 from a member, consistent with its header, while the leader
        // lives: not granted, and nothing adopted.
        let v = c.nodes[&target].consensus().cluster_view();
        let candidate = other_member(&c, &[target]);
        let term = v.term + 1000;
        let req = VoteRequest::new(
            Vote::new(term, candidate),
            Some(LogId::new(CommittedLeaderId::new(term, candidate), 1 << 40)),
        );
        for _ in 0..5 {
            let (status, answer) = peer_post(
                &c,
                target,
                "/raft/vote",
                Some(&candidate.to_string()),
                "application/json",
                serde_json::to_vec(&req).unwrap(),
            )
            .await;
            assert_eq!(status, 200);
            let doc: Value = serde_json::from_slice(&answer).unwrap();
            assert_eq!(doc["Ok"]["vote_granted"], false, "{doc}");
        }
        // A vote whose candidate is not its sender.
        let (status, answer) = peer_post(
            &c,
            target,
            "/raft/vote",
            Some(&other_member(&c, &[target, candidate]).to_string()),
            "application/json",
            serde_json::to_vec(&req).unwrap(),
        )
        .await;
        assert_eq!(status, 403);
        assert_eq!(error_reason(&answer).1, "inconsistent");
    }

    assert_eq!(fingerprint(&c), before, "a forged message changed a node");
    assert_eq!(c.leader().await, leader);
    for id in [1, 2, 3] {
        assert!(
            c.client_of(id)
                .get("diverged", true)
                .await
                .unwrap()
                .is_none()
        );
    }
    // The cluster still writes, under the same leader.
    c.client().put("after", "ok", None, None).await.unwrap();
    assert_eq!(c.leader().await, leader);

    let page = metrics_of(&c, leader).await;
    for reason in ["not_member", "inconsistent", "no_sender", "disruptive_vote"] {
        assert!(refused(&page, reason) > 0, "{reason} not counted:\n{page}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_election_still_happens_when_the_leader_dies() {
    let mut c = TestCluster::start(3).await;
    let old = c.leader().await;
    c.client().put("k", "1", None, None).await.unwrap();
    c.stop(old).await;
    let new = c.leader().await;
    assert_ne!(new, old);
    c.client().put("k", "2", None, None).await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forwarded_commands_are_checked_like_a_clients() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let member = other_member(&c, &[leader]).to_string();
    let granted = c.client().grant("victim", 60_000).await.unwrap();
    // Refreshed once, so no checkpoint is in force: the leader then writes nothing on its own
    // (no lease clock ticks) and the log index below proves the forged commands did nothing.
    c.client().refresh("victim", None).await.unwrap();
    // Forwarded client commands travel guarded (on behalf of a user; "" without a token).
    let propose_raw = |cmd: Command| {
        let body = serde_json::to_vec(&cmd).unwrap();
        let member = member.clone();
        let c = &c;
        async move {
            peer_post(
                c,
                leader,
                "/raft/propose",
                Some(&member),
                "application/json",
                body,
            )
            .await
        }
    };
    let propose = |cmd: Command| {
        propose_raw(Command::Guarded {
            user: String::new(),
            command: Box::new(cmd),
        })
    };
    let put = |key: String, value: String| Command::Put {
        key,
        value,
        lease: None,
        prev_revision: None,
    };
    let before = settled(&c).await;
    // 32 MiB is over the route's body limit: the node answers 413 at once, without reading
    // the body, and may close the connection while the body is still being written.
    let huge = serde_json::to_vec(&put("k".into(), "v".repeat(32 << 20))).unwrap();
    let refused_early = reqwest::Client::new()
        .post(format!("{}/raft/propose", c.peer_url(leader)))
        .header(SENDER, &member)
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await;
    match refused_early {
        Ok(r) => assert_eq!(r.status(), 413),
        Err(e) => assert!(e.is_request(), "{e}"),
    }
    let forged = [
        (put("k".repeat(100 << 10), "v".into()), 400),
        // Within the body limit, over the value limit.
        (put("k".into(), "v".repeat((1 << 20) + 1)), 413),
        (
            Command::RegisterLease {
                name: "forever".into(),
                ttl_ms: u64::MAX,
                clock_ms: None,
            },
            400,
        ),
        (
            Command::RegisterLease {
                name: "stamped".into(),
                ttl_ms: 60_000,
                clock_ms: Some(1),
            },
            400,
        ),
        (
            Command::ExpireLeases {
                leases: vec![LeaseRef {
                    name: "victim".into(),
                    revision: granted.revision,
                }],
            },
            400,
        ),
        (
            Command::Batch {
                commands: vec![put("a".into(), "b".into())],
            },
            400,
        ),
    ];
    // A bare client command would skip apply's auth check: refused.
    let (got, _) = propose_raw(put("bare".into(), "v".into())).await;
    assert_eq!(got, 400, "a bare forwarded put");
    for (cmd, status) in forged {
        let what = format!("{:.80}", format!("{cmd:?}"));
        let (got, _) = propose(cmd).await;
        assert_eq!(got, status, "{what}");
    }
    assert_eq!(fingerprint(&c), before);
    assert!(c.client().lease("victim").await.unwrap().is_some());

    // A membership change naming a bad address, and one from a non-member.
    let (status, _) = peer_post(
        &c,
        leader,
        "/raft/admin",
        Some(&member),
        "application/json",
        br#"{"op":"add_node","id":7,"address":"not an address"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = peer_post(
        &c,
        leader,
        "/raft/admin",
        Some("99"),
        "application/json",
        br#"{"op":"remove_node","id":2}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 403);
    // The same for the etcd API's learner-only add.
    let (status, _) = peer_post(
        &c,
        leader,
        "/raft/add_learner",
        Some(&member),
        "application/json",
        br#"{"id":7,"address":"not an address"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = peer_post(
        &c,
        leader,
        "/raft/add_learner",
        Some("99"),
        "application/json",
        br#"{"id":7,"address":"127.0.0.1:7999"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(c.nodes[&leader].consensus().cluster_view().nodes.len(), 3);
    // Lease calls with names over the limit.
    let (status, _) = peer_post(
        &c,
        leader,
        "/raft/lease_refresh",
        Some(&member),
        "application/json",
        serde_json::to_vec(&"n".repeat(2000)).unwrap(),
    )
    .await;
    assert_eq!(status, 400);

    // A command a client could send still passes when forwarded.
    let (status, answer) = propose(put("fine".into(), "v".into())).await;
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_slice(&answer).unwrap();
    assert!(doc.get("Ok").is_some(), "{doc}");

    // Peer routes are not served on the client port.
    let r = reqwest::Client::new()
        .post(format!("{}/raft/propose", c.url(leader)))
        .header(SENDER, &member)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    assert!(refused(&metrics_of(&c, leader).await, "invalid_request") >= 8);
    c.shutdown().await;
}

fn wall_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_flease_writes_are_refused_and_the_holder_keeps_its_lease() {
    let cfg = FleaseConfig::derived(2000, 50, 100);
    let c = TestCluster::start_tweaked(3, move |n| n.flease = cfg).await;
    c.leader().await;
    let alice = c.client_of(1);
    let held = eventually(Duration::from_secs(20), "alice holds res", || async {
        alice
            .resource_acquire(Protocol::Flease, "res", "alice")
            .await
            .ok()
            .filter(|v| v.granted == Some(true))
    })
    .await;

    for target in [1u64, 2, 3] {
        let from = other_member(&c, &[target]);
        let now = wall_now();
        let max = Ballot {
            era: u64::MAX,
            counter: u32::MAX,
            boot: u64::MAX,
            node: from,
        };
        let plausible = Ballot {
            era: now / cfg.ballot_era_ms + 1,
            counter: 0,
            boot: 1,
            node: from,
        };
        let forever = |owner: &str| Slot::Lease {
            owner: owner.into(),
            expires: WallMillis(u64::MAX),
            epoch: u64::MAX,
        };
        let long = Slot::Lease {
            owner: "attacker".into(),
            expires: WallMillis(now + 1_000_000),
            epoch: held.epoch + 1,
        };
        let msgs: Vec<Envelope> = [(max, forever("attacker")), (plausible, long)]
            .into_iter()
            .map(|(k, value)| Envelope {
                proto: Protocol::Flease,
                resource: "res".into(),
                from,
                to: target,
                sent_at: WallMillis(now),
                body: Msg::Write { k, value },
            })
            .collect();
        let body = rmp_serde::to_vec(&msgs).unwrap();
        let (status, answer) = peer_post(
            &c,
            target,
            "/flease/msg",
            Some(&from.to_string()),
            "application/msgpack",
            body.clone(),
        )
        .await;
        assert_eq!(status, 200);
        let answers: Vec<Option<Envelope>> = rmp_serde::from_slice(&answer).unwrap();
        assert_eq!(
            answers,
            vec![None, None],
            "an acceptor acknowledged a forgery"
        );
        // The same batch from a node that is not a member is refused outright.
        let (status, _) = peer_post(
            &c,
            target,
            "/flease/msg",
            Some("99"),
            "application/msgpack",
            body,
        )
        .await;
        assert_eq!(status, 403);
    }

    // The real holder keeps it: another owner is told it is busy, alice renews.
    let bob = c
        .client_of(2)
        .resource_acquire(Protocol::Flease, "res", "bob")
        .await
        .unwrap();
    assert_eq!(bob.granted, Some(false), "{bob:?}");
    assert_eq!(bob.holder.as_deref(), Some("alice"));
    assert!(bob.valid_ms <= cfg.t_max_ms);
    let renewed = alice
        .resource_acquire(Protocol::Flease, "res", "alice")
        .await
        .unwrap();
    assert_eq!(renewed.granted, Some(true));
    for id in [1, 2, 3] {
        let page = metrics_of(&c, id).await;
        assert!(refused(&page, "invalid_lease_message") >= 2, "node {id}");
        assert!(refused(&page, "not_member") >= 1, "node {id}");
    }
    c.shutdown().await;
}

/// Forwarded batches (`/raft/propose_batch`, and `/raft/propose_batch_applied`, which also
/// says how far the leader had applied): checked command by command as a single
/// forwarded command is (one bad command refuses the whole batch, nothing applied), bounded
/// in size, answered in order with each command's own result; and under load through a
/// follower every put is answered once with a revision of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forwarded_batches_are_checked_command_by_command_and_answered_in_order() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = other_member(&c, &[leader]);
    let member = follower.to_string();
    let put = |key: &str| Command::Guarded {
        user: String::new(),
        command: Box::new(Command::Put {
            key: key.into(),
            value: "v".into(),
            lease: None,
            prev_revision: None,
        }),
    };
    let batch_on = |route: &'static str, cmds: Vec<Command>| {
        let body = serde_json::to_vec(&cmds).unwrap();
        let (c, member) = (&c, member.clone());
        async move { peer_post(c, leader, route, Some(&member), "application/json", body).await }
    };
    let before = settled(&c).await;
    let bare = Command::Put {
        key: "bare".into(),
        value: "v".into(),
        lease: None,
        prev_revision: None,
    };
    for route in ["/raft/propose_batch", "/raft/propose_batch_applied"] {
        for (what, cmds) in [
            (
                "a bare command among guarded ones",
                vec![put("a"), bare.clone()],
            ),
            ("an empty batch", Vec::new()),
            ("too many commands", vec![put("many"); 257]),
        ] {
            let (status, body) = batch_on(route, cmds).await;
            assert_eq!(
                status,
                400,
                "{route}, {what}: {}",
                String::from_utf8_lossy(&body)
            );
        }
    }
    assert_eq!(fingerprint(&c), before, "nothing applied");

    // The newer route says how far the leader had applied: at least as far as the batch.
    let (status, body) = batch_on(
        "/raft/propose_batch_applied",
        vec![put("four"), put("five")],
    )
    .await;
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_slice(&body).unwrap();
    let answers = doc["Ok"]["results"]
        .as_array()
        .expect("one answer per command");
    assert_eq!(answers.len(), 2, "{doc}");
    assert!(answers.iter().all(|a| a.get("Ok").is_some()), "{doc}");
    let applied = doc["Ok"]["applied_index"]
        .as_u64()
        .expect("an applied index");
    assert!(applied >= 1, "{doc}");

    let (status, body) = batch_on(
        "/raft/propose_batch",
        vec![put("one"), put("two"), put("three")],
    )
    .await;
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_slice(&body).unwrap();
    let answers = doc["Ok"].as_array().expect("one answer per command");
    assert_eq!(answers.len(), 3, "{doc}");
    let kv = c.client();
    for (key, answer) in ["one", "two", "three"].iter().zip(answers) {
        assert!(answer.get("Ok").is_some(), "{key}: {doc}");
        assert!(kv.get(key, false).await.unwrap().is_some(), "{key} stored");
    }

    // Through the follower's batching: 200 concurrent puts, each answered with its own revision.
    let through = c.client_of(follower);
    let through = &through;
    let puts =
        (0..200).map(|i| async move { through.put(&format!("load/{i}"), "v", None, None).await });
    let revisions: Vec<u64> = futures::future::join_all(puts)
        .await
        .into_iter()
        .map(|r| r.expect("put through the follower").revision.0)
        .collect();
    let distinct: std::collections::BTreeSet<u64> = revisions.iter().copied().collect();
    assert_eq!(distinct.len(), 200, "a revision each");
    for (i, rev) in revisions.iter().enumerate() {
        let stored = kv.get(&format!("load/{i}"), false).await.unwrap();
        assert_eq!(stored.expect("stored").kv.mod_revision.0, *rev);
    }
    c.shutdown().await;
}

/// A leadership-transfer call (`/raft/transfer`) holds a follower's elections only on its
/// leader's word, in its term, and no longer than the call lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transfer_calls_hold_elections_only_for_the_leader_and_only_while_they_last() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let target = other_member(&c, &[leader]);
    let bystander = other_member(&c, &[leader, target]);
    // The leader's term, once the target has heard of it too (a node just started may still
    // be a term behind: a call in what the test takes for "another term" would be in its own).
    let term = c.nodes[&leader].consensus().cluster_view().term;
    eventually(
        Duration::from_secs(10),
        "the target in the leader's term",
        || async { (c.nodes[&target].consensus().cluster_view().term == term).then_some(()) },
    )
    .await;
    let call = |term: u64, to: NodeId| {
        serde_json::to_vec(&serde_json::json!({"term": term, "target": to, "hold_ms": 60_000}))
            .unwrap()
    };

    // From a member that does not lead, or from the leader in another term: refused at once.
    for (sender, term) in [(bystander, term), (leader, term + 1), (leader, term - 1)] {
        let (status, answer) = peer_post(
            &c,
            target,
            "/raft/transfer",
            Some(&sender.to_string()),
            "application/json",
            call(term, bystander),
        )
        .await;
        assert_eq!(status, 200);
        let doc: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(doc["Err"]["code"], "not_leader", "{doc}");
        assert!(!c.nodes[&target].consensus().elections_held());
    }

    // The leader's own call holds the elections, for as long as the call lasts.
    let url = format!("{}/raft/transfer", c.peer_url(target));
    let held = tokio::spawn(
        reqwest::Client::new()
            .post(url)
            .header("content-type", "application/json")
            .header(SENDER, leader.to_string())
            .timeout(Duration::from_millis(1500))
            .body(call(term, bystander))
            .send(),
    );
    eventually(Duration::from_secs(5), "elections held", || async {
        c.nodes[&target].consensus().elections_held().then_some(())
    })
    .await;
    assert!(
        held.await.unwrap().is_err(),
        "the call ended before its timeout"
    );
    eventually(Duration::from_secs(5), "elections released", || async {
        (!c.nodes[&target].consensus().elections_held()).then_some(())
    })
    .await;
    assert_eq!(c.leader().await, leader);
    c.shutdown().await;
}
