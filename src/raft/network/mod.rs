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
//! Every request names this node in the
//! [`SENDER_HEADER`](crate::domain::peer_trust::SENDER_HEADER) header: the receiving node
//! admits only members of its cluster and checks that the body claims the same node
//! (`domain::peer_trust`).
//!
//! It also records, per peer, when this node last heard from it ([`Contacts`]): an answer to
//! one of openraft's RPCs, or an AppendEntries the peer sent as leader. That record is a fact for
//! the health rules (`domain::health`) to judge; the network never acts on it.
//!
//! # Layout
//! This file holds the wire's vocabulary: the routes, the append budget, the MessagePack type,
//! the snapshot frame and [`PeerError`]; `client` the HTTP client ([`PeerClient`]) and its
//! peer streams, `append_codec` an append's body both ways (around the entries' own
//! encodings), `connection` openraft's `RaftNetwork` ([`PeerConnection`]), `links` the
//! contact times and the outage log, `reversion` the leader's guard against a follower whose
//! log went back (it lost its data), `faults` the tests' fault injection.
//!
//! # What it must not do
//! Decide. It moves bytes, maps errors and records contact times.

use openraft::Vote;

use super::{NodeId, SnapshotMeta};

mod append_codec;
mod client;
mod connection;
mod faults;
mod links;
pub mod reversion;

pub use append_codec::read_append;
pub use client::{MAX_ANSWER_BYTES, PeerClient};
pub use connection::{NetworkFactory, PeerConnection};
pub use faults::Faults;
pub use links::{Contacts, LinkLog};

/// The largest AppendEntries payload sent in one request (estimated), unless a single entry is
/// larger on its own.
pub const MAX_APPEND_BYTES: usize = 1 << 20;

/// The MIME type of MessagePack bodies.
pub const MSGPACK: &str = "application/msgpack";

/// The routes of the peer API (served by `http::peer`).
pub mod routes {
    pub const APPEND: &str = "/raft/append";
    pub const VOTE: &str = "/raft/vote";
    /// Would you vote for me? (`domain::prevote`; answers change nothing.)
    pub const PREVOTE: &str = "/raft/prevote";
    pub const SNAPSHOT: &str = "/raft/snapshot";
    pub const PROPOSE: &str = "/raft/propose";
    /// Several forwarded proposals in one request (`raft::consensus::forward`).
    pub const PROPOSE_BATCH: &str = "/raft/propose_batch";
    /// The same, answered with how far the leader had applied (the forwarding node waits to
    /// apply as far before it answers its callers).
    pub const PROPOSE_BATCH_APPLIED: &str = "/raft/propose_batch_applied";
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
