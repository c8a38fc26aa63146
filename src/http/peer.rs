//! The peer API: openraft RPCs and forwarded calls between nodes (`/raft/...`).
//!
//! Answers are `Result` documents (`{"Ok": ...}` or `{"Err": ...}`) with status 200, so the
//! caller can tell an error of the remote Raft (which openraft must see) from a transport
//! failure. A body that does not decode is refused with 400 before it reaches Raft: a malformed
//! message never touches the node's state.
//!
//! Every handler but [`status`] (open to any node) runs behind [`super::peer_trust::gate`] (the
//! sender is a member) and checks what the body claims against the sender
//! (`domain::peer_trust`): an append's or a snapshot's leader, a vote's candidate. A vote
//! request while a leader is alive is answered "not granted" without reaching Raft. Forwarded commands and requests pass the same checks as a
//! client's (`kv::admit`, `domain::limits`): a peer can never ask for more than a
//! client could.

use axum::extract::State;
use axum::{Extension, Json};
use bytes::Bytes;
use openraft::Snapshot;
use openraft::error::{Fatal, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};

use super::AppState;
use super::error::ApiError;
use super::extract::ApiJson;
use super::kv::{MAX_LIST_LIMIT, admit};
use super::peer_trust::{PeerSender, record, refuse, vote_context};
use crate::domain::command::{Command, Response};
use crate::domain::history_fill::{HistoryReach, PageAnswer, PageAsk};
use crate::domain::peer_trust::{Refusal, check_claim, disruptive_vote};
use crate::raft::consensus::{
    AdminOutcome, AdminRequest, ClusterView, ConsensusError, ForwardedAnswers, PreVoteAnswer,
    PreVoteRequest, TransferAnswer, TransferRequest,
};
use crate::raft::network::{decode_snapshot_frame, routes};
use crate::raft::{NodeId, TypeConfig};
use crate::runtime::lease::{LeaseError, RefreshAck};

/// Refuse a body that claims another node than its sender.
fn claim(state: &AppState, sender: NodeId, claimed: NodeId, route: &str) -> Result<(), ApiError> {
    check_claim(sender, claimed).map_err(|why| refuse(state, why, Some(sender), route))
}

/// Refuse a forwarded request a client could not have sent (400/413/429 as for a client).
fn invalid(state: &AppState, sender: NodeId, route: &str, e: ApiError) -> ApiError {
    record(
        state,
        Refusal::InvalidRequest,
        Some(sender),
        route,
        &e.message,
    );
    e
}

pub async fn append(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    body: Bytes,
) -> Result<Json<AppendAnswer>, ApiError> {
    append_answer(&state, sender, &body).await.map(Json)
}

/// What an append is answered with (the remote Raft's error travels inside, for openraft).
pub type AppendAnswer = Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>;

/// Check and hand an AppendEntries request (MessagePack) from `sender` to Raft: the HTTP route
/// and the peer stream (`http::peer_stream`) both answer through this.
pub async fn append_answer(
    state: &AppState,
    sender: NodeId,
    body: &[u8],
) -> Result<AppendAnswer, ApiError> {
    // MessagePack (see raft::network): values travel as raw bytes, and each entry's bytes are
    // kept for this node's log store, which then writes them as they are.
    let req: AppendEntriesRequest<TypeConfig> = crate::raft::network::read_append(body)
        .map_err(|e| ApiError::invalid(format!("undecodable append request: {e}")))?;
    let leader = req.vote.leader_id().node_id;
    claim(state, sender, leader, routes::APPEND)?;
    let from_leader = req.vote.is_committed();
    let (leader_term, leader_commit) = (req.vote.leader_id().term, req.leader_commit);
    let carried_up_to = req.entries.last().map(|e| e.log_id).or(req.prev_log_id);
    let answer = state.consensus.raft().append_entries(req).await;
    if from_leader && matches!(&answer, Ok(r) if !matches!(r, AppendEntriesResponse::HigherVote(_)))
    {
        // A leader this node follows: the follower's "last heard from my leader" (readiness,
        // and the vote rule).
        let contacts = state.consensus.peers().contacts();
        contacts.heard_from(leader);
        contacts.led_now();
        // The leader's commit point, for a node that joined empty (`raft::vote_hold`).
        if let Some(hold) = state.consensus.vote_hold() {
            hold.leader_append(leader_term, leader_commit.as_ref());
        }
    }
    // The leader records a success as this node's match, a copy on its disk: see that it is
    // one (`raft::durability::append_answer_waits_for`).
    let answered = match &answer {
        Ok(AppendEntriesResponse::Success) => carried_up_to,
        Ok(AppendEntriesResponse::PartialSuccess(matched)) => *matched,
        _ => None,
    };
    state.consensus.answer_when_durable(answered).await?;
    Ok(answer)
}

pub async fn vote(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(req): ApiJson<VoteRequest<NodeId>>,
) -> Result<Json<Result<VoteResponse<NodeId>, RaftError<NodeId>>>, ApiError> {
    claim(&state, sender, req.vote.leader_id().node_id, routes::VOTE)?;
    if state.consensus.vote_hold().is_some_and(|h| h.is_held()) {
        record(
            &state,
            Refusal::VoteWithheld,
            Some(sender),
            routes::VOTE,
            &format!(
                "vote for term {}: joined empty, not yet listed as a non-voter; if listed as a \
                 voter it lost its data: `leasecore cluster remove {me}`, then `cluster add`",
                req.vote.leader_id().term,
                me = state.consensus.cluster_view().node_id
            ),
        );
        let mine = state.consensus.raft().metrics().borrow().vote;
        return Ok(Json(Ok(VoteResponse::new(mine, None, false))));
    }
    if disruptive_vote(&vote_context(&state.consensus)) {
        record(
            &state,
            Refusal::DisruptiveVote,
            Some(sender),
            routes::VOTE,
            &format!(
                "a vote request for term {} while a leader is alive",
                req.vote.leader_id().term
            ),
        );
        // Not granted, and this node's own vote: the candidate learns nothing new and this
        // node adopts nothing (no higher term, no step-down).
        let mine = state.consensus.raft().metrics().borrow().vote;
        return Ok(Json(Ok(VoteResponse::new(mine, None, false))));
    }
    Ok(Json(state.consensus.raft().vote(req).await))
}

/// A pre-vote (`domain::prevote`): answered as the real vote would be, and nothing changes.
pub async fn prevote(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(req): ApiJson<PreVoteRequest>,
) -> Result<Json<PreVoteAnswer>, ApiError> {
    claim(&state, sender, req.candidate, routes::PREVOTE)?;
    let ctx = vote_context(&state.consensus);
    let held = state.consensus.vote_withheld();
    let mine = state.consensus.raft().data_metrics().borrow().last_log;
    let granted = crate::domain::prevote::grants(&ctx, held, &req.last_log_id, &mine);
    Ok(Json(PreVoteAnswer { granted }))
}

pub async fn snapshot(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    body: Bytes,
) -> Result<Json<Result<SnapshotResponse<NodeId>, Fatal<NodeId>>>, ApiError> {
    let (vote, meta, data) = decode_snapshot_frame(&body).map_err(ApiError::invalid)?;
    claim(&state, sender, vote.leader_id().node_id, routes::SNAPSHOT)?;
    let (installed_membership, installed_last) = (meta.last_membership.clone(), meta.last_log_id);
    let snapshot = Snapshot {
        meta,
        snapshot: Box::new(data),
    };
    let answer = state
        .consensus
        .raft()
        .install_full_snapshot(vote, snapshot)
        .await;
    if vote.is_committed() && matches!(&answer, Ok(r) if r.vote == vote) {
        state.consensus.peers().contacts().led_now();
    }
    // Installed: its membership is this node's now.
    if matches!(&answer, Ok(r) if r.vote == vote)
        && let Some(hold) = state.consensus.vote_hold()
    {
        if let Some(at) = installed_membership.log_id() {
            hold.stored(at.index, installed_membership.membership());
        }
        if let Some(last) = installed_last {
            hold.durable_up_to(last.index);
        }
    }
    // openraft answers at once a snapshot at or below this node's commit, which on an ex-leader
    // may cover entries not yet synced; the leader records the answer as this node's match.
    if matches!(&answer, Ok(r) if r.vote == vote) {
        state.consensus.answer_when_durable(installed_last).await?;
    }
    Ok(Json(answer))
}

pub async fn propose(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(cmd): ApiJson<Command>,
) -> Result<Json<Result<Response, ConsensusError>>, ApiError> {
    // Every client command reaches the leader guarded (on behalf of a user, or `""`), so
    // that apply checks it against the auth state: a bare one from a peer would skip that.
    if !matches!(cmd, Command::Guarded { .. }) {
        let e = ApiError::invalid("a forwarded command must be guarded (on behalf of a user)");
        return Err(invalid(&state, sender, routes::PROPOSE, e));
    }
    admit(&state, &cmd).map_err(|e| invalid(&state, sender, routes::PROPOSE, e))?;
    Ok(Json(state.consensus.propose_here(cmd).await))
}

/// Several forwarded proposals (`raft::consensus::forward`), each checked as [`propose`] checks
/// one, answered in order. (The route of older builds: [`propose_batch_applied`] replaces it.)
pub async fn propose_batch(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(cmds): ApiJson<Vec<Command>>,
) -> Result<Json<Result<Vec<Result<Response, ConsensusError>>, ConsensusError>>, ApiError> {
    check_forwarded(&state, sender, routes::PROPOSE_BATCH, &cmds)?;
    Ok(Json(state.consensus.propose_batch_here(cmds).await))
}

/// [`propose_batch`], answered with how far this leader had applied when it answered.
pub async fn propose_batch_applied(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(cmds): ApiJson<Vec<Command>>,
) -> Result<Json<Result<ForwardedAnswers, ConsensusError>>, ApiError> {
    check_forwarded(&state, sender, routes::PROPOSE_BATCH_APPLIED, &cmds)?;
    Ok(Json(state.consensus.propose_batch_for_peer(cmds).await))
}

/// A forwarded batch holds 1 to `MAX_FORWARD_COMMANDS` commands, each guarded and admitted as
/// [`propose`] checks one.
fn check_forwarded(
    state: &AppState,
    sender: NodeId,
    route: &str,
    cmds: &[Command],
) -> Result<(), ApiError> {
    let max = crate::raft::consensus::MAX_FORWARD_COMMANDS;
    if cmds.is_empty() || cmds.len() > max {
        let e = ApiError::invalid(format!("a forwarded batch holds 1 to {max} commands"));
        return Err(invalid(state, sender, route, e));
    }
    for cmd in cmds {
        if !matches!(cmd, Command::Guarded { .. }) {
            let e = ApiError::invalid("a forwarded command must be guarded (on behalf of a user)");
            return Err(invalid(state, sender, route, e));
        }
        admit(state, cmd).map_err(|e| invalid(state, sender, route, e))?;
    }
    Ok(())
}

pub async fn read_index(State(state): State<AppState>) -> Json<Result<u64, ConsensusError>> {
    Json(state.consensus.read_index_here().await)
}

pub async fn admin(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(req): ApiJson<AdminRequest>,
) -> Result<Json<Result<AdminOutcome, ConsensusError>>, ApiError> {
    if let AdminRequest::AddNode { address, .. }
    | AdminRequest::RemoveForReplacement { address, .. }
    | AdminRequest::ReplaceHeldVoter { address, .. } = &req
    {
        super::cluster::check_address(address)
            .map_err(|e| invalid(&state, sender, routes::ADMIN, e))?;
    }
    // Only a node itself asks to be replaced.
    if let AdminRequest::RemoveForReplacement { id, .. }
    | AdminRequest::ReplaceHeldVoter { id, .. } = &req
    {
        claim(&state, sender, *id, routes::ADMIN)?;
    }
    Ok(Json(state.consensus.admin_here(req).await))
}

pub async fn lease_refresh(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(name): ApiJson<String>,
) -> Result<Json<Result<RefreshAck, LeaseError>>, ApiError> {
    state
        .limits
        .check_lease_name(&name)
        .map_err(|e| invalid(&state, sender, routes::LEASE_REFRESH, e.into()))?;
    Ok(Json(state.leases.refresh_here(&name).await))
}

pub async fn lease_remaining(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(names): ApiJson<Vec<String>>,
) -> Result<Json<Result<Vec<Option<u64>>, LeaseError>>, ApiError> {
    let route = routes::LEASE_REMAINING;
    // A listing asks for the remaining time of at most `MAX_LIST_LIMIT` leases.
    if names.len() > MAX_LIST_LIMIT {
        let e = ApiError::invalid(format!("at most {MAX_LIST_LIMIT} names"));
        return Err(invalid(&state, sender, route, e));
    }
    for name in &names {
        state
            .limits
            .check_lease_name(name)
            .map_err(|e| invalid(&state, sender, route, e.into()))?;
    }
    Ok(Json(state.leases.remaining_here(&names).await))
}

/// A leadership transfer forwarded by a follower (`Consensus::move_leader`).
pub async fn move_leader(
    State(state): State<AppState>,
    ApiJson(target): ApiJson<NodeId>,
) -> Json<Result<NodeId, ConsensusError>> {
    Json(state.consensus.move_leader_here(target).await)
}

/// The leader's call during a leadership transfer: hold elections, or campaign as the
/// transferee (`raft::consensus::transfer`). Only the leader this node follows, in its term,
/// is heeded, and never for longer than `MAX_HOLD`.
pub async fn transfer(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    ApiJson(req): ApiJson<TransferRequest>,
) -> Json<Result<TransferAnswer, ConsensusError>> {
    let answer = state.consensus.transfer_here(sender, req).await;
    if let Err(e) = &answer {
        record(
            &state,
            Refusal::InvalidRequest,
            Some(sender),
            routes::TRANSFER,
            &e.to_string(),
        );
    }
    Json(answer)
}

/// This node's view of the cluster (`GET /v1/cluster`'s document, its etcd URL included), for
/// a starting node's probe (`runtime::bootstrap`) and the members' `MemberList`
/// (`etcd::client_urls`). Open to any node (`OPEN_PEER_ROUTES`), and without a token even
/// while auth is on: peers hold none, and a refusal would hide a running cluster from a
/// starting node.
pub async fn status(State(state): State<AppState>) -> Json<ClusterView> {
    Json(state.cluster_view())
}

/// How far back this node's history reaches, for a peer's fill (`domain::history_fill`).
pub async fn history_reach(State(state): State<AppState>) -> Json<HistoryReach> {
    Json(state.consensus.view().reach())
}

/// A page of this node's history, for a peer's fill: bounded by `history_fill::PAGE_BYTES`
/// and `MAX_PAGE_ITEMS` whatever is asked; a revision this node no longer holds answers as a
/// client's read would (`compacted`, 4xx).
pub async fn history_page(
    State(state): State<AppState>,
    ApiJson(ask): ApiJson<PageAsk>,
) -> Result<Json<PageAnswer>, ApiError> {
    let view = state.consensus.view().clone();
    // Reads of up to a page of the store: off the async workers.
    let answer = tokio::task::spawn_blocking(move || match ask {
        PageAsk::Keys {
            revision,
            after,
            limit,
        } => view
            .keys_page(revision, after.as_deref(), limit)
            .map(PageAnswer::Keys),
        PageAsk::Events {
            from,
            through,
            limit,
        } => view
            .events_page(from, through, limit)
            .map(PageAnswer::Events),
    })
    .await
    .map_err(|e| {
        ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("history read failed: {e}"),
        )
    })??;
    Ok(Json(answer))
}
