//! `GET /v1/snapshot`: a backup of the whole state, for `leasecore snapshot save`.
//!
//! The read is linearizable (a quorum round first), so the backup holds every write
//! acknowledged before the request; the state is then copied at one revision (see
//! `raft::backup`). The body is the backup file itself (`application/octet-stream`), with its
//! revision in the `X-Leasecore-Revision` header.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use serde::Deserialize;

use super::AppState;
use super::error::ApiError;
use super::extract::ApiQuery;
use super::kv::Consistency;
use crate::raft::backup;
use crate::raft::consensus::ConsensusError;
use crate::runtime::auth::Caller;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotQuery {
    #[serde(default)]
    consistency: Consistency,
}

/// Root only: a backup holds every key, and the auth state with its hashes and token key.
pub async fn save(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<SnapshotQuery>,
) -> Result<impl IntoResponse, ApiError> {
    super::auth::require_root(&state, &caller)?;
    if q.consistency == Consistency::Linearizable {
        state.consensus.read_barrier().await?;
    }
    let view = state.consensus.view().clone();
    let node_id = state.consensus.cluster_view().node_id;
    // The blocking task fails only when the runtime is going away: nothing was done.
    let (header, file) = tokio::task::spawn_blocking(move || backup::take(&view, node_id))
        .await
        .map_err(|_| ConsensusError::ShuttingDown)?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (
                header::HeaderName::from_static("x-leasecore-revision"),
                header.revision.to_string(),
            ),
        ],
        file,
    ))
}
