//! etcd clients whose HTTP/2 `:authority` is not an authority: etcdctl 3.4 sends the whole
//! endpoint URL (`http://127.0.0.1:2379`) when the endpoint is written with a scheme, and the
//! etcd 3.5.0 client sent `#initially=[http://...]` (etcd issues 13192 and 13359). The `h2`
//! crate resets such a request (PROTOCOL_ERROR) before any leasecore code runs; etcd's Go server
//! accepts it. The etcd listener mends it (`leasecore::etcd::authority`).
//!
//! Driven twice: by etcdctl itself (skipped without it, see `common::etcdctl`), and by hand-made
//! HTTP/2 frames that need nothing installed.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::TestCluster;
use common::etcdctl::{endpoint, etcd_cluster, etcdctl_in, have_etcdctl, json, ok};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn url(c: &TestCluster, id: u64) -> String {
    format!("http://{}", endpoint(c, id))
}

/// `endpoint status`, `endpoint health` (each also with `--cluster`, which dials the members'
/// advertised `http://` URLs), `endpoint hashkv` and plain KV calls, with `http://` endpoints.
/// Without the shim, every per-endpoint call (status, hashkv) was reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_accepts_endpoints_written_with_a_scheme() {
    if !have_etcdctl() {
        return;
    }
    let c = etcd_cluster().await;
    let (e1, e2, e3) = (url(&c, 1), url(&c, 2), url(&c, 3));

    let status = json(&e1, &["endpoint", "status"]).await;
    let status = status.as_array().unwrap();
    assert_eq!(status.len(), 1, "{status:?}");
    assert_eq!(status[0]["Endpoint"], e1.as_str());
    assert_ne!(status[0]["Status"]["leader"].as_u64().unwrap(), 0);
    assert!(
        status[0]["Status"]["version"]
            .as_str()
            .unwrap()
            .starts_with("3.5")
    );

    let all = [e1.as_str(), &e2, &e3].join(",");
    let status = json(&all, &["endpoint", "status"]).await;
    let status = status.as_array().unwrap();
    assert_eq!(status.len(), 3, "{status:?}");
    let leaders: Vec<u64> = status
        .iter()
        .map(|s| s["Status"]["leader"].as_u64().unwrap())
        .collect();
    assert!(
        leaders.iter().all(|l| *l == leaders[0] && *l != 0),
        "{leaders:?}"
    );
    // `--cluster` dials the `http://` client URLs that MemberList advertises: every member's
    // (a member's URL shows once this node has heard back from it: asked again until then).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let status = loop {
        let status = json(&e2, &["endpoint", "status", "--cluster"]).await;
        let n = status.as_array().unwrap().len();
        if n == 3 || std::time::Instant::now() > deadline {
            break status;
        }
    };
    let status = status.as_array().unwrap();
    assert_eq!(status.len(), 3, "{status:?}");
    for s in status {
        assert!(
            s["Endpoint"].as_str().unwrap().starts_with("http://"),
            "{s:?}"
        );
        assert_eq!(s["Status"]["leader"].as_u64().unwrap(), leaders[0], "{s:?}");
    }

    // etcdctl 3.4 prints health to stderr.
    for (eps, args, healthy) in [
        (e1.as_str(), &["endpoint", "health"][..], Some(1)),
        (all.as_str(), &["endpoint", "health"][..], Some(3)),
        (e3.as_str(), &["endpoint", "health", "--cluster"][..], None),
    ] {
        let out = etcdctl_in(eps, args, "").await;
        let text = String::from_utf8_lossy(&out.stderr).to_string()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {text}");
        let count = text.matches("is healthy").count();
        assert!(!text.contains("unhealthy"), "{args:?}: {text}");
        match healthy {
            Some(n) => assert_eq!(count, n, "{args:?}: {text}"),
            None => assert!(count >= 1, "{args:?}: {text}"),
        }
    }

    let hash: Value = json(&e1, &["endpoint", "hashkv"]).await;
    assert_eq!(hash.as_array().unwrap().len(), 1, "{hash:?}");

    ok(&e3, &["put", "scheme/k", "v"]).await;
    assert_eq!(ok(&e1, &["get", "scheme/k"]).await, "scheme/k\nv\n");
    c.shutdown().await;
}

// ---- The same by hand: HTTP/2 frames on a plain TCP connection ----

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK string literal, without Huffman coding (lengths under 127 only).
fn hpack_str(out: &mut Vec<u8>, s: &str) {
    assert!(s.len() < 127);
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// A literal field with incremental indexing and a literal name: it enters the dynamic table.
fn hpack_indexed_literal(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0x40);
    hpack_str(out, name);
    hpack_str(out, value);
}

/// A unary gRPC call's request headers for `path` with `authority`, every field entering the
/// dynamic table (as Go's encoder does).
fn request_block(path: &str, authority: &str) -> Vec<u8> {
    let mut b = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    hpack_indexed_literal(&mut b, ":path", path);
    hpack_indexed_literal(&mut b, ":authority", authority);
    hpack_indexed_literal(&mut b, "content-type", "application/grpc");
    hpack_indexed_literal(&mut b, "te", "trailers");
    b
}

/// What the server sent on a stream, read until its END_STREAM, a reset or a GOAWAY.
#[derive(Debug, Default)]
struct Answer {
    data: Vec<u8>,
    reset: Option<u32>,
    goaway: bool,
    ended: bool,
}

async fn read_answer(s: &mut TcpStream, stream: u32) -> Answer {
    let mut answer = Answer::default();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !(answer.ended || answer.goaway || answer.reset.is_some()) {
            let mut head = [0u8; 9];
            if s.read_exact(&mut head).await.is_err() {
                answer.goaway = true;
                break;
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            s.read_exact(&mut payload).await.unwrap();
            match kind {
                SETTINGS if flags & 0x1 == 0 => {
                    s.write_all(&frame(SETTINGS, 0x1, 0, &[])).await.unwrap();
                }
                GOAWAY => answer.goaway = true,
                _ if id != stream => {}
                DATA => {
                    answer.data.extend_from_slice(&payload);
                    answer.ended |= flags & END_STREAM != 0;
                }
                HEADERS => answer.ended |= flags & END_STREAM != 0,
                RST_STREAM => {
                    answer.reset = Some(u32::from_be_bytes(payload[..4].try_into().unwrap()))
                }
                _ => {}
            }
        }
    })
    .await
    .expect("an answer within 10 s");
    answer
}

/// `Maintenance.Status` asked with `:authority: http://host:port`, then asked again on the same
/// connection with that `:authority` taken from the dynamic table (one byte, index 63): both
/// are answered, the connection stays up, and an ordinary request after them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_authority_with_a_scheme_is_answered_not_reset() {
    let c = etcd_cluster().await;
    let addr = endpoint(&c, 1);
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    s.write_all(&hello).await.unwrap();

    // An empty StatusRequest: the gRPC message header (uncompressed, length 0).
    let empty_message = [0u8; 5];
    let path = "/etcdserverpb.Maintenance/Status";
    let bad = format!("http://{addr}");
    let mut first = frame(HEADERS, END_HEADERS, 1, &request_block(path, &bad));
    first.extend(frame(DATA, END_STREAM, 1, &empty_message));
    s.write_all(&first).await.unwrap();
    let answer = read_answer(&mut s, 1).await;
    assert_eq!(answer.reset, None, "stream 1 was reset: {answer:?}");
    assert!(!answer.goaway, "{answer:?}");
    // A StatusResponse: a gRPC message of more than its 5-byte header.
    assert!(answer.data.len() > 5, "{answer:?}");

    // Indexes 62.. are the dynamic table, newest first: te (62), content-type (63),
    // :authority (64), :path (65).
    let again = [0x83, 0x86, 0xc1, 0xc0, 0xbf, 0xbe];
    let mut second = frame(HEADERS, END_HEADERS, 3, &again);
    second.extend(frame(DATA, END_STREAM, 3, &empty_message));
    s.write_all(&second).await.unwrap();
    let answer = read_answer(&mut s, 3).await;
    assert_eq!(answer.reset, None, "stream 3 was reset: {answer:?}");
    assert!(answer.data.len() > 5, "{answer:?}");

    // A request with a valid authority, after the client's table and the server's parted.
    let mut third = frame(HEADERS, END_HEADERS, 5, &request_block(path, &addr));
    third.extend(frame(DATA, END_STREAM, 5, &empty_message));
    s.write_all(&third).await.unwrap();
    let answer = read_answer(&mut s, 5).await;
    assert_eq!(answer.reset, None, "stream 5 was reset: {answer:?}");
    assert!(answer.data.len() > 5, "{answer:?}");

    // etcd 3.5.0's form, on a new connection.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(&hello).await.unwrap();
    let initially = format!("#initially=[http://{addr};http://127.0.0.1:1]");
    let mut req = frame(HEADERS, END_HEADERS, 1, &request_block(path, &initially));
    req.extend(frame(DATA, END_STREAM, 1, &empty_message));
    s.write_all(&req).await.unwrap();
    let answer = read_answer(&mut s, 1).await;
    assert_eq!(answer.reset, None, "{answer:?}");
    assert!(answer.data.len() > 5, "{answer:?}");
    c.shutdown().await;
}
