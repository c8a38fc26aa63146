//! `/v1/kv`: put, get, delete and prefix listing.
//!
//! Handlers extract, validate at the edge (so bad input never reaches the log), call the
//! consensus layer, and map the applied result. Reads are linearizable unless the client asks
//! for `consistency=local`, which serves this node's applied state (possibly stale, never torn).

use axum::Json;
use axum::extract::State;
use serde::Deserialize;

use super::AppState;
use super::auth::{check, check_key, guard};
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath, ApiQuery};
use crate::domain::auth::{Access, KeyRange};
use crate::domain::command::{Command, Response};
use crate::domain::types::Revision;
use crate::runtime::auth::Caller;
use crate::wire::{DeleteResponse, GetResponse, KeyValue, ListResponse, PutRequest, PutResponse};

/// The default and the largest `limit` of a listing.
pub const DEFAULT_LIST_LIMIT: usize = 10_000;
pub const MAX_LIST_LIMIT: usize = 100_000;

/// How a read is served.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// Confirmed with a quorum, reflects every write acknowledged before the read began.
    #[default]
    Linearizable,
    /// This node's applied state, without a quorum round.
    Local,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteQuery {
    prev_revision: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadQuery {
    #[serde(default)]
    consistency: Consistency,
    /// Read the key as it was at this revision (from the MVCC history).
    revision: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    prefix: String,
    limit: Option<usize>,
    #[serde(default)]
    consistency: Consistency,
    /// List the keys as they were at this revision (from the MVCC history).
    revision: Option<u64>,
}

/// `POST /v1/compact`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactRequest {
    revision: u64,
}

/// The answer to `POST /v1/compact`.
#[derive(serde::Serialize)]
pub struct CompactResponse {
    compact_revision: Revision,
    revision: Revision,
}

/// Run a command and count it.
pub(crate) async fn propose(state: &AppState, cmd: Command) -> Result<Response, ApiError> {
    use std::sync::atomic::Ordering::Relaxed;
    state.metrics.proposals.fetch_add(1, Relaxed);
    state.consensus.propose(cmd).await.map_err(|e| {
        state.metrics.proposals_failed.fetch_add(1, Relaxed);
        ApiError::from(e)
    })
}

/// Check a command before it is proposed, for a client or for a peer that forwards one:
/// [`crate::domain::limits::Limits::check_command`] (the one set of rules), and room for one
/// more lease if it registers one.
pub(crate) fn admit(state: &AppState, cmd: &Command) -> Result<(), ApiError> {
    let ttl = state.leases.hub().config().ttl_bounds();
    state.limits.check_command(cmd, ttl)?;
    let inner = match cmd {
        Command::Guarded { command, .. } => command.as_ref(),
        other => other,
    };
    if matches!(
        inner,
        Command::RegisterLease { .. } | Command::RegisterMember { .. }
    ) {
        let leases = state.consensus.view().with_state(|kv| kv.leases().len());
        state.limits.check_lease_count(leases)?;
    }
    Ok(())
}

/// Check a `/v1` client's command before it is proposed: [`admit`], and no value it writes
/// begins with U+0000 ([`Limits::check_text_writes`]: that marks a binary value written
/// through the etcd API, which `/v1` shows in that stored form).
///
/// [`Limits::check_text_writes`]: crate::domain::limits::Limits::check_text_writes
pub(crate) fn admit_text(state: &AppState, cmd: &Command) -> Result<(), ApiError> {
    crate::domain::limits::Limits::check_text_writes(cmd)?;
    admit(state, cmd)
}

/// Make a read linearizable if asked.
pub(crate) async fn read_point(state: &AppState, c: Consistency) -> Result<(), ApiError> {
    match c {
        Consistency::Linearizable => Ok(state.consensus.read_barrier().await?),
        Consistency::Local => Ok(()),
    }
}

pub async fn put(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<WriteQuery>,
    ApiJson(body): ApiJson<PutRequest>,
) -> Result<Json<PutResponse>, ApiError> {
    let cmd = Command::Put {
        key,
        value: body.value,
        lease: body.lease,
        prev_revision: q.prev_revision.map(Revision),
    };
    admit_text(&state, &cmd)?;
    let cmd = guard(&state, &caller, cmd)?;
    match propose(&state, cmd).await? {
        Response::Put { revision } => Ok(Json(PutResponse { revision })),
        other => Err(unexpected(other)),
    }
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<ReadQuery>,
) -> Result<Json<GetResponse>, ApiError> {
    state.limits.check_key(&key)?;
    // After the read point: a linearizable read is checked against the auth state as of then.
    read_point(&state, q.consistency).await?;
    check_key(&state, &caller, Access::Read, &key)?;
    let found = match q.revision {
        None => state.consensus.view().get(&key),
        Some(at) => {
            let (revision, mut kvs) = state
                .consensus
                .view()
                .range_at(&KeyRange::of_stored(&key), Some(Revision(at)))?;
            (revision, kvs.pop().map(|(_, v)| v))
        }
    };
    match found {
        (revision, Some(v)) => Ok(Json(GetResponse {
            kv: KeyValue::new(key, v),
            revision,
        })),
        (revision, None) => Err(ApiError::not_found(
            "key_not_found",
            format!("key {key:?} does not exist"),
        )
        .with("key", key)
        .with("revision", revision.0)),
    }
}

pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<ListResponse>, ApiError> {
    let limit = q.limit.unwrap_or(DEFAULT_LIST_LIMIT);
    if limit == 0 || limit > MAX_LIST_LIMIT {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {MAX_LIST_LIMIT}"
        )));
    }
    read_point(&state, q.consistency).await?;
    // As etcd: a range needs read on all of it (no silent filtering of what it returns).
    check(&state, &caller, Access::Read, &KeyRange::prefix(&q.prefix))?;
    // One more than asked tells whether the listing was cut short.
    let (revision, mut items) = match q.revision {
        None => state.consensus.view().list(&q.prefix, limit + 1),
        Some(at) => state
            .consensus
            .view()
            .range_at(&KeyRange::prefix(&q.prefix), Some(Revision(at)))?,
    };
    let more = items.len() > limit;
    items.truncate(limit);
    Ok(Json(ListResponse {
        revision,
        items: items
            .into_iter()
            .map(|(k, v)| KeyValue::new(k, v))
            .collect(),
        more,
    }))
}

pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(key): ApiPath<String>,
    ApiQuery(q): ApiQuery<WriteQuery>,
) -> Result<Json<DeleteResponse>, ApiError> {
    let cmd = Command::Delete {
        key,
        prev_revision: q.prev_revision.map(Revision),
    };
    admit(&state, &cmd)?;
    let cmd = guard(&state, &caller, cmd)?;
    match propose(&state, cmd).await? {
        Response::Delete { revision, deleted } => Ok(Json(DeleteResponse { revision, deleted })),
        other => Err(unexpected(other)),
    }
}

/// `/v1/kv/` with nothing after it.
pub async fn empty_key() -> ApiError {
    ApiError::invalid("key must not be empty")
}

/// Map an applied response that is not the success shape of the call.
pub(crate) fn unexpected(resp: Response) -> ApiError {
    match resp {
        Response::Rejected { error } => error.into(),
        other => ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("unexpected applied result {other:?}"),
        ),
    }
}

/// `POST /v1/compact`: forget the key versions below a revision, on every node (etcd's
/// `Compact`). Reads below it and watches from it answer 410 `compacted` afterwards.
pub async fn compact(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(body): ApiJson<CompactRequest>,
) -> Result<Json<CompactResponse>, ApiError> {
    let cmd = Command::Compact {
        revision: Revision(body.revision),
    };
    admit(&state, &cmd)?;
    let cmd = guard(&state, &caller, cmd)?;
    match propose(&state, cmd).await? {
        Response::Compacted { compact_revision } => Ok(Json(CompactResponse {
            compact_revision,
            revision: state.consensus.view().applied().revision,
        })),
        other => Err(unexpected(other)),
    }
}
