//! TLS end to end, with real certificates (scripts/certs.sh) and real processes of the binary:
//! a 3-node cluster with client TLS (client certificates required) and mutual peer TLS serves
//! keys, leases, watches and Flease; plaintext and certificate-less or foreign-CA connections
//! are refused at the handshake on both ports; a certificate swapped on disk is served to new
//! connections after SIGHUP, and a broken one leaves the old in force.
//!
//! Nothing sleeps to let things settle: every wait polls a condition with a deadline.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use common::certs::{identity, make_certs};
use common::{eventually, free_node_addrs};
use leasecore::client::{Client, WatchFilter};
use leasecore::tls::{ClientTls, IdentityFiles, ServerTls, TlsError};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(30);

/// A node process, killed on drop.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn spawn(args: &[String], log: PathBuf) -> Proc {
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .arg("serve")
            .args(args)
            .env("LEASECORE_LOG", "info,leasecore::http::listener=debug")
            .env("NO_COLOR", "1")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("spawn the leasecore binary");
        Proc { child, log }
    }

    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {sig}");
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// Open a TLS connection to `addr` as `tls` says, send one HTTP request, and return the
/// response's status line; `Err` when the handshake (or the connection) failed. With TLS 1.3 a
/// server refuses a client certificate only after the client's side of the handshake is done,
/// so the refusal shows as a failed read: the request is what proves the handshake passed.
async fn https_status(addr: &str, tls: &ClientTls, path: &str) -> Result<String, String> {
    https_get(addr, tls, path).await.map(|(status, _)| status)
}

/// [`https_status`] with the whole answer (status line, then the raw text).
async fn https_get(addr: &str, tls: &ClientTls, path: &str) -> Result<(String, String), String> {
    let config = tls.build().map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let talk = async {
        let mut stream = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::new();
        stream
            .read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&answer).to_string();
        match text.lines().next() {
            Some(line) if line.starts_with("HTTP/1.1 ") => Ok((line.to_string(), text.clone())),
            _ => Err(format!("no HTTP answer: {text:?}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), talk)
        .await
        .map_err(|_| "timed out".to_string())?
}

/// Send a plaintext HTTP request to `addr`; what came back (empty, or a TLS alert).
async fn plaintext_answer(addr: &str) -> Vec<u8> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer))
        .await
        .expect("the TLS port closes a plaintext connection");
    answer
}

fn peer_addr(client: &str) -> String {
    leasecore::domain::resources::peer_address(client).unwrap()
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn metrics_text(addr: &str, tls: &ClientTls) -> String {
    match https_get(addr, tls, "/metrics").await {
        Ok((_, text)) => text,
        Err(e) => panic!("GET /metrics: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_with_client_and_peer_tls() {
    let tmp = TempDir::new().unwrap();
    let certs = make_certs(&tmp.path().join("certs"), 3);
    // Another CA: its certificates must be refused everywhere.
    let rogue = make_certs(&tmp.path().join("rogue"), 3);
    let addrs = free_node_addrs(3);
    let peers: Vec<String> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect();
    let c = |f: &str| certs.join(f).display().to_string();
    let procs: Vec<Proc> = (1..=3)
        .map(|id| {
            let args: Vec<String> = [
                "--id",
                &id.to_string(),
                "--listen",
                &addrs[id - 1],
                "--data",
                &tmp.path().join(format!("node-{id}")).display().to_string(),
                "--peers",
                &peers.join(","),
                "--cert-file",
                &c(&format!("node-{id}.pem")),
                "--key-file",
                &c(&format!("node-{id}-key.pem")),
                "--trusted-ca-file",
                &c("ca.pem"),
                "--client-cert-auth",
                "--peer-cert-file",
                &c(&format!("peer-{id}.pem")),
                "--peer-key-file",
                &c(&format!("peer-{id}-key.pem")),
                "--peer-trusted-ca-file",
                &c("ca.pem"),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            Proc::spawn(&args, tmp.path().join(format!("node-{id}.log")))
        })
        .collect();

    let tls = ClientTls {
        ca: Some(certs.join("ca.pem")),
        identity: Some(identity(&certs, "client")),
    };
    // Bare host:port endpoints become https with a TLS client.
    let client = Client::with_tls(&addrs, Duration::from_secs(10), &tls).unwrap();
    assert!(client.endpoints().iter().all(|e| e.starts_with("https://")));
    let view = eventually(WAIT, "a leader over mutual peer TLS", || async {
        let v = client.cluster_status().await.ok()?;
        (v.leader_id.is_some() && v.nodes.len() == 3).then_some(v)
    })
    .await;
    assert!(view.leader_id.is_some(), "logs: {}", procs[0].log_tail());

    // Keys: a put, then a linearizable get on every node (each forwards or confirms over
    // the peer TLS).
    // The first write may meet the cluster's first leader change (three processes starting
    // on a loaded machine): retried, which is harmless for a plain put of the same value.
    let put = eventually(WAIT, "a first put over TLS", || async {
        client.put("tls/k", "v1", None, None).await.ok()
    })
    .await;
    for (a, proc) in addrs.iter().zip(&procs) {
        let one = Client::with_tls(&[a], Duration::from_secs(10), &tls).unwrap();
        let got = one
            .get("tls/k", false)
            .await
            .unwrap_or_else(|e| panic!("get from {a}: {e}; its log:\n{}", proc.log_tail()))
            .expect("the key");
        assert_eq!(got.kv.value, "v1");
    }

    // Leases: register and refresh (refresh goes to the leader, forwarded by followers).
    client.grant("tls-lease", 10_000).await.unwrap();
    for a in &addrs {
        let one = Client::with_tls(&[a], Duration::from_secs(10), &tls).unwrap();
        one.refresh("tls-lease", None).await.unwrap();
    }

    // Watch: the put above is in the history.
    let w = client
        .watch_once(
            &WatchFilter::Prefix("tls/".into()),
            Some(put.revision.0),
            1000,
        )
        .await
        .unwrap();
    assert!(w.events.iter().any(|e| e.key == "tls/k"), "{w:?}");

    // Flease: a round over the peers' TLS.
    let lease = eventually(WAIT, "a Flease grant", || async {
        client
            .flease_acquire("tls-res", "me")
            .await
            .ok()
            .filter(|v| v.granted == Some(true))
    })
    .await;
    assert_eq!(lease.holder.as_deref(), Some("me"));

    // The CLI (global --cacert/--cert/--key; `--key` is not the positional KEY) and the
    // benchmark over https.
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .args(args)
            .args(["--endpoints", &addrs.join(",")])
            .arg("--cacert")
            .arg(certs.join("ca.pem"))
            .arg("--cert")
            .arg(certs.join("client.pem"))
            .arg("--key")
            .arg(certs.join("client-key.pem"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "leasecore {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    cli(&["kv", "put", "tls/cli", "from-cli"]);
    assert_eq!(cli(&["kv", "get", "tls/cli"]).trim(), "from-cli");
    let bench = cli(&["bench", "put", "-c", "2", "-d", "0.5", "--json"]);
    let bench: serde_json::Value = serde_json::from_str(bench.trim()).unwrap();
    assert!(bench["ok"].as_u64().unwrap() > 0, "{bench}");

    // Client port: plaintext, or TLS without a client certificate, is refused at the
    // handshake; the node goes on serving.
    let addr = &addrs[0];
    let plain = reqwest::Client::new()
        .get(format!("http://{addr}/health"))
        .send()
        .await;
    assert!(
        plain.is_err(),
        "plaintext to a TLS port answered: {plain:?}"
    );
    let answer = plaintext_answer(addr).await;
    assert!(
        !answer.starts_with(b"HTTP/"),
        "plaintext got an HTTP answer"
    );
    let no_cert = ClientTls {
        ca: Some(certs.join("ca.pem")),
        identity: None,
    };
    let refused = https_status(addr, &no_cert, "/health").await;
    assert!(
        refused.is_err(),
        "a client without a certificate: {refused:?}"
    );
    let anon = Client::with_tls(&[addr], Duration::from_secs(5), &no_cert).unwrap();
    let err = anon.cluster_status().await.unwrap_err();
    assert!(
        err.status().is_none(),
        "refused at the handshake, not by HTTP: {err}"
    );
    let foreign = ClientTls {
        ca: Some(certs.join("ca.pem")),
        identity: Some(identity(&rogue, "client")),
    };
    assert!(https_status(addr, &foreign, "/health").await.is_err());
    assert!(
        https_status(addr, &tls, "/health")
            .await
            .unwrap()
            .contains("200")
    );
    let text = metrics_text(addr, &tls).await;
    let failures = metric(
        &text,
        "leasecore_client_connections_tls_handshake_failures_total",
    );
    assert!(
        failures.unwrap_or(0.0) >= 3.0,
        "the failed handshakes are counted: {failures:?}"
    );

    // Peer port: only a certificate from the peer CA gets through.
    let peer = peer_addr(addr);
    let peer_answer = plaintext_answer(&peer).await;
    assert!(
        !peer_answer.starts_with(b"HTTP/"),
        "plaintext to the peer port"
    );
    for (what, identity) in [
        ("no certificate", None),
        (
            "a foreign CA's peer certificate",
            Some(identity(&rogue, "peer-2")),
        ),
    ] {
        let t = ClientTls {
            ca: Some(certs.join("ca.pem")),
            identity,
        };
        let r = https_status(&peer, &t, "/raft/status").await;
        assert!(r.is_err(), "peer port with {what}: {r:?}");
    }
    let good = ClientTls {
        ca: Some(certs.join("ca.pem")),
        identity: Some(identity(&certs, "peer-2")),
    };
    let ok = https_status(&peer, &good, "/no-such-peer-route")
        .await
        .unwrap();
    assert!(ok.contains("404"), "a real peer gets HTTP answers: {ok}");
    // The peer listener does not trust a server certificate from another CA either: a node
    // whose peer TLS is foreign never joins (covered by the handshake checks above).
    drop(procs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_reload_on_sighup() {
    let tmp = TempDir::new().unwrap();
    let old = make_certs(&tmp.path().join("old"), 1);
    let new = make_certs(&tmp.path().join("new"), 1);
    // The node serves the files in `live`, first copies of `old`.
    let live = tmp.path().join("live");
    std::fs::create_dir_all(&live).unwrap();
    let install = |from: &Path| {
        for f in ["node-1.pem", "node-1-key.pem"] {
            let staged = live.join(format!("{f}.tmp"));
            std::fs::copy(from.join(f), &staged).unwrap();
            std::fs::rename(&staged, live.join(f)).unwrap();
        }
    };
    install(&old);
    let addr = free_node_addrs(1).remove(0);
    let args: Vec<String> = [
        "--listen",
        &addr,
        "--data",
        &tmp.path().join("node-1").display().to_string(),
        "--cert-file",
        &live.join("node-1.pem").display().to_string(),
        "--key-file",
        &live.join("node-1-key.pem").display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let node = Proc::spawn(&args, tmp.path().join("node.log"));
    let trust = |dir: &Path| ClientTls {
        ca: Some(dir.join("ca.pem")),
        identity: None,
    };
    let (old_ca, new_ca) = (trust(&old), trust(&new));
    eventually(WAIT, "the node serves the old certificate", || async {
        https_status(&addr, &old_ca, "/health").await.ok()
    })
    .await;
    assert!(https_status(&addr, &new_ca, "/health").await.is_err());

    install(&new);
    node.signal("-HUP");
    eventually(
        WAIT,
        "a new connection sees the new certificate",
        || async { https_status(&addr, &new_ca, "/health").await.ok() },
    )
    .await;
    assert!(
        https_status(&addr, &old_ca, "/health").await.is_err(),
        "the old certificate is no longer served"
    );

    // A broken file: the reload fails, is counted, and the working config stays.
    std::fs::write(live.join("node-1.pem"), "not a certificate").unwrap();
    node.signal("-HUP");
    eventually(WAIT, "the failed reload is counted", || async {
        let text = metrics_text(&addr, &new_ca).await;
        let failed = metric(
            &text,
            "leasecore_tls_reload_failures_total{config=\"client listener\"}",
        )?;
        (failed >= 1.0).then_some(())
    })
    .await;
    assert!(
        https_status(&addr, &new_ca, "/health").await.is_ok(),
        "the previous certificate stays in force; log: {}",
        node.log_tail()
    );
}

#[test]
fn bad_files_give_clear_errors() {
    let tmp = TempDir::new().unwrap();
    let a = make_certs(&tmp.path().join("a"), 1);
    let b = make_certs(&tmp.path().join("b"), 1);
    let server = |cert: PathBuf, key: PathBuf| ServerTls {
        identity: IdentityFiles { cert, key },
        client_ca: None,
        require_client_cert: false,
    };
    server(a.join("node-1.pem"), a.join("node-1-key.pem"))
        .build()
        .expect("a matching pair builds");
    let missing = server(a.join("nope.pem"), a.join("node-1-key.pem")).build();
    assert!(
        matches!(&missing, Err(TlsError::Read { path, .. }) if path.ends_with("nope.pem")),
        "{missing:?}"
    );
    let mismatch = server(a.join("node-1.pem"), b.join("node-1-key.pem")).build();
    assert!(
        matches!(mismatch, Err(TlsError::KeyMismatch { .. })),
        "{mismatch:?}"
    );
    let swapped = server(a.join("node-1-key.pem"), a.join("node-1.pem")).build();
    assert!(
        matches!(swapped, Err(TlsError::NoCertificate { .. })),
        "{swapped:?}"
    );
    let no_key = server(a.join("node-1.pem"), a.join("node-1.pem")).build();
    assert!(matches!(no_key, Err(TlsError::NoKey { .. })), "{no_key:?}");
    // Flags that do not go together.
    assert!(ServerTls::client_side(Some(a.join("x")), None, None, false).is_err());
    assert!(ServerTls::client_side(Some(a.join("x")), Some(a.join("y")), None, true).is_err());
    assert!(ClientTls::from_flags(None, Some(a.join("x")), None).is_err());
    assert!(
        leasecore::tls::PeerTls::from_flags(Some(a.join("x")), Some(a.join("y")), None).is_err()
    );
    // The binary says so and exits non-zero.
    let addr = free_node_addrs(1).remove(0);
    let out = Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args(["serve", "--listen", &addr, "--data"])
        .arg(tmp.path().join("d"))
        .arg("--cert-file")
        .arg(a.join("node-1.pem"))
        .arg("--key-file")
        .arg(b.join("node-1-key.pem"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("does not belong to the certificate"),
        "{stderr}"
    );
}
