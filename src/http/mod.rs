//! The HTTP servers (axum): the client port (`/v1/...`, `/health`, `/metrics`) and the peer
//! port (`/raft/...`, Flease messages, forwarded calls), each with its own listener, connection
//! cap and timeouts ([`listener`]), so that misbehaving clients cannot starve peer traffic.
//!
//! # Invariants
//! - The client port serves only `Public` routes, the peer port only `Peer` routes: a peer
//!   route on the client port is an unknown route (404).
//! - The router is built only from [`route_table`], which is also what the OpenAPI test reads:
//!   a route cannot exist without being documented (or be documented without existing).
//! - Every error a client can cause is a JSON error document with a 4xx status
//!   ([`error::ApiError`]), including unknown routes, wrong methods and undecodable bodies.
//! - Every peer route but the status document (`OPEN_PEER_ROUTES`) sits behind
//!   [`peer_trust::gate`]: only members of the current membership are heard
//!   (`domain::peer_trust`).
//! - Handlers translate; they decide nothing. Rules live in `domain`.

pub mod auth;
pub mod cluster;
pub mod coalesce;
pub mod error;
pub mod extract;
pub mod flease;
pub mod kv;
pub mod leases;
pub mod listener;
pub mod members;
pub mod peer;
pub mod peer_stream;
pub mod peer_trust;
pub mod recipes;
pub mod snapshot;
pub mod txn;
pub mod ui;
pub mod watch;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{MethodRouter, delete, get, post, put};
use tokio_util::sync::CancellationToken;

use crate::domain::limits::Limits;
use crate::metrics::Metrics;
use crate::raft::consensus::{ClusterView, Consensus};
use crate::raft::network::routes;
use crate::runtime::flease::{FleaseService, MSG_ROUTE};
use crate::runtime::lease::LeaseService;
use crate::runtime::watch::WatchHub;
use error::ApiError;

/// The largest peer message (a snapshot frame).
pub const MAX_PEER_BODY_BYTES: usize = 1 << 30;

/// The peer routes open to any node, members or not: the status document (the same as the
/// public `GET /v1/cluster`), which a starting node asks its configured peers before it is a
/// member, and must get (a refusal would hide a running cluster from `domain::bootstrap`);
/// members ask it for each other's etcd URL too (`etcd::client_urls`). It asks for no token
/// either (`peer::status`).
const OPEN_PEER_ROUTES: [&str; 1] = [routes::STATUS];

/// The peer routes that may carry more than a client's largest body.
const BULK_PEER_ROUTES: [&str; 4] = [
    routes::APPEND,
    routes::SNAPSHOT,
    routes::LEASE_REMAINING,
    MSG_ROUTE,
];

/// What every handler can reach: one shared [`AppStateParts`]. axum clones the state for every
/// extractor and middleware of every request; one reference count to move instead of one per
/// part keeps that off the profile.
#[derive(Clone)]
pub struct AppState(Arc<AppStateParts>);

impl AppState {
    pub fn new(parts: AppStateParts) -> AppState {
        AppState(Arc::new(parts))
    }

    /// This node's view of the cluster as it serves it (`GET /v1/cluster`, `/raft/status`):
    /// with its etcd URL.
    pub fn cluster_view(&self) -> ClusterView {
        self.served(self.consensus.cluster_view())
    }

    /// `view` as this node serves it: with its etcd URL.
    pub fn served(&self, view: ClusterView) -> ClusterView {
        ClusterView {
            etcd_url: self.etcd_url.clone(),
            ..view
        }
    }
}

impl std::ops::Deref for AppState {
    type Target = AppStateParts;
    fn deref(&self) -> &AppStateParts {
        &self.0
    }
}

/// The parts of [`AppState`].
pub struct AppStateParts {
    pub consensus: Consensus,
    pub limits: Limits,
    pub metrics: Arc<Metrics>,
    pub leases: Arc<LeaseService>,
    pub watch: Arc<WatchHub>,
    pub flease: Arc<FleaseService>,
    pub auth: Arc<crate::runtime::auth::AuthService>,
    /// The peer streams this node serves (`peer_stream`).
    pub peer_streams: peer_stream::PeerStreams,
    /// This node's etcd client URL, if it serves the etcd API (`etcd::client_urls::own_url`).
    pub etcd_url: Option<String>,
}

/// Who a route is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Audience {
    /// Documented in api/openapi.yaml.
    Public,
    /// Node-to-node only.
    Peer,
}

/// One route.
pub struct RouteSpec {
    pub method: &'static str,
    pub path: &'static str,
    pub audience: Audience,
    pub handler: MethodRouter<AppState>,
}

fn spec(
    method: &'static str,
    path: &'static str,
    audience: Audience,
    handler: MethodRouter<AppState>,
) -> RouteSpec {
    RouteSpec {
        method,
        path,
        audience,
        handler,
    }
}

/// Every route the node serves.
pub fn route_table() -> Vec<RouteSpec> {
    use Audience::{Peer, Public};
    vec![
        spec("GET", "/health", Public, get(cluster::health)),
        spec("GET", "/livez", Public, get(cluster::livez)),
        spec("GET", "/readyz", Public, get(cluster::readyz)),
        spec("GET", "/metrics", Public, get(cluster::metrics)),
        spec("GET", "/version", Public, get(cluster::version)),
        spec("GET", "/ui", Public, get(ui::page)),
        spec("GET", "/ui/", Public, get(ui::page)),
        spec("GET", "/ui/app.js", Public, get(ui::script)),
        spec("GET", "/ui/style.css", Public, get(ui::style)),
        spec("GET", "/v1/kv", Public, get(kv::list)),
        spec("PUT", "/v1/kv/{*key}", Public, put(kv::put)),
        spec("GET", "/v1/kv/{*key}", Public, get(kv::get)),
        spec("DELETE", "/v1/kv/{*key}", Public, delete(kv::delete)),
        spec("POST", "/v1/leases", Public, post(leases::register)),
        spec("GET", "/v1/leases", Public, get(leases::list)),
        spec("GET", "/v1/leases/{name}", Public, get(leases::get)),
        spec(
            "DELETE",
            "/v1/leases/{name}",
            Public,
            delete(leases::revoke),
        ),
        spec(
            "POST",
            "/v1/leases/{name}/refresh",
            Public,
            post(leases::refresh),
        ),
        spec("GET", "/v1/watch", Public, get(watch::watch)),
        spec("POST", "/v1/watches", Public, post(watch::watch_many)),
        spec("POST", "/v1/members", Public, post(members::register)),
        spec("GET", "/v1/members", Public, get(members::list)),
        spec("DELETE", "/v1/members/{id}", Public, delete(members::leave)),
        spec("POST", "/v1/locks/{name}", Public, post(recipes::lock)),
        spec(
            "DELETE",
            "/v1/locks/{name}",
            Public,
            delete(recipes::unlock),
        ),
        spec("GET", "/v1/elections/{name}", Public, get(recipes::leader)),
        spec(
            "POST",
            "/v1/elections/{name}/campaign",
            Public,
            post(recipes::campaign),
        ),
        spec(
            "PUT",
            "/v1/elections/{name}/proclaim",
            Public,
            put(recipes::proclaim),
        ),
        spec(
            "POST",
            "/v1/elections/{name}/resign",
            Public,
            post(recipes::resign),
        ),
        spec(
            "POST",
            "/v1/members/{id}/heartbeat",
            Public,
            post(members::heartbeat),
        ),
        spec(
            "POST",
            "/v1/flease/{resource}/acquire",
            Public,
            post(flease::acquire),
        ),
        spec(
            "POST",
            "/v1/flease/{resource}/release",
            Public,
            post(flease::release),
        ),
        spec("GET", "/v1/flease/{resource}", Public, get(flease::get)),
        spec(
            "POST",
            "/v1/paxoslease/{resource}/acquire",
            Public,
            post(flease::paxos_acquire),
        ),
        spec(
            "POST",
            "/v1/paxoslease/{resource}/release",
            Public,
            post(flease::paxos_release),
        ),
        spec(
            "GET",
            "/v1/paxoslease/{resource}",
            Public,
            get(flease::paxos_get),
        ),
        spec("POST", "/v1/compact", Public, post(kv::compact)),
        spec("POST", "/v1/txn", Public, post(txn::txn_handler)),
        spec("GET", "/v1/cluster", Public, get(cluster::status)),
        spec("GET", "/v1/snapshot", Public, get(snapshot::save)),
        spec("POST", "/v1/cluster/nodes", Public, post(cluster::add_node)),
        spec(
            "POST",
            "/v1/cluster/leader",
            Public,
            post(cluster::move_leader),
        ),
        spec(
            "DELETE",
            "/v1/cluster/nodes/{id}",
            Public,
            delete(cluster::remove_node),
        ),
        spec(
            "POST",
            "/v1/auth/authenticate",
            Public,
            post(auth::authenticate),
        ),
        spec("GET", "/v1/auth/status", Public, get(auth::status)),
        spec("POST", "/v1/auth/enable", Public, post(auth::enable)),
        spec("POST", "/v1/auth/disable", Public, post(auth::disable)),
        spec("GET", "/v1/auth/users", Public, get(auth::user_list)),
        spec("POST", "/v1/auth/users", Public, post(auth::user_add)),
        spec("GET", "/v1/auth/users/{name}", Public, get(auth::user_get)),
        spec(
            "DELETE",
            "/v1/auth/users/{name}",
            Public,
            delete(auth::user_delete),
        ),
        spec(
            "PUT",
            "/v1/auth/users/{name}/password",
            Public,
            put(auth::user_passwd),
        ),
        spec(
            "PUT",
            "/v1/auth/users/{name}/roles/{role}",
            Public,
            put(auth::user_grant_role),
        ),
        spec(
            "DELETE",
            "/v1/auth/users/{name}/roles/{role}",
            Public,
            delete(auth::user_revoke_role),
        ),
        spec("GET", "/v1/auth/roles", Public, get(auth::role_list)),
        spec("POST", "/v1/auth/roles", Public, post(auth::role_add)),
        spec("GET", "/v1/auth/roles/{name}", Public, get(auth::role_get)),
        spec(
            "DELETE",
            "/v1/auth/roles/{name}",
            Public,
            delete(auth::role_delete),
        ),
        spec(
            "POST",
            "/v1/auth/roles/{name}/permissions",
            Public,
            post(auth::role_grant),
        ),
        spec(
            "DELETE",
            "/v1/auth/roles/{name}/permissions",
            Public,
            delete(auth::role_revoke),
        ),
        spec("POST", routes::APPEND, Peer, post(peer::append)),
        spec("GET", routes::STREAM, Peer, get(peer_stream::open)),
        spec("POST", routes::VOTE, Peer, post(peer::vote)),
        spec("POST", routes::PREVOTE, Peer, post(peer::prevote)),
        spec("POST", routes::SNAPSHOT, Peer, post(peer::snapshot)),
        spec("POST", routes::PROPOSE, Peer, post(peer::propose)),
        spec(
            "POST",
            routes::PROPOSE_BATCH,
            Peer,
            post(peer::propose_batch),
        ),
        spec(
            "POST",
            routes::PROPOSE_BATCH_APPLIED,
            Peer,
            post(peer::propose_batch_applied),
        ),
        spec("POST", routes::READ_INDEX, Peer, post(peer::read_index)),
        spec("POST", routes::ADMIN, Peer, post(peer::admin)),
        spec("POST", routes::MOVE_LEADER, Peer, post(peer::move_leader)),
        spec("POST", routes::TRANSFER, Peer, post(peer::transfer)),
        spec(
            "POST",
            routes::HISTORY_REACH,
            Peer,
            post(peer::history_reach),
        ),
        spec("POST", routes::HISTORY_PAGE, Peer, post(peer::history_page)),
        spec(
            "POST",
            crate::etcd::learner::ROUTE,
            Peer,
            post(crate::etcd::learner::peer_add),
        ),
        spec("POST", MSG_ROUTE, Peer, post(flease::peer_messages)),
        spec(
            "POST",
            routes::LEASE_REFRESH,
            Peer,
            post(peer::lease_refresh),
        ),
        spec("POST", routes::STATUS, Peer, post(peer::status)),
        spec(
            "POST",
            routes::LEASE_REMAINING,
            Peer,
            post(peer::lease_remaining),
        ),
    ]
}

/// Every route, client and peer, on one router.
pub fn router(state: AppState) -> Router {
    build(state, &[Audience::Public, Audience::Peer])
}

/// The client port's router: the `Public` routes only.
pub fn client_router(state: AppState) -> Router {
    build(state, &[Audience::Public])
}

/// The peer port's router: the `Peer` routes only.
pub fn peer_router(state: AppState) -> Router {
    build(state, &[Audience::Peer])
}

fn build(state: AppState, audiences: &[Audience]) -> Router {
    let client_limit = DefaultBodyLimit::max(state.limits.max_body_bytes());
    let mut public = Router::new();
    let mut peers = Router::new();
    let mut open_peers = Router::new();
    for r in route_table()
        .into_iter()
        .filter(|r| audiences.contains(&r.audience))
    {
        match r.audience {
            Audience::Public => public = public.route(r.path, r.handler),
            Audience::Peer if OPEN_PEER_ROUTES.contains(&r.path) => {
                open_peers = open_peers.route(r.path, r.handler.layer(client_limit))
            }
            // Only Raft's bulk messages (log entries, snapshots, Flease batches) and the
            // remaining-time lookups of a listing need more than a client's largest body.
            Audience::Peer if BULK_PEER_ROUTES.contains(&r.path) => {
                peers = peers.route(
                    r.path,
                    r.handler.layer(DefaultBodyLimit::max(MAX_PEER_BODY_BYTES)),
                )
            }
            Audience::Peer => peers = peers.route(r.path, r.handler.layer(client_limit)),
        }
    }
    if audiences.contains(&Audience::Peer) {
        // Every peer route but the open ones admits members only (`peer_trust::gate`); an
        // unknown path stays a 404. (A router without routes must not be given a route layer.)
        peers = peers.route_layer(middleware::from_fn_with_state(
            state.clone(),
            peer_trust::gate,
        ));
    }
    if audiences.contains(&Audience::Public) {
        // `/v1/kv/` names no key; answer it rather than calling it an unknown route.
        public = public.route(
            "/v1/kv/",
            get(kv::empty_key).put(kv::empty_key).delete(kv::empty_key),
        );
    }
    public
        .layer(client_limit)
        .merge(peers)
        .merge(open_peers)
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::map_response(end_json_with_newline))
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .with_state(state)
}

/// A JSON answer ends with a newline, so that `curl` output does not run into the
/// shell prompt (JSON parsers skip the whitespace). A small whole answer (in memory already)
/// is copied with its newline; any other is streamed on with one more chunk, never buffered.
/// A known `Content-Length` grows by one byte.
async fn end_json_with_newline(resp: Response) -> Response {
    /// Answers up to this size get their newline by a copy rather than a second chunk.
    const SMALL_JSON_BYTES: u64 = 16 << 10;
    use futures::StreamExt;
    let is_json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !is_json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // A whole body (every JSON answer but a long listing's) keeps a Content-Length; otherwise
    // hyper sends it chunked.
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let exact = http_body::Body::size_hint(&body).exact();
    if let Some(len) = exact.filter(|len| *len <= SMALL_JSON_BYTES) {
        // A small answer is in memory already: one buffer with its newline costs less than
        // a stream of two chunks (boxed, polled twice, written as one anyway).
        let bytes = match axum::body::to_bytes(body, SMALL_JSON_BYTES as usize).await {
            Ok(b) => b,
            // Unreachable for an in-memory body; say so rather than send half an answer.
            Err(e) => {
                tracing::error!(error = %e, "a JSON answer could not be read back");
                return axum::response::IntoResponse::into_response(ApiError::internal(
                    "the answer could not be produced",
                ));
            }
        };
        let mut with_newline = Vec::with_capacity(bytes.len() + 1);
        with_newline.extend_from_slice(&bytes);
        with_newline.push(b'\n');
        parts
            .headers
            .insert(axum::http::header::CONTENT_LENGTH, (len + 1).into());
        return Response::from_parts(parts, axum::body::Body::from(with_newline));
    }
    if let Some(len) = exact {
        parts
            .headers
            .insert(axum::http::header::CONTENT_LENGTH, (len + 1).into());
    }
    let newline = futures::stream::once(async { Ok(bytes::Bytes::from_static(b"\n")) });
    let body = axum::body::Body::from_stream(body.into_data_stream().chain(newline));
    Response::from_parts(parts, body)
}

async fn unknown_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn wrong_method() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not accept that method",
    )
}

/// Count and time every request by its route template.
#[allow(clippy::disallowed_methods)]
async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    // Both are reference-counted or inline: nothing is allocated per request.
    let route = req.extensions().get::<MatchedPath>().cloned();
    let method = req.method().clone();
    // Latency is an observation, not a decision: the one clock read outside clock.rs.
    let started = Instant::now();
    let resp = next.run(req).await;
    state.metrics.observe_request(
        method.as_str(),
        route.as_ref().map_or("unmatched", MatchedPath::as_str),
        resp.status().as_u16(),
        started.elapsed(),
    );
    resp
}

/// Serve until `cancel` fires, then finish in-flight requests and return (no connection
/// limits: the node serves through [`listener::serve_limited`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // Small answers must leave at once: Nagle's algorithm would hold a response's last
    // segment for the peer's delayed ACK (tens of milliseconds).
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await
}
