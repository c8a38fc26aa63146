//! Leadership transfer (`raft::consensus::transfer`): etcd's `MoveLeader` through `etcdctl
//! move-leader`, `POST /v1/cluster/leader` through the client, under a steady stream of writes
//! through every node, none of which may be lost; and the refusals.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::etcdctl::{endpoints, fails, have_etcdctl, ok};
use common::{TestCluster, eventually};
use leasecore::domain::types::NodeId;

/// Puts unique keys through node `id` until told to stop; returns the acknowledged ones.
fn writer(
    c: &TestCluster,
    id: NodeId,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<String>> {
    let client = c.client_of(id);
    tokio::spawn(async move {
        let mut acked = Vec::new();
        for i in 0..100_000u64 {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let key = format!("w{id}/{i}");
            if client.put(&key, "v", None, None).await.is_ok() {
                acked.push(key);
            }
        }
        acked
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leadership_moves_on_request_and_no_write_is_lost() {
    let etcdctl = have_etcdctl();
    let c = TestCluster::start_tweaked(3, |cfg| cfg.etcd_listen = Some("127.0.0.1:0".into())).await;
    let first = c.leader().await;
    let followers: Vec<NodeId> = (1..=3).filter(|id| *id != first).collect();
    let (target, other) = (followers[0], followers[1]);

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (1..=3).map(|id| writer(&c, id, stop.clone())).collect();
    eventually(Duration::from_secs(10), "writes flowing", || async {
        let n = c.client().list("w", None, true).await.ok()?.items.len();
        (n >= 30).then_some(())
    })
    .await;

    // To a follower, with etcd's own client (it finds the leader among the endpoints).
    if etcdctl {
        let out = ok(&endpoints(&c), &["move-leader", &format!("{target:x}")]).await;
        assert!(
            out.contains(&format!(
                "Leadership transferred from {first:x} to {target:x}"
            )),
            "{out}"
        );
    } else {
        c.client_of(first).move_leader(target).await.unwrap();
    }
    assert_eq!(c.leader().await, target);

    // Back again through /v1, asked of the node that leads neither before nor after.
    let view = c.client_of(other).move_leader(first).await.unwrap();
    assert_eq!(view.leader_id, Some(first));
    assert_eq!(c.leader().await, first);

    // Naming the leader changes nothing; a node that is not a voter is refused.
    let view = c.client_of(target).move_leader(first).await.unwrap();
    assert_eq!(view.leader_id, Some(first));
    let e = c.client_of(target).move_leader(99).await.unwrap_err();
    assert_eq!(e.code(), Some("bad_leader_transferee"), "{e}");
    if etcdctl {
        let err = fails(&endpoints(&c), &["move-leader", "63"]).await;
        assert!(err.contains("etcdserver: bad leader transferee"), "{err}");
    }

    stop.store(true, Ordering::Relaxed);
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(w.await.unwrap());
    }
    assert!(
        acked.len() >= 30,
        "only {} writes acknowledged",
        acked.len()
    );
    let client = c.client();
    for key in &acked {
        assert!(
            client.get(key, false).await.unwrap().is_some(),
            "acknowledged write {key} is lost"
        );
    }
    c.shutdown().await;
}

/// In five nodes the other voters' own election timers would beat the transferee to the
/// lapsed lease: they hold their elections, and each transfer lands where it was asked to.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_voters_hand_the_leadership_round() {
    let c = TestCluster::start(5).await;
    let mut leader = c.leader().await;
    for _ in 0..4 {
        let target = (1..=5).map(|i| (leader + i - 1) % 5 + 1).nth(1).unwrap();
        let view = c.client_of(leader).move_leader(target).await.unwrap();
        assert_eq!(view.leader_id, Some(target));
        assert_eq!(c.leader().await, target);
        leader = target;
    }
    c.client().put("after", "moves", None, None).await.unwrap();
    c.shutdown().await;
}
