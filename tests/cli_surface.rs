//! What a person at the command line sees when things go wrong (issue 12, items 4 and 5), run
//! against the real binary: connection flags before or after the subcommand, "connection
//! refused" with the endpoint rather than "error sending request", a write without a quorum
//! that says the quorum is lost, a watch of a stopped cluster that fails instead of waiting
//! in silence, a watch that reports an outage and resumes, `LEASECORE_JOIN=1`.
//!
//! Nothing runs on a terminal here: progress lines must not appear, only the final error.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{TestCluster, eventually, free_node_addrs};

fn leasecore() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasecore"));
    cmd.env_remove("LEASECORE_ENDPOINTS")
        .env_remove("LEASECORE_USER")
        .env_remove("LEASECORE_TOKEN");
    cmd
}

fn run(args: &[&str]) -> Output {
    leasecore().args(args).output().expect("run leasecore")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A loopback URL nothing listens on.
fn dead_endpoint() -> String {
    format!("http://{}", free_node_addrs(1)[0])
}

/// Wait for a child to exit by itself (bounded), killing it if it does not.
async fn exit_of(mut child: Child, what: &str) -> Output {
    let mut attempts = 600; // 60 s, 100 ms apart
    loop {
        if child.try_wait().expect("poll child").is_some() {
            return child.wait_with_output().expect("collect output");
        }
        attempts -= 1;
        if attempts == 0 {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!("{what} did not exit by itself; stderr: {}", stderr(&out));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_flags_work_before_and_after_the_subcommand() {
    let c = TestCluster::start(1).await;
    c.leader().await;
    let url = c.url(1);
    let put = run(&["--endpoints", &url, "kv", "put", "greeting", "hello"]);
    assert!(put.status.success(), "{}", stderr(&put));
    let get = run(&["kv", "get", "greeting", "--endpoints", &url, "--json"]);
    assert!(get.status.success(), "{}", stderr(&get));
    let doc: serde_json::Value = serde_json::from_slice(&get.stdout).unwrap();
    assert_eq!(doc["value"], "hello");
    let get = run(&["--json", "--endpoints", &url, "kv", "get", "greeting"]);
    assert!(get.status.success(), "{}", stderr(&get));
    c.shutdown().await;
}

#[test]
fn an_unreachable_endpoint_is_reported_as_connection_refused_with_its_url() {
    let url = dead_endpoint();
    let out = run(&["kv", "get", "k", "--endpoints", &url]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("{url}: connection refused")),
        "stderr: {err}"
    );
    assert!(!err.contains("error sending request"), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line, no progress: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_without_a_quorum_says_the_quorum_is_lost() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    c.stop(2).await;
    c.stop(3).await;
    // Until node 1 knows it has no leader: a write it took as a leader just before stepping
    // down waits out the request timeout and answers 504 (its outcome is unknown), which is
    // right, but not what this test is about.
    let one = c.client_of(1);
    eventually(
        Duration::from_secs(20),
        "node 1 to know no leader",
        || async {
            let view = one.cluster_status().await.ok()?;
            (view.state != "leader" && view.leader_id.is_none()).then_some(())
        },
    )
    .await;
    let endpoints = format!("{},{},{}", c.url(1), c.url(2), c.url(3));
    let put = leasecore()
        .args(["kv", "put", "k", "v", "--endpoints", &endpoints])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = exit_of(put, "kv put without a quorum").await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("lost its quorum"), "stderr: {err}");
    assert!(err.contains("heard from 1 of 3 voters"), "stderr: {err}");
    // Each endpoint's own failure is named.
    assert!(
        err.contains(&format!("{}: connection refused", c.url(2))),
        "stderr: {err}"
    );
    assert_eq!(err.lines().count(), 1, "one line, no progress: {err}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_of_a_stopped_cluster_fails_instead_of_waiting_in_silence() {
    let url = dead_endpoint();
    let watch = leasecore()
        .args(["watch", "--prefix", "", "--endpoints", &url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = exit_of(watch, "watch of a stopped cluster").await;
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("connection refused"), "stderr: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_reports_an_outage_and_resumes_without_a_gap() {
    let mut c = TestCluster::start(1).await;
    c.leader().await;
    let url = c.url(1);
    c.client().put("w/0", "before", None, None).await.unwrap();
    let mut watch = leasecore()
        .args(["watch", "--prefix", "w/", "--from-revision", "1"])
        .args(["--endpoints", &url])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out_tx, out_rx) = mpsc::channel::<String>();
    let (err_tx, err_rx) = mpsc::channel::<String>();
    let stdout = watch.stdout.take().unwrap();
    let stderr_pipe = watch.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = out_tx.send(line);
        }
    });
    std::thread::spawn(move || {
        for line in BufReader::new(stderr_pipe).lines().map_while(Result::ok) {
            let _ = err_tx.send(line);
        }
    });
    let next_line = |rx: &mpsc::Receiver<String>, what: &str| -> String {
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("no line: {what}"))
    };
    let first = next_line(&out_rx, "the first event");
    assert!(first.starts_with("PUT w/0 = before"), "{first}");

    c.stop(1).await;
    let interrupted = next_line(&err_rx, "the interruption");
    assert!(
        interrupted.starts_with("watch interrupted"),
        "{interrupted}"
    );
    assert!(interrupted.contains("connection refused"), "{interrupted}");

    c.restart(1).await;
    c.leader().await;
    let client = c.client();
    eventually(
        Duration::from_secs(20),
        "a write after the restart",
        || async { client.put("w/1", "after", None, None).await.ok() },
    )
    .await;
    let resumed = next_line(&err_rx, "the resumption");
    assert!(resumed.starts_with("watch resumed"), "{resumed}");
    let second = next_line(&out_rx, "the event after the outage");
    assert!(second.starts_with("PUT w/1 = after"), "{second}");
    let _ = watch.kill();
    let _ = watch.wait();
    c.shutdown().await;
}

/// `LEASECORE_JOIN` takes the words people write in environment files: a joining node waits
/// to be added (never ready by itself), a node with `0` forms its own cluster (ready).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasecore_join_accepts_1_0_true_false() {
    let tmp = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    for (value, forms_a_cluster) in [("1", false), ("true", false), ("0", true), ("false", true)] {
        let addr = free_node_addrs(1).remove(0);
        let mut node = leasecore()
            .args(["serve", "--id", "1", "--listen", &addr])
            .arg("--data")
            .arg(tmp.path().join(format!("join-{value}")))
            .env("LEASECORE_JOIN", value)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://{addr}");
        // It serves either way; only a node that formed a cluster becomes ready.
        let status = eventually(Duration::from_secs(30), "the node answers", || async {
            http.get(format!("{url}/readyz"))
                .send()
                .await
                .ok()
                .map(|r| r.status())
        })
        .await;
        if forms_a_cluster {
            eventually(Duration::from_secs(30), "ready", || async {
                let r = http.get(format!("{url}/readyz")).send().await.ok()?;
                r.status().is_success().then_some(())
            })
            .await;
        } else {
            assert!(!status.is_success(), "LEASECORE_JOIN={value}: {status}");
            let cluster: serde_json::Value = http
                .get(format!("{url}/v1/cluster"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert!(cluster["leader_id"].is_null(), "{cluster}");
        }
        node.kill().unwrap();
        node.wait().unwrap();
    }
    let bad = leasecore()
        .args(["serve", "--id", "1"])
        .env("LEASECORE_JOIN", "maybe")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("'maybe'"), "{}", stderr(&bad));
}
