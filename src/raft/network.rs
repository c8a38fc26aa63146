//! The peer network: openraft's RPCs and leasecore's forwarded calls over HTTP/JSON.
//!
//! One shared `reqwest::Client` (a connection pool) serves every peer. Every call has a
//! deadline. With peer TLS on, peers are reached with `https` and the client presents this
//! node's peer certificate and trusts only the peer CA (mutual TLS); the scheme follows this
//! node's own setting, so a cluster's peer side is all-TLS or all-plaintext. A TLS reload
//! swaps the whole client (new connections use the new identity; pooled ones finish out). Calls name a peer by its membership address (its client address) and go to its
//! peer listener, at [`crate::domain::resources::peer_address`] of it: peers never use the
//! client port. Errors are classified the way openraft needs them: a connection that could not be
//! made is `Unreachable` (openraft backs off), any other transport failure is `Network` (retry
//! at once), and an error the remote Raft returned is `RemoteError`.
//!
//! AppendEntries travels as MessagePack (values as raw bytes, not JSON-escaped text) and is
//! bounded in bytes: openraft 0.9 gives each append RPC only `heartbeat_interval` to complete
//! (pitfall P3), so a batch of large entries is cut to [`MAX_APPEND_BYTES`] (at least one entry)
//! and a success is reported as `PartialSuccess` up to the last entry sent; openraft then sends
//! the rest. Without the cut, a batch too large to cross in time would be retried, whole, for
//! ever.
//!
//! Snapshots travel as one binary frame, `[u64 BE header length][JSON {vote, meta}][raw data]`,
//! so that the data is not inflated into a JSON array of numbers.
//!
//! Every request names this node in the [`SENDER_HEADER`] header: the receiving node admits
//! only members of its cluster and checks that the body claims the same node
//! (`domain::peer_trust`).
//!
//! It also records, per peer, when this node last heard from it ([`Contacts`]): an answer to
//! one of openraft's RPCs, or an AppendEntries the peer sent as leader. That record is a fact for
//! the health rules (`domain::health`) to judge; the network never acts on it.
//!
//! # What it must not do
//! Decide. It moves bytes, maps errors and records contact times.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{
    Fatal, NetworkError, RPCError, RaftError, RemoteError, ReplicationClosed, StreamingError,
    Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{AnyError, BasicNode, EntryPayload, OptionalSend, Snapshot, Vote};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::durability::DurableView;
use super::peer_stream::{self, PeerStream, StreamPool};
use super::{Entry, NodeId, SnapshotMeta, TypeConfig};
use crate::domain::peer_link::{LinkPolicy, LinkReport, PeerLink};
use crate::domain::peer_trust::SENDER_HEADER;
use crate::domain::resources::peer_address;
use crate::tls::{PeerTls, Reloadable, TlsError};

/// The largest AppendEntries payload sent in one request (estimated), unless a single entry is
/// larger on its own.
pub const MAX_APPEND_BYTES: usize = 1 << 20;

/// The MIME type of MessagePack bodies.
pub const MSGPACK: &str = "application/msgpack";

/// A cheap estimate of an entry's encoded size.
fn approx_entry_bytes(entry: &Entry) -> usize {
    const OVERHEAD: usize = 48;
    match &entry.payload {
        EntryPayload::Normal(cmd) => OVERHEAD + cmd.approx_bytes(),
        EntryPayload::Membership(_) => 8 * OVERHEAD,
        EntryPayload::Blank => OVERHEAD,
    }
}

/// Cut `entries` to the byte budget, keeping at least one. Returns whether anything was cut.
fn cut_to_budget(entries: &mut Vec<Entry>) -> bool {
    let mut total = 0;
    let keep = entries
        .iter()
        .position(|e| {
            total += approx_entry_bytes(e);
            total > MAX_APPEND_BYTES
        })
        .map_or(entries.len(), |i| i.max(1));
    let cut = keep < entries.len();
    entries.truncate(keep);
    cut
}

/// The routes of the peer API (served by `http::peer`).
pub mod routes {
    pub const APPEND: &str = "/raft/append";
    pub const VOTE: &str = "/raft/vote";
    pub const SNAPSHOT: &str = "/raft/snapshot";
    pub const PROPOSE: &str = "/raft/propose";
    /// Several forwarded proposals in one request (`raft::consensus::forward`).
    pub const PROPOSE_BATCH: &str = "/raft/propose_batch";
    pub const READ_INDEX: &str = "/raft/read_index";
    pub const ADMIN: &str = "/raft/admin";
    pub const LEASE_REFRESH: &str = "/raft/lease_refresh";
    pub const LEASE_REMAINING: &str = "/raft/lease_remaining";
    /// A leadership transfer asked of the leader (`raft::consensus::transfer`).
    pub const MOVE_LEADER: &str = "/raft/move_leader";
    /// The leader's call to a voter during a transfer: hold elections, or campaign.
    pub const TRANSFER: &str = "/raft/transfer";
    /// How far back this node's history reaches (`domain::history_fill`).
    pub const HISTORY_REACH: &str = "/raft/history/reach";
    /// A page of this node's history, for a peer's fill.
    pub const HISTORY_PAGE: &str = "/raft/history/page";
    /// This node's view of the cluster (`GET /v1/cluster`'s document), for the start-up probe.
    pub const STATUS: &str = "/raft/status";
    /// A peer stream (`raft::peer_stream`): an HTTP/1.1 upgrade to framed messages.
    pub const STREAM: &str = "/raft/stream";
}

/// A failed peer call.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The connection could not be made: the request was certainly not delivered.
    #[error("peer {addr} unreachable: {}", crate::transport::cause(source))]
    Unreachable {
        addr: String,
        source: reqwest::Error,
    },
    /// The request may have been delivered, but no usable answer came back.
    #[error("peer {addr}: {detail}")]
    Transport { addr: String, detail: String },
    /// The peer has no such route (a build older than this one): no handler ran, nothing
    /// was done.
    #[error("peer {addr} does not serve {path} (an older build?)")]
    NoRoute { addr: String, path: String },
}

impl PeerError {
    /// Why, in a few words (without the address).
    pub fn cause(&self) -> String {
        match self {
            PeerError::Unreachable { source, .. } => crate::transport::cause(source),
            PeerError::Transport { detail, .. } => detail.clone(),
            PeerError::NoRoute { path, .. } => format!("no route {path}"),
        }
    }

    /// Whether the request certainly never reached the peer (safe to send elsewhere).
    pub fn not_delivered(&self) -> bool {
        matches!(self, PeerError::Unreachable { .. })
    }
}

/// Fault injection for tests: peers this node must not reach (a partition seen from here).
/// Empty in production; checked before each send.
#[derive(Default)]
pub struct Faults {
    blocked: std::sync::RwLock<std::collections::HashSet<String>>,
}

impl Faults {
    /// Drop every message to `addr` from now on.
    pub fn block(&self, addr: &str) {
        self.blocked
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr.to_string());
    }

    /// Heal every partition.
    pub fn heal(&self) {
        self.blocked
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    fn is_blocked(&self, addr: &str) -> bool {
        let blocked = self.blocked.read().unwrap_or_else(|p| p.into_inner());
        !blocked.is_empty() && blocked.contains(addr)
    }
}

/// When this node last heard from each peer, on this process's monotonic clock.
///
/// Bounded by the membership: one entry per node id ever heard from (ids are few).
#[derive(Default)]
pub struct Contacts {
    clock: crate::clock::SystemClock,
    last: std::sync::Mutex<std::collections::BTreeMap<NodeId, crate::domain::types::MonoMillis>>,
    /// When this node last accepted an append or a snapshot from a leader (not an answer to
    /// its own RPCs): the "leader alive" fact of the vote rule (`domain::peer_trust`).
    led: std::sync::Mutex<Option<crate::domain::types::MonoMillis>>,
}

impl Contacts {
    /// Record that `id` was heard from just now.
    pub fn heard_from(&self, id: NodeId) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        self.last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, now);
    }

    /// Record that a leader's append or snapshot was accepted just now.
    pub fn led_now(&self) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        *self.led.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
    }

    /// Milliseconds since a leader's append or snapshot was last accepted (None: never).
    pub fn led_age(&self) -> Option<u64> {
        use crate::clock::Clock;
        let now = self.clock.mono();
        let led = *self.led.lock().unwrap_or_else(|p| p.into_inner());
        led.map(|t| t.until(now))
    }

    /// Milliseconds since each peer was last heard from.
    pub fn ages(&self) -> std::collections::BTreeMap<NodeId, u64> {
        use crate::clock::Clock;
        let now = self.clock.mono();
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.iter().map(|(id, t)| (*id, t.until(now))).collect()
    }
}

/// Logs each peer's outages once, with reminders, instead of every failed RPC (the rule is
/// `domain::peer_link`; this only keeps its state per peer and prints its verdicts).
#[derive(Default)]
pub struct LinkLog {
    clock: crate::clock::SystemClock,
    links: std::sync::Mutex<std::collections::BTreeMap<NodeId, PeerLink>>,
}

impl LinkLog {
    fn with_link<T>(&self, id: NodeId, f: impl FnOnce(&mut PeerLink) -> T) -> T {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        f(links.entry(id).or_default())
    }

    /// An RPC to `id` (at `addr`) failed with `e`.
    pub fn failed(&self, id: NodeId, addr: &str, e: &PeerError) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        let report = self.with_link(id, |l| l.failed(now, LinkPolicy::default()));
        match report {
            Some(LinkReport::WentDown { for_ms, failures }) => tracing::warn!(
                peer = id,
                addr,
                error = %e.cause(),
                failing_for_ms = for_ms,
                failures,
                "peer unreachable"
            ),
            Some(LinkReport::StillDown { for_ms, failures }) => tracing::warn!(
                peer = id,
                addr,
                error = %e.cause(),
                failing_for_ms = for_ms,
                failures,
                "peer still unreachable"
            ),
            _ => {}
        }
    }

    /// An RPC to `id` got an answer.
    pub fn answered(&self, id: NodeId, addr: &str) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        if let Some(LinkReport::CameBack { after_ms, failures }) =
            self.with_link(id, |l| l.answered(now))
        {
            tracing::info!(
                peer = id,
                addr,
                down_for_ms = after_ms,
                failures,
                "peer reachable again"
            );
        }
    }
}

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
    contacts: Arc<Contacts>,
    links: Arc<LinkLog>,
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

/// Encode a snapshot for the wire.
pub fn encode_snapshot_frame(vote: &Vote<NodeId>, meta: &SnapshotMeta, data: &[u8]) -> Vec<u8> {
    let header = serde_json::to_vec(&(vote, meta)).expect("plain data serializes");
    let mut frame = Vec::with_capacity(8 + header.len() + data.len());
    frame.extend_from_slice(&(header.len() as u64).to_be_bytes());
    frame.extend_from_slice(&header);
    frame.extend_from_slice(data);
    frame
}

/// Decode a snapshot frame; `Err` describes what is malformed.
pub fn decode_snapshot_frame(
    frame: &[u8],
) -> Result<(Vote<NodeId>, SnapshotMeta, Vec<u8>), String> {
    let len_bytes: [u8; 8] = frame
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("snapshot frame shorter than its length prefix")?;
    let len = u64::from_be_bytes(len_bytes);
    let end = 8u64
        .checked_add(len)
        .filter(|&end| end <= frame.len() as u64)
        .ok_or("snapshot header length exceeds the frame")? as usize;
    let (vote, meta): (Vote<NodeId>, SnapshotMeta) =
        serde_json::from_slice(&frame[8..end]).map_err(|e| format!("snapshot header: {e}"))?;
    Ok((vote, meta, frame[end..].to_vec()))
}

/// Makes one [`PeerConnection`] per target for openraft.
#[derive(Clone)]
pub struct NetworkFactory {
    client: PeerClient,
    durable: Option<DurableView>,
}

impl NetworkFactory {
    pub fn new(client: PeerClient) -> Self {
        NetworkFactory {
            client,
            durable: None,
        }
    }

    /// Tell followers a commit no higher than this node's durable log (the leader
    /// acknowledges its own appends before their sync: `super::durability`).
    pub fn with_durability(mut self, durable: DurableView) -> Self {
        self.durable = Some(durable);
        self
    }
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Self::Network {
        PeerConnection {
            client: self.client.clone(),
            target,
            addr: node.addr.clone(),
            durable: self.durable.clone(),
        }
    }
}

/// openraft's view of one peer.
pub struct PeerConnection {
    client: PeerClient,
    target: NodeId,
    addr: String,
    durable: Option<DurableView>,
}

impl PeerConnection {
    async fn call<Req, Resp, E>(
        &self,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let answer: Result<Resp, E> = self
            .client
            .post_json(&self.addr, path, req, timeout)
            .await
            .map_err(|e| self.failed(e))?;
        self.answered();
        answer.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl PeerConnection {
    /// The peer answered: a contact for the health rules, maybe the end of an outage.
    fn answered(&self) {
        self.client.contacts.heard_from(self.target);
        self.client.links.answered(self.target, &self.addr);
    }

    /// A transport failure of this peer's RPC.
    fn transport(&self, detail: String) -> PeerError {
        PeerError::Transport {
            addr: self.addr.clone(),
            detail,
        }
    }

    /// An RPC failed: maybe the start of an outage worth a log line; openraft's error.
    fn failed<E: std::error::Error>(&self, e: PeerError) -> RPCError<NodeId, BasicNode, E> {
        self.client.links.failed(self.target, &self.addr, &e);
        to_rpc_error(&e)
    }
}

fn to_rpc_error<E: std::error::Error>(e: &PeerError) -> RPCError<NodeId, BasicNode, E> {
    match e {
        PeerError::Unreachable { .. } => RPCError::Unreachable(Unreachable::new(e)),
        PeerError::Transport { .. } | PeerError::NoRoute { .. } => {
            RPCError::Network(NetworkError::new(e))
        }
    }
}

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        if let Some(durable) = &self.durable {
            rpc.leader_commit = durable.cap_commit(rpc.leader_commit);
        }
        let cut = cut_to_budget(&mut rpc.entries);
        let last_sent = rpc.entries.last().map(|e| e.log_id);
        let network = |e: &dyn std::error::Error| {
            RPCError::Network(NetworkError::new(&AnyError::error(e.to_string())))
        };
        // The MessagePack body is encoded once, straight into a stream frame; over plain HTTP
        // the same bytes (after the frame's head) are the request body.
        let estimate = rpc.entries.iter().map(approx_entry_bytes).sum::<usize>() + 64;
        let mut frame = peer_stream::start_frame(peer_stream::KIND_APPEND, estimate);
        rmp_serde::encode::write_named(&mut frame, &rpc).map_err(|e| network(&e))?;
        let frame = peer_stream::finish_frame(frame).map_err(|e| network(&e))?;
        let ttl = option.hard_ttl();
        let answer: Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>> = match self
            .client
            .stream_call(&self.addr, &frame, ttl, peer_stream::MAX_ANSWER_FRAME)
            .await
        {
            Ok(Some((peer_stream::ANSWERED, body))) => serde_json::from_slice(&body)
                .map_err(|e| self.failed(self.transport(format!("undecodable answer: {e}"))))?,
            Ok(Some((status, body))) => {
                let why = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
                return Err(self.failed(self.transport(format!(
                    "append refused on the peer stream (status {status}): {why}"
                ))));
            }
            Ok(None) => self
                .client
                .post_bytes(
                    &self.addr,
                    routes::APPEND,
                    MSGPACK,
                    frame[5..].to_vec(),
                    ttl,
                )
                .await
                .map_err(|e| self.failed(e))?,
            Err(e) => return Err(self.failed(e)),
        };
        self.answered();
        match answer {
            Ok(AppendEntriesResponse::Success) if cut => {
                Ok(AppendEntriesResponse::PartialSuccess(last_sent))
            }
            Ok(resp) => Ok(resp),
            Err(e) => Err(RPCError::RemoteError(RemoteError::new(self.target, e))),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(routes::VOTE, &rpc, option.hard_ttl()).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote<NodeId>,
        snapshot: Snapshot<TypeConfig>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<TypeConfig, Fatal<NodeId>>> {
        let frame = encode_snapshot_frame(&vote, &snapshot.meta, &snapshot.snapshot);
        let send = self
            .client
            .post_bytes::<Result<SnapshotResponse<NodeId>, Fatal<NodeId>>>(
                &self.addr,
                routes::SNAPSHOT,
                "application/octet-stream",
                frame,
                option.hard_ttl(),
            );
        let answer = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            answer = send => answer,
        };
        match &answer {
            Ok(_) => self.answered(),
            Err(e) => {
                self.client.links.failed(self.target, &self.addr, e);
            }
        }
        match answer {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(fatal)) => Err(StreamingError::RemoteError(RemoteError::new(
                self.target,
                fatal,
            ))),
            Err(e @ PeerError::Unreachable { .. }) => {
                Err(StreamingError::Unreachable(Unreachable::new(&e)))
            }
            Err(e) => Err(StreamingError::Network(NetworkError::new(&e))),
        }
    }

    fn backoff(&self) -> openraft::network::Backoff {
        // Retry an unreachable peer quickly at first (a restarting node comes back within a
        // second), then settle at one attempt per 500 ms.
        let steps = [50u64, 100, 200, 400]
            .into_iter()
            .chain(std::iter::repeat(500))
            .map(Duration::from_millis);
        openraft::network::Backoff::new(steps)
    }
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
