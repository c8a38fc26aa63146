//! The peer HTTP client, [`PeerClient`]: one shared connection pool for every peer; JSON,
//! MessagePack and raw bodies; a peer stream (`raft::peer_stream`) where the peer serves
//! them, plain HTTP where it does not.
//!
//! # Invariants
//! - Every call has a deadline, and every answer is bounded in bytes ([`MAX_ANSWER_BYTES`], or
//!   the caller's cap), refused before it is read whole if it is longer.
//! - Every request names this node in [`SENDER_HEADER`].
//! - Only a connection that could not be made is `PeerError::Unreachable` (certainly not
//!   delivered); any other failure is `Transport`, a route the peer lacks `NoRoute`.
//! - Only a peer stream whose exchange completed goes back to the pool.
//!
//! # What it must not do
//! Resend a request that may have been delivered, or decide anything from an answer: it
//! delivers one request and reports what came back.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Contacts, Faults, LinkLog, MSGPACK, PeerError, routes};
use crate::domain::peer_trust::SENDER_HEADER;
use crate::domain::resources::peer_address;
use crate::raft::NodeId;
use crate::raft::peer_stream::{self, PeerStream, StreamPool};
use crate::tls::{PeerTls, Reloadable, TlsError};

/// How peers are reached: the reqwest client in force (swapped on a TLS reload) and the scheme.
enum PeerHttp {
    Plain(reqwest::Client),
    Tls(Arc<Reloadable<reqwest::Client>>),
}

/// The shared HTTP client for peer traffic.
#[derive(Clone)]
pub struct PeerClient {
    http: Arc<PeerHttp>,
    faults: Arc<Faults>,
    pub(super) contacts: Arc<Contacts>,
    pub(super) links: Arc<LinkLog>,
    /// Open peer streams, idle between exchanges.
    streams: Arc<StreamPool>,
    /// This node's id, sent as [`SENDER_HEADER`].
    me: String,
}

/// The peer client's settings, with `tls` (a rustls config) when peer TLS is on.
fn peer_http(tls: Option<rustls::ClientConfig>) -> Result<reqwest::Client, TlsError> {
    let builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(500))
        // Shorter than the peer listener's header timeout (90 s), so that the server never
        // closes a pooled connection just as a request is sent on it (that would turn a
        // forwarded write into `outcome_unknown`).
        .pool_idle_timeout(Duration::from_secs(30))
        .tcp_nodelay(true);
    // Plaintext peers need no trust store (the host may have none: a scratch container).
    let config = tls.unwrap_or_else(crate::tls::trust_nothing);
    builder
        .tls_backend_preconfigured(config)
        .build()
        .map_err(|e| TlsError::Build(e.to_string()))
}

impl PeerClient {
    /// The plaintext peer client of node `me`.
    pub fn new(me: NodeId) -> Self {
        let http = peer_http(None).expect("a plain HTTP client always builds");
        Self::with_http(me, PeerHttp::Plain(http))
    }

    /// The peer client of node `me` that speaks mutual TLS with `tls` (reloadable: see
    /// [`PeerClient::tls`]).
    pub fn with_tls(me: NodeId, tls: &PeerTls) -> Result<Self, TlsError> {
        let files = tls.client();
        let reloadable = Reloadable::new("peer client", files.files(), move || {
            peer_http(Some(files.build()?))
        })?;
        Ok(Self::with_http(me, PeerHttp::Tls(Arc::new(reloadable))))
    }

    fn with_http(me: NodeId, http: PeerHttp) -> Self {
        PeerClient {
            http: Arc::new(http),
            faults: Arc::default(),
            contacts: Arc::default(),
            links: Arc::default(),
            streams: Arc::default(),
            me: me.to_string(),
        }
    }

    /// The reloadable TLS client, when peer TLS is on (for the reloader).
    pub fn tls(&self) -> Option<Arc<Reloadable<reqwest::Client>>> {
        match &*self.http {
            PeerHttp::Plain(_) => None,
            PeerHttp::Tls(r) => Some(r.clone()),
        }
    }

    /// The URL of `path` on the peer listener of the node whose client address is `addr`.
    pub fn url(&self, addr: &str, path: &str) -> Result<String, String> {
        let peer = peer_address(addr)?;
        let scheme = match &*self.http {
            PeerHttp::Plain(_) => "http",
            PeerHttp::Tls(_) => "https",
        };
        Ok(format!("{scheme}://{peer}{path}"))
    }

    fn http(&self) -> reqwest::Client {
        match &*self.http {
            PeerHttp::Plain(c) => c.clone(),
            PeerHttp::Tls(r) => (*r.current()).clone(),
        }
    }

    /// When each peer was last heard from.
    pub fn contacts(&self) -> &Contacts {
        &self.contacts
    }

    /// The fault injector of this client (tests only).
    pub fn faults(&self) -> Arc<Faults> {
        self.faults.clone()
    }

    /// A peer's view of its cluster (`/raft/status`, the document of `GET /v1/cluster`): what
    /// a starting node, a forming cluster and `MemberList` ask their peers. Bounded to
    /// [`MAX_STATUS_BYTES`]: a status document is small, whatever a peer sends.
    pub async fn status(
        &self,
        addr: &str,
        timeout: Duration,
    ) -> Result<leasecore_client::api::ClusterView, PeerError> {
        self.post_json_within(addr, routes::STATUS, &(), timeout, MAX_STATUS_BYTES)
            .await
    }

    /// POST a JSON body and decode a JSON answer.
    pub async fn post_json<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &Req,
        timeout: Duration,
    ) -> Result<Resp, PeerError> {
        self.post_json_within(addr, path, body, timeout, MAX_ANSWER_BYTES)
            .await
    }

    /// POST a compact MessagePack body and decode a MessagePack answer.
    pub async fn post_msgpack<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &Req,
        timeout: Duration,
    ) -> Result<Resp, PeerError> {
        let transport = |detail: String| PeerError::Transport {
            addr: addr.to_string(),
            detail,
        };
        let bytes = rmp_serde::to_vec(body).map_err(|e| transport(e.to_string()))?;
        let answer = self
            .post_raw(addr, path, MSGPACK, bytes, timeout, MAX_ANSWER_BYTES)
            .await?;
        rmp_serde::from_slice(&answer).map_err(|e| transport(format!("undecodable answer: {e}")))
    }

    /// POST raw bytes and decode a JSON answer.
    pub async fn post_bytes<Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        content_type: &'static str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<Resp, PeerError> {
        let answer = self
            .post_raw(addr, path, content_type, body, timeout, MAX_ANSWER_BYTES)
            .await?;
        serde_json::from_slice(&answer).map_err(|e| PeerError::Transport {
            addr: addr.to_string(),
            detail: format!("undecodable answer: {e}"),
        })
    }

    /// POST a JSON body and decode a JSON answer of at most `cap` bytes.
    pub async fn post_json_within<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &Req,
        timeout: Duration,
        cap: usize,
    ) -> Result<Resp, PeerError> {
        let transport = |detail: String| PeerError::Transport {
            addr: addr.to_string(),
            detail,
        };
        let bytes = serde_json::to_vec(body).map_err(|e| transport(e.to_string()))?;
        let answer = self
            .post_raw(addr, path, "application/json", bytes, timeout, cap)
            .await?;
        serde_json::from_slice(&answer).map_err(|e| transport(format!("undecodable answer: {e}")))
    }

    /// POST raw bytes; the answer's body (at most `cap` bytes) if the status is a success.
    async fn post_raw(
        &self,
        addr: &str,
        path: &str,
        content_type: &'static str,
        body: Vec<u8>,
        timeout: Duration,
        cap: usize,
    ) -> Result<bytes::Bytes, PeerError> {
        let transport = |detail: String| PeerError::Transport {
            addr: addr.to_string(),
            detail,
        };
        // Over a peer stream when the peer serves them: all but snapshots (bulk) and the
        // status document (open to non-members, which cannot open a stream).
        if path != routes::SNAPSHOT && path != routes::STATUS {
            let frame = peer_stream::request_frame(path, content_type, &body)
                .map_err(|e| transport(e.to_string()))?;
            if let Some((kind, answer)) = self
                .stream_call(addr, &frame, timeout, cap.saturating_add(2))
                .await?
            {
                if kind != peer_stream::ANSWERED {
                    return Err(transport(format!(
                        "refused on the peer stream: {}",
                        String::from_utf8_lossy(&answer[..answer.len().min(512)])
                    )));
                }
                let (status, _) =
                    peer_stream::parse_answer(&answer).map_err(|e| transport(e.into()))?;
                let status = reqwest::StatusCode::from_u16(status)
                    .map_err(|_| transport(format!("an impossible status {status}")))?;
                // The body is the answer after its 2-byte status: no copy.
                let body = bytes::Bytes::from(answer).slice(2..);
                return answered_with(addr, path, status, body);
            }
        }
        let url = self.url(addr, path).map_err(transport)?;
        if self.faults.is_blocked(addr) {
            // A partition: the message is lost; the sender learns only that it timed out.
            tokio::time::sleep(timeout.min(Duration::from_millis(50))).await;
            return Err(transport("partitioned (fault injection)".into()));
        }
        let resp = self
            .http()
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .header(SENDER_HEADER, &self.me)
            .body(body)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| send_failed(addr, e))?;
        let status = resp.status();
        let body = read_bounded(resp, cap).await.map_err(transport)?;
        answered_with(addr, path, status, body)
    }
}

/// A peer's answer to a request for `path`: its body if the status is a success.
fn answered_with(
    addr: &str,
    path: &str,
    status: reqwest::StatusCode,
    body: bytes::Bytes,
) -> Result<bytes::Bytes, PeerError> {
    // An unknown route answers 404 with no body; every route of ours answers with one.
    if status == reqwest::StatusCode::NOT_FOUND && body.is_empty() {
        return Err(PeerError::NoRoute {
            addr: addr.to_string(),
            path: path.to_string(),
        });
    }
    if !status.is_success() {
        return Err(PeerError::Transport {
            addr: addr.to_string(),
            detail: format!(
                "status {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(512)])
            ),
        });
    }
    Ok(body)
}

/// A request that could not be sent or got no answer: `Unreachable` if the connection could
/// not be made (certainly not delivered).
fn send_failed(addr: &str, e: reqwest::Error) -> PeerError {
    if e.is_connect() {
        PeerError::Unreachable {
            addr: addr.to_string(),
            source: e,
        }
    } else {
        PeerError::Transport {
            addr: addr.to_string(),
            detail: crate::transport::cause(&e),
        }
    }
}

impl PeerClient {
    /// Send one request frame to `addr` over a peer stream (a pooled one, or a new one) and
    /// return the answer frame, all within `timeout`. `Ok(None)`: the peer does not serve
    /// streams; send the message over plain HTTP instead.
    pub async fn stream_call(
        &self,
        addr: &str,
        frame: &[u8],
        timeout: Duration,
        cap: usize,
    ) -> Result<Option<peer_stream::Frame>, PeerError> {
        let transport = |detail: String| PeerError::Transport {
            addr: addr.to_string(),
            detail,
        };
        if self.streams.plain(addr) {
            return Ok(None);
        }
        if self.faults.is_blocked(addr) {
            tokio::time::sleep(timeout.min(Duration::from_millis(50))).await;
            return Err(transport("partitioned (fault injection)".into()));
        }
        let exchange = async {
            let mut stream = match self.streams.take(addr) {
                Some(stream) => stream,
                None => match self.open_stream(addr, timeout).await? {
                    Some(stream) => stream,
                    None => return Ok(None),
                },
            };
            let answer = stream
                .exchange(frame, cap)
                .await
                .map_err(|e| transport(format!("peer stream: {e}")))?;
            // Only a stream whose exchange completed is reused: any failure above drops it
            // (an answer may still be on its way).
            self.streams.give_back(addr, stream);
            Ok(Some(answer))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or_else(|_| Err(transport("timed out".into())))
    }

    /// Open a peer stream to `addr`. `Ok(None)` if the peer does not open one: it has no such
    /// route (a build before streams; remembered for a while), or it refused (not a member of
    /// its cluster yet, or at its cap of streams): the message then goes over plain HTTP, which
    /// answers as it always did.
    async fn open_stream(
        &self,
        addr: &str,
        timeout: Duration,
    ) -> Result<Option<PeerStream>, PeerError> {
        let transport = |detail: String| PeerError::Transport {
            addr: addr.to_string(),
            detail,
        };
        let url = self.url(addr, routes::STREAM).map_err(transport)?;
        let resp = self
            .http()
            .get(&url)
            .header(reqwest::header::CONNECTION, "upgrade")
            .header(reqwest::header::UPGRADE, peer_stream::PROTOCOL)
            .header(SENDER_HEADER, &self.me)
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| send_failed(addr, e))?;
        let status = resp.status();
        if status == reqwest::StatusCode::SWITCHING_PROTOCOLS {
            let io = resp
                .upgrade()
                .await
                .map_err(|e| transport(format!("peer stream upgrade: {e}")))?;
            return Ok(Some(PeerStream::new(io)));
        }
        let body = read_bounded(resp, peer_stream::MAX_ANSWER_FRAME)
            .await
            .map_err(transport)?;
        // A build before streams answers 404 (its unknown-route document).
        if status == reqwest::StatusCode::NOT_FOUND {
            self.streams.use_plain(addr);
        } else {
            tracing::debug!(
                addr,
                %status,
                answer = %String::from_utf8_lossy(&body[..body.len().min(200)]),
                "peer stream refused: plain HTTP for this message"
            );
        }
        Ok(None)
    }
}

/// The largest answer taken from a peer: as large as the largest message a peer may send
/// this node (a peer is validated like a client: its answers are bounded too).
pub const MAX_ANSWER_BYTES: usize = crate::http::MAX_PEER_BODY_BYTES;

/// The largest status document taken from a peer (a view of a cluster of thousands of
/// nodes fits).
pub const MAX_STATUS_BYTES: usize = 4 << 20;

/// Read an answer's body, refusing one longer than `cap` before it is read whole.
async fn read_bounded(mut resp: reqwest::Response, cap: usize) -> Result<bytes::Bytes, String> {
    let too_long = |n: u64| format!("answer of {n} bytes exceeds the {cap}-byte limit");
    match resp.content_length() {
        Some(n) if n > cap as u64 => return Err(too_long(n)),
        // A length within the cap (every answer of ours has one): hyper reads no further
        // than it, in one buffer.
        Some(_) => {
            return resp.bytes().await.map_err(|e| crate::transport::cause(&e));
        }
        None => {}
    }
    let mut body = bytes::BytesMut::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| crate::transport::cause(&e))?
    {
        if body.len() + chunk.len() > cap {
            return Err(too_long((body.len() + chunk.len()) as u64));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that answers `body` at `/sized` (with its length) and at `/streamed` (chunked,
    /// no length announced), on loopback.
    async fn answering(body: &'static [u8]) -> String {
        use axum::routing::get;
        let streamed = move || async move {
            let chunks = body.chunks(7).map(|c| Ok::<_, std::io::Error>(c.to_vec()));
            axum::body::Body::from_stream(futures::stream::iter(chunks))
        };
        let app = axum::Router::new()
            .route("/sized", get(move || async move { body }))
            .route("/streamed", get(streamed));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn a_peer_answer_longer_than_the_limit_is_refused() {
        let base = answering(&[b'x'; 100]).await;
        let http = reqwest::Client::new();
        for path in ["/sized", "/streamed"] {
            let get = || http.get(format!("{base}{path}")).send();
            let refused = read_bounded(get().await.unwrap(), 99).await.unwrap_err();
            assert!(
                refused.contains("exceeds the 99-byte limit"),
                "{path}: {refused}"
            );
            let read = read_bounded(get().await.unwrap(), 100).await.unwrap();
            assert_eq!(read.len(), 100, "{path}");
        }
    }

    /// A peer of a build before streams (its unknown routes answer 404 with a JSON document):
    /// a message goes over plain HTTP, and the stream is not asked for again at once.
    #[tokio::test]
    async fn a_peer_without_streams_is_reached_over_plain_http() {
        use axum::routing::post;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let asked = Arc::new(AtomicUsize::new(0));
        let counter = asked.clone();
        let app = axum::Router::new()
            .route(
                routes::READ_INDEX,
                post(|| async { axum::Json(serde_json::json!({"Ok": 7})) }),
            )
            .fallback(move || {
                counter.fetch_add(1, Ordering::SeqCst);
                async { (axum::http::StatusCode::NOT_FOUND, "{\"error\":{}}") }
            });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let offset = crate::domain::resources::PEER_PORT_OFFSET;
        let addr = format!("127.0.0.1:{}", port - offset);
        let client = PeerClient::new(1);
        for _ in 0..3 {
            let answer: Result<u64, String> = client
                .post_json(&addr, routes::READ_INDEX, &(), Duration::from_secs(5))
                .await
                .unwrap();
            assert_eq!(answer, Ok(7));
        }
        assert_eq!(
            asked.load(Ordering::SeqCst),
            1,
            "the stream was asked for once"
        );
    }
}
