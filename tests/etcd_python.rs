//! leasecore's etcd v3 API driven by Python client libraries nobody here wrote: `etcd3`
//! (python-etcd3, over gRPC) and `etcd3gw` (OpenStack's client for etcd's JSON gateway),
//! each running a script under `tests/support/` against a three-node cluster. The scripts
//! print every check (`ok: ...` / `MISMATCH: ...`) and exit non-zero on any mismatch; each
//! expectation in them was first checked against a real etcd 3.4 with the same script.
//!
//! Without python3 or the packages the tests say `SKIPPED: ...` and pass, unless
//! `LEASECORE_REQUIRE_PY_ETCD` is set (`scripts/test.sh` installs the packages with pip and
//! sets it, so CI cannot skip them silently).
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::TestCluster;
use common::etcdctl::{endpoint, etcd_cluster};
use tokio::process::Command;

/// How long one script may run: each takes a few seconds; this bounds a hang.
const SCRIPT_DEADLINE: Duration = Duration::from_secs(60);

fn script(name: &str) -> String {
    format!("{}/tests/support/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A python3 command with the environment the scripts need: python-etcd3's generated
/// protobuf modules predate protobuf 4, whose C implementation refuses them; the pure-Python
/// one accepts them.
fn python() -> Command {
    let mut cmd = Command::new("python3");
    cmd.env("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1");
    cmd
}

/// Whether python3 can import `module`; if not, the test skips (or fails when required).
async fn have(module: &str) -> bool {
    let found = python()
        .args(["-c", &format!("import {module}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .status()
        .await
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var_os("LEASECORE_REQUIRE_PY_ETCD").is_none(),
            "the Python package {module} is required (LEASECORE_REQUIRE_PY_ETCD is set): \
             python3 -m pip install etcd3 etcd3gw"
        );
        eprintln!("SKIPPED: python3 cannot import {module} (python3 -m pip install {module})");
    }
    found
}

/// Run a script against `endpoints` (the first and last are the two members it talks to)
/// with `extra` arguments, within the deadline, and fail with its whole output unless it
/// passed.
async fn run(name: &str, endpoints: &[String], extra: &[&str]) {
    let child = python()
        .arg(script(name))
        .arg("--endpoints")
        .arg(endpoints.join(","))
        .arg("--members")
        .arg(endpoints.len().to_string())
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run python3");
    let out = tokio::time::timeout(SCRIPT_DEADLINE, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{name} did not finish within {SCRIPT_DEADLINE:?}"))
        .expect("wait for python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The checks that passed show with --nocapture; a failure shows them all.
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("checks passed"),
        "{name} exited 0 without finishing:\n{stdout}\n{stderr}"
    );
}

/// Every member's etcd endpoint, followers first and the leader last: the scripts write
/// through the first and read through the last, so every check crosses members.
async fn follower_first(c: &TestCluster) -> Vec<String> {
    let leader = c.leader().await;
    let mut ids: Vec<_> = c.nodes.keys().copied().filter(|id| *id != leader).collect();
    ids.push(leader);
    ids.into_iter().map(|id| endpoint(c, id)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_etcd3_grpc_client() {
    if !have("etcd3").await {
        return;
    }
    let c = etcd_cluster().await;
    let endpoints = follower_first(&c).await;
    // `--leasecore`: expect its documented differences (no alarm can be raised).
    run("py_etcd3.py", &endpoints, &["--leasecore"]).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_etcd3gw_gateway_client() {
    if !have("etcd3gw").await {
        return;
    }
    let c = etcd_cluster().await;
    let endpoints = follower_first(&c).await;
    run("py_etcd3gw.py", &endpoints, &[]).await;
    c.shutdown().await;
}
