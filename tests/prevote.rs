//! Pre-vote (`domain::prevote`, `runtime::election`): a voter campaigns only once a majority
//! would vote for it. A follower cut off from the others must not raise its term on its own
//! and, once back, depose the leader that kept serving (openraft 0.9 alone does: its
//! candidate's higher term, in its first answer to the leader's append, makes the leader step
//! down).
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_cut_off_and_back_does_not_depose_the_leader() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let term = |id: u64| {
        c.nodes[&id]
            .consensus()
            .raft()
            .metrics()
            .borrow()
            .current_term
    };
    let term_before = term(leader);
    let cut = *c.nodes.keys().find(|id| **id != leader).unwrap();
    c.partition(cut);
    // Cut off for three times the longest election timeout: long enough to have tried
    // several times.
    eventually(WAIT, "the cut node's leader silent for 3 s", || async {
        let age = c.nodes[&cut].consensus().peers().contacts().led_age()?;
        (age >= 3_000).then_some(())
    })
    .await;
    assert_eq!(
        term(cut),
        term_before,
        "the cut node raised its term on its own"
    );
    c.client_of(leader)
        .put("while-cut", "x", None, None)
        .await
        .unwrap();
    c.heal();
    eventually(WAIT, "the cut node caught up", || async {
        let last = c.nodes[&leader]
            .consensus()
            .raft()
            .metrics()
            .borrow()
            .last_log_index;
        let m = c.nodes[&cut].consensus().raft().metrics().borrow().clone();
        (m.last_applied.map(|l| l.index) == last && m.current_leader == Some(leader)).then_some(())
    })
    .await;
    assert_eq!(c.leader().await, leader, "the leader was deposed");
    assert_eq!(term(leader), term_before);
    c.shutdown().await;
}

/// With the leader gone, the others still elect one promptly (the watchdog is the election
/// timer now), and a whole cluster restarted elects one too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_is_elected_after_the_leader_stops_and_after_a_whole_restart() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    c.stop(leader).await;
    let next = c.leader().await;
    assert_ne!(next, leader);
    c.client_of(next).put("k", "v", None, None).await.unwrap();
    c.restart(leader).await;
    c.leader().await;
    let ids: Vec<u64> = c.nodes.keys().copied().collect();
    for id in &ids {
        c.stop(*id).await;
    }
    for id in &ids {
        c.restart(*id).await;
    }
    let l = c.leader().await;
    let got = c.client_of(l).get("k", false).await.unwrap().unwrap();
    assert_eq!(got.kv.value, "v");
    c.shutdown().await;
}
