//! The plain HTTP endpoints etcd serves on its client port beside gRPC and the gateway:
//!
//! - `GET /health`: etcd 3.4's health check. `{"health":"true"}` (200) when this member is
//!   ready as `/readyz` judges it (it knows a leader it heard from within an election timeout,
//!   and has applied what it knows to be committed: etcd asks for a leader, then for a read
//!   through Raft), and `{"health":"false"}` (503) otherwise. etcd also answers false while an
//!   alarm is raised; leasecore raises none (`Maintenance.Alarm` lists none: a full quota
//!   refuses writes with its own error). 3.5's `"reason"` is left out: clients read `health`.
//! - `GET /metrics`: the node's Prometheus text, the same as the client port's `/metrics`
//!   (`http::cluster::metrics_text`), process metrics included.
//!
//! Both are open, with auth on too (as etcd's: no token is asked for); TLS is the listener's.
//! Other methods are 405, as etcd's handler answers them.
//!
//! # What it must not do
//! Judge health itself: the verdict is `http::cluster::ready`'s.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::http::AppState;
use crate::http::cluster::{METRICS_CONTENT_TYPE, metrics_text, ready};

/// etcd's `GET /health`.
async fn health(State(state): State<AppState>) -> Response {
    let (status, body) = match ready(&state).await {
        Ok(()) => (StatusCode::OK, "{\"health\":\"true\"}\n"),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "{\"health\":\"false\"}\n"),
    };
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// etcd's `GET /metrics`.
async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        metrics_text(&state).await,
    )
        .into_response()
}

/// The routes, on the etcd listener beside the gRPC services and the gateway.
pub fn routes(state: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state)
}
