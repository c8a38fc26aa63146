//! `/v1/flease`: decentralized per-resource leases (no leader, no log, no disk write), and the
//! peer route that carries the register messages between nodes.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::AppState;
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath};
use crate::domain::flease::Envelope;
use crate::runtime::flease::{FleaseError, LeaseView};

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

fn check(resource: &str, owner: Option<&str>) -> Result<(), ApiError> {
    if resource.is_empty() || resource.len() > 1024 {
        return Err(ApiError::invalid("resource must be 1 to 1024 bytes"));
    }
    if let Some(o) = owner
        && (o.is_empty() || o.len() > 256)
    {
        return Err(ApiError::invalid("owner must be 1 to 256 bytes"));
    }
    Ok(())
}

impl From<FleaseError> for ApiError {
    fn from(e: FleaseError) -> Self {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_quorum", e.to_string())
    }
}

pub async fn acquire(
    State(state): State<AppState>,
    ApiPath(resource): ApiPath<String>,
    ApiJson(req): ApiJson<OwnerRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    check(&resource, Some(&req.owner))?;
    Ok(Json(state.flease.acquire(&resource, &req.owner).await?))
}

pub async fn release(
    State(state): State<AppState>,
    ApiPath(resource): ApiPath<String>,
    ApiJson(req): ApiJson<OwnerRequest>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    check(&resource, Some(&req.owner))?;
    let released = state.flease.release(&resource, &req.owner).await?;
    Ok(Json(ReleaseResponse { released }))
}

pub async fn get(
    State(state): State<AppState>,
    ApiPath(resource): ApiPath<String>,
) -> Result<Json<LeaseView>, ApiError> {
    check(&resource, None)?;
    Ok(Json(state.flease.peek(&resource)))
}

pub async fn peer_messages(
    State(state): State<AppState>,
    ApiJson(batch): ApiJson<Vec<Envelope>>,
) -> Json<Vec<Option<Envelope>>> {
    Json(state.flease.on_peer_batch(&batch))
}
