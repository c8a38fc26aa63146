//! Adding a node as a learner only, for etcd's `MemberAdd` with `is_learner`: the node joins
//! the membership without a vote and stays a learner until `MemberPromote`.
//!
//! leasecore's own add path (`AdminRequest::AddNode`, `POST /v1/cluster/nodes`) always goes on
//! to promote a learner once it has caught up, so it cannot express "a learner until told".
//! This is the first half of that path alone, forwarded to the leader the same way
//! ([`Consensus::on_leader`], over the peer route [`ROUTE`]); promotion is the existing
//! `AddNode` (which resumes the wait of a learner already there and promotes it once caught
//! up).
//!
//! It belongs beside `AddNode` in `raft::consensus::membership` (as an
//! `AdminRequest::AddLearner`); it lives here only while that module is being changed by
//! others.
//!
//! # Invariants
//! - An error that says nothing was done (`NotLeader`, `NoQuorum`, `ChangeInProgress`,
//!   `InvalidMembership`) is returned only before the learner entry was proposed; a core that
//!   stops with it in flight is `OutcomeUnknown`.
//! - Adding a learner already present at the same address is a no-op success (a retry).

use std::time::Duration;

use axum::extract::State;
use axum::{Extension, Json};
use openraft::BasicNode;
use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
use serde::{Deserialize, Serialize};

use crate::http::AppState;
use crate::http::error::ApiError;
use crate::http::extract::ApiJson;
use crate::http::peer_trust::PeerSender;
use crate::raft::NodeId;
use crate::raft::consensus::{ConsensusError, Delivery};

/// The peer route a follower forwards a learner add on.
pub const ROUTE: &str = "/raft/add_learner";

/// How long the leader waits for the learner entry to commit (the consensus request timeout).
const COMMIT_WAIT: Duration = Duration::from_secs(10);

/// The body of [`ROUTE`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddLearner {
    pub id: NodeId,
    pub address: String,
}

/// Add node `id` at client address `address` as a learner, from any node.
pub async fn add(state: &AppState, req: AddLearner) -> Result<(), ConsensusError> {
    state
        .consensus
        .on_leader(ROUTE, &req, Delivery::AtMostOnce, || {
            add_here(state, req.clone())
        })
        .await
}

/// The leader's side of [`add`].
async fn add_here(state: &AppState, req: AddLearner) -> Result<(), ConsensusError> {
    let consensus = &state.consensus;
    if !consensus.is_leader() {
        return Err(ConsensusError::NotLeader);
    }
    if consensus.quorum_lost() {
        return Err(ConsensusError::NoQuorum);
    }
    let existing = {
        let metrics = consensus.raft().metrics();
        let m = metrics.borrow();
        m.membership_config
            .membership()
            .get_node(&req.id)
            .map(|n| n.addr.clone())
    };
    match existing {
        Some(addr) if addr == req.address => return Ok(()),
        Some(addr) => {
            return Err(ConsensusError::InvalidMembership {
                message: format!(
                    "node {} is already in the cluster at {addr}; remove it first",
                    req.id
                ),
            });
        }
        None => {}
    }
    let add = consensus
        .raft()
        .add_learner(req.id, BasicNode::new(req.address), false);
    match tokio::time::timeout(COMMIT_WAIT, add).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) => {
            Err(ConsensusError::NotLeader)
        }
        Ok(Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(c)))) => match c {
            ChangeMembershipError::InProgress(p) => Err(ConsensusError::ChangeInProgress {
                message: format!(
                    "another membership change has not committed yet ({p}); one change at a \
                     time: retry when it has"
                ),
            }),
            other => Err(ConsensusError::InvalidMembership {
                message: other.to_string(),
            }),
        },
        Ok(Err(RaftError::Fatal(_))) => Err(ConsensusError::OutcomeUnknown {
            detail: format!(
                "this node stopped while adding node {} as a learner; check `GET /v1/cluster`",
                req.id
            ),
        }),
        Err(_) => Err(ConsensusError::Timeout {
            ms: COMMIT_WAIT.as_millis() as u64,
        }),
    }
}

/// The peer route's handler: a forwarded learner add, checked as a client's would be.
pub async fn peer_add(
    State(state): State<AppState>,
    Extension(PeerSender(_sender)): Extension<PeerSender>,
    ApiJson(req): ApiJson<AddLearner>,
) -> Result<Json<Result<(), ConsensusError>>, ApiError> {
    crate::http::cluster::check_address(&req.address)?;
    Ok(Json(add_here(&state, req).await))
}
