//! End-to-end: a 3-node cluster over real HTTP on loopback.

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_through_any_node_are_readable_linearizably_from_every_node() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    for (i, id) in [1u64, 2, 3].into_iter().enumerate() {
        let key = format!("k/{i}");
        let put = c
            .client_of(id)
            .put(&key, &format!("v{i}"), None, None)
            .await
            .unwrap();
        for reader in [1u64, 2, 3] {
            let got = c.client_of(reader).get(&key, false).await.unwrap().unwrap();
            assert_eq!(got.kv.value, format!("v{i}"));
            assert_eq!(got.kv.mod_revision, put.revision);
        }
    }
    let list = c.client().list("k/", None, false).await.unwrap();
    assert_eq!(list.items.len(), 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_failover_loses_no_acknowledged_write() {
    let mut c = TestCluster::start(3).await;
    let mut acknowledged = Vec::new();
    for round in 0..2 {
        let leader = c.leader().await;
        // Writes keep flowing from a client that knows every node, across the failover.
        for i in 0..20 {
            let key = format!("f/{round}/{i}");
            let r = c.client().put(&key, "v", None, None).await.unwrap();
            acknowledged.push((key, r.revision));
        }
        c.stop(leader).await;
        let new_leader = c.leader().await;
        assert_ne!(new_leader, leader);
        // Writes continue under the new leader.
        let key = format!("f/{round}/after");
        let r = c.client().put(&key, "v", None, None).await.unwrap();
        acknowledged.push((key, r.revision));
        c.restart(leader).await;
    }
    for id in [1u64, 2, 3] {
        let client = c.client_of(id);
        for (key, revision) in &acknowledged {
            let got = client.get(key, false).await.unwrap();
            assert_eq!(
                got.map(|g| g.kv.mod_revision),
                Some(*revision),
                "{key} on node {id}"
            );
        }
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_node_recovers_from_its_directory_and_catches_up() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = [1u64, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    c.client().put("before", "1", None, None).await.unwrap();
    c.stop(follower).await;
    for i in 0..30 {
        c.client()
            .put(&format!("during/{i}"), "2", None, None)
            .await
            .unwrap();
    }
    c.restart(follower).await;
    let client = c.client_of(follower);
    eventually(
        Duration::from_secs(20),
        "restarted follower catches up",
        || async {
            let r = client.list("during/", None, true).await.ok()?;
            (r.items.len() == 30).then_some(())
        },
    )
    .await;
    assert_eq!(
        client.get("before", true).await.unwrap().unwrap().kv.value,
        "1"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_added_after_compaction_catches_up_by_snapshot() {
    // Snapshot every 20 entries so the log is purged long before the new node arrives.
    let mut c = TestCluster::start_with(3, 20).await;
    c.leader().await;
    for i in 0..150 {
        c.client()
            .put(&format!("s/{i:03}"), &i.to_string(), None, None)
            .await
            .unwrap();
    }
    // The leader's log no longer starts at 1: a newcomer cannot be fed from the log.
    let leader = c.leader().await;
    eventually(
        Duration::from_secs(20),
        "the leader purges its log",
        || async {
            let m = c.nodes[&leader]
                .consensus()
                .raft()
                .metrics()
                .borrow()
                .clone();
            m.purged.filter(|p| p.index > 10).map(|_| ())
        },
    )
    .await;
    c.start_joiner(4).await;
    // An add may leave the node a learner, saying why (the leader changed while it caught
    // up, on a loaded machine): adding it again promotes it, as the answer says.
    let mut added = None;
    for _ in 0..3 {
        let answer = c
            .client()
            .add_node_detailed(4, &c.addrs[&4].clone())
            .await
            .unwrap();
        if answer.voter {
            added = Some(answer);
            break;
        }
        eprintln!("node 4 stays a learner: {:?}", answer.message);
    }
    let added = added.expect("node 4 became a voter within three adds");
    assert!(added.view.nodes.iter().any(|n| n.id == 4 && n.voter));
    let newcomer = c.client_of(4);
    let listed = newcomer.list("s/", None, true).await.unwrap();
    assert_eq!(listed.items.len(), 150);
    assert!(
        c.nodes[&4]
            .consensus()
            .raft()
            .metrics()
            .borrow()
            .snapshot
            .is_some(),
        "the newcomer installed a snapshot"
    );
    // And it takes part from then on.
    c.client().put("after-join", "x", None, None).await.unwrap();
    assert!(newcomer.get("after-join", false).await.unwrap().is_some());
    // Removing it again shrinks the membership.
    let view = c.client().remove_node(4).await.unwrap();
    assert!(view.nodes.iter().all(|n| n.id != 4));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_compare_and_set_increments_never_lose_an_update() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    c.client().put("counter", "0", None, None).await.unwrap();
    let per_client = 15;
    let mut tasks = Vec::new();
    for (w, id) in [1u64, 2, 3, 1, 2, 3].into_iter().enumerate() {
        let client = c.client_of(id);
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            while done < per_client {
                let cur = client.get("counter", false).await.unwrap().unwrap();
                let n: u64 = cur.kv.value.split(':').next().unwrap().parse().unwrap();
                // The value names its writer, so an uncertain outcome can be checked.
                let next = format!("{}:{w}:{done}", n + 1);
                match client
                    .put("counter", &next, None, Some(cur.kv.mod_revision.0))
                    .await
                {
                    Ok(_) => done += 1,
                    Err(e) if e.code() == Some("revision_mismatch") => {}
                    Err(e) => panic!("unexpected error: {e}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let last = c.client().get("counter", false).await.unwrap().unwrap();
    let n: u64 = last.kv.value.split(':').next().unwrap().parse().unwrap();
    assert_eq!(n, 6 * per_client);
    c.shutdown().await;
}

/// A fresh cluster keeps its first leader. Every listed node of a new cluster used to campaign
/// for the first term as soon as it started; openraft orders same-term votes by node id, so a
/// later candidate with a higher id made the first leader step down at its first append, and
/// the survivors (who had just heard from that leader) refused every vote until their leader
/// lease ran out: about two seconds with no leader, seen as `503 outcome_unknown` on the
/// first writes. Only the lowest id campaigns at once now; the others wait to be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fresh_cluster_elects_one_leader_in_the_first_term_and_keeps_it() {
    for round in 0..3 {
        let c = TestCluster::start(3).await;
        let leader = c.leader().await;
        let client = c.client_of(leader);
        for i in 0..20 {
            client
                .put(&format!("first/{round}/{i}"), "v", None, None)
                .await
                .unwrap_or_else(|e| panic!("round {round}: write {i} failed: {e}"));
        }
        for (id, node) in &c.nodes {
            let v = node.consensus().cluster_view();
            assert_eq!(
                (v.term, v.leader_id),
                (1, Some(leader)),
                "round {round}: node {id} moved past the first term or leader"
            );
        }
        c.shutdown().await;
    }
}

/// With the lowest listed id down from the start, the next one forms the cluster (an election
/// timeout later) and the others follow it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_cluster_forms_without_its_lowest_listed_id() {
    let c = TestCluster::start_without(3, &[2, 3]).await;
    let leader = c.leader().await;
    assert!([2, 3].contains(&leader), "leader {leader}");
    let put = c
        .client_of(leader)
        .put("formed/without-1", "v", None, None)
        .await
        .unwrap();
    for id in [2u64, 3] {
        eventually(
            Duration::from_secs(10),
            "the write on both nodes",
            || async {
                let got = c.client_of(id).get("formed/without-1", true).await.ok()??;
                (got.kv.mod_revision == put.revision).then_some(())
            },
        )
        .await;
    }
    c.shutdown().await;
}
