//! Driving etcd's own command-line client, `etcdctl` 3.4 (Debian's `etcd-client` package,
//! which `scripts/test.sh` installs), against a cluster's etcd listeners.
//!
//! Without `etcdctl` on the PATH the tests that use it say so and pass, unless
//! `LEASECORE_REQUIRE_ETCDCTL` is set (the suite's script sets it, so CI cannot skip them
//! silently).

use std::process::Stdio;
use std::time::Duration;

use base64::Engine;
use leasecore::domain::types::NodeId;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use super::TestCluster;

pub fn have_etcdctl() -> bool {
    let found = std::process::Command::new("etcdctl")
        .arg("version")
        .env("ETCDCTL_API", "3")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("LEASECORE_REQUIRE_ETCDCTL").is_none(),
            "etcdctl is required (LEASECORE_REQUIRE_ETCDCTL is set): apt-get install etcd-client"
        );
        eprintln!("SKIPPED: etcdctl is not installed (apt-get install etcd-client)");
    }
    found
}

/// A three-node cluster serving the etcd API, with an agreed leader.
pub async fn etcd_cluster() -> TestCluster {
    etcd_cluster_tweaked(|_| {}).await
}

/// The same, with each node's configuration adjusted by `tweak` too.
pub async fn etcd_cluster_tweaked(
    tweak: impl Fn(&mut leasecore::node::NodeConfig) + Send + Sync + 'static,
) -> TestCluster {
    let c = TestCluster::start_tweaked(3, move |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
        tweak(cfg);
    })
    .await;
    c.leader().await;
    c
}

/// The etcd listener's `host:port` of node `id`.
pub fn endpoint(c: &TestCluster, id: NodeId) -> String {
    c.nodes[&id].etcd_addr().expect("etcd listener").to_string()
}

/// Every running node's etcd listener, comma-separated (etcdctl's `--endpoints`).
pub fn endpoints(c: &TestCluster) -> String {
    c.nodes
        .keys()
        .map(|id| endpoint(c, *id))
        .collect::<Vec<_>>()
        .join(",")
}

/// Run etcdctl against `endpoints` with `args` (and `stdin`), bounded by a deadline.
pub async fn etcdctl_in(endpoints: &str, args: &[&str], stdin: &str) -> std::process::Output {
    let mut child = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .arg("--command-timeout=10s")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run etcdctl");
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).await.unwrap();
    drop(input);
    tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("etcdctl {args:?} did not finish within 30 s"))
        .unwrap()
}

/// etcdctl's stdout, which must have succeeded.
pub async fn ok(endpoints: &str, args: &[&str]) -> String {
    let out = etcdctl_in(endpoints, args, "").await;
    assert!(
        out.status.success(),
        "etcdctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// etcdctl's error output, which must have failed.
pub async fn fails(endpoints: &str, args: &[&str]) -> String {
    let out = etcdctl_in(endpoints, args, "").await;
    assert!(
        !out.status.success(),
        "etcdctl {args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// etcdctl's `-w json` answer.
pub async fn json(endpoints: &str, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-w", "json"]);
    serde_json::from_str(&ok(endpoints, &all).await).unwrap()
}

/// Base64 text (etcd's JSON encoding of bytes) decoded as UTF-8.
pub fn b64(v: &Value) -> String {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(v.as_str().expect("base64 text"))
        .unwrap();
    String::from_utf8(bytes).unwrap()
}
