//! [`Consensus`]: the one handle through which the rest of leasecore uses Raft.
//!
//! - `propose(cmd)`: any node accepts any command. The leader writes it; a follower forwards it
//!   to the leader it knows over the peer API (`/raft/propose`), and the leader never forwards
//!   again (no forwarding loops). While no leader is known the call waits up to `leader_wait`
//!   for one, then fails with [`ConsensusError::NoLeader`] (nothing was proposed: retry).
//! - `read_barrier()`: a linearizable read point (ReadIndex). The leader confirms its leadership
//!   with a quorum, the node waits until it has applied up to the leader's commit index, and
//!   the caller then reads its local state. Concurrent callers share quorum rounds through a
//!   [`RoundBatcher`]; a follower forwards one round to the leader for all its waiting callers.
//! - membership changes (learner, then voter) and removal, forwarded to the leader likewise.
//!
//! # Invariants
//! - A forwarded request whose delivery is uncertain is never retried: the caller gets
//!   [`ConsensusError::OutcomeUnknown`]. Only a request that certainly did not reach the leader
//!   (the connection was refused) is sent again, after the node learns of a new leader.
//! - No lock is held across an await; all shared state is openraft's own (metrics) or atomics.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use openraft::error::{
    ChangeMembershipError, CheckIsLeaderError, ClientWriteError, InitializeError, RaftError,
};
use openraft::{BasicNode, ChangeMembers, ServerState};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::network::{PeerClient, routes};
use super::state_machine::StateView;
use super::{NodeId, Raft};
use crate::domain::command::{Command, Response};
use crate::domain::types::Revision;
use crate::runtime::batch::{RoundBatcher, RoundFuture};
use crate::runtime::election::ElectionPort;

/// Why a consensus operation did not complete. Also the peer-wire error of forwarded calls.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum ConsensusError {
    /// No leader is known: nothing was proposed; retry later.
    #[error("no leader is known; the cluster may be electing one, retry")]
    NoLeader,
    /// This node is not the leader (peer calls only; clients see `NoLeader`).
    #[error("this node is not the leader")]
    NotLeader,
    /// The leader could not reach a quorum to confirm its leadership.
    #[error("the leader could not reach a quorum")]
    NoQuorum,
    /// The request reached the leader but no answer came back: it may or may not have applied.
    #[error("the leader failed while the request was in flight; the outcome is unknown: {detail}")]
    OutcomeUnknown { detail: String },
    /// The operation did not finish in time.
    #[error("timed out after {ms} ms (a write may still be applied)")]
    Timeout { ms: u64 },
    /// The node is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
    /// A membership change the cluster refused.
    #[error("{message}")]
    InvalidMembership { message: String },
    /// A membership change named a node that is not in the cluster.
    #[error("node {id} is not in the cluster")]
    NodeNotFound { id: NodeId },
}

/// A cluster membership request, forwarded to the leader.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    AddNode { id: NodeId, address: String },
    RemoveNode { id: NodeId },
}

/// One node of the membership.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberNode {
    pub id: NodeId,
    pub address: String,
    pub voter: bool,
}

/// This node's view of the cluster.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterView {
    pub node_id: NodeId,
    pub state: String,
    pub leader_id: Option<NodeId>,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_log_index: u64,
    pub revision: Revision,
    pub nodes: Vec<MemberNode>,
}

/// Whether a forwarded operation may be delivered twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Idempotent (a read, a refresh): resend after any transport failure.
    Retryable,
    /// Not idempotent (a write): resend only when the first send certainly never arrived.
    AtMostOnce,
}

/// An error that can travel back from a forwarded operation.
pub trait Forwardable: From<ConsensusError> + DeserializeOwned {
    /// The target was not the leader and did nothing: safe to try the next leader.
    fn is_not_leader(&self) -> bool;
}

impl Forwardable for ConsensusError {
    fn is_not_leader(&self) -> bool {
        matches!(self, ConsensusError::NotLeader)
    }
}

/// Timing of consensus calls.
#[derive(Clone, Copy, Debug)]
pub struct ConsensusTimeouts {
    /// How long a call waits for a leader to be known before failing with `NoLeader`.
    pub leader_wait: Duration,
    /// The deadline of one proposal or read, forwarding included.
    pub request: Duration,
    /// The deadline of a learner's catch-up when a node is added.
    pub catch_up: Duration,
}

/// The Raft handle of the node, as the rest of leasecore sees it. Cheap to clone.
#[derive(Clone)]
pub struct Consensus {
    inner: Arc<Inner>,
}

struct Inner {
    id: NodeId,
    raft: Raft,
    peers: PeerClient,
    view: StateView,
    committed: Arc<AtomicU64>,
    timeouts: ConsensusTimeouts,
    /// Read rounds for local callers: confirm here if leader, else forward to the leader.
    reads: RoundBatcher<u64, ConsensusError>,
    /// Read rounds for forwarded callers: confirm here, never forward.
    leader_reads: RoundBatcher<u64, ConsensusError>,
    /// Proposals, in order: the log receives them in the order they were enqueued.
    proposals: mpsc::UnboundedSender<Proposal>,
}

/// A proposal waiting in the queue, with where its applied result goes.
type Proposal = (Command, oneshot::Sender<Result<Response, ConsensusError>>);

/// Where the leader is, as far as this node knows.
enum LeaderRef {
    Me,
    Other { id: NodeId, addr: String },
    Unknown,
}

fn leader_ref(raft: &Raft, me: NodeId) -> LeaderRef {
    let m = raft.metrics();
    let m = m.borrow();
    match m.current_leader {
        Some(id) if id == me && m.state == ServerState::Leader => LeaderRef::Me,
        Some(id) if id != me => match m.membership_config.membership().get_node(&id) {
            Some(node) => LeaderRef::Other {
                id,
                addr: node.addr.clone(),
            },
            None => LeaderRef::Unknown,
        },
        _ => LeaderRef::Unknown,
    }
}

/// Wait until the known leader differs from `stale` (or one appears), at most `wait`.
async fn wait_for_new_leader(raft: &Raft, stale: Option<NodeId>, wait: Duration) -> bool {
    let mut rx = raft.metrics();
    let changed = rx.wait_for(|m| {
        m.current_leader.is_some()
            && m.current_leader != stale
            && (m.current_leader != Some(m.id) || m.state == ServerState::Leader)
    });
    matches!(tokio::time::timeout(wait, changed).await, Ok(Ok(_)))
}

fn from_check_error(e: RaftError<NodeId, CheckIsLeaderError<NodeId, BasicNode>>) -> ConsensusError {
    match e {
        RaftError::APIError(CheckIsLeaderError::ForwardToLeader(_)) => ConsensusError::NotLeader,
        RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_)) => ConsensusError::NoQuorum,
        RaftError::Fatal(_) => ConsensusError::ShuttingDown,
    }
}

fn from_write_error(e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>) -> ConsensusError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => ConsensusError::NotLeader,
        RaftError::APIError(ClientWriteError::ChangeMembershipError(c)) => match c {
            ChangeMembershipError::LearnerNotFound(l) => {
                ConsensusError::NodeNotFound { id: l.node_id }
            }
            other => ConsensusError::InvalidMembership {
                message: other.to_string(),
            },
        },
        RaftError::Fatal(_) => ConsensusError::ShuttingDown,
    }
}

/// One leader-side read round: confirm leadership with a quorum, return the read index.
fn local_read_round(raft: Raft) -> RoundFuture<u64, ConsensusError> {
    Box::pin(async move {
        let (read_log_id, _applied) = raft.get_read_log_id().await.map_err(from_check_error)?;
        Ok(read_log_id.map(|l| l.index).unwrap_or(0))
    })
}

/// One read round from any node: local on the leader, forwarded from a follower.
fn any_read_round(
    raft: Raft,
    me: NodeId,
    peers: PeerClient,
    timeouts: ConsensusTimeouts,
) -> RoundFuture<u64, ConsensusError> {
    Box::pin(async move {
        let mut stale = None;
        loop {
            match leader_ref(&raft, me) {
                LeaderRef::Me => return local_read_round(raft.clone()).await,
                LeaderRef::Other { id, addr } => {
                    let answer: Result<Result<u64, ConsensusError>, _> = peers
                        .post_json(&addr, routes::READ_INDEX, &(), timeouts.request)
                        .await;
                    match answer {
                        Ok(Err(ConsensusError::NotLeader)) => stale = Some(id),
                        Ok(result) => return result,
                        // A read round changes nothing, so any failure can be retried.
                        Err(_) => stale = Some(id),
                    }
                }
                LeaderRef::Unknown => {}
            }
            if !wait_for_new_leader(&raft, stale, timeouts.leader_wait).await {
                return Err(ConsensusError::NoLeader);
            }
        }
    })
}

impl Consensus {
    /// Wrap a started Raft node. The returned [`ProposalQueue`] must be run (`node` spawns it).
    pub fn new(
        id: NodeId,
        raft: Raft,
        peers: PeerClient,
        view: StateView,
        committed: Arc<AtomicU64>,
        timeouts: ConsensusTimeouts,
    ) -> (Self, ProposalQueue) {
        let (proposals, queue) = mpsc::unbounded_channel();
        let reads = {
            let (raft, peers) = (raft.clone(), peers.clone());
            RoundBatcher::new(
                move || any_read_round(raft.clone(), id, peers.clone(), timeouts),
                ConsensusError::ShuttingDown,
            )
        };
        let leader_reads = {
            let raft = raft.clone();
            RoundBatcher::new(
                move || local_read_round(raft.clone()),
                ConsensusError::ShuttingDown,
            )
        };
        let consensus = Consensus {
            inner: Arc::new(Inner {
                id,
                raft: raft.clone(),
                peers,
                view,
                committed,
                timeouts,
                reads,
                leader_reads,
                proposals,
            }),
        };
        (consensus, ProposalQueue { raft, queue })
    }

    /// Enqueue a proposal, synchronously: proposals enqueued one after another (by any caller)
    /// reach the log in that order. Resolves with the applied result. Only meaningful on the
    /// leader: elsewhere it fails with `NotLeader`.
    pub fn submit(
        &self,
        cmd: Command,
    ) -> impl Future<Output = Result<Response, ConsensusError>> + Send + 'static {
        let (tx, rx) = oneshot::channel();
        let sent = self.inner.proposals.send((cmd, tx)).is_ok();
        let t = self.inner.timeouts.request;
        async move {
            if !sent {
                return Err(ConsensusError::ShuttingDown);
            }
            match tokio::time::timeout(t, rx).await {
                Ok(Ok(result)) => result,
                Ok(Err(_)) => Err(ConsensusError::ShuttingDown),
                Err(_) => Err(ConsensusError::Timeout {
                    ms: t.as_millis() as u64,
                }),
            }
        }
    }

    /// Confirm with a quorum that this node is still the leader, in a round that starts after
    /// this call (shared with concurrent callers).
    pub async fn confirm_leadership(&self) -> Result<(), ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        self.inner.leader_reads.confirm().await.map(|_| ())
    }

    /// The term this node leads in, if it is the leader.
    pub fn leader_term(&self) -> Option<u64> {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        (m.state == ServerState::Leader && m.current_leader == Some(self.inner.id))
            .then_some(m.current_term)
    }

    /// The openraft handle (for the peer endpoints and the node's start-up and shutdown).
    pub fn raft(&self) -> &Raft {
        &self.inner.raft
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.inner.id
    }

    /// The applied state.
    pub fn view(&self) -> &StateView {
        &self.inner.view
    }

    /// Whether this node is the leader right now.
    pub fn is_leader(&self) -> bool {
        matches!(leader_ref(&self.inner.raft, self.inner.id), LeaderRef::Me)
    }

    /// Form the initial cluster from `voters` if this node has never been initialized.
    pub async fn initialize(&self, voters: BTreeMap<NodeId, String>) -> Result<(), ConsensusError> {
        let nodes: BTreeMap<NodeId, BasicNode> = voters
            .into_iter()
            .map(|(id, addr)| (id, BasicNode::new(addr)))
            .collect();
        match self.inner.raft.initialize(nodes).await {
            Ok(()) => Ok(()),
            // Already initialized (a restart, or a peer got there first): nothing to do.
            Err(RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
            Err(RaftError::APIError(InitializeError::NotInMembers(e))) => {
                Err(ConsensusError::InvalidMembership {
                    message: e.to_string(),
                })
            }
            Err(RaftError::Fatal(_)) => Err(ConsensusError::ShuttingDown),
        }
    }

    /// Propose a command from any node and return its applied response.
    pub async fn propose(&self, cmd: Command) -> Result<Response, ConsensusError> {
        let t = self.inner.timeouts.request;
        match tokio::time::timeout(t, self.propose_anywhere(cmd)).await {
            Ok(result) => result,
            Err(_) => Err(ConsensusError::Timeout {
                ms: t.as_millis() as u64,
            }),
        }
    }

    async fn propose_anywhere(&self, cmd: Command) -> Result<Response, ConsensusError> {
        // The common case moves the command straight into the log, without a copy.
        if matches!(leader_ref(&self.inner.raft, self.inner.id), LeaderRef::Me) {
            return self.propose_here(cmd).await.map_err(no_leader_for_clients);
        }
        self.on_leader(routes::PROPOSE, &cmd, Delivery::AtMostOnce, || {
            self.propose_here(cmd.clone())
        })
        .await
    }

    /// Run an operation on the leader: `here` if this node leads, otherwise forwarded to the
    /// leader's peer route `path` with `req`. While no leader is known, waits up to
    /// `leader_wait` for one. An operation that is not idempotent is never sent twice when its
    /// first delivery is uncertain (see the module docs).
    pub async fn on_leader<Req, T, E, F, Fut>(
        &self,
        path: &str,
        req: &Req,
        delivery: Delivery,
        here: F,
    ) -> Result<T, E>
    where
        Req: Serialize + ?Sized,
        T: DeserializeOwned,
        E: Forwardable,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let inner = &self.inner;
        let mut stale = None;
        // Adding a node waits for the learner to catch up; everything else is quick.
        let timeout = if path == routes::ADMIN {
            inner.timeouts.catch_up + inner.timeouts.request
        } else {
            inner.timeouts.request
        };
        loop {
            match leader_ref(&inner.raft, inner.id) {
                LeaderRef::Me => {
                    return here().await.map_err(|e| {
                        if e.is_not_leader() {
                            E::from(ConsensusError::NoLeader)
                        } else {
                            e
                        }
                    });
                }
                LeaderRef::Other { id, addr } => {
                    let answer: Result<Result<T, E>, _> =
                        inner.peers.post_json(&addr, path, req, timeout).await;
                    match answer {
                        // The leader refused before doing anything: try the next leader.
                        Ok(Err(e)) if e.is_not_leader() => stale = Some(id),
                        Ok(result) => return result,
                        Err(e) if e.not_delivered() || delivery == Delivery::Retryable => {
                            stale = Some(id)
                        }
                        Err(e) => {
                            return Err(E::from(ConsensusError::OutcomeUnknown {
                                detail: e.to_string(),
                            }));
                        }
                    }
                }
                LeaderRef::Unknown => {}
            }
            if !wait_for_new_leader(&inner.raft, stale, inner.timeouts.leader_wait).await {
                return Err(E::from(ConsensusError::NoLeader));
            }
        }
    }

    /// Propose on this node only (the target of forwarded proposals): `NotLeader` if it is not
    /// the leader, so that a forwarded request is never forwarded again.
    pub async fn propose_here(&self, cmd: Command) -> Result<Response, ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        self.submit(cmd).await
    }

    /// Make the next local read linearizable: confirm leadership with a quorum (shared with
    /// concurrent callers) and wait until this node has applied up to the read index.
    pub async fn read_barrier(&self) -> Result<(), ConsensusError> {
        let t = self.inner.timeouts.request;
        let index = match tokio::time::timeout(t, self.inner.reads.confirm()).await {
            Ok(result) => result.map_err(no_leader_for_clients)?,
            Err(_) => {
                return Err(ConsensusError::Timeout {
                    ms: t.as_millis() as u64,
                });
            }
        };
        if self.inner.view.wait_applied(index, t).await {
            Ok(())
        } else {
            Err(ConsensusError::Timeout {
                ms: t.as_millis() as u64,
            })
        }
    }

    /// The read index, confirmed by this node as leader (the target of forwarded read rounds).
    pub async fn read_index_here(&self) -> Result<u64, ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        self.inner.leader_reads.confirm().await
    }

    /// Apply a membership request from any node (forwarded to the leader).
    pub async fn admin(&self, req: AdminRequest) -> Result<(), ConsensusError> {
        self.on_leader(routes::ADMIN, &req, Delivery::AtMostOnce, || {
            self.admin_here(req.clone())
        })
        .await
    }

    /// Apply a membership request on this node as leader.
    pub async fn admin_here(&self, req: AdminRequest) -> Result<(), ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        let raft = &self.inner.raft;
        let membership = raft.metrics().borrow().membership_config.clone();
        let membership = membership.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        match req {
            AdminRequest::AddNode { id, address } => {
                if let Some(existing) = membership.get_node(&id) {
                    if existing.addr != address {
                        return Err(ConsensusError::InvalidMembership {
                            message: format!(
                                "node {id} is already in the cluster at {}; remove it first",
                                existing.addr
                            ),
                        });
                    }
                    if voters.contains(&id) {
                        return Ok(());
                    }
                }
                // Learner first: it catches up (by snapshot if the log was purged) without
                // counting toward any quorum, then it is promoted.
                let catch_up = raft.add_learner(id, BasicNode::new(address), true);
                match tokio::time::timeout(self.inner.timeouts.catch_up, catch_up).await {
                    Ok(r) => r.map_err(from_write_error)?,
                    Err(_) => {
                        return Err(ConsensusError::Timeout {
                            ms: self.inner.timeouts.catch_up.as_millis() as u64,
                        });
                    }
                };
                let ids = BTreeSet::from([id]);
                raft.change_membership(ChangeMembers::AddVoterIds(ids), false)
                    .await
                    .map_err(from_write_error)?;
                Ok(())
            }
            AdminRequest::RemoveNode { id } => {
                if membership.get_node(&id).is_none() {
                    return Err(ConsensusError::NodeNotFound { id });
                }
                let ids = BTreeSet::from([id]);
                let change = if voters.contains(&id) {
                    if voters.len() == 1 {
                        return Err(ConsensusError::InvalidMembership {
                            message: format!("node {id} is the last voter; it cannot be removed"),
                        });
                    }
                    ChangeMembers::RemoveVoters(ids)
                } else {
                    ChangeMembers::RemoveNodes(ids)
                };
                let t = self.inner.timeouts.request;
                match tokio::time::timeout(t, raft.change_membership(change, false)).await {
                    Ok(r) => r.map(|_| ()).map_err(from_write_error),
                    Err(_) => Err(ConsensusError::Timeout {
                        ms: t.as_millis() as u64,
                    }),
                }
            }
        }
    }

    /// This node's view of the cluster once it satisfies `settled` (a change committed on the
    /// leader reaches a forwarding node a moment later), or as it is after the request timeout.
    pub async fn view_once(&self, settled: impl Fn(&ClusterView) -> bool) -> ClusterView {
        let mut changes = self.inner.raft.metrics();
        let settle = async {
            loop {
                if settled(&self.cluster_view()) || changes.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(self.inner.timeouts.request, settle).await;
        self.cluster_view()
    }

    /// This node's view of the cluster.
    pub fn cluster_view(&self) -> ClusterView {
        let m = self.inner.raft.metrics().borrow().clone();
        let applied = self.inner.view.applied();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let nodes = membership
            .nodes()
            .map(|(id, node)| MemberNode {
                id: *id,
                address: node.addr.clone(),
                voter: voters.contains(id),
            })
            .collect();
        let state = match m.state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        };
        ClusterView {
            node_id: self.inner.id,
            state: state.to_string(),
            leader_id: m.current_leader,
            term: m.current_term,
            commit_index: self
                .inner
                .committed
                .load(Ordering::Relaxed)
                .max(applied.log_index),
            applied_index: applied.log_index,
            last_log_index: m.last_log_index.unwrap_or(0),
            revision: applied.revision,
            nodes,
        }
    }
}

/// Batches in flight at once: while they commit, new proposals gather into the next batch.
const BATCHES_IN_FLIGHT: usize = 4;
/// The most commands, and the most bytes (estimated), in one batch.
const MAX_BATCH_COMMANDS: usize = 1024;
const MAX_BATCH_BYTES: usize = 1 << 20;

/// Feeds proposals into openraft in order, many per log entry (group commit).
///
/// openraft 0.9 appends and flushes each submitted entry on its own before taking the next,
/// so one entry per command costs one fsync per command. This queue instead lets proposals
/// that arrive while up to [`BATCHES_IN_FLIGHT`] batches are committing gather into one
/// `Command::Batch`: one entry, one fsync, applied as consecutive commands. Order is kept:
/// batches are formed and submitted in arrival order.
pub struct ProposalQueue {
    raft: Raft,
    queue: mpsc::UnboundedReceiver<Proposal>,
}

impl ProposalQueue {
    /// Run until cancelled.
    pub async fn run(mut self, cancel: tokio_util::sync::CancellationToken) {
        let in_flight = Arc::new(tokio::sync::Semaphore::new(BATCHES_IN_FLIGHT));
        loop {
            let permit = tokio::select! {
                _ = cancel.cancelled() => return,
                p = in_flight.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
            };
            let first = tokio::select! {
                _ = cancel.cancelled() => return,
                next = self.queue.recv() => match next {
                    Some(p) => p,
                    None => return,
                },
            };
            let mut bytes = first.0.approx_bytes();
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH_COMMANDS && bytes < MAX_BATCH_BYTES {
                match self.queue.try_recv() {
                    Ok(p) => {
                        bytes += p.0.approx_bytes();
                        batch.push(p);
                    }
                    Err(_) => break,
                }
            }
            let (commands, replies): (Vec<Command>, Vec<_>) = batch.into_iter().unzip();
            let single = commands.len() == 1;
            let cmd = match single {
                true => commands.into_iter().next().expect("one command"),
                false => Command::Batch { commands },
            };
            match self.raft.client_write_ff(cmd).await {
                Ok(applied) => {
                    tokio::spawn(async move {
                        let result = match applied.await {
                            Ok(Ok(written)) => Ok(written.data),
                            Ok(Err(e)) => Err(from_write_error(RaftError::APIError(e))),
                            // The core stopped (a shutdown) with the entry handed over: it may
                            // be in the log and replicated, and a later leader may commit it.
                            // `shutting_down` would promise nothing was done (clients resend).
                            Err(_) => Err(ConsensusError::OutcomeUnknown {
                                detail: "the node stopped with the write in flight".into(),
                            }),
                        };
                        distribute(result, single, replies);
                        drop(permit);
                    });
                }
                Err(_) => distribute(Err(ConsensusError::ShuttingDown), single, replies),
            }
        }
    }
}

/// Hand each proposer its own response.
fn distribute(
    result: Result<Response, ConsensusError>,
    single: bool,
    replies: Vec<oneshot::Sender<Result<Response, ConsensusError>>>,
) {
    match result {
        Ok(Response::Batch { responses }) if !single => {
            for (reply, r) in replies.into_iter().zip(responses) {
                let _ = reply.send(Ok(r));
            }
        }
        Ok(r) => {
            if let Some(reply) = replies.into_iter().next() {
                let _ = reply.send(Ok(r));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

/// Clients are told "no leader" where peers are told "not leader": both mean retry.
fn no_leader_for_clients(e: ConsensusError) -> ConsensusError {
    match e {
        ConsensusError::NotLeader => ConsensusError::NoLeader,
        other => other,
    }
}

impl ElectionPort for Consensus {
    fn leader_known(&self) -> bool {
        self.inner.raft.metrics().borrow().current_leader.is_some()
    }

    fn is_voter(&self) -> bool {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        m.membership_config
            .membership()
            .voter_ids()
            .any(|id| id == self.inner.id)
    }

    fn elect(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let _ = self.inner.raft.trigger().elect().await;
        })
    }
}
