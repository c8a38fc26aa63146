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
//! This file holds the handle, its construction, its accessors and the types callers name;
//! `error` [`ConsensusError`] and the mapping of openraft's errors, `leader` where the leader
//! is and running an operation on it ([`Consensus::on_leader`]), `propose` proposals,
//! `read` the read barrier and its rounds, `forward` forwarded proposals (batched), `queue`
//! the proposal queue's group commit, `membership` the membership changes, `transfer`
//! leadership transfer, `status` health and the cluster view (and the watchdogs' ports).
//!
//! # Invariants
//! - A forwarded request whose delivery is uncertain is never retried: the caller gets
//!   [`ConsensusError::OutcomeUnknown`]. Only a request that certainly did not reach the leader
//!   (the connection was refused) is sent again, after the node learns of a new leader.
//! - No lock is held across an await; all shared state is openraft's own (metrics) or atomics.
//! - A borrow of openraft's metrics (`raft.metrics().borrow()`, anywhere in leasecore) lives
//!   for a few field reads and nothing else: the Raft core publishes its metrics behind a
//!   synchronous lock on its own task, so a borrow held across anything that can wait (the
//!   state's lock during a long apply, once) stops the Raft core, and with it the heartbeats.
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

mod error;
mod forward;
mod leader;
mod membership;
mod propose;
mod queue;
mod read;
mod status;
mod transfer;

pub use error::ConsensusError;
pub use forward::{APPLY_WAIT, ForwardedAnswers, MAX_FORWARD_COMMANDS};
pub use leader::{Delivery, Forwardable};
pub use queue::ProposalQueue;
pub use transfer::{MAX_HOLD, TransferAnswer, TransferRequest};

use error::{from_check_error, from_write_error, no_leader_for_clients};
use leader::{LeaderRef, cut_off_error, leader_ref, leaderless, wait_for_new_leader};
use read::{any_read_round, local_read_round};

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
    AddNode {
        id: NodeId,
        address: String,
    },
    RemoveNode {
        id: NodeId,
    },
    /// Sent by node `id` itself, starting with an empty data dir while the cluster still lists
    /// it (`domain::bootstrap::Start::Replace`), before it answers anything: remove it, and
    /// add it back at `address` as a learner (a new member, with replication progress started
    /// afresh); once it serves it asks to be promoted (`AddNode`). Refused while the leader
    /// still hears from a node `id` (another process with that id, or a restart faster than
    /// an election timeout: retry), and when the removal could not commit without it. Older
    /// builds refuse the unknown op: nothing is done.
    RemoveForReplacement {
        id: NodeId,
        address: String,
    },
    /// Sent by node `id` itself while it withholds its vote (`raft::vote_hold`: it joined with
    /// an empty data dir) although its log has reached the leader's commit point and still
    /// lists it as a voter: it lost its data, and no leader replaced it (the one that had its
    /// acknowledgements changed before it came back). The leader replaces it as for
    /// `RemoveForReplacement` (only at the recorded `address`, only a voter, only if the
    /// removal commits without it), without waiting for it to fall silent; the node then asks
    /// to be promoted (`AddNode`). Older builds refuse the unknown op: nothing is done.
    ReplaceHeldVoter {
        id: NodeId,
        address: String,
    },
}

/// A pre-vote asked of a voter (`domain::prevote`): would it vote for `candidate`, whose log
/// ends at `last_log_id`, now? Answering changes nothing on the node asked.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PreVoteRequest {
    pub candidate: NodeId,
    pub last_log_id: Option<openraft::LogId<NodeId>>,
}

/// A pre-vote's answer.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PreVoteAnswer {
    pub granted: bool,
}

pub use leasecore_client::api::{ClusterView, MemberNode, MemberStatus};

/// Reads this node's lease clock, if it tracks leases as leader.
pub type LeaseStamper = Arc<dyn Fn() -> Option<u64> + Send + Sync>;

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
pub const PROMOTE_MAX_LAG: u64 = 64;

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
    /// The network's record of followers' matches (set once by the node): a removed node's
    /// record is forgotten (`membership`).
    reversions: std::sync::OnceLock<super::network::reversion::ReversionGuard>,
    /// Whether this node withholds its vote (set once by the node: `raft::vote_hold`).
    vote_hold: std::sync::OnceLock<Arc<super::vote_hold::VoteHold>>,
    /// How far this node's log is durable (set once by the node): an append's answer waits
    /// for it ([`Consensus::answer_when_durable`]).
    durable: std::sync::OnceLock<super::durability::DurableView>,
}

/// A proposal waiting in the queue, with where its applied result goes.
type Proposal = (Command, oneshot::Sender<Result<Response, ConsensusError>>);

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
                move || local_read_round(raft.clone(), leaving.clone(), timeouts.election_timeout),
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
                reversions: std::sync::OnceLock::new(),
                vote_hold: std::sync::OnceLock::new(),
                durable: std::sync::OnceLock::new(),
            }),
        };
        (consensus, ProposalQueue { raft, queue })
    }

    /// Share the network's record of followers' matches (once, at start).
    pub fn set_reversion_guard(&self, guard: super::network::reversion::ReversionGuard) {
        let _ = self.inner.reversions.set(guard);
    }

    /// Share this node's vote hold (once, at start).
    pub fn set_vote_hold(&self, hold: Arc<super::vote_hold::VoteHold>) {
        let _ = self.inner.vote_hold.set(hold);
    }

    /// Share how far this node's log is durable (once, at start).
    pub fn set_durable_view(&self, view: super::durability::DurableView) {
        let _ = self.inner.durable.set(view);
    }

    /// Wait until an append (or a snapshot) answered successfully up to `answered` may be
    /// answered: until this node's log is durable that far (`durability::append_answer_waits_for`).
    /// Nearly always at once; an ex-leader whose successor sent back its own entries before they
    /// were synced waits for its sync thread, at most an election timeout (its leader gives up on
    /// the append sooner, after a heartbeat interval, and sends it again).
    pub async fn answer_when_durable(
        &self,
        answered: Option<LogId<NodeId>>,
    ) -> Result<(), super::durability::AnswerNotDurable> {
        use super::durability::{AnswerNotDurable, append_answer_waits_for};
        let Some(view) = self.inner.durable.get() else {
            return Ok(());
        };
        let mark = view.current();
        if append_answer_waits_for(answered, None, mark).is_none() {
            return Ok(());
        }
        // openraft publishes a snapshot it installed (or the purge after one) in its metrics
        // a moment after it answers, and the durable mark never moves for it: watch both.
        let (mut durable, mut metrics) = (view.clone(), self.inner.raft.metrics());
        let wait = async move {
            loop {
                let covered = {
                    let m = metrics.borrow_and_update();
                    [m.snapshot, m.purged]
                        .into_iter()
                        .flatten()
                        .map(|c| c.index)
                        .max()
                };
                let mark = durable.current();
                if append_answer_waits_for(answered, covered, mark).is_none() {
                    return Ok(());
                }
                if mark.failed {
                    return Err(AnswerNotDurable::SyncFailed);
                }
                tokio::select! {
                    changed = durable.changed() => changed.map_err(|_| AnswerNotDurable::SyncFailed)?,
                    changed = metrics.changed() => changed.map_err(|_| AnswerNotDurable::SyncFailed)?,
                }
            }
        };
        let deadline = self.inner.timeouts.election_timeout;
        tokio::time::timeout(deadline, wait)
            .await
            .unwrap_or(Err(AnswerNotDurable::Timeout {
                ms: deadline.as_millis() as u64,
            }))
    }

    /// This node's vote hold, if set (`raft::vote_hold`).
    pub fn vote_hold(&self) -> Option<&Arc<super::vote_hold::VoteHold>> {
        self.inner.vote_hold.get()
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
}

/// The last log index the leader knows `id` acknowledged (leader's metrics only).
fn replicated_index(m: &openraft::RaftMetrics<NodeId, BasicNode>, id: NodeId) -> Option<u64> {
    m.replication
        .as_ref()
        .and_then(|r| r.get(&id))
        .and_then(|l| l.as_ref())
        .map(|l| l.index)
}

#[cfg(test)]
mod tests {
    use super::*;

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
