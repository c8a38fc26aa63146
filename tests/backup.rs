//! Backup and restore with the real CLI: `snapshot save` from a running cluster, `snapshot
//! status`, `snapshot restore` into new data dirs, and a new cluster that starts from them with
//! the same keys, revisions and leases.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::{TestCluster, eventually};
use leasecore::client::Client;
use leasecore::domain::types::NodeId;
use leasecore::node::{Node, NodeConfig};
use leasecore::storage::backup::{self, BackupHeader};
use leasecore::wire::KeyValue;

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args(args)
        .output()
        .expect("run the leasecore binary")
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every key (linearizable) and every lease as (name, ttl, revision, keys).
async fn everything(c: &Client) -> (u64, Vec<KeyValue>, Vec<(String, u64, u64, Vec<String>)>) {
    let list = c.list("", None, false).await.expect("list every key");
    let leases = c
        .leases("", None)
        .await
        .unwrap()
        .leases
        .into_iter()
        .map(|l| (l.name, l.ttl_ms, l.revision.0, l.keys))
        .collect();
    (list.revision.0, list.items, leases)
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn save_restore_gives_the_same_keys_revisions_and_leases() {
    let src = TestCluster::start(3).await;
    src.leader().await;
    let c = src.client();
    for i in 0..50 {
        c.put(&format!("k/{i:02}"), &format!("v{i}"), None, None)
            .await
            .unwrap();
    }
    c.put("k/07", "again", None, None).await.unwrap();
    c.delete("k/08", None).await.unwrap();
    c.grant("svc", 60_000).await.unwrap();
    c.put("svc/a", "leased", Some("svc"), None).await.unwrap();
    let before = everything(&c).await;

    let tmp = tempfile::TempDir::new().unwrap();
    let file = tmp.path().join("backup.lcb");
    let out = ok(cli(&[
        "snapshot",
        "save",
        path_str(&file),
        "--endpoints",
        &src.url(2),
    ]));
    assert!(out.contains(&format!("revision {}", before.0)), "{out}");
    let status: BackupHeader =
        serde_json::from_str(&ok(cli(&["snapshot", "status", path_str(&file), "--json"]))).unwrap();
    assert_eq!(status.revision, before.0);
    assert_eq!((status.keys, status.leases), (50, 1));
    // The source moves on; the backup does not.
    c.put("k/later", "x", None, None).await.unwrap();
    src.shutdown().await;

    // A new three-node cluster from the backup.
    let mut listeners = BTreeMap::new();
    let mut peers = BTreeMap::new();
    for id in 1..=3u64 {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        peers.insert(id, l.local_addr().unwrap().to_string());
        listeners.insert(id, l);
    }
    let peer_list: Vec<String> = peers.iter().map(|(i, a)| format!("{i}={a}")).collect();
    let peer_list = peer_list.join(",");
    let data = |id: NodeId| tmp.path().join(format!("restored-{id}"));
    for id in 1..=3u64 {
        ok(cli(&[
            "snapshot",
            "restore",
            path_str(&file),
            "--data",
            path_str(&data(id)),
            "--id",
            &id.to_string(),
            "--peers",
            &peer_list,
        ]));
    }
    // Never over a data dir that holds something.
    let again = cli(&[
        "snapshot",
        "restore",
        path_str(&file),
        "--data",
        path_str(&data(1)),
        "--id",
        "1",
        "--peers",
        &peer_list,
    ]);
    assert!(!again.status.success());

    let mut nodes = Vec::new();
    for (id, l) in listeners {
        let mut cfg = NodeConfig::new(id, data(id));
        cfg.listen = peers[&id].clone();
        cfg.peers = peers.clone();
        cfg.cache_bytes = 16 << 20;
        nodes.push(Node::start_on(cfg, l).await.unwrap());
    }
    let eps: Vec<String> = peers.values().map(|a| format!("http://{a}")).collect();
    let restored = Client::new(&eps).unwrap();
    eventually(Duration::from_secs(20), "a leader", || async {
        restored.cluster_status().await.ok()?.leader_id
    })
    .await;
    let after = everything(&restored).await;
    assert_eq!(after.0, before.0, "the same store revision");
    assert_eq!(after.1, before.1, "the same keys, values and revisions");
    assert_eq!(after.2, before.2, "the same leases and their keys");
    // The leader tracks the restored lease again, with a fresh TTL.
    let lease = eventually(Duration::from_secs(10), "the lease is tracked", || async {
        let l = restored.lease("svc").await.ok()??;
        l.remaining_ms.map(|r| (r, l))
    })
    .await;
    assert!(lease.0 > 50_000, "{lease:?}");
    // And the new cluster goes on from the backup's revision.
    let put = restored.put("k/new", "y", None, None).await.unwrap();
    assert_eq!(put.revision.0, before.0 + 1);
    for n in nodes {
        n.shutdown().await;
    }
}

#[test]
fn a_damaged_backup_is_refused_everywhere() {
    let tmp = tempfile::TempDir::new().unwrap();
    let file = tmp.path().join("bad.lcb");
    let header = BackupHeader {
        format_version: 1,
        revision: 3,
        applied_index: 4,
        node_id: 1,
        keys: 0,
        leases: 0,
        payload_bytes: 0,
        crc32: 0,
    };
    let mut bytes = backup::encode(header, br#"{"kv":{"revision":3,"keys":{}}}"#);
    *bytes.last_mut().unwrap() = b' ';
    std::fs::write(&file, &bytes).unwrap();
    let status = cli(&["snapshot", "status", path_str(&file)]);
    assert!(!status.status.success());
    assert!(String::from_utf8_lossy(&status.stderr).contains("checksum"));
    let dir = tmp.path().join("data");
    let restore = cli(&[
        "snapshot",
        "restore",
        path_str(&file),
        "--data",
        path_str(&dir),
        "--id",
        "1",
        "--peers",
        "1=127.0.0.1:1",
    ]);
    assert!(!restore.status.success());
    assert!(!dir.exists(), "nothing written from a bad backup");
}

/// Two of three nodes gone for good: the survivor cannot elect a leader, so a linearizable
/// backup is refused, but a local one from the survivor seeds a new single-node cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quorum_lost_recover_from_the_survivor() {
    let mut src = TestCluster::start(3).await;
    src.leader().await;
    let c = src.client();
    for i in 0..20 {
        c.put(&format!("k/{i:02}"), "v", None, None).await.unwrap();
    }
    // Everything is applied on node 3 (the survivor) before the others go.
    let survivor = src.client_of(3);
    let before = eventually(Duration::from_secs(10), "node 3 applied all", || async {
        let list = survivor.list("k/", None, true).await.ok()?;
        (list.items.len() == 20).then_some(list)
    })
    .await;
    src.stop(1).await;
    src.stop(2).await;

    let tmp = tempfile::TempDir::new().unwrap();
    let file = tmp.path().join("survivor.lcb");
    let linear = cli(&[
        "snapshot",
        "save",
        path_str(&file),
        "--endpoints",
        &src.url(3),
    ]);
    assert!(
        !linear.status.success(),
        "no quorum, no linearizable backup"
    );
    assert!(!file.exists(), "a failed save leaves no file");
    ok(cli(&[
        "snapshot",
        "save",
        path_str(&file),
        "--local",
        "--endpoints",
        &src.url(3),
    ]));
    src.shutdown().await;

    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let dir = tmp.path().join("new-1");
    ok(cli(&[
        "snapshot",
        "restore",
        path_str(&file),
        "--data",
        path_str(&dir),
        "--id",
        "1",
        "--peers",
        &format!("1={addr}"),
    ]));
    let mut cfg = NodeConfig::new(1, &dir);
    cfg.listen = addr.clone();
    cfg.peers = BTreeMap::from([(1, addr.clone())]);
    let node = Node::start_on(cfg, l).await.unwrap();
    let restored = Client::new(&[format!("http://{addr}")]).unwrap();
    let after = eventually(
        Duration::from_secs(20),
        "the new cluster serves",
        || async { restored.list("k/", None, false).await.ok() },
    )
    .await;
    assert_eq!(after.items, before.items);
    assert_eq!(after.revision, before.revision);
    node.shutdown().await;
}
