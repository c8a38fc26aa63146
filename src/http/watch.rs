//! `GET /v1/watch`: follow changes by key or prefix from a revision, as a long poll or as a
//! Server-Sent Events stream (when the client accepts `text/event-stream`).
//!
//! Served by any node from its applied history: a watcher that moves to another node and
//! resumes from its last revision misses nothing that node still retains, and is told
//! `410 compacted` otherwise (it then re-lists and watches from the listing's revision + 1).

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde::Deserialize;

use super::AppState;
use super::auth::{can_read, check, keep_visible};
use super::error::ApiError;
use super::extract::ApiQuery;
use crate::domain::auth::{Access, KeyRange};
use crate::domain::history::{Compacted, KeyFilter, Resume};
use crate::domain::types::Revision;
use crate::domain::watch_batch::BatchLimit;
use crate::runtime::auth::Caller;
use crate::wire::WatchResponse;

/// Default and longest long-poll wait.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;
pub const MAX_TIMEOUT_MS: u64 = 300_000;
/// The most events in one answer.
pub const MAX_BATCH: usize = 1000;
/// How long one SSE poll of the history waits before sending a progress comment.
const SSE_PROGRESS: Duration = Duration::from_secs(15);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchQuery {
    key: Option<String>,
    prefix: Option<String>,
    from_revision: Option<u64>,
    timeout_ms: Option<u64>,
    limit: Option<usize>,
}

/// The revision in `Last-Event-ID`, if the client sent one.
fn last_event_id(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    headers
        .get("last-event-id")
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|id| *id < u64::MAX)
                .ok_or_else(|| ApiError::invalid("Last-Event-ID must be a revision"))
        })
        .transpose()
}

fn compacted(c: Compacted) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::GONE,
        "compacted",
        format!(
            "events up to revision {} are no longer retained: list the keys and watch from the listing's revision + 1",
            c.compacted
        ),
    )
    .with("compact_revision", c.compacted.0)
}

/// The keys a filter can match, for the permission check.
fn filter_range(filter: &KeyFilter) -> KeyRange {
    match filter {
        KeyFilter::Key(k) => KeyRange::of_stored(k),
        KeyFilter::Prefix(p) => KeyRange::prefix(p),
    }
}

pub async fn watch(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<WatchQuery>,
) -> Result<Response, ApiError> {
    let filter = match (q.key, q.prefix) {
        (Some(_), Some(_)) => return Err(ApiError::invalid("give key or prefix, not both")),
        (Some(k), None) => {
            state.limits.check_key(&k)?;
            KeyFilter::Key(k)
        }
        (None, p) => KeyFilter::Prefix(p.unwrap_or_default()),
    };
    // As etcd: a watch needs read on its whole range when it starts; each event is checked
    // again when it is delivered.
    check(&state, &caller, Access::Read, &filter_range(&filter))?;
    let timeout_ms = q.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
    if timeout_ms > MAX_TIMEOUT_MS {
        return Err(ApiError::invalid(format!(
            "timeout_ms must be at most {MAX_TIMEOUT_MS}"
        )));
    }
    let limit = q.limit.unwrap_or(MAX_BATCH);
    if limit == 0 || limit > MAX_BATCH {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {MAX_BATCH}"
        )));
    }
    // SSE resumes from the id of the last event the client saw. It wins over `from_revision`:
    // a browser reconnects with the original URL, and starting over would repeat events.
    let last_event_id = last_event_id(&headers)?;
    let from = match (last_event_id, q.from_revision) {
        (Some(id), _) => Some(Revision(id + 1)),
        (None, Some(0)) => return Err(ApiError::invalid("from_revision starts at 1")),
        (None, Some(f)) => Some(Revision(f)),
        (None, None) => None,
    };
    let wants_stream = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    if wants_stream {
        let from = from.unwrap_or_else(|| state.watch.current().next());
        // Fail fast with a proper status if the start is already compacted.
        state
            .watch
            .watch(
                &filter,
                Some(from),
                Duration::ZERO,
                BatchLimit::events(1),
                Resume::AfterMark,
            )
            .await
            .map_err(compacted)?;
        return Ok(Sse::new(event_stream(state, caller, filter, from))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let mut batch = state
        .watch
        .watch(
            &filter,
            from,
            Duration::from_millis(timeout_ms),
            BatchLimit::events(limit),
            Resume::AfterMark,
        )
        .await
        .map_err(compacted)?;
    keep_visible(&state, &caller, &mut batch.events);
    Ok(Json(WatchResponse {
        revision: batch.through,
        events: batch.events,
    })
    .into_response())
}

/// One SSE message per event (`id` = its revision, `event` = put or delete); a progress
/// comment when nothing happens; a final `compacted` message if the stream falls behind the
/// retained history.
fn event_stream(
    state: AppState,
    caller: Caller,
    filter: KeyFilter,
    from: Revision,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    use futures::StreamExt;
    futures::stream::unfold(Some(from), move |next| {
        let state = state.clone();
        let caller = caller.clone();
        let filter = filter.clone();
        async move {
            let from = next?;
            if state.watch.is_closed() {
                return None; // the node is shutting down
            }
            let messages: Vec<SseEvent> = match state
                .watch
                .watch(
                    &filter,
                    Some(from),
                    SSE_PROGRESS,
                    BatchLimit::events(MAX_BATCH),
                    Resume::AfterMark,
                )
                .await
            {
                Ok(mut batch) => {
                    keep_visible(&state, &caller, &mut batch.events);
                    // Never backwards: a node behind the client's start reports less than it.
                    let resume = from.max(batch.through.next());
                    let ends = revision_ends(&batch.events);
                    let mut out: Vec<SseEvent> = batch
                        .events
                        .iter()
                        .zip(ends)
                        .map(|(e, last)| {
                            sse_event(e, last)
                                .json_data(e)
                                .unwrap_or_else(|_| SseEvent::default().comment("unencodable"))
                        })
                        .collect();
                    if out.is_empty() {
                        out.push(
                            SseEvent::default()
                                .comment(format!("progress revision={}", batch.through)),
                        );
                    }
                    return Some((out, Some(resume)));
                }
                Err(c) => vec![
                    SseEvent::default()
                        .event("compacted")
                        .data(format!("{{\"compact_revision\":{}}}", c.compacted)),
                ],
            };
            Some((messages, None))
        }
    })
    .flat_map(|messages| futures::stream::iter(messages.into_iter().map(Ok)))
}

/// An SSE message for `e`: its kind as the event name, and its revision as the message id
/// only if it is the last message of that revision. A browser resumes from `Last-Event-ID +
/// 1`: an id in the middle of a revision would make it skip the rest of that revision.
fn sse_event(e: &crate::domain::command::Event, last_of_revision: bool) -> SseEvent {
    let kind = match e.kind {
        crate::domain::command::EventKind::Put => "put",
        crate::domain::command::EventKind::Delete => "delete",
    };
    let msg = SseEvent::default().event(kind);
    if last_of_revision {
        msg.id(e.revision.to_string())
    } else {
        msg
    }
}

/// For each event, whether it is the last of its revision in the list.
fn revision_ends(events: &[crate::domain::command::Event]) -> Vec<bool> {
    revision_ends_of(events.iter().map(|e| e.revision))
}

fn revision_ends_of(revisions: impl Iterator<Item = Revision>) -> Vec<bool> {
    let revisions: Vec<Revision> = revisions.collect();
    (0..revisions.len())
        .map(|i| revisions.get(i + 1) != Some(&revisions[i]))
        .collect()
}

/// The most watches one `POST /v1/watches` stream may carry.
pub const MAX_WATCHES: usize = 10_000;

/// Body of `POST /v1/watches`: many watches on one stream, from one revision.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchManyRequest {
    watches: Vec<WatchSpec>,
    from_revision: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchSpec {
    id: String,
    key: Option<String>,
    prefix: Option<String>,
}

/// One event and the watches of the stream it matches.
#[derive(serde::Serialize)]
struct MatchedEvent<'a> {
    watches: Vec<&'a str>,
    event: &'a crate::domain::command::Event,
}

/// `POST /v1/watches`: one SSE stream for many watches (as etcd multiplexes watches on one
/// gRPC stream). Each message is one event with the ids of the watches it matches; the stream
/// wakes once per applied batch whatever the number of watches, and matches through an index.
pub async fn watch_many(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    super::extract::ApiJson(req): super::extract::ApiJson<WatchManyRequest>,
) -> Result<Response, ApiError> {
    if req.watches.is_empty() || req.watches.len() > MAX_WATCHES {
        return Err(ApiError::invalid(format!(
            "give 1 to {MAX_WATCHES} watches"
        )));
    }
    let mut ids = std::collections::HashSet::new();
    let mut filters = Vec::with_capacity(req.watches.len());
    for w in req.watches {
        if w.id.is_empty() || w.id.len() > 128 {
            return Err(ApiError::invalid("a watch id must be 1 to 128 bytes"));
        }
        if !ids.insert(w.id.clone()) {
            return Err(ApiError::invalid(format!(
                "watch id {:?} is repeated",
                w.id
            )));
        }
        let filter = match (w.key, w.prefix) {
            (Some(k), None) => {
                state.limits.check_key(&k)?;
                KeyFilter::Key(k)
            }
            (None, Some(p)) => {
                if !p.is_empty() {
                    state.limits.check_key(&p)?;
                }
                KeyFilter::Prefix(p)
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "watch {:?}: give key or prefix (\"\" for every key), not both",
                    w.id
                )));
            }
        };
        check(&state, &caller, Access::Read, &filter_range(&filter))?;
        filters.push((w.id, filter));
    }
    let last_event_id = last_event_id(&headers)?;
    let from = match (last_event_id, req.from_revision) {
        (Some(id), _) => Revision(id + 1),
        (None, Some(0)) => return Err(ApiError::invalid("from_revision starts at 1")),
        (None, Some(f)) => Revision(f),
        (None, None) => state.watch.current().next(),
    };
    state
        .watch
        .since_all(from, BatchLimit::events(1))
        .map_err(compacted)?;
    let set = std::sync::Arc::new(crate::domain::history::FilterSet::new(filters));
    Ok(Sse::new(matched_stream(state, caller, set, from))
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn matched_stream(
    state: AppState,
    caller: Caller,
    set: std::sync::Arc<crate::domain::history::FilterSet>,
    from: Revision,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    use futures::StreamExt;
    let revisions = state.watch.revisions();
    futures::stream::unfold(Some((from, revisions)), move |cursor| {
        let state = state.clone();
        let caller = caller.clone();
        let set = set.clone();
        async move {
            let (mut from, mut revisions) = cursor?;
            loop {
                if state.watch.is_closed() {
                    return None;
                }
                // Seen before reading: anything applied after the read shows as a change.
                revisions.borrow_and_update();
                let batch = match state.watch.since_all(from, BatchLimit::events(MAX_BATCH)) {
                    Ok(b) => b,
                    Err(c) => {
                        let gone = SseEvent::default()
                            .event("compacted")
                            .data(format!("{{\"compact_revision\":{}}}", c.compacted));
                        return Some((vec![gone], None));
                    }
                };
                from = batch.through.next();
                let visible: Vec<(&crate::domain::command::Event, Vec<&str>)> = batch
                    .events
                    .iter()
                    .filter_map(|e| {
                        let watches = set.matching(&e.key);
                        (!watches.is_empty() && can_read(&state, &caller, &e.key))
                            .then_some((e, watches))
                    })
                    .collect();
                let ends = revision_ends_of(visible.iter().map(|(e, _)| e.revision));
                let out: Vec<SseEvent> = visible
                    .into_iter()
                    .zip(ends)
                    .map(|((e, watches), last)| {
                        sse_event(e, last)
                            .json_data(MatchedEvent { watches, event: e })
                            .unwrap_or_else(|_| SseEvent::default().comment("unencodable"))
                    })
                    .collect();
                if !out.is_empty() {
                    return Some((out, Some((from, revisions))));
                }
                if !batch.events.is_empty() {
                    continue; // events for other keys: read on
                }
                let changed = tokio::select! {
                    c = tokio::time::timeout(SSE_PROGRESS, revisions.changed()) => c,
                    _ = state.watch.closed() => return None,
                };
                match changed {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return None, // the hub is gone: shutting down
                    Err(_) => {
                        let progress = SseEvent::default()
                            .comment(format!("progress revision={}", batch.through));
                        return Some((vec![progress], Some((from, revisions))));
                    }
                }
            }
        }
    })
    .flat_map(|messages| futures::stream::iter(messages.into_iter().map(Ok)))
}
