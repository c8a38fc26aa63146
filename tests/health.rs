//! End to end: membership changes that cannot hurt the quorum, a leader that steps down when
//! it loses its quorum, readiness (`/livez`, `/readyz`) and the per-member status of
//! `GET /v1/cluster` (issue 10, items 2, 3 and 7).

// Tests measure how fast an answer comes against real deadlines.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{TestCluster, eventually};
use serde_json::{Value, json};

/// A port nobody listens on (the discard port): connections are refused.
const DEAD_ADDRESS: &str = "127.0.0.1:9";

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn send(req: reqwest::RequestBuilder) -> (u16, Value) {
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

fn voters(view: &Value) -> BTreeSet<u64> {
    view["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["voter"] == json!(true))
        .map(|n| n["id"].as_u64().unwrap())
        .collect()
}

fn has_node(view: &Value, id: u64) -> bool {
    view["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["id"] == json!(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adding_nodes_nobody_listens_on_leaves_them_learners_that_delete_removes() {
    let c = TestCluster::start_tweaked(3, |cfg| cfg.catch_up_ms = 1500).await;
    let leader = c.leader().await;
    let follower = [1u64, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    let http = http();
    // Three adds, through a follower (forwarded) and the leader: none may become a voter.
    for (id, via) in [(4u64, follower), (5, leader), (6, follower)] {
        let (status, body) = send(
            http.post(format!("{}/v1/cluster/nodes", c.url(via)))
                .json(&json!({"id": id, "address": DEAD_ADDRESS})),
        )
        .await;
        assert_eq!(status, 202, "node {id} answered {body}");
        assert_eq!(body["voter"], json!(false), "{body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|m| m.contains("learner")),
            "{body}"
        );
        assert!(has_node(&body, id), "{body}");
        assert_eq!(voters(&body), BTreeSet::from([1, 2, 3]), "{body}");
    }
    // The cluster still commits writes at once.
    c.client().put("after-adds", "x", None, None).await.unwrap();
    // And every learner can be removed.
    for id in [4u64, 5, 6] {
        let (status, body) =
            send(http.delete(format!("{}/v1/cluster/nodes/{id}", c.url(follower)))).await;
        assert_eq!(status, 200, "removing {id}: {body}");
        assert!(!has_node(&body, id), "{body}");
    }
    let view = c.client().cluster_status().await.unwrap();
    assert_eq!(view.nodes.len(), 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_cut_off_from_its_quorum_steps_down_and_fails_fast() {
    let c = TestCluster::start(3).await;
    let old = c.leader().await;
    let http = http();
    for id in [1u64, 2, 3] {
        let url = c.url(id);
        eventually(Duration::from_secs(10), "every node ready", || async {
            let (s, _) = send(http.get(format!("{url}/readyz"))).await;
            (s == 200).then_some(())
        })
        .await;
        let (s, _) = send(http.get(format!("{url}/livez"))).await;
        assert_eq!(s, 200);
    }
    c.partition(old);
    let cut_at = Instant::now();
    let old_url = c.url(old);
    // Within a few election timeouts the old leader says it is not ready, and stops leading.
    eventually(
        Duration::from_secs(5),
        "the cut-off leader is not ready",
        || async {
            let (s, body) = send(http.get(format!("{old_url}/readyz"))).await;
            (s == 503).then_some(body)
        },
    )
    .await;
    let not_ready_after = cut_at.elapsed();
    eventually(
        Duration::from_secs(5),
        "the cut-off leader steps down",
        || async { (!c.nodes[&old].consensus().is_leader()).then_some(()) },
    )
    .await;
    let stepped_down_after = cut_at.elapsed();
    let (s, health) = send(http.get(format!("{old_url}/health"))).await;
    assert_eq!(s, 200);
    assert_ne!(health["state"], json!("leader"), "{health}");
    assert_ne!(health["status"], json!("ok"), "{health}");
    // It is still alive.
    let (s, _) = send(http.get(format!("{old_url}/livez"))).await;
    assert_eq!(s, 200);
    // Writes and linearizable reads sent to it fail fast with a retryable 503, not a timeout.
    let started = Instant::now();
    let (s, body) = send(
        http.put(format!("{old_url}/v1/kv/cut-off"))
            .json(&json!({"value": "x"})),
    )
    .await;
    assert_eq!(s, 503, "{body}");
    assert_eq!(body["error"]["code"], json!("no_quorum"), "{body}");
    let write_failed_in = started.elapsed();
    assert!(
        write_failed_in < Duration::from_secs(1),
        "{write_failed_in:?}"
    );
    let started = Instant::now();
    let (s, body) = send(http.get(format!("{old_url}/v1/kv/cut-off"))).await;
    assert_eq!(s, 503, "{body}");
    assert_eq!(body["error"]["code"], json!("no_quorum"), "{body}");
    let read_failed_in = started.elapsed();
    assert!(
        read_failed_in < Duration::from_secs(1),
        "{read_failed_in:?}"
    );
    eprintln!(
        "cut off: not ready after {not_ready_after:?}, stepped down after {stepped_down_after:?}; \
         a write failed in {write_failed_in:?}, a read in {read_failed_in:?}"
    );
    // `cluster status` on it reports no leader.
    let view = c.nodes[&old].consensus().cluster_view();
    assert_eq!(view.leader_id, None, "{view:?}");
    // The majority elected a new leader and is ready.
    for id in [1u64, 2, 3].into_iter().filter(|id| *id != old) {
        let url = c.url(id);
        eventually(Duration::from_secs(10), "the majority is ready", || async {
            let (s, _) = send(http.get(format!("{url}/readyz"))).await;
            (s == 200).then_some(())
        })
        .await;
    }
    let majority_ready_after = cut_at.elapsed();
    // Once healed, the old leader follows and is ready again.
    c.heal();
    let healed_at = Instant::now();
    eventually(
        Duration::from_secs(15),
        "the old leader is ready again",
        || async {
            let (s, _) = send(http.get(format!("{old_url}/readyz"))).await;
            (s == 200).then_some(())
        },
    )
    .await;
    eprintln!(
        "majority ready {majority_ready_after:?} after the cut; old leader ready {:?} after healing",
        healed_at.elapsed()
    );
    c.shutdown().await;
}

/// A write the leader took just before it was cut off is answered `outcome_unknown` when the
/// leader steps down (a later leader may still commit it), not `timeout` at the end of the
/// request timeout: openraft keeps such a proposal waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_in_flight_when_the_leader_steps_down_is_answered_outcome_unknown() {
    let c = TestCluster::start(3).await;
    let old = c.leader().await;
    let http = http();
    let old_url = c.url(old);
    let (s, body) = send(
        http.put(format!("{old_url}/v1/kv/before"))
            .json(&json!({"value": "x"})),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    c.partition(old);
    // Sent at once: the leader has not yet noticed (an election timeout has to pass), so it
    // takes the write, which can never commit on its side of the partition.
    let (s, body) = send(
        http.put(format!("{old_url}/v1/kv/in-flight"))
            .json(&json!({"value": "x"})),
    )
    .await;
    assert_eq!(s, 503, "{body}");
    let code = body["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        code == "outcome_unknown" || code == "no_quorum",
        "a write in flight at the step-down: {body}"
    );
    eprintln!("the write in flight was answered {code}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_status_shows_each_members_reachability_contact_and_lag() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let cut = [1u64, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    let http = http();
    let url = c.url(leader);
    let member = |view: &Value, id: u64| {
        view["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == json!(id))
            .cloned()
            .unwrap()
    };
    eventually(
        Duration::from_secs(10),
        "every member reachable",
        || async {
            let (_, view) = send(http.get(format!("{url}/v1/cluster"))).await;
            let all = [1u64, 2, 3].into_iter().all(|id| {
                let m = member(&view, id);
                m["reachable"] == json!(true) && m["last_contact_ms"].is_u64()
            });
            (all && member(&view, cut)["lag"].is_u64()).then_some(())
        },
    )
    .await;
    c.partition(cut);
    c.client_of(leader)
        .put("while-cut", "x", None, None)
        .await
        .unwrap();
    let view = eventually(
        Duration::from_secs(10),
        "the cut member unreachable",
        || async {
            let (_, view) = send(http.get(format!("{url}/v1/cluster"))).await;
            (member(&view, cut)["reachable"] == json!(false)).then_some(view)
        },
    )
    .await;
    let other = [1u64, 2, 3]
        .into_iter()
        .find(|id| *id != leader && *id != cut)
        .unwrap();
    assert_eq!(member(&view, other)["reachable"], json!(true), "{view}");
    assert!(member(&view, cut)["lag"].as_u64().unwrap() >= 1, "{view}");
    c.heal();
    eventually(
        Duration::from_secs(10),
        "the cut member reachable again",
        || async {
            let (_, view) = send(http.get(format!("{url}/v1/cluster"))).await;
            let m = member(&view, cut);
            (m["reachable"] == json!(true) && m["lag"] == json!(0)).then_some(())
        },
    )
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_status_exits_non_zero_without_a_leader() {
    let mut c = TestCluster::start(1).await;
    c.leader().await;
    // A node waiting to join knows no leader.
    c.start_joiner(2).await;
    let run = |url: String, extra: &'static [&'static str]| async move {
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_leasecore"))
                .args(["cluster", "status", "--endpoints", &url])
                .args(extra)
                .output()
                .unwrap()
        })
        .await
        .unwrap()
    };
    let ok = run(c.url(1), &[]).await;
    assert!(ok.status.success(), "{ok:?}");
    let lonely = run(c.url(2), &[]).await;
    assert!(!lonely.status.success(), "{lonely:?}");
    // Given several endpoints, it shows the leader's view, with each member's reachability.
    let both = run(format!("{},{}", c.url(2), c.url(1)), &[]).await;
    assert!(both.status.success(), "{both:?}");
    let table = String::from_utf8_lossy(&both.stdout);
    assert!(table.contains("reachable"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.contains("voter (leader)") && l.contains("yes")),
        "{table}"
    );
    let ready = run(c.url(1), &["--ready"]).await;
    assert!(ready.status.success(), "{ready:?}");
    let not_ready = run(c.url(2), &["--ready"]).await;
    assert!(!not_ready.status.success(), "{not_ready:?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_add_that_lost_the_leader_half_way_never_answers_no_leader() {
    let c = TestCluster::start_tweaked(3, |cfg| cfg.catch_up_ms = 5000).await;
    let leader = c.leader().await;
    let via = [1u64, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    let url = c.url(via);
    let add = tokio::spawn(async move {
        send(
            http()
                .post(format!("{url}/v1/cluster/nodes"))
                .json(&json!({"id": 4, "address": DEAD_ADDRESS})),
        )
        .await
    });
    // The learner is in the membership, committed: something was done.
    eventually(Duration::from_secs(10), "the learner is added", || async {
        let node = &c.nodes[&leader];
        let v = node.consensus().cluster_view();
        let entry = node
            .consensus()
            .raft()
            .metrics()
            .borrow()
            .membership_config
            .log_id()
            .map(|l| l.index);
        let committed = entry.is_some_and(|i| i <= v.commit_index);
        (v.nodes.iter().any(|n| n.id == 4) && committed).then_some(())
    })
    .await;
    // The leader loses its quorum (and steps down) while the learner "catches up".
    c.partition(leader);
    let (status, body) = add.await.unwrap();
    assert!(
        status == 202 || body["error"]["code"] == json!("outcome_unknown"),
        "a change that was applied must not answer as if nothing was done: {status} {body}"
    );
    if status == 202 {
        assert_eq!(body["voter"], json!(false), "{body}");
    }
    c.heal();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_healthy_leader_under_write_load_never_steps_down_or_refuses() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let term = c.nodes[&leader].consensus().cluster_view().term;
    let client = std::sync::Arc::new(c.client_of(leader));
    let value = "v".repeat(1024);
    let mut writers = Vec::new();
    for w in 0..32 {
        let (client, value) = (client.clone(), value.clone());
        writers.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(3);
            let mut i = 0u64;
            while Instant::now() < deadline {
                client
                    .put(&format!("load/{w}/{i}"), &value, None, None)
                    .await
                    .unwrap();
                i += 1;
            }
            i
        }));
    }
    let mut puts = 0;
    for w in writers {
        puts += w.await.unwrap();
    }
    let view = c.nodes[&leader].consensus().cluster_view();
    assert_eq!(view.term, term, "a leader change under load: {view:?}");
    assert!(c.nodes[&leader].consensus().is_leader());
    eprintln!(
        "{puts} puts in 3 s; quorum acknowledged {:?} ms ago",
        view.quorum_ack_ms
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_learner_still_catching_up_can_be_removed_at_once() {
    let c = TestCluster::start_tweaked(3, |cfg| cfg.catch_up_ms = 8000).await;
    let leader = c.leader().await;
    let url = c.url(leader);
    let started = Instant::now();
    let add = tokio::spawn({
        let url = url.clone();
        async move {
            send(
                http()
                    .post(format!("{url}/v1/cluster/nodes"))
                    .json(&json!({"id": 4, "address": DEAD_ADDRESS})),
            )
            .await
        }
    });
    eventually(Duration::from_secs(10), "the learner is added", || async {
        let v = c.nodes[&leader].consensus().cluster_view();
        v.nodes.iter().any(|n| n.id == 4).then_some(())
    })
    .await;
    // The add is still waiting for node 4, and removing it works: at most a retryable 409
    // while the learner's own entry commits (one change at a time), never a 400.
    let body = eventually(Duration::from_secs(5), "node 4 is removed", || async {
        let (status, body) = send(http().delete(format!("{url}/v1/cluster/nodes/4"))).await;
        match status {
            200 => Some(body),
            409 => {
                assert_eq!(
                    body["error"]["code"],
                    json!("membership_change_in_progress")
                );
                None
            }
            _ => panic!("removing a learner that catches up: {status} {body}"),
        }
    })
    .await;
    assert!(!has_node(&body, 4), "{body}");
    // And the waiting add ends at once, saying what happened.
    let (status, body) = add.await.unwrap();
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["voter"], json!(false), "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("removed")),
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    c.shutdown().await;
}
