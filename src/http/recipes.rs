//! `/v1/locks` and `/v1/elections`: distributed locks and leader election over HTTP, as
//! etcd's v3lock and v3election services, usable with curl.
//!
//! Both are the same queue (`domain::recipes`): a contender puts its key
//! (`locks/<name>/<lease>`, attached to its lease, only if absent), lists the queue
//! linearizably, and either holds (the oldest key) or long-polls the watch hub for the
//! deletion of the key just before its own. The answer is 200 once it holds, or 202 when
//! `timeout_ms` passes first: it is still queued (its key stays), and the same call again
//! goes on waiting in the same place; `DELETE` (unlock, resign) or the lease's expiry leaves.
//!
//! # What it must not do
//! Decide the order (the domain does, from create revisions), or hold anything across a wait
//! except its own request: a waiter costs one parked long poll and no polling.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response as HttpResponse};
use serde::Deserialize;

use super::AppState;
use super::auth::{check, guard};
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath, ApiQuery};
use super::kv::{admit, propose, unexpected};
use crate::clock::{Clock, SystemClock};
use crate::domain::auth::{Access, KeyRange};
use crate::domain::command::{Command, EventKind, KvError, Response};
use crate::domain::history::{KeyFilter, Resume};
use crate::domain::limits::Limits;
use crate::domain::recipes::{self, Position, Recipe};
use crate::domain::types::Revision;
use crate::domain::watch_batch::BatchLimit;
use crate::runtime::auth::Caller;
use crate::wire::{
    ContendRequest, Leadership, LeaseRef, ProclaimRequest, Proclaimed, Released, Standing,
};

/// The default and the longest wait of one call.
const DEFAULT_WAIT_MS: u64 = 30_000;
const MAX_WAIT_MS: u64 = 300_000;
/// The most contenders one queue lists (a queue longer than this is refused).
const MAX_QUEUE: usize = 100_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnlockQuery {
    pub lease: String,
}

pub async fn lock(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<ContendRequest>,
) -> Result<HttpResponse, ApiError> {
    Limits::check_text_value(&req.value)?;
    contend(&state, &caller, Recipe::Lock, &name, req)
        .await
        .map(answer)
}

pub async fn unlock(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<UnlockQuery>,
) -> Result<Json<Released>, ApiError> {
    leave(&state, &caller, Recipe::Lock, &name, &q.lease).await
}

pub async fn campaign(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<ContendRequest>,
) -> Result<HttpResponse, ApiError> {
    Limits::check_text_value(&req.value)?;
    contend(&state, &caller, Recipe::Election, &name, req)
        .await
        .map(answer)
}

pub async fn resign(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<LeaseRef>,
) -> Result<Json<Released>, ApiError> {
    leave(&state, &caller, Recipe::Election, &name, &req.lease).await
}

/// `PUT /v1/elections/{name}/proclaim`: [`proclaim_value`], for a value that does not begin
/// with U+0000 ([`Limits::check_text_value`]).
pub async fn proclaim(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<ProclaimRequest>,
) -> Result<Json<Proclaimed>, ApiError> {
    Limits::check_text_value(&req.value)?;
    proclaim_value(&state, &caller, Recipe::Election, name, req)
        .await
        .map(Json)
}

/// Change the leader's value: only the leader, only while it leads (the put is conditional on
/// the key's revision, so a leader that lost its key meanwhile is refused). The etcd API's
/// Proclaim calls it with its value's stored form.
pub(crate) async fn proclaim_value(
    state: &AppState,
    caller: &Caller,
    recipe: Recipe,
    name: String,
    req: ProclaimRequest,
) -> Result<Proclaimed, ApiError> {
    let key = checked_key(state, recipe, &name, &req.lease)?;
    let (queue, _) = list_queue(state, caller, recipe, &name).await?;
    let mine = match recipes::position(&queue.order, &key) {
        Position::Holder => queue.entry(&key).expect("the holder is listed"),
        Position::After { .. } => {
            return Err(not_leader(&name, &key));
        }
        Position::Gone => return Err(gone(recipe, &name, &key)),
    };
    let cmd = Command::Put {
        key: key.clone(),
        value: req.value,
        lease: Some(req.lease),
        prev_revision: Some(mine.mod_revision),
    };
    admit(state, &cmd)?;
    let cmd = guard(state, caller, cmd)?;
    match propose(state, cmd).await {
        Ok(Response::Put { revision }) => Ok(Proclaimed {
            name,
            key,
            revision,
        }),
        // The key changed or went since the listing: this contender no longer leads as it was.
        Ok(Response::Rejected {
            error: KvError::RevisionMismatch { .. },
        }) => Err(not_leader(&name, &key)),
        Ok(other) => Err(unexpected(other)),
        Err(e) => Err(e),
    }
}

/// The leader of an election and its value.
pub async fn leader(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Leadership>, ApiError> {
    leadership(&state, &caller, Recipe::Election, name)
        .await
        .map(Json)
}

/// The leader of `recipe`'s election `name` and its value (404 `no_leader_elected` while
/// there is none; the etcd API's Leader and Observe read it too).
pub(crate) async fn leadership(
    state: &AppState,
    caller: &Caller,
    recipe: Recipe,
    name: String,
) -> Result<Leadership, ApiError> {
    recipe
        .check_name("election name", &name)
        .map_err(ApiError::invalid)?;
    let (queue, store_revision) = list_queue(state, caller, recipe, &name).await?;
    let Some((key, _)) = recipes::holder(&queue.order) else {
        return Err(ApiError::not_found(
            "no_leader_elected",
            format!("election {name:?} has no leader"),
        )
        .with("name", name)
        .with("revision", store_revision.0));
    };
    let entry = queue.entry(key).expect("the holder is listed");
    Ok(Leadership {
        name,
        key: key.clone(),
        lease: entry.lease.clone().unwrap_or_default(),
        value: entry.value.clone(),
        revision: entry.create_revision,
        mod_revision: entry.mod_revision,
        store_revision,
    })
}

/// The contender key of `lease` in `name`'s queue, after checking both names.
fn checked_key(
    state: &AppState,
    recipe: Recipe,
    name: &str,
    lease: &str,
) -> Result<String, ApiError> {
    let what = match recipe {
        Recipe::Lock | Recipe::EtcdLock => "lock name",
        Recipe::Election | Recipe::EtcdElection => "election name",
    };
    recipe.check_name(what, name).map_err(ApiError::invalid)?;
    recipes::check_name("lease", lease).map_err(ApiError::invalid)?;
    let key = recipe.key(name, lease);
    state.limits.check_key(&key)?;
    Ok(key)
}

/// 200 with the standing once it holds, 202 while it is still queued.
fn answer(s: Standing) -> HttpResponse {
    let status = if s.held {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    (status, Json(s)).into_response()
}

/// Queue up (if not yet) and wait until holding, or until the call's wait is over (the etcd
/// API's Lock and Campaign call it too).
pub(crate) async fn contend(
    state: &AppState,
    caller: &Caller,
    recipe: Recipe,
    name: &str,
    req: ContendRequest,
) -> Result<Standing, ApiError> {
    let wait_ms = req.timeout_ms.unwrap_or(DEFAULT_WAIT_MS);
    if wait_ms > MAX_WAIT_MS {
        return Err(ApiError::invalid(format!(
            "timeout_ms must be at most {MAX_WAIT_MS}"
        )));
    }
    let key = checked_key(state, recipe, name, &req.lease)?;
    enqueue(state, caller, &key, &req.lease, req.value).await?;
    let clock = SystemClock::new();
    let deadline = clock.mono().plus(wait_ms);
    loop {
        let (queue, listed_at) = list_queue(state, caller, recipe, name).await?;
        let mine = match recipes::position(&queue.order, &key) {
            Position::Gone => return Err(gone(recipe, name, &key)),
            Position::Holder => {
                let revision = queue.entry(&key).expect("listed").create_revision;
                return Ok(standing(name, &key, &req.lease, true, revision, None));
            }
            Position::After { key: before, .. } => (before, queue.entry(&key).expect("listed")),
        };
        let (before, entry) = mine;
        if clock.mono() >= deadline {
            let revision = entry.create_revision;
            return Ok(standing(
                name,
                &key,
                &req.lease,
                false,
                revision,
                Some(before),
            ));
        }
        // Wait for the predecessor's deletion only: the events of one key from just after
        // the listing (nothing between the listing and the wait is missed).
        wait_for_delete(state, &before, listed_at.next(), &clock, deadline).await;
    }
}

/// Block (until `deadline` on `clock`) until `key` is deleted after `from`, or the history
/// moved past it.
async fn wait_for_delete(
    state: &AppState,
    key: &str,
    from: Revision,
    clock: &SystemClock,
    deadline: crate::domain::types::MonoMillis,
) {
    let filter = KeyFilter::Key(key.to_string());
    let mut from = from;
    loop {
        let left = clock.mono().until(deadline);
        if left == 0 {
            return;
        }
        match state
            .watch
            .watch(
                &filter,
                Some(from),
                Duration::from_millis(left),
                BatchLimit::events(64),
                Resume::AfterMark,
            )
            .await
        {
            Ok(batch) => {
                if batch.events.iter().any(|e| e.kind == EventKind::Delete) {
                    return;
                }
                from = batch.through.next();
            }
            // Compacted past the listing: list again rather than risk missing the deletion.
            Err(_) => return,
        }
    }
}

/// Put the contender's key if it is not there; a key already there with the same lease is
/// this contender's (a repeated call keeps its place).
async fn enqueue(
    state: &AppState,
    caller: &Caller,
    key: &str,
    lease: &str,
    value: String,
) -> Result<(), ApiError> {
    let cmd = Command::Put {
        key: key.to_string(),
        value,
        lease: Some(lease.to_string()),
        prev_revision: Some(Revision(0)),
    };
    admit(state, &cmd)?;
    let cmd = guard(state, caller, cmd)?;
    match propose(state, cmd).await {
        Ok(Response::Put { .. }) => Ok(()),
        Ok(Response::Rejected {
            error: KvError::RevisionMismatch { .. },
        }) => {
            state.consensus.read_barrier().await?;
            match state.consensus.view().get(key).1 {
                Some(v) if v.lease.as_deref() == Some(lease) => Ok(()),
                // Written by hand, or attached to nothing: not a contender's key.
                _ => Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "key_exists",
                    format!("key {key:?} exists and is not held by lease {lease:?}"),
                )
                .with("key", key)),
            }
        }
        Ok(other) => Err(unexpected(other)),
        Err(e) => Err(e),
    }
}

/// Leave a queue: delete the contender's key (unlock, resign). Idempotent.
pub(crate) async fn leave(
    state: &AppState,
    caller: &Caller,
    recipe: Recipe,
    name: &str,
    lease: &str,
) -> Result<Json<Released>, ApiError> {
    let key = checked_key(state, recipe, name, lease)?;
    let cmd = Command::Delete {
        key: key.clone(),
        prev_revision: None,
    };
    admit(state, &cmd)?;
    let cmd = guard(state, caller, cmd)?;
    match propose(state, cmd).await? {
        Response::Delete { revision, deleted } => Ok(Json(Released {
            name: name.to_string(),
            key,
            revision,
            released: deleted > 0,
        })),
        other => Err(unexpected(other)),
    }
}

/// One contender's key in a listing.
struct Entry {
    key: String,
    value: String,
    lease: Option<String>,
    create_revision: Revision,
    mod_revision: Revision,
}

struct Queue {
    order: Vec<(String, Revision)>,
    entries: Vec<Entry>,
}

impl Queue {
    fn entry(&self, key: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.key == key)
    }
}

/// The queue of `name`, linearizably, and the store revision it was read at.
async fn list_queue(
    state: &AppState,
    caller: &Caller,
    recipe: Recipe,
    name: &str,
) -> Result<(Queue, Revision), ApiError> {
    state.consensus.read_barrier().await?;
    let prefix = recipe.queue(name);
    check(state, caller, Access::Read, &KeyRange::prefix(&prefix))?;
    let (revision, items) = state.consensus.view().list(&prefix, MAX_QUEUE + 1);
    if items.len() > MAX_QUEUE {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "queue_full",
            format!("{prefix} holds more than {MAX_QUEUE} contenders"),
        ));
    }
    let entries: Vec<Entry> = items
        .into_iter()
        .map(|(key, v)| Entry {
            key,
            value: v.value,
            lease: v.lease,
            create_revision: v.create_revision,
            mod_revision: v.mod_revision,
        })
        .collect();
    let order = entries
        .iter()
        .map(|e| (e.key.clone(), e.create_revision))
        .collect();
    Ok((Queue { order, entries }, revision))
}

fn standing(
    name: &str,
    key: &str,
    lease: &str,
    held: bool,
    revision: Revision,
    waiting_for: Option<String>,
) -> Standing {
    Standing {
        name: name.to_string(),
        key: key.to_string(),
        lease: lease.to_string(),
        held,
        revision,
        waiting_for,
    }
}

fn gone(recipe: Recipe, name: &str, key: &str) -> ApiError {
    let what = match recipe {
        Recipe::Lock | Recipe::EtcdLock => "lock",
        Recipe::Election | Recipe::EtcdElection => "election",
    };
    ApiError::new(
        StatusCode::CONFLICT,
        "contender_gone",
        format!(
            "{key:?} left the {what} {name:?} while waiting (its lease expired or was revoked, \
             or it was unlocked): nothing is held"
        ),
    )
    .with("key", key)
}

fn not_leader(name: &str, key: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "not_leader",
        format!("{key:?} does not lead the election {name:?}"),
    )
    .with("key", key)
}
