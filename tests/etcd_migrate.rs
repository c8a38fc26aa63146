//! Moving a live etcd's keys into leasecore with etcd's own tool, `etcdctl make-mirror`: a real
//! etcd 3.4 (Debian's `etcd-server`) with text and binary keys and values, mirrored into a
//! three-node leasecore cluster through its etcd API while writes and deletes go on in etcd;
//! leasecore ends with exactly etcd's keys and values. (README, "Moving from etcd".)
//!
//! Without the `etcd` binary the test says so and passes, unless `LEASECORE_REQUIRE_ETCD` is
//! set (the suite's script installs `etcd-server` and sets it).
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::etcdctl::{endpoint, etcd_cluster, have_etcdctl};
use etcd_client::{Client, GetOptions};

fn have_etcd() -> bool {
    let found = std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("LEASECORE_REQUIRE_ETCD").is_none(),
            "etcd is required (LEASECORE_REQUIRE_ETCD is set): apt-get install etcd-server"
        );
        eprintln!("SKIPPED: etcd is not installed (apt-get install etcd-server)");
    }
    found
}

/// A one-member etcd on loopback ports of its own, stopped (killed) when dropped.
struct Etcd {
    client_url: String,
    _dir: tempfile::TempDir,
    _child: tokio::process::Child,
}

impl Etcd {
    async fn start() -> Etcd {
        let (base, holders) = common::free_ports_at(&[0, 1]);
        drop(holders);
        let dir = tempfile::tempdir().unwrap();
        let client_url = format!("http://127.0.0.1:{base}");
        let peer_url = format!("http://127.0.0.1:{}", base + 1);
        let child = tokio::process::Command::new("etcd")
            .arg("--name=source")
            .arg(format!("--data-dir={}", dir.path().join("etcd").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=source={peer_url}"))
            .arg("--log-level=error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start etcd");
        Etcd {
            client_url,
            _dir: dir,
            _child: child,
        }
    }

    async fn client(&self) -> Client {
        common::eventually(Duration::from_secs(30), "etcd to answer", || async {
            let mut c = Client::connect([self.client_url.as_str()], None)
                .await
                .ok()?;
            c.status().await.ok()?;
            Some(c)
        })
        .await
    }
}

/// Every key and value of a store.
async fn everything(c: &mut Client) -> Vec<(Vec<u8>, Vec<u8>)> {
    let all = c
        .get(vec![0u8], Some(GetOptions::new().with_from_key()))
        .await
        .unwrap();
    all.kvs()
        .iter()
        .map(|kv| (kv.key().to_vec(), kv.value().to_vec()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn make_mirror_moves_a_live_etcd_into_leasecore() {
    if !have_etcd() || !have_etcdctl() {
        return;
    }
    let etcd = Etcd::start().await;
    let mut source = etcd.client().await;
    for i in 0..200u32 {
        source
            .put(format!("app/config/{i:03}"), format!("value {i}"), None)
            .await
            .unwrap();
    }
    source
        .put(
            b"app/bin/\xff\x00\x80".to_vec(),
            vec![0u8, 0xfe, 0xff],
            None,
        )
        .await
        .unwrap();
    source.put("app/text", "héllo", None).await.unwrap();

    let c = etcd_cluster().await;
    let leader = c.leader().await;
    let mut dest = Client::connect([endpoint(&c, leader)], None).await.unwrap();
    let mut mirror = tokio::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", etcd.client_url))
        .args(["make-mirror", &endpoint(&c, leader)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run etcdctl make-mirror");

    // Changes while the mirror runs: it follows them with a watch from its first read.
    for i in 0..50u32 {
        source
            .put(format!("app/config/{i:03}"), format!("changed {i}"), None)
            .await
            .unwrap();
    }
    source.delete("app/config/199", None).await.unwrap();
    source
        .put(b"app/bin/late\x81".to_vec(), "late", None)
        .await
        .unwrap();

    let want = everything(&mut source).await;
    assert_eq!(want.len(), 202);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = everything(&mut dest).await;
        if got == want {
            break;
        }
        if let Ok(Some(status)) = mirror.try_wait() {
            let mut err = String::new();
            if let Some(mut e) = mirror.stderr.take() {
                use tokio::io::AsyncReadExt;
                let _ = e.read_to_string(&mut err).await;
            }
            panic!("make-mirror exited ({status}): {err}");
        }
        assert!(
            Instant::now() < deadline,
            "leasecore holds {} of etcd's {} keys after 60 s (first difference: {:?})",
            got.len(),
            want.len(),
            got.iter().zip(&want).find(|(a, b)| a != b)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    mirror.kill().await.unwrap();
    c.shutdown().await;
}
