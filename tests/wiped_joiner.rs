//! A node that joined with `--join` (no `--peers`, as the README's own command line for a
//! node added later), lost its data dir, and was started again with the same command line:
//! it must not come back as the voter it was. Its empty log and lost vote would let it elect a
//! leader that lacks writes it had acknowledged, or vote twice in one term.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually};

const WAIT: Duration = Duration::from_secs(60);

/// Start node `id` empty with `--join`, and add it until it is a voter.
async fn join_as_voter(c: &mut TestCluster, id: u64) {
    c.start_joiner(id).await;
    for _ in 0..3 {
        let answer = c
            .client()
            .add_node_detailed(id, &c.addrs[&id].clone())
            .await
            .unwrap();
        if answer.voter {
            return;
        }
    }
    panic!("node {id} did not become a voter");
}

/// Write `k/{i}` = `v{i}` for each `i` of `range`.
async fn write_keys(client: &leasecore::client::Client, range: std::ops::Range<u32>) {
    for i in range {
        client
            .put(&format!("k/{i}"), &format!("v{i}"), None, None)
            .await
            .unwrap();
    }
}

/// Wait until node `id` applied up to `index`.
async fn applied_at_least(c: &TestCluster, id: u64, index: u64) {
    eventually(
        WAIT,
        &format!("node {id} applied up to {index}"),
        || async {
            let m = c
                .nodes
                .get(&id)?
                .consensus()
                .raft()
                .metrics()
                .borrow()
                .clone();
            m.last_applied.filter(|l| l.index >= index).map(|_| ())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wiped_joiner_started_again_with_join_is_replaced_not_trusted() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    join_as_voter(&mut c, 4).await;
    let client = c.client();
    write_keys(&client, 0..50).await;
    // Node 4 holds the writes, then loses everything and starts again as it was started.
    applied_at_least(&c, 4, 50).await;
    c.stop(4).await;
    std::fs::remove_dir_all(c.data_dir(4)).unwrap();
    c.restart(4).await;

    // The cluster keeps its leader (nobody crashed on the node's empty log) and serves writes.
    write_keys(&client, 50..60).await;
    // Node 4 ends up whole again: replaced (it no longer counts as the voter whose log it
    // lost) and caught up, with every write.
    eventually(WAIT, "node 4 caught up after its replacement", || async {
        let node = c.nodes.get(&4)?;
        let m = node.consensus().raft().metrics().borrow().clone();
        m.last_applied.filter(|l| l.index >= 60).map(|_| ())
    })
    .await;
    let local = c.client_of(4);
    let listed = local.list("k/", None, true).await.unwrap();
    assert_eq!(listed.items.len(), 60);
    for id in [1, 2, 3] {
        assert!(
            c.nodes.contains_key(&id) && !c.nodes[&id].cancelled().is_cancelled(),
            "node {id} still runs"
        );
    }
    c.shutdown().await;
}

/// A vote request to node `target`'s peer port from `candidate` for `term`, with a log as long
/// as anyone's: whether it was granted.
async fn vote_granted(c: &TestCluster, target: u64, candidate: u64, term: u64) -> bool {
    use leasecore::domain::peer_trust::SENDER_HEADER;
    use openraft::{CommittedLeaderId, LogId, Vote, raft::VoteRequest};
    let req = VoteRequest::new(
        Vote::new(term, candidate),
        Some(LogId::new(CommittedLeaderId::new(term, candidate), 1 << 40)),
    );
    let resp = reqwest::Client::new()
        .post(format!("{}/raft/vote", c.peer_url(target)))
        .header(SENDER_HEADER, candidate.to_string())
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&req).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let doc: serde_json::Value = resp.json().await.unwrap();
    doc["Ok"]["vote_granted"].as_bool().unwrap()
}

/// Node `id`'s `leasecore_vote_withheld` sample in `/metrics`.
async fn vote_withheld_gauge(c: &TestCluster, id: u64) -> String {
    let text = reqwest::get(format!("{}/metrics", c.url(id)))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("leasecore_vote_withheld "))
        .unwrap_or_else(|| panic!("no leasecore_vote_withheld in {text}"))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_joining_empty_votes_only_once_listed_as_a_non_voter() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    // Started empty with --join (a new node, or a member that lost its data: it cannot
    // tell): a candidate gets no vote from it, also after a restart.
    c.start_joiner(4).await;
    assert!(!vote_granted(&c, 4, 2, 1000).await);
    assert_eq!(vote_withheld_gauge(&c, 4).await, "1");
    c.stop(4).await;
    c.restart(4).await;
    assert!(!vote_granted(&c, 4, 2, 1001).await);
    // Added: a learner first, so the hold is released (it votes once it is a voter).
    let answer = c
        .client()
        .add_node_detailed(4, &c.addrs[&4].clone())
        .await
        .unwrap();
    assert!(answer.view.nodes.iter().any(|n| n.id == 4), "{answer:?}");
    eventually(WAIT, "node 4's vote hold released", || async {
        let hold = c.nodes[&4].consensus().vote_hold().cloned()?;
        (!hold.is_held()).then_some(())
    })
    .await;
    assert!(!c.data_dir(4).join("vote-held").exists());
    assert_eq!(vote_withheld_gauge(&c, 4).await, "0");
    // A node of the new cluster never held its vote.
    for id in [1, 2, 3] {
        assert!(!c.nodes[&id].consensus().vote_hold().unwrap().is_held());
    }
    c.shutdown().await;
}

/// The manual procedure (remove, wipe, start with --join, add) under one leader: the node's
/// acknowledgements from before its removal must not make its fresh catch-up look like a
/// log that went back (which would have it removed again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_removed_and_added_back_by_hand_is_not_taken_for_a_reverted_one() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let client = c.client();
    for i in 0..40 {
        client
            .put(&format!("k/{i}"), &format!("v{i}"), None, None)
            .await
            .unwrap();
    }
    let gone = *c.nodes.keys().find(|id| **id != leader).unwrap();
    eventually(WAIT, "the follower applied the writes", || async {
        let m = c.nodes[&gone].consensus().raft().metrics().borrow().clone();
        m.last_applied.filter(|l| l.index >= 40).map(|_| ())
    })
    .await;
    c.stop(gone).await;
    c.client_of(leader).remove_node(gone).await.unwrap();
    std::fs::remove_dir_all(c.data_dir(gone)).unwrap();
    c.restart_as_joiner(gone).await;
    let answer = c
        .client_of(leader)
        .add_node_detailed(gone, &c.addrs[&gone].clone())
        .await
        .unwrap();
    assert!(answer.voter, "{answer:?}");
    assert_eq!(c.leader().await, leader, "the same leader throughout");
    // Still a voter a moment later (no replacement removed it meanwhile), with every key.
    eventually(WAIT, "the node holds every key", || async {
        let listed = c.client_of(gone).list("k/", None, true).await.ok()?;
        (listed.items.len() == 40).then_some(())
    })
    .await;
    let view = c.client_of(leader).cluster_status().await.unwrap();
    assert!(
        view.nodes.iter().any(|n| n.id == gone && n.voter),
        "{view:?}"
    );
    c.shutdown().await;
}

/// A member that lost its data, restarted with `--join` after the leader changed (so no
/// leader remembers what it acknowledged, and nobody notices its log went back). Returns the
/// cluster with node 5 caught up from the new leader, and that leader.
async fn wiped_voter_back_under_a_new_leader(auto_replace: bool) -> (TestCluster, u64) {
    let mut c = TestCluster::start(4).await;
    let first_leader = c.leader().await;
    join_as_voter(&mut c, 5).await;
    write_keys(&c.client(), 0..30).await;
    applied_at_least(&c, 5, 30).await;
    c.stop(5).await;
    std::fs::remove_dir_all(c.data_dir(5)).unwrap();
    // A new leader, which never heard from node 5, before node 5 comes back.
    c.stop(first_leader).await;
    let leader = c.leader().await;
    c.tweak = Some(std::sync::Arc::new(move |cfg| {
        cfg.auto_replace = auto_replace
    }));
    c.restart_as_joiner(5).await;
    let client = c.client_of(leader);
    write_keys(&client, 30..40).await;
    let last = c.nodes[&leader]
        .consensus()
        .raft()
        .metrics()
        .borrow()
        .last_log_index
        .unwrap();
    applied_at_least(&c, 5, last).await;
    (c, leader)
}

/// Its young log, replayed from index 1, holds its own first learner entry: that entry must
/// not release the hold (the cluster still counts it as the voter it was). With auto-replace
/// off it withholds its vote, does not campaign when no leader is left without it, and votes
/// again once the operator removed and added it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wiped_voter_replaying_its_own_learner_entry_keeps_withholding_its_vote() {
    let (mut c, leader) = wiped_voter_back_under_a_new_leader(false).await;
    let hold = c.nodes[&5].consensus().vote_hold().cloned().unwrap();
    assert!(hold.is_held(), "released by its own first learner entry");
    assert!(hold.still_counted_as_voter());
    assert!(!vote_granted(&c, 5, 2, 1000).await);
    assert!(c.data_dir(5).join("vote-held").exists());

    // Without the leader, the two other live voters cannot elect anyone without node 5's
    // vote (nor win a pre-vote); node 5 must not campaign (a vote for itself is a vote)
    // while everyone has been without a leader for several election timeouts.
    let term_before = c.nodes[&5]
        .consensus()
        .raft()
        .metrics()
        .borrow()
        .current_term;
    c.stop(leader).await;
    eventually(WAIT, "every live node without a leader for 3 s", || async {
        let leaderless = c.nodes.values().all(|n| {
            n.consensus()
                .peers()
                .contacts()
                .led_age()
                .is_some_and(|age| age >= 3_000)
        });
        let voted_for_itself = c.nodes[&5]
            .consensus()
            .raft()
            .metrics()
            .borrow()
            .vote
            .leader_id()
            .node_id
            == 5;
        (leaderless || voted_for_itself).then_some(())
    })
    .await;
    let m = c.nodes[&5].consensus().raft().metrics().borrow().clone();
    assert_ne!(m.vote.leader_id().node_id, 5, "node 5 campaigned: {m:?}");
    assert_ne!(m.state, openraft::ServerState::Leader);
    assert_eq!(m.current_term, term_before, "{m:?}");

    // The operator's way out, as its log says: with a leader back, remove it and add it.
    c.restart(leader).await;
    let leader = c.leader().await;
    let client = c.client_of(leader);
    client.remove_node(5).await.unwrap();
    client
        .add_node_detailed(5, &c.addrs[&5].clone())
        .await
        .unwrap();
    eventually(WAIT, "node 5's vote hold released", || async {
        (!hold.is_held()).then_some(())
    })
    .await;
    c.shutdown().await;
}

/// The same member with auto-replace on (the default): it finds out from its own log that it
/// is still counted as the voter it was, asks the leader to replace it, and ends a voter
/// again with every write, its vote released.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wiped_voter_nobody_replaced_asks_to_be_replaced() {
    let (c, leader) = wiped_voter_back_under_a_new_leader(true).await;
    let hold = c.nodes[&5].consensus().vote_hold().cloned().unwrap();
    eventually(WAIT, "node 5 replaced and a voter again", || async {
        let view = c.client_of(leader).cluster_status().await.ok()?;
        let voter = view.nodes.iter().any(|n| n.id == 5 && n.voter);
        (voter && !hold.is_held()).then_some(())
    })
    .await;
    let listed = c.client_of(5).list("k/", None, true).await.unwrap();
    assert_eq!(listed.items.len(), 40);
    assert!(!c.data_dir(5).join("vote-held").exists());
    c.shutdown().await;
}
