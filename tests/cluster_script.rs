//! `scripts/cluster.sh`, run as users run it (with the test's binary and its own directory and
//! ports): a second `start` must not orphan the running cluster; `kill` of a stopped node says
//! so plainly; `clean` wipes the cluster.

use crate::common;

use std::path::Path;
use std::process::{Command, Output};

fn script(dir: &Path, base_port: u16, args: &[&str]) -> Output {
    Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster.sh"))
        .args(args)
        .env("LEASECORE_BIN", env!("CARGO_BIN_EXE_leasecore"))
        .env("LEASECORE_CLUSTER_DIR", dir)
        .env("LEASECORE_BASE_PORT", base_port.to_string())
        // No etcd listener: its ports (client port + 2000) are not among those checked free.
        .env("LEASECORE_ETCD_BASE_PORT", "0")
        .output()
        .expect("run scripts/cluster.sh")
}

/// A base port with `n` free consecutive client ports after it and their peer ports (+1000),
/// with the listeners that checked them: client ports first, then peer ports.
fn free_range_held(n: u16) -> (u16, Vec<std::net::TcpListener>) {
    let offsets: Vec<u16> = (0..n).chain((0..n).map(|i| 1000 + i)).collect();
    common::free_ports_at(&offsets)
}

fn free_range(n: u16) -> u16 {
    free_range_held(n).0
}

fn pids(dir: &Path) -> Vec<String> {
    (1..=3)
        .map(|id| std::fs::read_to_string(dir.join(format!("node-{id}.pid"))).unwrap())
        .collect()
}

fn alive(pid: &str) -> bool {
    Command::new("kill")
        .args(["-0", pid.trim()])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
        .success()
}

#[test]
fn starting_twice_refuses_and_keeps_the_running_cluster() {
    let tmp = tempfile::TempDir::new().unwrap();
    let dir = tmp.path().join("cluster");
    let base = free_range(3);
    let first = script(&dir, base, &["start", "3"]);
    assert!(
        first.status.success(),
        "first start: {}",
        String::from_utf8_lossy(&first.stderr)
    );
    let before = pids(&dir);
    assert!(before.iter().all(|p| alive(p)));

    let second = script(&dir, base, &["start", "3"]);
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "a second start must fail");
    assert!(err.contains("already running"), "{err}");
    // The first cluster is still the one the pid files name, and still runs.
    assert_eq!(pids(&dir), before);
    assert!(before.iter().all(|p| alive(p)));

    // Killing a node twice: the second time says it is not running, and nothing else.
    let kill = script(&dir, base, &["kill", "2"]);
    assert!(
        kill.status.success(),
        "{}",
        String::from_utf8_lossy(&kill.stderr)
    );
    let again = script(&dir, base, &["kill", "2"]);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success());
    assert_eq!(err.trim(), "node 2 is not running");

    let stop = script(&dir, base, &["stop"]);
    assert!(stop.status.success());
    assert!(before.iter().all(|p| !alive(p)), "stop stops every node");

    let clean = script(&dir, base, &["clean"]);
    assert!(clean.status.success());
    assert!(!dir.exists(), "clean removes the cluster's directory");
}

#[test]
fn a_node_that_cannot_bind_fails_the_start() {
    let tmp = tempfile::TempDir::new().unwrap();
    let dir = tmp.path().join("cluster");
    // Someone else holds node 2's port: node 2 dies with "address in use". Kept from the
    // check that found it free (bound again after, it could be taken in between).
    let (base, mut held) = free_range_held(3);
    let _squatter = held.remove(1);
    drop(held);
    let out = script(&dir, base, &["start", "3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a start with a dead node must fail");
    assert!(err.contains("node 2 exited"), "{err}");
    // Nothing is left running.
    for id in [1, 3] {
        assert!(!dir.join(format!("node-{id}.pid")).exists());
    }
}
