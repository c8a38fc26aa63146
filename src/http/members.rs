//! `/v1/members`: membership by heartbeat, on top of leases (see `domain::members`).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;

use super::AppState;
use super::auth::{check, check_key, guard};
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath};
use super::kv::{admit, propose, unexpected};
use crate::domain::auth::{Access, KeyRange};
use crate::domain::command::{Command, KvError, Response};
use crate::domain::members::{
    MEMBERS_PREFIX, MemberRecord, check_member_id, member_id, member_key,
};
use crate::runtime::auth::Caller;
use crate::runtime::lease::LeaseError;
use crate::wire::{Heartbeat, MemberLeft, MemberList, MemberRegistered, RegisterMemberRequest};

fn member_not_found(id: &str) -> ApiError {
    ApiError::not_found(
        "member_not_found",
        format!("member {id:?} is not registered (or its lease expired)"),
    )
    .with("id", id)
}

pub async fn register(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<RegisterMemberRequest>,
) -> Result<(StatusCode, Json<MemberRegistered>), ApiError> {
    let cmd = Command::RegisterMember {
        id: req.id.clone(),
        address: req.address,
        ttl_ms: req.ttl_ms,
        meta: req.meta,
        clock_ms: None,
    };
    admit(&state, &cmd)?;
    let cmd = guard(&state, &caller, cmd)?;
    match propose(&state, cmd).await? {
        Response::MemberRegistered { revision, .. } => {
            let key = member_key(&req.id);
            Ok((
                StatusCode::CREATED,
                Json(MemberRegistered {
                    id: req.id,
                    lease: key.clone(),
                    key,
                    revision,
                }),
            ))
        }
        other => Err(unexpected(other)),
    }
}

pub async fn heartbeat(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Heartbeat>, ApiError> {
    check_member_id(&id)?;
    check_key(&state, &caller, Access::Write, &member_key(&id))?;
    match state.leases.refresh(&member_key(&id)).await {
        Ok(ack) => Ok(Json(Heartbeat {
            id,
            ttl_ms: ack.ttl_ms,
            remaining_ms: ack.remaining_ms,
        })),
        Err(LeaseError::NotFound { .. }) => Err(member_not_found(&id)),
        Err(e) => Err(e.into()),
    }
}

pub async fn leave(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<MemberLeft>, ApiError> {
    check_member_id(&id)?;
    check_key(&state, &caller, Access::Write, &member_key(&id))?;
    let cmd = Command::RevokeLease {
        name: member_key(&id),
    };
    admit(&state, &cmd)?;
    match propose(&state, guard(&state, &caller, cmd)?).await? {
        Response::LeaseRevoked { revision, .. } => Ok(Json(MemberLeft { id, revision })),
        Response::Rejected {
            error: KvError::LeaseNotFound { .. },
        } => Err(member_not_found(&id)),
        other => Err(unexpected(other)),
    }
}

pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<MemberList>, ApiError> {
    state.consensus.read_barrier().await?;
    check(
        &state,
        &caller,
        Access::Read,
        &KeyRange::prefix(MEMBERS_PREFIX),
    )?;
    let (revision, items) = state.consensus.view().list(MEMBERS_PREFIX, usize::MAX);
    let members = items
        .into_iter()
        // Only keys registered as members (attached to their own lease) count.
        .filter(|(k, v)| v.lease.as_deref() == Some(k.as_str()) && member_id(k).is_some())
        .filter_map(|(_, v)| MemberRecord::decode(&v.value))
        .collect();
    Ok(Json(MemberList { revision, members }))
}
