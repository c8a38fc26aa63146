//! The server side of peer streams (`raft::peer_stream`): `GET /raft/stream` upgrades a peer's
//! HTTP/1.1 connection, and a task then answers its frames one at a time until the peer
//! closes it, it idles past the peer listener's header timeout, or the node stops.
//!
//! The upgrade request passes [`super::peer_trust::gate`] like every peer request (the sender
//! is a member), and every frame is checked again: the sender must still be a member (a node
//! removed from the cluster loses its streams at its next message), and the frame goes through
//! the very checks of its HTTP route (`http::peer::append_answer`: decoding, the leader it
//! claims). A frame that fails them is answered `REFUSED` with the JSON error a 4xx would
//! carry; a frame whose length is impossible, or a read or write that times out, ends the
//! stream. A sender that closes the stream while its request is handled cancels the request
//! (the handler's future is dropped), as a closed HTTP connection cancels its handler.
//!
//! # Invariants
//! - At most [`MAX_PEER_STREAMS`] streams are served at once (an upgraded connection leaves
//!   the listener's connection table, so it is counted here instead); one more is refused
//!   with 429 before the upgrade (its sender then uses plain HTTP).
//! - Every stream task is tracked by the node's task tracker and ends when the node's token
//!   fires (between frames: a frame being handled finishes first).
//! - Frames over `raft::peer_stream::SMALL_FRAME` are read and handled within one budget for
//!   all streams, [`LARGE_FRAMES_BUDGET`] (`raft::peer_stream::FrameBudget`).
//!
//! # What it must not do
//! Decide: the rules are the HTTP routes' and `domain::peer_trust`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Extension;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::AppState;
use super::error::ApiError;
use super::peer_trust::{PeerSender, member_ids, refuse};
use crate::domain::peer_trust::{SENDER_HEADER, is_member};
use crate::domain::types::NodeId;
use crate::raft::network::routes;
use crate::raft::peer_stream::{self, ANSWERED, KIND_APPEND, KIND_REQUEST, REFUSED};

/// Peer streams served at once. A peer uses a few (its replication, and leadership
/// confirmations: `raft::peer_stream::MAX_IDLE_PER_PEER` idle at most); this leaves room for a
/// cluster of several dozen nodes, and bounds a misbehaving member.
pub const MAX_PEER_STREAMS: usize = 256;

/// The bytes of large peer frames that all streams together may hold at once: one frame of
/// the largest size a peer message may have.
pub const LARGE_FRAMES_BUDGET: usize = super::MAX_PEER_BODY_BYTES;

/// What the node's peer streams share: the node's task tracker and stop token, and the count.
pub struct PeerStreams {
    tasks: TaskTracker,
    cancel: CancellationToken,
    slots: Arc<Semaphore>,
    large_frames: peer_stream::FrameBudget,
    /// How long a stream may wait for its next frame (the peer listener's header timeout).
    idle: Duration,
    open: AtomicU64,
}

impl PeerStreams {
    pub fn new(tasks: TaskTracker, cancel: CancellationToken, idle: Duration) -> Self {
        PeerStreams {
            tasks,
            cancel,
            slots: Arc::new(Semaphore::new(MAX_PEER_STREAMS)),
            large_frames: peer_stream::FrameBudget::new(LARGE_FRAMES_BUDGET),
            idle,
            open: AtomicU64::new(0),
        }
    }

    /// Streams served now (for `/metrics`).
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }
}

/// `GET /raft/stream`: upgrade this connection to a peer stream.
pub async fn open(
    State(state): State<AppState>,
    Extension(PeerSender(sender)): Extension<PeerSender>,
    mut req: Request,
) -> Result<Response, ApiError> {
    let asked = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(peer_stream::PROTOCOL));
    if !asked {
        return Err(ApiError::invalid(format!(
            "a peer stream is asked with `Upgrade: {}`",
            peer_stream::PROTOCOL
        )));
    }
    let Some(upgrade) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() else {
        return Err(ApiError::invalid(
            "this connection cannot be upgraded (peer streams need HTTP/1.1)",
        ));
    };
    let Ok(slot) = state.peer_streams.slots.clone().try_acquire_owned() else {
        // The peer then sends over plain HTTP (any answer but 101 means that).
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_requests",
            format!("this node serves at most {MAX_PEER_STREAMS} peer streams"),
        ));
    };
    let streams = &state.peer_streams;
    streams.open.fetch_add(1, Ordering::Relaxed);
    let task_state = state.clone();
    streams.tasks.spawn(async move {
        match upgrade.await {
            Ok(io) => serve(&task_state, sender, TokioIo::new(io)).await,
            Err(e) => tracing::debug!(error = %e, peer = sender, "peer stream upgrade failed"),
        }
        task_state.peer_streams.open.fetch_sub(1, Ordering::Relaxed);
        drop(slot);
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, peer_stream::PROTOCOL)
        .body(Body::empty())
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// Answer `sender`'s frames until the stream ends.
async fn serve<IO>(state: &AppState, sender: NodeId, io: IO)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let (cancel, idle) = (&state.peer_streams.cancel, state.peer_streams.idle);
    let budget = &state.peer_streams.large_frames;
    let mut io = BufReader::new(io);
    // The peer routes, for tunneled requests: built for this stream when first needed, and
    // dropped with it (the state cannot hold its own router).
    let mut router: Option<axum::Router> = None;
    loop {
        let next = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(
                idle,
                peer_stream::read_frame_within(&mut io, super::MAX_PEER_BODY_BYTES, Some(budget)),
            ) => r,
        };
        // `_share`: a large frame's part of the budget, held until its answer is written.
        let ((kind, payload), _share) = match next {
            Ok(Ok(Some(frame))) => frame,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, peer = sender, "peer stream ended");
                return;
            }
            Err(_) => {
                tracing::debug!(peer = sender, "peer stream idle too long: closed");
                return;
            }
        };
        let work = async {
            if kind == KIND_REQUEST {
                let router = router.get_or_insert_with(|| super::peer_router(state.clone()));
                tunneled(router.clone(), sender, payload).await
            } else {
                answer(state, sender, kind, &payload).await
            }
        };
        // A sender that leaves before its answer cancels its request, as closing an HTTP
        // connection cancels its handler (a transfer's "hold elections" call lasts exactly as
        // long as the leader's call). It may send nothing while it waits: anything it sends
        // ends the stream too.
        let answer = tokio::select! {
            answer = work => answer,
            _ = io.fill_buf() => {
                tracing::debug!(peer = sender, "peer stream: the sender left before its answer");
                return;
            }
        };
        let written =
            tokio::time::timeout(idle, peer_stream::write_frame(io.get_mut(), &answer)).await;
        if !matches!(written, Ok(Ok(()))) {
            tracing::debug!(
                peer = sender,
                "peer stream: the answer could not be written"
            );
            return;
        }
    }
}

/// The answer frame to one request frame.
async fn answer(state: &AppState, sender: NodeId, kind: u8, payload: &[u8]) -> Vec<u8> {
    let members = member_ids(&state.consensus);
    let answered = match is_member(sender, &members) {
        Err(why) => Err(refuse(state, why, Some(sender), routes::STREAM)),
        Ok(()) => match kind {
            KIND_APPEND => super::peer::append_answer(state, sender, payload)
                .await
                .and_then(|doc| {
                    serde_json::to_vec(&doc).map_err(|e| ApiError::internal(e.to_string()))
                }),
            other => Err(ApiError::invalid(format!(
                "unknown peer stream request kind {other}"
            ))),
        },
    };
    match answered {
        // An answer is a small document (an append's outcome): it always fits a frame.
        Ok(doc) => peer_stream::frame(ANSWERED, &doc)
            .unwrap_or_else(|e| refused(ApiError::internal(e.to_string()))),
        Err(e) => refused(e),
    }
}

/// The frame of a refusal: the JSON error a 4xx HTTP answer would carry.
fn refused(e: ApiError) -> Vec<u8> {
    // An error document always fits a frame; the bare status byte is the impossible case.
    peer_stream::frame(REFUSED, e.body().to_string().as_bytes())
        .unwrap_or_else(|_| vec![0, 0, 0, 1, REFUSED])
}

/// Answer a tunneled request as the peer router answers it over HTTP: as if `sender` had
/// sent it (the sender header is the stream's, whatever the payload says), through the gate,
/// the route's body limit and its handler.
async fn tunneled(router: axum::Router, sender: NodeId, payload: Vec<u8>) -> Vec<u8> {
    use tower::ServiceExt;
    let request = match peer_stream::parse_request(&payload) {
        Ok((path, content_type, body)) => {
            // The body is the payload's tail: handed on without a copy.
            let body_at = payload.len() - body.len();
            let request = axum::http::Request::post(path)
                .header(header::CONTENT_TYPE, content_type)
                .header(SENDER_HEADER, sender.to_string());
            let body = bytes::Bytes::from(payload).slice(body_at..);
            match request.body(Body::from(body)) {
                Ok(r) => r,
                Err(e) => return refused(ApiError::invalid(format!("a tunneled request: {e}"))),
            }
        }
        Err(why) => return refused(ApiError::invalid(why)),
    };
    let Ok(response) = router.oneshot(request).await;
    let status = response.status().as_u16();
    match axum::body::to_bytes(response.into_body(), super::MAX_PEER_BODY_BYTES).await {
        Ok(body) => peer_stream::answer_frame(status, &body)
            .unwrap_or_else(|e| refused(ApiError::internal(e.to_string()))),
        Err(e) => refused(ApiError::internal(format!(
            "the answer could not be read: {e}"
        ))),
    }
}
