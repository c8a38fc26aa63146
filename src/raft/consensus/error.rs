//! [`ConsensusError`], the one error of every consensus call and of the peer wire's forwarded
//! calls, and the mapping of openraft's errors onto it.
//!
//! # Invariants
//! - The error travels between peers tagged by its `code`: a variant's name and fields are its
//!   wire format, read by nodes of other builds.
//! - A refusal that did nothing stays one that says so: openraft's `ForwardToLeader` is
//!   `NotLeader`, and a membership change refused because another has not committed yet is
//!   `ChangeInProgress` (retry), never `InvalidMembership`.
//! - `NotLeader` is for peers; clients are told `NoLeader` ([`no_leader_for_clients`]): both
//!   mean retry.
//!
//! # What it must not do
//! Decide or retry anything: it names what happened, and the callers decide.

use super::*;

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
    /// A node asked to be removed for replacement, but the leader still hears from a node with
    /// its id: nothing was done. Retry once an election timeout has passed without it.
    #[error(
        "the leader still hears from node {id}: it was restarted a moment ago (retry), or \
         another process runs as node {id} (give this one another id)"
    )]
    StillAnswering { id: NodeId },
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

pub(super) fn from_check_error(
    e: RaftError<NodeId, CheckIsLeaderError<NodeId, BasicNode>>,
) -> ConsensusError {
    match e {
        RaftError::APIError(CheckIsLeaderError::ForwardToLeader(_)) => ConsensusError::NotLeader,
        RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(_)) => ConsensusError::NoQuorum,
        RaftError::Fatal(_) => ConsensusError::ShuttingDown,
    }
}

pub(super) fn from_write_error(
    e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>,
) -> ConsensusError {
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

/// Clients are told "no leader" where peers are told "not leader": both mean retry.
pub(super) fn no_leader_for_clients(e: ConsensusError) -> ConsensusError {
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
}
