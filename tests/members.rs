//! Membership by heartbeat, with real `leasecore agent` processes.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{TestCluster, eventually};
use leasecore::client::{WatchFilter, WatchItem, Watcher};
use leasecore::domain::command::{Cause, Event, EventKind};

/// Kills the agent if a test fails half-way.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_agent(c: &TestCluster, id: &str, ttl_ms: u64) -> Agent {
    let endpoints: Vec<String> = c.nodes.keys().map(|n| c.url(*n)).collect();
    let child = Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args([
            "agent",
            "--id",
            id,
            "--address",
            "10.1.1.1:8080",
            "--meta",
            "zone=z1",
        ])
        .args(["--ttl-ms", &ttl_ms.to_string()])
        .args(["--endpoints", &endpoints.join(",")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the leasecore binary");
    Agent(child)
}

async fn until_member(c: &TestCluster, id: &str, present: bool) {
    let client = c.client();
    eventually(
        Duration::from_secs(20),
        "the member list changes",
        || async {
            let list = client.members().await.ok()?;
            (list.members.iter().any(|m| m.id == id) == present).then_some(())
        },
    )
    .await;
}

/// The next delete event of `key` from the watcher.
async fn next_delete(w: &mut Watcher, key: &str) -> Event {
    loop {
        let item = tokio::time::timeout(Duration::from_secs(20), w.next())
            .await
            .expect("a delete within 20 s")
            .unwrap();
        if let WatchItem::Event(e) = item
            && e.key == key
            && e.kind == EventKind::Delete
        {
            return e;
        }
    }
}

/// A cluster and a watcher of `members/` from now on.
async fn cluster_with_member_watch() -> (TestCluster, Watcher) {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let start = c.client().put("m/start", "x", None, None).await.unwrap();
    let watcher = Watcher::new(
        Arc::new(c.client()),
        WatchFilter::Prefix("members/".into()),
        Some(start.revision.0),
    )
    .poll_timeout(1_000);
    (c, watcher)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_agent_disappears_after_its_ttl_and_watchers_see_it_expire() {
    let (c, mut watcher) = cluster_with_member_watch().await;
    let mut agent = spawn_agent(&c, "crashy", 2000);
    until_member(&c, "crashy", true).await;
    let m = c.client().members().await.unwrap();
    let rec = m.members.iter().find(|m| m.id == "crashy").unwrap();
    assert_eq!(rec.address, "10.1.1.1:8080");
    assert_eq!(rec.meta.get("zone").map(String::as_str), Some("z1"));

    // SIGKILL: no goodbye. The lease runs out and the key goes with it.
    agent.0.kill().unwrap();
    agent.0.wait().unwrap();
    let gone = next_delete(&mut watcher, "members/crashy").await;
    assert_eq!(gone.cause, Cause::LeaseExpired);
    until_member(&c, "crashy", false).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminated_agent_leaves_at_once() {
    let (c, mut watcher) = cluster_with_member_watch().await;
    // A long TTL: only a deregistration can remove it within the test.
    let agent = spawn_agent(&c, "polite", 60_000);
    until_member(&c, "polite", true).await;
    let pid = agent.0.id().to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    let gone = next_delete(&mut watcher, "members/polite").await;
    assert_eq!(gone.cause, Cause::LeaseRevoked);
    drop(agent);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registration_conflicts_and_unknown_members() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = c.client();
    let r = client
        .register_member("n1", "h:1", 60_000, Default::default())
        .await
        .unwrap();
    assert_eq!(
        (r.lease.as_str(), r.key.as_str()),
        ("members/n1", "members/n1")
    );
    let dup = client
        .register_member("n1", "h:2", 60_000, Default::default())
        .await
        .unwrap_err();
    assert_eq!(
        (dup.status(), dup.code()),
        (Some(409), Some("member_exists"))
    );
    client.heartbeat("n1", None).await.unwrap();
    let missing = client.heartbeat("ghost", None).await.unwrap_err();
    assert_eq!(missing.code(), Some("member_not_found"));
    assert_eq!(
        client.leave("ghost").await.unwrap_err().code(),
        Some("member_not_found")
    );
    let bad = client
        .register_member("a/b", "h:1", 60_000, Default::default())
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Some("invalid_argument"));
    client.leave("n1").await.unwrap();
    assert!(client.members().await.unwrap().members.is_empty());
    c.shutdown().await;
}
