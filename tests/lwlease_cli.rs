//! `leasecore lwlease` run as processes: over a file and over a leasecore key, contend, renew
//! (only the id whose stamp is still there), and a holder whose process dies hands over to a
//! waiting contender once its lease lapsed and the register stayed quiet.

use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::TestCluster;

fn lwlease(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasecore"));
    cmd.arg("lwlease").args(args);
    cmd
}

#[test]
fn over_a_file_contend_then_only_the_holder_renews() {
    let tmp = tempfile::tempdir().unwrap();
    let register = format!("file:{}", tmp.path().join("register").display());
    let base = ["--register", register.as_str(), "--delta-ms", "100"];
    let code = |sub: &str, id: &str| {
        lwlease(&[sub])
            .args(base)
            .args(["--id", id])
            .output()
            .unwrap()
            .status
            .code()
    };
    assert_eq!(code("contend", "a"), Some(0));
    assert_eq!(code("renew", "a"), Some(0));
    assert_eq!(code("renew", "b"), Some(3), "b never held it");
    let bad = lwlease(&["contend", "--register", "s3:x", "--delta-ms", "10"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("kv:KEY or file:PATH"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_key_a_dead_holder_hands_over_to_a_waiting_contender() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let endpoints = (1..=3).map(|id| c.url(id)).collect::<Vec<_>>().join(",");
    let base = [
        "--register",
        "kv:lw/job",
        "--delta-ms",
        "200",
        "--lease-ms",
        "2000",
    ];
    let mut holder = lwlease(&["hold"])
        .args(base)
        .args(["--id", "holder", "--endpoints", &endpoints])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the holder says it holds.
    let mut line = String::new();
    let mut out = std::io::BufReader::new(holder.stdout.take().unwrap());
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert!(line.starts_with("held by holder"), "{line}");
    let mut waiter = lwlease(&["contend"])
        .args(base)
        .args(["--id", "waiter", "--endpoints", &endpoints])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // While the holder renews, the waiter keeps seeing the register change: it must not hold.
    // The holder renews every second; watch for several of the waiter's quiet waits (3.2 s).
    // (A holder whose register operation outlasted delta on a loaded machine gives up by
    // itself and exits: from then on it no longer holds, and the check ends there.)
    for _ in 0..80 {
        if holder.try_wait().unwrap().is_some() {
            break;
        }
        assert!(
            waiter.try_wait().unwrap().is_none(),
            "the waiter got the lease while the holder renewed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = holder.kill();
    holder.wait().unwrap();
    let status = common::exited(
        &mut waiter,
        Duration::from_secs(30),
        "the waiter gets the lease after the holder died",
    )
    .await;
    assert_eq!(status.code(), Some(0));
    c.shutdown().await;
}
