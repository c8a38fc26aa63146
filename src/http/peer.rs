//! The peer API: openraft RPCs and forwarded calls between nodes (`/raft/...`).
//!
//! Answers are `Result` documents (`{"Ok": ...}` or `{"Err": ...}`) with status 200, so the
//! caller can tell an error of the remote Raft (which openraft must see) from a transport
//! failure. A body that does not decode is refused with 400 before it reaches Raft: a malformed
//! message never touches the node's state.

use axum::Json;
use axum::extract::State;
use bytes::Bytes;
use openraft::Snapshot;
use openraft::error::{Fatal, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};

use super::AppState;
use super::error::ApiError;
use super::extract::ApiJson;
use crate::domain::command::{Command, Response};
use crate::raft::consensus::{AdminOutcome, AdminRequest, ConsensusError};
use crate::raft::network::decode_snapshot_frame;
use crate::raft::{NodeId, TypeConfig};
use crate::runtime::lease::{LeaseError, RefreshAck};

pub async fn append(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Json<Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>>, ApiError> {
    // MessagePack (see raft::network): values travel as raw bytes.
    let req: AppendEntriesRequest<TypeConfig> = rmp_serde::from_slice(&body)
        .map_err(|e| ApiError::invalid(format!("undecodable append request: {e}")))?;
    if req.vote.is_committed() {
        // A leader's message: the follower's "last heard from my leader" (readiness).
        let leader = req.vote.leader_id().node_id;
        state.consensus.peers().contacts().heard_from(leader);
    }
    Ok(Json(state.consensus.raft().append_entries(req).await))
}

pub async fn vote(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<VoteRequest<NodeId>>,
) -> Json<Result<VoteResponse<NodeId>, RaftError<NodeId>>> {
    Json(state.consensus.raft().vote(req).await)
}

pub async fn snapshot(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Json<Result<SnapshotResponse<NodeId>, Fatal<NodeId>>>, ApiError> {
    let (vote, meta, data) = decode_snapshot_frame(&body).map_err(ApiError::invalid)?;
    let snapshot = Snapshot {
        meta,
        snapshot: Box::new(data),
    };
    Ok(Json(
        state
            .consensus
            .raft()
            .install_full_snapshot(vote, snapshot)
            .await,
    ))
}

pub async fn propose(
    State(state): State<AppState>,
    ApiJson(cmd): ApiJson<Command>,
) -> Json<Result<Response, ConsensusError>> {
    Json(state.consensus.propose_here(cmd).await)
}

pub async fn read_index(State(state): State<AppState>) -> Json<Result<u64, ConsensusError>> {
    Json(state.consensus.read_index_here().await)
}

pub async fn admin(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<AdminRequest>,
) -> Json<Result<AdminOutcome, ConsensusError>> {
    Json(state.consensus.admin_here(req).await)
}

pub async fn lease_refresh(
    State(state): State<AppState>,
    ApiJson(name): ApiJson<String>,
) -> Json<Result<RefreshAck, LeaseError>> {
    Json(state.leases.refresh_here(&name).await)
}

pub async fn lease_remaining(
    State(state): State<AppState>,
    ApiJson(names): ApiJson<Vec<String>>,
) -> Json<Result<Vec<Option<u64>>, LeaseError>> {
    Json(state.leases.remaining_here(&names).await)
}
