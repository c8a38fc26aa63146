//! Locks and elections over HTTP (`/v1/locks`, `/v1/elections`), through the client crate and
//! a real cluster: arrival order, one holder at a time, through any node, across a leader
//! kill; a lease's expiry releases a holder and takes a waiter out of line; fencing tokens
//! refuse a paused old holder (and without them the same run loses an update); campaign,
//! proclaim, resign.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{TestCluster, eventually};
use leasecore::client::{Client, Session};
use leasecore::domain::types::Revision;

/// Register a lease, riding out the cluster's start (a retry after a lost answer finds it
/// registered).
async fn grant(client: &Client, name: &str, ttl_ms: u64) {
    eventually(Duration::from_secs(30), "a lease", || async {
        match client.grant(name, ttl_ms).await {
            Ok(_) => Some(()),
            Err(e) if e.code() == Some("lease_exists") => Some(()),
            Err(_) => None,
        }
    })
    .await;
}

/// A client of one node only (to send each contender through a different node).
fn via(c: &TestCluster, id: u64) -> Arc<Client> {
    Arc::new(c.client_of(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lock_is_held_by_one_contender_at_a_time_in_arrival_order_through_any_node() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let mut sessions = Vec::new();
    for i in 0..6u64 {
        let client = via(&c, i % 3 + 1);
        let session = eventually(Duration::from_secs(20), "a session", || {
            let client = client.clone();
            async move { Session::new(client, 10_000).await.ok() }
        })
        .await;
        sessions.push(session);
    }
    // Queue up in a known order: the first holds at once, each other waits for the one before.
    let mut queued = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        let standing = s.client().lock_once("db", s.lease(), 0).await.unwrap();
        assert_eq!(standing.held, i == 0, "{standing:?}");
        if i > 0 {
            let before = format!("locks/db/{}", sessions[i - 1].lease());
            assert_eq!(standing.waiting_for.as_deref(), Some(before.as_str()));
        }
        queued.push(standing.revision);
    }
    let held = Arc::new(AtomicBool::new(false));
    let (order_tx, mut order_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for (i, s) in sessions.into_iter().enumerate() {
        let held = held.clone();
        let order_tx = order_tx.clone();
        tasks.push(tokio::spawn(async move {
            let standing = s.lock("db").await.unwrap();
            assert!(
                !held.swap(true, Ordering::SeqCst),
                "two holders at once (contender {i})"
            );
            order_tx.send((i, standing.revision)).unwrap();
            tokio::task::yield_now().await;
            held.store(false, Ordering::SeqCst);
            s.unlock("db").await.unwrap();
            s.close().await.unwrap();
        }));
    }
    let mut order = Vec::new();
    for _ in 0..6 {
        order.push(
            tokio::time::timeout(Duration::from_secs(60), order_rx.recv())
                .await
                .expect("the next holder within 60 s")
                .unwrap(),
        );
    }
    let who: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
    assert_eq!(who, vec![0, 1, 2, 3, 4, 5], "arrival order");
    let tokens: Vec<Revision> = order.iter().map(|(_, r)| *r).collect();
    assert_eq!(
        tokens, queued,
        "each holder's token is its key's create revision"
    );
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "tokens increase");
    for t in tasks {
        t.await.unwrap();
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_lease_releases_its_holder_and_takes_its_waiter_out_of_line() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = Arc::new(c.client());
    // The leases are never refreshed: they expire after their TTL (the shortest allowed).
    grant(&client, "dead-holder", 1_500).await;
    grant(&client, "dead-waiter", 2_000).await;
    let live = Session::new(client.clone(), 10_000).await.unwrap();
    assert!(
        client
            .lock_once("job", "dead-holder", 0)
            .await
            .unwrap()
            .held
    );
    assert!(
        !client
            .lock_once("job", "dead-waiter", 0)
            .await
            .unwrap()
            .held
    );
    assert!(!client.lock_once("job", live.lease(), 0).await.unwrap().held);
    // The live session gets the lock once both dead leases are gone, without anyone unlocking.
    let standing = tokio::time::timeout(Duration::from_secs(30), live.lock("job"))
        .await
        .expect("held after the dead leases expire")
        .unwrap();
    assert!(standing.held);
    // The dead waiter was taken out of line: its next call says so.
    let gone = client.lock_once("job", "dead-waiter", 0).await.unwrap_err();
    assert!(
        matches!(gone.code(), Some("lease_not_found" | "contender_gone")),
        "{gone}"
    );
    live.close().await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_queue_survives_a_leader_kill() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let endpoints: Vec<String> = (1..=3).map(|id| c.url(id)).collect();
    let client = Arc::new(Client::new(&endpoints).unwrap());
    let a = Session::new(client.clone(), 10_000).await.unwrap();
    let b = Session::new(client.clone(), 10_000).await.unwrap();
    let first = a.lock("shard").await.unwrap();
    assert!(!client.lock_once("shard", b.lease(), 0).await.unwrap().held);
    c.stop(leader).await;
    c.leader().await;
    let waiter = tokio::spawn(async move {
        let s = b.lock("shard").await.unwrap();
        (b, s)
    });
    eventually(Duration::from_secs(30), "unlock after the kill", || async {
        a.unlock("shard").await.ok()
    })
    .await;
    let (b, second) = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter holds after the unlock")
        .unwrap();
    assert!(second.held && second.revision > first.revision);
    b.close().await.unwrap();
    a.close().await.unwrap();
    c.shutdown().await;
}

/// A resource that a lock protects: it applies writes in the order they arrive, and, if it
/// checks tokens, refuses a token lower than the highest it has seen.
#[derive(Default)]
struct Resource {
    checks_tokens: bool,
    highest: Option<Revision>,
    value: Option<String>,
}

impl Resource {
    fn write(&mut self, token: Revision, value: &str) -> Result<(), String> {
        if self.checks_tokens && self.highest.is_some_and(|h| token < h) {
            return Err(format!("stale token {token} (seen {:?})", self.highest));
        }
        self.highest = self.highest.max(Some(token));
        self.value = Some(value.to_string());
        Ok(())
    }
}

/// The Jepsen lesson: A holds the lock, pauses past its lease, B takes the lock and writes,
/// then A wakes and writes with what it believes is still its lock. With fencing the resource
/// refuses A; without it, A's stale write silently replaces B's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fencing_tokens_refuse_a_paused_old_holder_and_without_them_an_update_is_lost() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = Arc::new(c.client());
    for checks_tokens in [true, false] {
        let name = if checks_tokens { "fenced" } else { "unfenced" };
        let paused = format!("paused-{name}");
        // A's lease is not refreshed while A is "paused".
        grant(&client, &paused, 1_500).await;
        let a = client.lock_once(name, &paused, 0).await.unwrap();
        assert!(a.held);
        let b_session = Session::new(client.clone(), 10_000).await.unwrap();
        let b = tokio::time::timeout(Duration::from_secs(30), b_session.lock(name))
            .await
            .expect("B holds once A's lease expires")
            .unwrap();
        assert!(b.revision > a.revision);
        let mut resource = Resource {
            checks_tokens,
            ..Resource::default()
        };
        resource.write(b.revision, "B").unwrap();
        // A wakes up, unaware its lease expired, and writes.
        let stale = resource.write(a.revision, "A (stale)");
        if checks_tokens {
            assert!(stale.is_err(), "the fenced resource refuses the old holder");
            assert_eq!(resource.value.as_deref(), Some("B"));
        } else {
            assert!(stale.is_ok());
            assert_eq!(
                resource.value.as_deref(),
                Some("A (stale)"),
                "without fencing, B's acknowledged write is lost"
            );
        }
        b_session.close().await.unwrap();
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn campaign_proclaim_resign() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = Arc::new(c.client());
    let a = eventually(Duration::from_secs(20), "a session", || {
        let client = client.clone();
        async move { Session::new(client, 10_000).await.ok() }
    })
    .await;
    let b = Session::new(client.clone(), 10_000).await.unwrap();
    assert!(client.leader("primary").await.unwrap().is_none());
    let elected = a.campaign("primary", "10.0.0.1:5432").await.unwrap();
    assert!(elected.held);
    let waiting = client
        .campaign_once("primary", b.lease(), "10.0.0.2:5432", 0)
        .await
        .unwrap();
    assert!(!waiting.held);
    let leader = client.leader("primary").await.unwrap().unwrap();
    assert_eq!(
        (
            leader.value.as_str(),
            leader.lease.as_str(),
            leader.revision
        ),
        ("10.0.0.1:5432", a.lease(), elected.revision)
    );
    // Only the leader proclaims.
    let refused = client
        .proclaim("primary", b.lease(), "10.0.0.9:5432")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some("not_leader"), "{refused}");
    client
        .proclaim("primary", a.lease(), "10.0.0.1:6432")
        .await
        .unwrap();
    let leader = client.leader("primary").await.unwrap().unwrap();
    assert_eq!(leader.value, "10.0.0.1:6432");
    assert_eq!(leader.revision, elected.revision, "same term");
    // Resigning hands over to the next in line.
    a.resign("primary").await.unwrap();
    let next = tokio::time::timeout(
        Duration::from_secs(30),
        b.campaign("primary", "10.0.0.2:5432"),
    )
    .await
    .expect("B leads after A resigns")
    .unwrap();
    assert!(next.held && next.revision > elected.revision);
    let leader = client.leader("primary").await.unwrap().unwrap();
    assert_eq!(leader.value, "10.0.0.2:5432");
    a.close().await.unwrap();
    b.close().await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_lock_requests_get_clear_errors() {
    let c = TestCluster::start(1).await;
    c.leader().await;
    let http = reqwest::Client::new();
    let url = c.url(1);
    let post = |path: String, body: &'static str| {
        let http = http.clone();
        async move {
            let r = http
                .post(path)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let doc: serde_json::Value = r.json().await.unwrap();
            (
                status,
                doc["error"]["code"].as_str().unwrap_or("").to_string(),
            )
        }
    };
    assert_eq!(
        post(format!("{url}/v1/locks/db"), r#"{"lease":"nope"}"#).await,
        (404, "lease_not_found".into())
    );
    assert_eq!(
        post(format!("{url}/v1/locks/db"), r#"{"lease":"a/b"}"#).await,
        (400, "invalid_argument".into())
    );
    assert_eq!(
        post(
            format!("{url}/v1/locks/db"),
            r#"{"lease":"x","timeout_ms":999999}"#
        )
        .await,
        (400, "invalid_argument".into())
    );
    assert_eq!(
        post(format!("{url}/v1/locks/db"), r#"{"leese":"x"}"#)
            .await
            .0,
        400
    );
    c.shutdown().await;
}

/// `leasecore lock NAME -- COMMAND`: the command runs with the fencing token, its exit code is
/// the lock's, and a lock lost while it runs (here: its lease revoked by someone else) kills
/// it and exits 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_command_passes_the_token_and_kills_its_command_when_the_lock_is_lost() {
    let c = TestCluster::start(1).await;
    c.leader().await;
    let url = c.url(1);
    let leasecore = || {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_leasecore"));
        cmd.args(["--endpoints", &url]);
        cmd
    };
    let out = eventually(Duration::from_secs(30), "the lock command", || async {
        let out = leasecore()
            .args(["lock", "report", "--", "sh", "-c"])
            .arg("echo \"token $LEASECORE_FENCE\"; exit 7")
            .output()
            .unwrap();
        (out.status.code() == Some(7)).then_some(out)
    })
    .await;
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.starts_with("token "), "{printed}");

    let mut held = leasecore()
        .args(["lock", "report", "--", "sleep", "600"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let client = c.client();
    let key = eventually(Duration::from_secs(30), "the lock key", || async {
        let list = client.list("locks/report/", Some(10), false).await.ok()?;
        list.items.first().map(|kv| kv.key.clone())
    })
    .await;
    let lease = key.trim_start_matches("locks/report/").to_string();
    client.revoke(&lease).await.unwrap();
    let status = common::exited(
        &mut held,
        Duration::from_secs(30),
        "the lock command stops after losing its lock",
    )
    .await;
    assert_eq!(status.code(), Some(4));
    let mut err = String::new();
    std::io::Read::read_to_string(held.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("lock report lost"), "{err}");
    c.shutdown().await;
}

/// `leasecore elect NAME VALUE`: each contender prints the leader as it changes; a leader
/// whose process dies (SIGKILL: no resignation) hands over once its session's lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_elect_command_prints_leader_changes_and_takes_over_from_a_dead_leader() {
    use std::io::BufRead;
    let c = TestCluster::start(3).await;
    c.leader().await;
    let endpoints = (1..=3).map(|id| c.url(id)).collect::<Vec<_>>().join(",");
    let elect = |value: &str| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .args(["--endpoints", &endpoints, "elect", "primary", value])
            .args(["--ttl-ms", "2000"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        (child, rx)
    };
    let until = |rx: &std::sync::mpsc::Receiver<String>, want: &str| loop {
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("no line {want:?}"));
        if line == want {
            return;
        }
    };
    let (mut a, a_out) = elect("10.0.0.1");
    until(&a_out, "leader: 10.0.0.1 (this process)");
    let (mut b, b_out) = elect("10.0.0.2");
    until(&b_out, "leader: 10.0.0.1");
    a.kill().unwrap();
    a.wait().unwrap();
    until(&b_out, "leader: 10.0.0.2 (this process)");
    b.kill().unwrap();
    b.wait().unwrap();
    c.shutdown().await;
}
