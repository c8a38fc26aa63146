//! `/v1/leases`: register, refresh, inspect and revoke leases.
//!
//! Registration and revocation are Raft commands (the duplicate check happens at apply time).
//! Refresh goes to the leader's tracker and is not logged. Reads of lease records are served
//! from the (linearizable) applied state; remaining times come from the leader's tracker.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;

use super::AppState;
use super::auth::{check_lease, guard, lease_allowed};
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath, ApiQuery};
use super::kv::{DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, admit, propose, unexpected};
use crate::domain::auth::Access;
use crate::domain::command::{Command, Response};
use crate::domain::kv::LeaseRecord;
use crate::runtime::auth::Caller;
use crate::runtime::lease::RefreshAck;
use crate::wire::{LeaseGranted, LeaseInfo, LeaseList, LeaseRevoked, RegisterLeaseRequest};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseListQuery {
    #[serde(default)]
    prefix: String,
    limit: Option<usize>,
}

pub async fn register(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<RegisterLeaseRequest>,
) -> Result<(StatusCode, Json<LeaseGranted>), ApiError> {
    let cmd = Command::RegisterLease {
        name: req.name.clone(),
        ttl_ms: req.ttl_ms,
        // Stamped by the leader when it submits the entry.
        clock_ms: None,
    };
    admit(&state, &cmd)?;
    let cmd = guard(&state, &caller, cmd)?;
    match propose(&state, cmd).await? {
        Response::LeaseRegistered { revision } => Ok((
            StatusCode::CREATED,
            Json(LeaseGranted {
                name: req.name,
                ttl_ms: req.ttl_ms,
                revision,
            }),
        )),
        other => Err(unexpected(other)),
    }
}

pub async fn refresh(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<RefreshAck>, ApiError> {
    state.limits.check_lease_name(&name)?;
    check_lease(&state, &caller, &name, Access::Write)?;
    Ok(Json(state.leases.refresh(&name).await?))
}

fn info(name: String, lease: LeaseRecord, remaining_ms: Option<u64>) -> LeaseInfo {
    LeaseInfo {
        name,
        ttl_ms: lease.ttl_ms,
        remaining_ms,
        revision: lease.revision,
        keys: lease.keys.into_iter().collect(),
    }
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<LeaseInfo>, ApiError> {
    state.limits.check_lease_name(&name)?;
    state.consensus.read_barrier().await?;
    // The answer names the lease's keys: reading them is what it takes.
    check_lease(&state, &caller, &name, Access::Read)?;
    let (_, lease) = state.consensus.view().lease(&name);
    let lease = lease.ok_or_else(|| lease_not_found(&name))?;
    let remaining = state.leases.remaining(std::slice::from_ref(&name)).await?;
    Ok(Json(info(
        name,
        lease,
        remaining.into_iter().next().flatten(),
    )))
}

pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<LeaseListQuery>,
) -> Result<Json<LeaseList>, ApiError> {
    let limit = q.limit.unwrap_or(DEFAULT_LIST_LIMIT);
    if limit == 0 || limit > MAX_LIST_LIMIT {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {MAX_LIST_LIMIT}"
        )));
    }
    state.consensus.read_barrier().await?;
    let (revision, all) = state.consensus.view().leases();
    let mut leases: Vec<_> = all
        .into_iter()
        .filter(|(n, _)| n.starts_with(&q.prefix))
        // Only the leases whose keys the caller may read (their keys are in the answer).
        .filter(|(n, _)| lease_allowed(&state, &caller, n, Access::Read))
        .take(limit + 1)
        .collect();
    let more = leases.len() > limit;
    leases.truncate(limit);
    let names: Vec<String> = leases.iter().map(|(n, _)| n.clone()).collect();
    let remaining = state.leases.remaining(&names).await?;
    Ok(Json(LeaseList {
        revision,
        leases: leases
            .into_iter()
            .zip(remaining)
            .map(|((n, l), r)| info(n, l, r))
            .collect(),
        more,
    }))
}

pub async fn revoke(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<LeaseRevoked>, ApiError> {
    let cmd = Command::RevokeLease { name };
    admit(&state, &cmd)?;
    let cmd = guard(&state, &caller, cmd)?;
    match propose(&state, cmd).await? {
        Response::LeaseRevoked {
            revision,
            deleted_keys,
        } => Ok(Json(LeaseRevoked {
            revision,
            deleted_keys,
        })),
        other => Err(unexpected(other)),
    }
}

fn lease_not_found(name: &str) -> ApiError {
    ApiError::not_found("lease_not_found", format!("lease {name:?} does not exist"))
        .with("lease", name)
}
