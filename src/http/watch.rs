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
use super::error::ApiError;
use super::extract::ApiQuery;
use crate::domain::history::{Compacted, KeyFilter};
use crate::domain::types::Revision;
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

pub async fn watch(
    State(state): State<AppState>,
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
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|id| *id < u64::MAX)
                .ok_or_else(|| ApiError::invalid("Last-Event-ID must be a revision"))?,
        ),
    };
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
            .watch(&filter, Some(from), Duration::ZERO, 1)
            .await
            .map_err(compacted)?;
        return Ok(Sse::new(event_stream(state, filter, from))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let batch = state
        .watch
        .watch(&filter, from, Duration::from_millis(timeout_ms), limit)
        .await
        .map_err(compacted)?;
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
    filter: KeyFilter,
    from: Revision,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    use futures::StreamExt;
    futures::stream::unfold(Some(from), move |next| {
        let state = state.clone();
        let filter = filter.clone();
        async move {
            let from = next?;
            if state.watch.is_closed() {
                return None; // the node is shutting down
            }
            let messages: Vec<SseEvent> = match state
                .watch
                .watch(&filter, Some(from), SSE_PROGRESS, MAX_BATCH)
                .await
            {
                Ok(batch) => {
                    let resume = batch.through.next();
                    let mut out: Vec<SseEvent> = batch
                        .events
                        .iter()
                        .map(|e| {
                            let kind = match e.kind {
                                crate::domain::command::EventKind::Put => "put",
                                crate::domain::command::EventKind::Delete => "delete",
                            };
                            SseEvent::default()
                                .id(e.revision.to_string())
                                .event(kind)
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
