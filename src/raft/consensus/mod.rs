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
//!   A node becomes a voter only after it answered and caught up (`domain::health::
//!   learner_caught_up`), within a bounded wait; otherwise it stays a learner and the answer
//!   says so ([`AdminOutcome::Learner`]). One change at a time: a change refused because
//!   another has not committed yet is [`ConsensusError::ChangeInProgress`] (retry).
//! - health: [`Consensus::health`] and [`Consensus::cluster_view`] snapshot what the node knows
//!   (openraft's metrics, peer contacts, applied and committed indexes) for the pure rules of
//!   `domain::health`; [`Consensus::step_down`] is the leader's way out when those rules say it
//!   lost its quorum (see its docs for how, in openraft 0.9).
//!
//! # Layout
//! This file holds the handle, its errors, proposals and reads; `membership` the membership
//! changes, `status` health and the cluster view (and the watchdogs' ports), `queue` the
//! proposal queue's group commit.
//!
//! # Invariants
//! - A forwarded request whose delivery is uncertain is never retried: the caller gets
//!   [`ConsensusError::OutcomeUnknown`]. Only a request that certainly did not reach the leader
//!   (the connection was refused) is sent again, after the node learns of a new leader.
//! - No lock is held across an await; all shared state is openraft's own (metrics) or atomics.
//! - An error that says "nothing was done" (`NotLeader`, `NoLeader`, `NoQuorum`) is only ever
//!   returned before the first step of an operation was taken. Once a step may have taken effect
//!   (a learner was added, a joint configuration proposed), losing leadership is
//!   [`ConsensusError::OutcomeUnknown`].
//! - A leader that lost its quorum (`domain::health::leader_lost_quorum`) accepts no new
//!   proposal: it answers [`ConsensusError::NoQuorum`] at once instead of queueing it.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use openraft::error::{
    ChangeMembershipError, CheckIsLeaderError, ClientWriteError, InitializeError, RaftError,
};
use openraft::raft::VoteRequest;
use openraft::{BasicNode, ChangeMembers, LogId, ServerState, Vote};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};

use super::network::{PeerClient, PeerError, routes};
use super::state_machine::StateView;
use super::{NodeId, Raft};
use crate::domain::command::{Command, Response};
use crate::domain::health::{self, NodeHealth};
use crate::domain::resources::Quota;
use crate::runtime::batch::{RoundBatcher, RoundFuture};
use crate::runtime::election::ElectionPort;

mod forward;
mod membership;
mod queue;
mod status;
mod transfer;

pub use forward::MAX_FORWARD_COMMANDS;
pub use queue::ProposalQueue;
pub use transfer::{MAX_HOLD, TransferAnswer, TransferRequest};

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
    /// No leader is known, and this node has heard from too few voters lately for any
    /// election to succeed: nothing was done; it may succeed once enough voters are back.
    #[error(
        "no leader, and the cluster has lost its quorum: this node has heard from {heard} of \
         {voters} voters within an election timeout and a leader needs {needed}; writes and \
         linearizable reads wait until enough voters are back"
    )]
    QuorumLost {
        heard: usize,
        voters: usize,
        needed: usize,
    },
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
    /// Another membership change has not committed yet: one change at a time. Retry later.
    #[error("{message}")]
    ChangeInProgress { message: String },
    /// The leader holds its storage quota: writes are refused (nothing was proposed) until
    /// deletes bring it back under (reads, deletes and revokes still work).
    #[error(
        "the storage quota is exhausted ({used_bytes} of {quota_bytes} bytes): delete keys or revoke leases to write again"
    )]
    QuotaExceeded { used_bytes: u64, quota_bytes: u64 },
    /// The leader does not serve this request (it runs an older build): nothing was done.
    /// Produced on the forwarding node only, which then falls back to a request the leader
    /// knows (`forward`).
    #[error("the leader does not serve this request (an older build): {detail}")]
    Unsupported { detail: String },
    /// A leadership transfer named a node that is not a voter: nothing was done.
    #[error("node {id} cannot take over leadership: it is not a voter of the cluster")]
    BadTransferee { id: NodeId },
    /// Another leadership transfer is under way: nothing was done; retry once it has ended.
    #[error("a leadership transfer is already under way; retry when it has ended")]
    TransferInProgress,
    /// The transferee did not take over in time (no data changed; the old leader, or another
    /// node, leads).
    #[error("the leadership transfer did not complete: {detail}")]
    TransferFailed { detail: String },
}

/// What the storage quota counts (the log's bytes; the state's come from the view), and the
/// quota.
#[derive(Clone, Debug, Default)]
pub struct StorageUse {
    pub log_bytes: Arc<AtomicU64>,
    pub quota: Quota,
    /// The node's data directory, whose size `/metrics` reports (none in tests without one).
    pub data_dir: Option<std::path::PathBuf>,
}

/// How a membership request ended (when it did not fail).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum AdminOutcome {
    /// The change is in effect (the node is a voter, or is gone).
    Done,
    /// The node was added but stays a learner: it did not answer or catch up in time. It can
    /// be removed, or added again to resume waiting.
    Learner { message: String },
    /// The node was added as a learner, then removed (by another call) while it caught up.
    Removed { message: String },
}

/// A cluster membership request, forwarded to the leader.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    AddNode { id: NodeId, address: String },
    RemoveNode { id: NodeId },
}

pub use leasecore_client::api::{ClusterView, MemberNode, MemberStatus};

/// Reads this node's lease clock, if it tracks leases as leader.
pub type LeaseStamper = Arc<dyn Fn() -> Option<u64> + Send + Sync>;

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
    /// The longest election timeout: a leader that heard from no quorum for longer has lost it,
    /// and a follower that heard nothing from its leader for longer is not ready.
    pub election_timeout: Duration,
}

/// The most entries a learner may lag behind the leader's log and still be promoted.
const PROMOTE_MAX_LAG: u64 = 64;

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
    /// Set when this node stepped down for lack of a quorum, cleared once it knows a leader
    /// again: meanwhile there is no point waiting for a leader, the answer is `NoQuorum` now.
    cut_off: Arc<AtomicBool>,
    /// Read rounds for local callers: confirm here if leader, else forward to the leader.
    reads: RoundBatcher<u64, ConsensusError>,
    /// Read rounds for forwarded callers: confirm here, never forward.
    leader_reads: RoundBatcher<u64, ConsensusError>,
    /// Proposals, in order: the log receives them in the order they were enqueued.
    proposals: mpsc::UnboundedSender<Proposal>,
    /// Reads the leader's lease clock for registrations (set once by the lease service).
    lease_stamper: std::sync::OnceLock<LeaseStamper>,
    /// The term the lease service tracks leases in (0: none), set once by the lease service:
    /// a leader proposes a registration only once it tracks, so that the registration carries
    /// its lease clock stamp.
    lease_tracking: std::sync::OnceLock<watch::Receiver<u64>>,
    storage: StorageUse,
    /// Proposals this node forwards to the leader, batched (started on the first).
    forwards: std::sync::OnceLock<mpsc::Sender<Proposal>>,
    /// Closed while this leader hands its leadership over (`transfer`).
    intake: transfer::Intake,
    /// Elections this node holds for a leadership transfer (`transfer`).
    holds: transfer::Holds,
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
            ChangeMembershipError::InProgress(p) => ConsensusError::ChangeInProgress {
                message: format!(
                    "another membership change has not committed yet ({p}); one change at a \
                     time: retry when it has (if it never does, a voter it needs is down: start \
                     that node again)"
                ),
            },
            other => ConsensusError::InvalidMembership {
                message: other.to_string(),
            },
        },
        RaftError::Fatal(_) => ConsensusError::ShuttingDown,
    }
}

/// One leader-side read round: confirm leadership with a quorum, return the read index.
/// During a leadership transfer the round waits for its end and says `NotLeader` (a
/// confirmation would refresh the lease the transfer waits out).
fn local_read_round(
    raft: Raft,
    mut leaving: watch::Receiver<bool>,
) -> RoundFuture<u64, ConsensusError> {
    Box::pin(async move {
        if *leaving.borrow() {
            transfer::until_settled(&mut leaving).await;
            return Err(ConsensusError::NotLeader);
        }
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
    cut_off: Arc<AtomicBool>,
    leaving: watch::Receiver<bool>,
) -> RoundFuture<u64, ConsensusError> {
    Box::pin(async move {
        let mut stale = None;
        // A leader that handed its leadership over: the round goes to the next one.
        let mut after_transfer = false;
        loop {
            match leader_ref(&raft, me) {
                LeaderRef::Me => match local_read_round(raft.clone(), leaving.clone()).await {
                    Err(ConsensusError::NotLeader) if !after_transfer => {
                        after_transfer = true;
                        if !matches!(leader_ref(&raft, me), LeaderRef::Me) {
                            stale = Some(me);
                        } else {
                            continue;
                        }
                    }
                    result => return result,
                },
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
                LeaderRef::Unknown if cut_off.load(Ordering::Relaxed) => {
                    return Err(cut_off_error(&raft, me, &peers, timeouts.election_timeout));
                }
                LeaderRef::Unknown => {}
            }
            if !wait_for_new_leader(&raft, stale, timeouts.leader_wait).await {
                return Err(leaderless(&raft, me, &peers, timeouts.election_timeout));
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
        storage: StorageUse,
    ) -> (Self, ProposalQueue) {
        let (proposals, queue) = mpsc::unbounded_channel();
        let cut_off = Arc::new(AtomicBool::new(false));
        let intake = transfer::Intake::default();
        let reads = {
            let (raft, peers, cut_off) = (raft.clone(), peers.clone(), cut_off.clone());
            let leaving = intake.subscribe();
            RoundBatcher::new(
                move || {
                    any_read_round(
                        raft.clone(),
                        id,
                        peers.clone(),
                        timeouts,
                        cut_off.clone(),
                        leaving.clone(),
                    )
                },
                ConsensusError::ShuttingDown,
            )
        };
        let leader_reads = {
            let raft = raft.clone();
            let leaving = intake.subscribe();
            RoundBatcher::new(
                move || local_read_round(raft.clone(), leaving.clone()),
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
                cut_off,
                reads,
                leader_reads,
                proposals,
                lease_stamper: std::sync::OnceLock::new(),
                lease_tracking: std::sync::OnceLock::new(),
                storage,
                forwards: std::sync::OnceLock::new(),
                intake,
                holds: transfer::Holds::default(),
            }),
        };
        (consensus, ProposalQueue { raft, queue })
    }

    /// Install the lease clock reader that stamps registrations on this node as leader (see
    /// [`crate::domain::lease`]: a stamped registration is a checkpoint). Set once.
    pub fn set_lease_stamper(&self, stamper: LeaseStamper) {
        let _ = self.inner.lease_stamper.set(stamper);
    }

    /// Install the lease service's view of the term it tracks leases in.
    pub fn set_lease_tracking(&self, tracking: watch::Receiver<u64>) {
        let _ = self.inner.lease_tracking.set(tracking);
    }

    /// Wait (bounded by two election timeouts: a new leader tracks once it applied an entry of
    /// its term, usually within a heartbeat) until the lease service tracks leases in this
    /// leader's term. The one wait of everything that needs the leader's lease tracker: a
    /// refresh, and a registration, which proposed before that would carry no lease clock
    /// stamp, so that the next leader would grant it its whole TTL again from its own promote
    /// (an abandoned lease registered just after a failover outlived its TTL by a failover more).
    pub async fn until_lease_tracking(&self) -> Result<(), ConsensusError> {
        let Some(rx) = self.inner.lease_tracking.get() else {
            return Ok(());
        };
        let term = self.leader_term().ok_or(ConsensusError::NotLeader)?;
        let mut rx = rx.clone();
        match tokio::time::timeout(
            self.inner.timeouts.election_timeout * 2,
            rx.wait_for(|t| *t == term),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            // Nothing was proposed: the caller may retry (a new leader, or this one once it
            // has caught up).
            _ => Err(ConsensusError::NoLeader),
        }
    }

    /// A registration leaves the leader stamped with its lease clock, when it has one. Only
    /// registrations call the stamper, so callers that submit other commands while holding the
    /// lease tracker's lock (expiries, checkpoints, clears) never re-enter it.
    fn stamp(&self, mut cmd: Command) -> Command {
        if let Command::RegisterLease { clock_ms, .. } | Command::RegisterMember { clock_ms, .. } =
            cmd.inner_mut()
            && clock_ms.is_none()
            && let Some(stamper) = self.inner.lease_stamper.get()
        {
            *clock_ms = stamper();
        }
        cmd
    }

    /// Enqueue a proposal, synchronously: proposals enqueued one after another (by any caller)
    /// reach the log in that order. Resolves with the applied result. Only meaningful on the
    /// leader: elsewhere it fails with `NotLeader`.
    pub fn submit(
        &self,
        cmd: Command,
    ) -> impl Future<Output = Result<Response, ConsensusError>> + Send + 'static {
        // A leader handing its leadership over takes nothing new: the proposal waits for the
        // transfer's end and is then refused, never proposed (its caller goes to the next
        // leader).
        let transferring = self.inner.intake.is_leaving();
        let mut leaving = transferring.then(|| self.inner.intake.subscribe());
        let cmd = self.stamp(cmd);
        // A leader cut off from its quorum could never commit it: say so now, having done
        // nothing, rather than time out with the outcome in doubt.
        let gated = !transferring && self.quorum_lost();
        // The term this node leads in now: a proposal outlives it only as `outcome_unknown`.
        // (Server metrics change with the role and vote only, not with every applied entry.)
        let mut role = self.inner.raft.server_metrics();
        let led_term = {
            let m = role.borrow();
            (m.state == ServerState::Leader).then_some(m.vote.leader_id().term)
        };
        let (tx, rx) = oneshot::channel();
        let sent = !gated && !transferring && self.inner.proposals.send((cmd, tx)).is_ok();
        let t = self.inner.timeouts.request;
        async move {
            if let Some(leaving) = leaving.as_mut() {
                let _ = tokio::time::timeout(t, transfer::until_settled(leaving)).await;
                return Err(ConsensusError::NotLeader);
            }
            if gated {
                return Err(ConsensusError::NoQuorum);
            }
            if !sent {
                return Err(ConsensusError::ShuttingDown);
            }
            // openraft keeps the proposal of a leader that stepped down (for lost quorum, or a
            // higher term) waiting: a later leader may commit the entry, or truncate it, or
            // nothing may happen for a long while. Waiting out the request timeout would tell
            // the client the same thing, later.
            let deposed = async move {
                match led_term {
                    Some(term) => {
                        let stopped = role
                            .wait_for(|m| {
                                m.state != ServerState::Leader || m.vote.leader_id().term != term
                            })
                            .await
                            .is_err();
                        if stopped {
                            // The core stopped: the reply channel says so.
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                reply = rx => match reply {
                    Ok(result) => result,
                    Err(_) => Err(ConsensusError::ShuttingDown),
                },
                _ = deposed => Err(ConsensusError::OutcomeUnknown {
                    detail: "this node stopped leading with the write in flight: a new leader \
                             may still apply it"
                        .into(),
                }),
                _ = tokio::time::sleep(t) => Err(ConsensusError::Timeout {
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

    /// The bytes this node holds, as the storage quota counts them: live keys and values plus
    /// the stored Raft log.
    pub fn storage_used(&self) -> u64 {
        self.inner.view.data_bytes() + self.inner.storage.log_bytes.load(Ordering::Relaxed)
    }

    /// The stored Raft log's bytes.
    pub fn log_bytes(&self) -> u64 {
        self.inner.storage.log_bytes.load(Ordering::Relaxed)
    }

    /// The disk space the data directory takes (allocated blocks, as `du` counts them): sled's
    /// files, the snapshot and the identity file. A walk of a few files, for `/metrics`.
    pub fn data_dir_bytes(&self) -> u64 {
        fn walk(dir: &std::path::Path, depth: usize) -> u64 {
            use std::os::unix::fs::MetadataExt;
            let Ok(entries) = std::fs::read_dir(dir) else {
                return 0;
            };
            entries
                .flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() && depth < 4 => walk(&e.path(), depth + 1),
                    Ok(m) => m.blocks() * 512,
                    Err(_) => 0,
                })
                .sum()
        }
        self.inner
            .storage
            .data_dir
            .as_deref()
            .map_or(0, |d| walk(d, 0))
    }

    /// The storage quota in force.
    pub fn quota(&self) -> Quota {
        self.inner.storage.quota
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
        if self.transferring() {
            // This leader hands over: propose to whichever node leads once it has.
            transfer::until_settled(&mut self.inner.intake.subscribe()).await;
        }
        // The common case moves the command straight into the log, without a copy.
        if matches!(leader_ref(&self.inner.raft, self.inner.id), LeaderRef::Me) {
            return self.propose_here(cmd).await.map_err(no_leader_for_clients);
        }
        self.forward(cmd).await
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
                        Err(e @ PeerError::NoRoute { .. }) => {
                            return Err(E::from(ConsensusError::Unsupported {
                                detail: e.to_string(),
                            }));
                        }
                        Err(e) => {
                            return Err(E::from(ConsensusError::OutcomeUnknown {
                                detail: e.to_string(),
                            }));
                        }
                    }
                }
                LeaderRef::Unknown if inner.cut_off.load(Ordering::Relaxed) => {
                    return Err(E::from(cut_off_error(
                        &inner.raft,
                        inner.id,
                        &inner.peers,
                        inner.timeouts.election_timeout,
                    )));
                }
                LeaderRef::Unknown => {}
            }
            if !wait_for_new_leader(&inner.raft, stale, inner.timeouts.leader_wait).await {
                return Err(E::from(leaderless(
                    &inner.raft,
                    inner.id,
                    &inner.peers,
                    inner.timeouts.election_timeout,
                )));
            }
        }
    }

    /// Propose on this node only (the target of forwarded proposals): `NotLeader` if it is not
    /// the leader, so that a forwarded request is never forwarded again.
    pub async fn propose_here(&self, mut cmd: Command) -> Result<Response, ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        if matches!(
            cmd.inner_mut(),
            Command::RegisterLease { .. } | Command::RegisterMember { .. }
        ) {
            self.until_lease_tracking().await?;
        }
        // The leader's own use decides for the cluster: every write goes through here.
        let storage = &self.inner.storage;
        storage
            .quota
            .admit(&cmd, self.storage_used())
            .map_err(|e| ConsensusError::QuotaExceeded {
                used_bytes: e.used_bytes,
                quota_bytes: e.quota_bytes,
            })?;
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
}

/// The last log index the leader knows `id` acknowledged (leader's metrics only).
fn replicated_index(m: &openraft::RaftMetrics<NodeId, BasicNode>, id: NodeId) -> Option<u64> {
    m.replication
        .as_ref()
        .and_then(|r| r.get(&id))
        .and_then(|l| l.as_ref())
        .map(|l| l.index)
}

/// Why no leader could be found: the quorum is lost when too few voters were heard from
/// lately (`domain::health::voter_contact` decides), else an election is (probably) under way.
fn leaderless(
    raft: &Raft,
    me: NodeId,
    peers: &PeerClient,
    election_timeout: Duration,
) -> ConsensusError {
    let voters: Vec<NodeId> = raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .voter_ids()
        .collect();
    let contact = crate::domain::health::voter_contact(
        &voters,
        me,
        &peers.contacts().ages(),
        election_timeout.as_millis() as u64,
    );
    if contact.quorum_lost() {
        ConsensusError::QuorumLost {
            heard: contact.heard,
            voters: contact.voters,
            needed: contact.needed,
        }
    } else {
        ConsensusError::NoLeader
    }
}

/// Why a node that stepped down for lack of a quorum cannot serve: the quorum is lost (with
/// how many voters it hears, when it still hears too few), or at least no quorum answered it.
fn cut_off_error(
    raft: &Raft,
    me: NodeId,
    peers: &PeerClient,
    election_timeout: Duration,
) -> ConsensusError {
    match leaderless(raft, me, peers, election_timeout) {
        ConsensusError::NoLeader => ConsensusError::NoQuorum,
        lost => lost,
    }
}

/// Clients are told "no leader" where peers are told "not leader": both mean retry.
fn no_leader_for_clients(e: ConsensusError) -> ConsensusError {
    match e {
        ConsensusError::NotLeader => ConsensusError::NoLeader,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::error::InProgress;

    #[test]
    fn a_change_refused_because_another_is_in_flight_is_change_in_progress_not_invalid() {
        let refused = RaftError::APIError(ClientWriteError::ChangeMembershipError(
            ChangeMembershipError::InProgress(InProgress {
                committed: None,
                membership_log_id: None,
            }),
        ));
        assert!(matches!(
            from_write_error(refused),
            ConsensusError::ChangeInProgress { .. }
        ));
    }

    #[test]
    fn admin_outcomes_and_the_new_error_travel_between_peers() {
        let learner = AdminOutcome::Learner {
            message: "m".into(),
        };
        let text = serde_json::to_string(&learner).unwrap();
        assert_eq!(
            serde_json::from_str::<AdminOutcome>(&text).unwrap(),
            learner
        );
        let err = ConsensusError::ChangeInProgress {
            message: "m".into(),
        };
        let text = serde_json::to_string(&err).unwrap();
        assert_eq!(serde_json::from_str::<ConsensusError>(&text).unwrap(), err);
    }
}
