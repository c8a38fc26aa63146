//! `/v1/flease` and `/v1/paxoslease`: decentralized per-resource leases (no leader, no log, no
//! disk write), and the peer route that carries the register messages between nodes. The two
//! protocols have separate resource namespaces and the same HTTP shapes.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::auth::check_key;
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath};
use super::peer_trust::{PeerSender, member_ids, record};
use crate::domain::auth::Access;
use crate::domain::flease::{Envelope, Protocol, validate};
use crate::domain::peer_trust::Refusal;
use crate::raft::network::MSGPACK;
use crate::runtime::auth::Caller;
use crate::runtime::flease::{FleaseError, LeaseView, MSG_ROUTE};

/// Body of acquire and release.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerRequest {
    owner: String,
}

/// Answer to a release.
#[derive(Serialize)]
pub struct ReleaseResponse {
    released: bool,
}

/// The key whose permission guards a resource (auth on): `flease/<resource>` or
/// `paxoslease/<resource>`. Acquire and release need write on it, get needs read.
pub fn resource_key(proto: Protocol, resource: &str) -> String {
    match proto {
        Protocol::Flease => format!("flease/{resource}"),
        Protocol::PaxosLease => format!("paxoslease/{resource}"),
    }
}

fn allowed(
    state: &AppState,
    caller: &Caller,
    proto: Protocol,
    resource: &str,
    access: Access,
) -> Result<(), ApiError> {
    check_key(state, caller, access, &resource_key(proto, resource))
}

fn check(resource: &str, owner: Option<&str>) -> Result<(), ApiError> {
    validate::check_resource(resource).map_err(ApiError::invalid)?;
    if let Some(o) = owner {
        validate::check_owner(o).map_err(ApiError::invalid)?;
    }
    Ok(())
}

impl From<FleaseError> for ApiError {
    fn from(e: FleaseError) -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_quorum", e.to_string())
    }
}

async fn acquire_in(
    proto: Protocol,
    (state, caller): (AppState, Caller),
    resource: String,
    req: OwnerRequest,
) -> Result<Json<LeaseView>, ApiError> {
    check(&resource, Some(&req.owner))?;
    allowed(&state, &caller, proto, &resource, Access::Write)?;
    Ok(Json(
        state.flease.acquire(proto, &resource, &req.owner).await?,
    ))
}

async fn release_in(
    proto: Protocol,
    (state, caller): (AppState, Caller),
    resource: String,
    req: OwnerRequest,
) -> Result<Json<ReleaseResponse>, ApiError> {
    check(&resource, Some(&req.owner))?;
    allowed(&state, &caller, proto, &resource, Access::Write)?;
    let released = state.flease.release(proto, &resource, &req.owner).await?;
    Ok(Json(ReleaseResponse { released }))
}

fn get_in(
    proto: Protocol,
    (state, caller): (AppState, Caller),
    resource: String,
) -> Result<Json<LeaseView>, ApiError> {
    check(&resource, None)?;
    allowed(&state, &caller, proto, &resource, Access::Read)?;
    Ok(Json(state.flease.peek(proto, &resource)))
}

pub async fn acquire(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(resource): ApiPath<String>,
    ApiJson(req): ApiJson<OwnerRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    acquire_in(Protocol::Flease, (state, caller), resource, req).await
}

pub async fn release(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(resource): ApiPath<String>,
    ApiJson(req): ApiJson<OwnerRequest>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    release_in(Protocol::Flease, (state, caller), resource, req).await
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(resource): ApiPath<String>,
) -> Result<Json<LeaseView>, ApiError> {
    get_in(Protocol::Flease, (state, caller), resource)
}

pub async fn paxos_acquire(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(resource): ApiPath<String>,
    ApiJson(req): ApiJson<OwnerRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    acquire_in(Protocol::PaxosLease, (state, caller), resource, req).await
}

pub async fn paxos_release(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(resource): ApiPath<String>,
    ApiJson(req): ApiJson<OwnerRequest>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    release_in(Protocol::PaxosLease, (state, caller), resource, req).await
}

pub async fn paxos_get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(resource): ApiPath<String>,
) -> Result<Json<LeaseView>, ApiError> {
    get_in(Protocol::PaxosLease, (state, caller), resource)
}

/// A batch of register messages, compact MessagePack both ways. A message the acceptor must
/// not handle (impossible values, a `from` that is not the sender: `domain::flease::validate`)
/// gets no answer, as a lost message would, and is counted.
pub async fn peer_messages(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    body: Bytes,
) -> Result<([(header::HeaderName, &'static str); 1], Vec<u8>), ApiError> {
    let batch: Vec<Envelope> = rmp_serde::from_slice(&body)
        .map_err(|e| ApiError::invalid(format!("undecodable flease batch: {e}")))?;
    let members = member_ids(&state.consensus);
    let (answers, refusals) = state.flease.on_peer_batch_from(sender, &members, &batch);
    for why in &refusals {
        record(
            &state,
            Refusal::InvalidLeaseMessage,
            Some(sender),
            MSG_ROUTE,
            why,
        );
    }
    let bytes = rmp_serde::to_vec(&answers).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("encoding flease answers: {e}"),
        )
    })?;
    Ok(([(header::CONTENT_TYPE, MSGPACK)], bytes))
}
