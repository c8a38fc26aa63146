//! Hostile networks against running nodes: clients that hold a connection without naming their
//! protocol, and clients that send their request and then take none of the answer. Each test
//! reproduces one finding of a black-box campaign against the real binary (slow, resetting and
//! never-reading clients on the `/v1`, etcd and peer ports).
//!
//! Timeouts are configured short (a second or less) so that each test runs in seconds; the
//! defaults face the same code paths in production.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestCluster, eventually, metrics_of};
use leasecore::domain::types::NodeId;
use leasecore::http::listener::ListenerLimits;
use leasecore::node::NodeConfig;
use leasecore_etcd_api::etcdserverpb::{WatchCreateRequest, WatchRequest, watch_request};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedWriteHalf;

/// Values written under the watched prefix: 24 of 512 KiB (12 MiB), more than a loopback
/// socket's buffers (4 MiB at most for the sender here) and a watch stream's queue together.
const BIG_VALUES: usize = 24;
const BIG_VALUE: usize = 512 << 10;

/// A value of `name` in a Prometheus text page.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Whether the server closed `s` (EOF or reset) within `within`, reading whatever it sent.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let drain = async {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::time::timeout(within, drain).await.is_ok()
}

/// A connection whose receive buffer is as small as the kernel allows: the server's writes to
/// a client that does not read then block as soon as possible.
async fn small_window_connection(addr: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(addr.parse().unwrap()).await.unwrap()
}

/// Write the big values under `big/` through node `id` (each must succeed).
async fn write_big_values(c: &TestCluster, id: NodeId) {
    let client = c.client_of(id);
    let value = "v".repeat(BIG_VALUE);
    for i in 0..BIG_VALUES {
        client
            .put(&format!("big/{i:03}"), &value, None, None)
            .await
            .unwrap();
    }
}

fn etcd_on(cfg: &mut NodeConfig) {
    cfg.etcd_listen = Some("127.0.0.1:0".into());
    cfg.etcd_limits = ListenerLimits {
        header_timeout: Duration::from_millis(500),
        write_timeout: Duration::from_secs(1),
        ..ListenerLimits::ETCD
    };
    cfg.client_limits = ListenerLimits {
        write_timeout: Duration::from_secs(1),
        ..ListenerLimits::CLIENT
    };
}

/// On the etcd port (HTTP/2 and HTTP/1 on one listener), a connection that sends nothing, or
/// only part of HTTP/2's preface, never reached hyper's HTTP/1 header timeout nor HTTP/2's
/// keep-alive: it stayed open until evicted at the connection cap (minutes, for ever below
/// it). It is closed at the header timeout, as on the `/v1` port.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_that_never_names_its_protocol_is_closed_on_the_etcd_port() {
    let c = TestCluster::start_tweaked(1, etcd_on).await;
    let id = c.leader().await;
    let addr = c.nodes[&id].etcd_addr().unwrap().to_string();
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    let mut partial = TcpStream::connect(&addr).await.unwrap();
    partial.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    assert!(
        closed_within(&mut silent, Duration::from_secs(5)).await,
        "a silent connection is still open 10 header timeouts later"
    );
    assert!(
        closed_within(&mut partial, Duration::from_secs(5)).await,
        "a connection that sent part of the HTTP/2 preface is still open 10 header timeouts later"
    );
    let page = metrics_of(&c, id).await;
    assert!(metric(&page, "leasecore_etcd_connections_header_timeouts_total").unwrap() >= 2.0);
    // A client that speaks at once is served as before.
    let resp = reqwest::get(format!("http://{addr}/version"))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    c.shutdown().await;
}

/// A `/v1` SSE watcher that sends its request and never reads: the node's writes to it
/// block, and it held its connection (a request in flight, never evicted) for ever. It is
/// closed once no byte has left for the write timeout, while writers and a reading watcher
/// go on as if it did not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_sse_watcher_that_never_reads_is_cut_off_and_others_are_served() {
    let c = TestCluster::start_tweaked(1, etcd_on).await;
    let id = c.leader().await;
    let addr = c.addrs[&id].clone();
    let mut stalled = small_window_connection(&addr).await;
    stalled
        .write_all(
            b"GET /v1/watch?prefix=big/ HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n",
        )
        .await
        .unwrap();
    // The stream is open (its head is answered at once) before the writes start.
    let mut head = [0u8; 12];
    stalled.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");

    write_big_values(&c, id).await;

    let page = eventually(
        Duration::from_secs(15),
        "the stalled SSE watcher to be cut off",
        || async {
            let page = metrics_of(&c, id).await;
            (metric(&page, "leasecore_client_connections_write_timeouts_total")? >= 1.0)
                .then_some(page)
        },
    )
    .await;
    assert_eq!(
        metric(&page, "leasecore_client_connections_write_timeouts_total"),
        Some(1.0)
    );
    assert!(
        closed_within(&mut stalled, Duration::from_secs(10)).await,
        "the stalled watcher's connection is still open"
    );
    // Another watcher is served every event, and writes go on.
    let client = c.client_of(id);
    let mut seen = 0;
    let mut from = 1;
    while seen < BIG_VALUES {
        let url = format!(
            "{}/v1/watch?prefix=big/&from_revision={from}&timeout_ms=1000",
            c.url(id)
        );
        let doc: serde_json::Value = reqwest::get(url).await.unwrap().json().await.unwrap();
        let events = doc["events"].as_array().unwrap();
        assert!(!events.is_empty(), "a watcher from revision {from}: {doc}");
        seen += events.len();
        from = events.last().unwrap()["revision"].as_u64().unwrap() + 1;
    }
    assert_eq!(seen, BIG_VALUES);
    client.put("after", "v", None, None).await.unwrap();
    c.shutdown().await;
}

/// An HTTP/2 frame.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A header block of literal fields (never indexed, no Huffman): no HPACK state needed.
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        assert!(name.len() < 127 && value.len() < 127);
        block.push(0x10);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

/// Read the server's frames until it closes the connection, answering SETTINGS and PINGs (so
/// that HTTP/2's keep-alive finds the client alive) and never granting any flow-control window:
/// the gRPC client of an application that stopped taking its watch stream's messages.
async fn answer_pings_take_nothing(
    mut r: tokio::net::tcp::OwnedReadHalf,
    w: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
) {
    let mut head = [0u8; 9];
    while r.read_exact(&mut head).await.is_ok() {
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        if r.read_exact(&mut payload).await.is_err() {
            return;
        }
        let (kind, flags) = (head[3], head[4]);
        let answer = match (kind, flags & 1) {
            (4, 0) => Some(frame(4, 1, 0, &[])),
            (6, 0) => Some(frame(6, 1, 0, &payload)),
            _ => None,
        };
        if let Some(a) = answer
            && w.lock().await.write_all(&a).await.is_err()
        {
            return;
        }
    }
}

/// An etcd gRPC Watch whose client answers HTTP/2 pings but takes none of the stream's
/// messages (it grants no flow-control window): the node's queue for the stream filled (4 MiB
/// a stream, 1,024 streams a connection) and stayed full, with the connection, for ever (300
/// such streams held 520 MB). The connection is closed once the queue has had no room for
/// the write timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_etcd_watch_whose_client_takes_nothing_is_cut_off() {
    let c = TestCluster::start_tweaked(1, etcd_on).await;
    let id = c.leader().await;
    let addr = c.nodes[&id].etcd_addr().unwrap().to_string();
    let (r, w) = TcpStream::connect(&addr).await.unwrap().into_split();
    let w = Arc::new(tokio::sync::Mutex::new(w));
    let reader = tokio::spawn(answer_pings_take_nothing(r, w.clone()));
    let create = WatchRequest {
        request_union: Some(watch_request::RequestUnion::CreateRequest(
            WatchCreateRequest {
                key: b"big/".to_vec(),
                range_end: b"big0".to_vec(),
                ..Default::default()
            },
        )),
    }
    .encode_to_vec();
    let mut message = vec![0u8];
    message.extend_from_slice(&(create.len() as u32).to_be_bytes());
    message.extend_from_slice(&create);
    let block = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":authority", &addr),
        (":path", "/etcdserverpb.Watch/Watch"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]);
    let mut opening = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    opening.extend(frame(4, 0, 0, &[]));
    opening.extend(frame(1, 4, 1, &block));
    opening.extend(frame(0, 0, 1, &message));
    w.lock().await.write_all(&opening).await.unwrap();

    write_big_values(&c, id).await;

    // Cut off within the write timeout of the queue filling (generously: a loaded machine).
    tokio::time::timeout(Duration::from_secs(15), reader)
        .await
        .expect("the stalled watch stream's connection is still open")
        .unwrap();
    let page = metrics_of(&c, id).await;
    assert_eq!(
        metric(&page, "leasecore_etcd_connections_write_timeouts_total"),
        Some(1.0)
    );
    // Writes go on.
    c.client_of(id).put("after", "v", None, None).await.unwrap();
    c.shutdown().await;
}
