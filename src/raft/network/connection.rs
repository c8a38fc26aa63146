//! openraft's side of the peer network: [`NetworkFactory`] makes one [`PeerConnection`] per
//! target, which carries AppendEntries (MessagePack, cut to a byte budget, over a peer stream
//! where it can), votes and snapshots (one binary frame), and maps each failure to the error
//! openraft needs.
//!
//! # Invariants
//! - An append carries at most [`MAX_APPEND_BYTES`] of entries (at least one entry); a cut
//!   batch that succeeds is reported as `PartialSuccess` up to the last entry sent.
//! - With a durable view, the commit told to followers is no higher than this node's durable
//!   log (`raft::durability`).
//! - Every answer is recorded as a contact and may end an outage in the link log; every
//!   transport failure goes to the link log.
//! - A follower's acknowledged match is recorded with the [`ReversionGuard`]; a conflict below
//!   it (the follower lost its data) is answered to openraft as "unreachable", never as a
//!   conflict (openraft 0.9 cannot take a follower's log going back).
//!
//! # What it must not do
//! Decide. It encodes, sends, maps errors and records contacts; openraft decides what to send,
//! and when to send it again.

use std::future::Future;
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

use super::append_codec::{append_size_hint, write_append};
use super::reversion::ReversionGuard;
use super::{MAX_APPEND_BYTES, MSGPACK, PeerClient, PeerError, encode_snapshot_frame, routes};
use crate::raft::durability::DurableView;
use crate::raft::peer_stream;
use crate::raft::{Entry, NodeId, TypeConfig};

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

/// Makes one [`PeerConnection`] per target for openraft.
#[derive(Clone)]
pub struct NetworkFactory {
    client: PeerClient,
    durable: Option<DurableView>,
    reversions: Option<ReversionGuard>,
}

impl NetworkFactory {
    pub fn new(client: PeerClient) -> Self {
        NetworkFactory {
            client,
            durable: None,
            reversions: None,
        }
    }

    /// Record followers' matches, and keep a follower whose log went back from openraft.
    pub fn with_reversion_guard(mut self, guard: ReversionGuard) -> Self {
        self.reversions = Some(guard);
        self
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
            reversions: self.reversions.clone(),
        }
    }
}

/// openraft's view of one peer.
pub struct PeerConnection {
    client: PeerClient,
    target: NodeId,
    addr: String,
    durable: Option<DurableView>,
    reversions: Option<ReversionGuard>,
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
        let estimate = append_size_hint(&rpc, approx_entry_bytes);
        let mut frame = peer_stream::start_frame(peer_stream::KIND_APPEND, estimate);
        write_append(&mut frame, &rpc).map_err(|e| network(&*e))?;
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
        let answer = match answer {
            Ok(AppendEntriesResponse::Success) if cut => {
                Ok(AppendEntriesResponse::PartialSuccess(last_sent))
            }
            other => other,
        };
        if let Some(guard) = &self.reversions {
            let leader = (rpc.vote.leader_id().term, rpc.vote.leader_id().node_id);
            let matched = match &answer {
                Ok(AppendEntriesResponse::Success) => last_sent.or(rpc.prev_log_id),
                Ok(AppendEntriesResponse::PartialSuccess(upto)) => *upto,
                _ => None,
            };
            if let Some(m) = matched {
                guard.acknowledged(self.target, leader, m.index);
            }
            if let (Ok(AppendEntriesResponse::Conflict), Some(prev)) = (&answer, rpc.prev_log_id)
                && guard.reverted(self.target, leader, prev.index)
            {
                return Err(RPCError::Unreachable(Unreachable::new(&AnyError::error(
                    format!(
                        "node {} lost entries it acknowledged (its log went back); it is being \
                         replaced",
                        self.target
                    ),
                ))));
            }
        }
        answer.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
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
        let installs_upto = snapshot.meta.last_log_id.map(|l| l.index);
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
            Ok(Ok(resp)) => {
                if let (Some(guard), Some(index)) = (&self.reversions, installs_upto)
                    && resp.vote == vote
                {
                    let leader = (vote.leader_id().term, vote.leader_id().node_id);
                    guard.acknowledged(self.target, leader, index);
                }
                Ok(resp)
            }
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
