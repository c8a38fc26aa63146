//! The plain HTTP endpoints etcd serves on its client port beside gRPC and the gateway:
//! `GET /health` (etcd 3.4's `{"health":"true"}`, 200; `{"health":"false"}`, 503, without a
//! leader) and `GET /metrics` (Prometheus text, with the process metrics `etcdctl check
//! datascale` reads). Both are open, with auth on and over TLS, as etcd's are.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::certs::{identity, make_certs};
use common::etcdctl::{endpoint, etcd_cluster};
use common::{TestCluster, eventually};
use leasecore::client::Client;
use leasecore::tls::{ClientTls, ServerTls};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(30);

/// The value of the unlabelled sample `name` in Prometheus text.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Status, content type and body of `GET path` on `addr` (plain HTTP/1.1).
async fn get(addr: &str, path: &str) -> (u16, String, String) {
    let r = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
    let status = r.status().as_u16();
    let ctype = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (status, ctype, r.text().await.unwrap())
}

fn assert_process_metrics(text: &str) {
    let rss = sample(text, "process_resident_memory_bytes").expect("process_resident_memory_bytes");
    assert!(rss > 1e6, "a running node holds more than 1 MB: {rss}");
    assert!(sample(text, "process_cpu_seconds_total").is_some_and(|s| s > 0.0));
    assert!(sample(text, "process_open_fds").is_some_and(|n| n >= 3.0));
    assert!(text.contains("# TYPE process_resident_memory_bytes gauge"));
    assert!(text.contains("# TYPE process_cpu_seconds_total counter"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_follows_the_quorum_and_metrics_are_prometheus_text() {
    let mut c = etcd_cluster().await;
    let leader = c.leader().await;
    let ids: Vec<u64> = c.nodes.keys().copied().collect();
    for id in &ids {
        let addr = endpoint(&c, *id);
        let (status, ctype, body) = get(&addr, "/health").await;
        assert_eq!(status, 200, "node {id}: {body}");
        assert!(ctype.starts_with("application/json"), "{ctype}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v, serde_json::json!({"health": "true"}));
    }
    let addr = endpoint(&c, leader);

    // Only GET, as etcd's handler.
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);

    let (status, ctype, text) = get(&addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(ctype.starts_with("text/plain"), "{ctype}");
    assert_eq!(sample(&text, "leasecore_is_leader"), Some(1.0));
    assert_process_metrics(&text);
    // One owner: `/v1`'s port answers the same metrics, process ones included.
    let v1 = common::metrics_of(&c, leader).await;
    assert_process_metrics(&v1);
    assert!(v1.contains("leasecore_proposals_total"));
    // The log has synced its first entries: etcd's `etcd_disk_wal_fsync_duration_seconds`.
    let syncs = sample(&v1, "leasecore_raft_log_fsync_duration_seconds_count");
    assert!(syncs.is_some_and(|n| n >= 1.0), "{v1}");
    assert!(v1.contains("# TYPE leasecore_raft_log_fsync_duration_seconds histogram"));
    // The gateway's `GET /version` is still there.
    let (status, _, body) = get(&addr, "/version").await;
    assert_eq!(status, 200, "{body}");

    // Lose the quorum: the last node reports unhealthy, 503, in etcd's shape.
    let last = *ids.iter().find(|id| **id != leader).unwrap();
    for id in ids.iter().filter(|id| **id != last) {
        c.stop(*id).await;
    }
    let addr = endpoint(&c, last);
    let body = eventually(WAIT, "health false without a quorum", || async {
        let (status, ctype, body) = get(&addr, "/health").await;
        (status == 503).then(|| {
            assert!(ctype.starts_with("application/json"), "{ctype}");
            body
        })
    })
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v, serde_json::json!({"health": "false"}));
    // Metrics answer whatever the cluster's state.
    let (status, _, text) = get(&addr, "/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(sample(&text, "leasecore_ready"), Some(0.0));
    c.shutdown().await;
}

/// One HTTP/1.1 request over TLS; the status code and the raw answer.
async fn https(addr: &str, tls: &ClientTls, method: &str, path: &str) -> (u16, String) {
    let config = tls.build().unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let talk = async {
        let mut stream = connector.connect(name, tcp).await.unwrap();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        );
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        // A peer that closes without close_notify is fine: the answer is in.
        let _ = stream.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer).to_string()
    };
    let text = tokio::time::timeout(Duration::from_secs(10), talk)
        .await
        .expect("the TLS request timed out");
    let status = text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("HTTP/1.1 "))
        .and_then(|l| l.get(..3))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_and_metrics_are_open_with_auth_and_tls_on() {
    let tmp = tempfile::TempDir::new().unwrap();
    let certs = make_certs(&tmp.path().join("certs"), 1);
    let server = ServerTls {
        identity: identity(&certs, "node-1"),
        client_ca: Some(certs.join("ca.pem")),
        require_client_cert: true,
    };
    let c = TestCluster::start_tweaked(1, move |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
        cfg.client_tls = Some(server.clone());
    })
    .await;
    c.leader().await;
    let tls = ClientTls {
        ca: Some(certs.join("ca.pem")),
        identity: Some(identity(&certs, "client")),
    };
    let anon = Client::with_tls(&[c.addrs[&1].clone()], Duration::from_secs(10), &tls).unwrap();
    anon.user_add("root", "root-pw-1").await.unwrap();
    anon.user_grant_role("root", "root").await.unwrap();
    anon.auth_enable().await.unwrap();

    let addr = endpoint(&c, 1);
    // Auth is on: the gateway wants a user (etcd's "user name is empty", a bad request)...
    let (status, text) = https(&addr, &tls, "POST", "/v3/kv/range").await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("user name is empty"), "{text}");
    // ...and health and metrics do not (as etcd's).
    let (status, text) = eventually(WAIT, "health over TLS", || async {
        let (status, text) = https(&addr, &tls, "GET", "/health").await;
        (status == 200).then_some((status, text))
    })
    .await;
    assert_eq!(status, 200);
    assert!(text.ends_with("{\"health\":\"true\"}\n"), "{text}");
    let (status, text) = https(&addr, &tls, "GET", "/metrics").await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
    assert!(text.contains("\nleasecore_is_leader 1"), "{text}");
    c.shutdown().await;
}
