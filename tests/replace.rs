//! A node replaced by the cluster (it came back with an empty data dir while the cluster still
//! listed it), in-process: the replacement is finished even when the asking node hangs up
//! between the leader's removal and its learner add (its ask timing out drops the leader's
//! handler), and a replaced node restarted from its data before its promotion is still
//! promoted. Either used to leave a 3-voter cluster with 2 voters, silently (found by review).

// Tests wait against real deadlines.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually};
use leasecore::domain::types::NodeId;
use leasecore::node::Node;
use leasecore::raft::consensus::{AdminRequest, ConsensusError};

/// Whether `id` is a voter (Some(true)), a learner (Some(false)) or absent, as `leader` sees it.
fn role(c: &TestCluster, leader: NodeId, id: NodeId) -> Option<bool> {
    let view = c.nodes[&leader].consensus().cluster_view();
    view.nodes.iter().find(|n| n.id == id).map(|n| n.voter)
}

// Current-thread runtime: what a spawned task does only happens once the test awaits.
#[tokio::test]
async fn a_replacement_cut_between_removal_and_learner_add_is_finished_on_retry() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let v = (1..=3).find(|i| *i != leader).unwrap();
    c.stop(v).await;
    std::fs::remove_dir_all(c.data_dir(v)).unwrap();

    // What the wiped node does first: note that it is to be promoted again (it was a voter)...
    let dir = c.data_dir(v);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(leasecore::runtime::replace::PROMOTION_PENDING), "").unwrap();
    // ... and what it asks, cut once the removal is in the leader's log (before the
    // learner add was sent): as a handler future dropped when the asking node's 2 s
    // `post_json` times out, or a leader that stops right there.
    let consensus = c.nodes[&leader].consensus().clone();
    let req = AdminRequest::RemoveForReplacement {
        id: v,
        address: c.addrs[&v].clone(),
    };
    let mut metrics = consensus.raft().metrics();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        assert!(tokio::time::Instant::now() < deadline, "never removed");
        let admin = consensus.admin_here(req.clone());
        let removed = metrics.wait_for(|m| m.membership_config.membership().get_node(&v).is_none());
        tokio::select! {
            biased;
            r = removed => { r.unwrap(); break; }
            r = admin => match r {
                // The leader heard from the old process less than an election timeout ago.
                Err(ConsensusError::StillAnswering { .. }) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => panic!("the removal was not cut as intended: {other:?}"),
            },
        }
    }
    // The wiped node starts (again), as an operator would after its first attempt exited
    // (the leader finished the replacement meanwhile, or does it again).
    let mut cfg = c.config(v, false);
    cfg.peer_probe = Duration::from_secs(2);
    let node = Node::start(cfg).await.unwrap_or_else(|e| {
        panic!("node {v}, whose replacement was cut after its removal, must start again: {e}")
    });
    c.nodes.insert(v, node);
    eventually(
        Duration::from_secs(30),
        "the node a voter again",
        || async { (role(&c, leader, v) == Some(true)).then_some(()) },
    )
    .await;
    c.shutdown().await;
}

#[tokio::test]
async fn a_replaced_node_restarted_before_its_promotion_is_still_promoted() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let client = c.client();
    for i in 0..20 {
        client.put(&format!("k{i}"), "v", None, None).await.unwrap();
    }
    let v = (1..=3).find(|i| *i != leader).unwrap();
    c.stop(v).await;
    std::fs::remove_dir_all(c.data_dir(v)).unwrap();

    let mut cfg = c.config(v, false);
    cfg.peer_probe = Duration::from_secs(2);
    let node = Node::start(cfg).await.expect("replaced");
    // Before its promotion task first runs (nothing ran since `start` returned), cut this
    // node's own calls to the leader: it still catches up (the leader calls it), but its
    // `AddNode` cannot get through yet: a slow or busy leader, a node restarted quickly.
    node.faults().block(&c.addrs[&leader]);
    c.nodes.insert(v, node);
    eventually(
        Duration::from_secs(20),
        "a learner holding the log",
        || async {
            let leader_last = c.nodes[&leader]
                .consensus()
                .raft()
                .metrics()
                .borrow()
                .last_log_index?;
            let applied = c.nodes[&v]
                .consensus()
                .raft()
                .metrics()
                .borrow()
                .last_applied
                .map(|l| l.index)?;
            (role(&c, leader, v) == Some(false) && applied >= leader_last).then_some(())
        },
    )
    .await;

    // An ordinary restart (a deploy, a crash) of the learner, from its data.
    c.stop(v).await;
    c.restart(v).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::time::Instant::now() < deadline && role(&c, leader, v) != Some(true) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        role(&c, leader, v),
        Some(true),
        "node {v} restarted from its data before its promotion: 30 s later it is still a \
         learner (Some(false)) or gone (None), and nothing will ever ask to promote it"
    );
    c.shutdown().await;
}

/// Only at the address the cluster records: a process elsewhere claiming a silent member's id
/// does not take its place (a takeover is the operator's call: remove, then add).
#[tokio::test]
async fn a_replacement_from_another_address_is_refused_and_changes_nothing() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let v = (1..=3).find(|i| *i != leader).unwrap();
    c.stop(v).await;
    let consensus = c.nodes[&leader].consensus().clone();
    let req = AdminRequest::RemoveForReplacement {
        id: v,
        address: "127.0.0.1:1".into(),
    };
    match consensus.admin_here(req).await {
        Err(ConsensusError::InvalidMembership { message }) => {
            assert!(message.contains("keeps the address"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(role(&c, leader, v), Some(true), "still a voter");
    c.shutdown().await;
}
