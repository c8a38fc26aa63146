//! etcd's gRPC-JSON gateway on the etcd port: `POST /v3/...` with a JSON body, answered in
//! proto3's JSON mapping with etcd's settings (proto field names, bytes in base64, 64-bit
//! integers as strings, zero values left out, enums by name; enums and 64-bit integers are
//! read as names or numbers, strings or numbers; unknown fields ignored), and
//! `GET /version`. Every route is served under `/v3beta/...` too, as etcd 3.4 serves it (for
//! clients written against etcd 3.3, such as etcd3gw pinned to that path); `/v3alpha` is not,
//! as in etcd 3.4. Server streams (`/v3/watch`, `/v3/lease/keepalive`,
//! `/v3/election/observe`, `/v3/maintenance/snapshot`) answer one `{"result": ...}` object
//! per line. An error is the HTTP
//! status of its gRPC code (as grpc-gateway maps them) with `{"error", "code", "message"}`
//! (etcd 3.5's shape), a body over [`MAX_BODY_BYTES`] included ([`GatewayBody`]).
//!
//! # What it must not do
//! Decide anything: every route calls the gRPC service method itself, with the caller's
//! `Authorization` header as the token, so both doors behave identically.

use std::future::Future;

use axum::body::{Body, Bytes};
use axum::extract::FromRequest;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use futures::{Stream, StreamExt};
use leasecore_etcd_api::etcdserverpb::auth_server::Auth;
use leasecore_etcd_api::etcdserverpb::cluster_server::Cluster;
use leasecore_etcd_api::etcdserverpb::kv_server::Kv;
use leasecore_etcd_api::etcdserverpb::lease_server::Lease;
use leasecore_etcd_api::etcdserverpb::maintenance_server::Maintenance;
use leasecore_etcd_api::etcdserverpb::{LeaseKeepAliveRequest, SnapshotRequest, WatchRequest};
use leasecore_etcd_api::v3electionpb::LeaderRequest;
use leasecore_etcd_api::v3electionpb::election_server::Election;
use leasecore_etcd_api::v3lockpb::lock_server::Lock;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::{Code, Status};

use super::{ETCD_VERSION, Etcd};
use crate::http::listener::ConnHandle;

/// The largest request body the gateway reads.
const MAX_BODY_BYTES: usize = 4 << 20;

/// The HTTP status of a gRPC code, as etcd's gateway answers it: grpc-gateway v1's mapping
/// (etcd 3.4 and 3.5 use v1), checked against etcd 3.4.23. It differs from grpc-gateway v2's,
/// which this followed before, in `FailedPrecondition` (412, not 400: etcd3gw raises its
/// `PreconditionFailedError` on 412, e.g. for `lease already exists`) and `Cancelled` (408,
/// not 499).
fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::REQUEST_TIMEOUT,
        Code::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    code: i32,
    message: &'a str,
}

fn error_body(s: &Status) -> Vec<u8> {
    serde_json::to_vec(&ErrorBody {
        error: s.message(),
        code: s.code() as i32,
        message: s.message(),
    })
    .unwrap_or_default()
}

/// A whole answer: the JSON and a newline (for terminals; JSON parsers skip it).
fn line(mut body: Vec<u8>) -> Vec<u8> {
    body.push(b'\n');
    body
}

fn error(s: Status) -> Response {
    (
        http_status(s.code()),
        [(header::CONTENT_TYPE, "application/json")],
        line(error_body(&s)),
    )
        .into_response()
}

fn json<T: Serialize>(v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], line(body)).into_response(),
        Err(e) => error(Status::internal(e.to_string())),
    }
}

/// A request body of at most [`MAX_BODY_BYTES`]. A body over it, or one that cannot be read,
/// is answered in the gateway's JSON error shape like every other error a caller can cause
/// (axum's own rejection is plain text): over the limit as etcd's gateway answers a message
/// over its gRPC limit (`ResourceExhausted`, HTTP 429, "grpc: received message larger than
/// max (N vs. LIMIT)").
struct GatewayBody(Bytes);

impl<S: Send + Sync> FromRequest<S> for GatewayBody {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Response> {
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        match Bytes::from_request(req, state).await {
            Ok(body) => Ok(GatewayBody(body)),
            Err(rejection) => Err(error(body_error(rejection.status(), declared))),
        }
    }
}

/// The gRPC status of a body that could not be read (`status`: axum's HTTP status for it).
fn body_error(status: StatusCode, declared: Option<u64>) -> Status {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        let size = declared.map_or_else(|| "more".to_string(), |n| n.to_string());
        return Status::resource_exhausted(format!(
            "grpc: received message larger than max ({size} vs. {MAX_BODY_BYTES})"
        ));
    }
    Status::invalid_argument("the request body could not be read")
}

/// The request message of a body (an empty body is the default message).
fn parse<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, Status> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| Status::invalid_argument(e.to_string()))?;
    message(value)
}

/// The request messages of a streamed route's body: one or more JSON messages one after
/// another, as etcd's gateway reads them (a watch's create and then its progress or cancel
/// requests, several keepalives); an empty body is no message (a keepalive stream then ends
/// at once, a watch stream waits with no watch, as etcd's do). At most
/// [`MAX_STREAMED_MESSAGES`].
fn parse_all<T: DeserializeOwned + Default>(body: &[u8]) -> Result<Vec<T>, Status> {
    let mut messages = Vec::new();
    for value in serde_json::Deserializer::from_slice(body).into_iter::<serde_json::Value>() {
        if messages.len() == MAX_STREAMED_MESSAGES {
            return Err(Status::invalid_argument(format!(
                "a request body holds at most {MAX_STREAMED_MESSAGES} messages"
            )));
        }
        let value = value.map_err(|e| Status::invalid_argument(e.to_string()))?;
        messages.push(message(value)?);
    }
    Ok(messages)
}

/// The most messages one streamed request body may hold.
const MAX_STREAMED_MESSAGES: usize = 1024;

/// A message from its JSON. A `null` field is the field's default, and a `null` message the
/// default message, as proto3's JSON mapping says and etcd's gateway reads them (clients
/// whose serialisers write unset fields as `null` were refused).
fn message<T: DeserializeOwned + Default>(mut value: serde_json::Value) -> Result<T, Status> {
    if value.is_null() {
        return Ok(T::default());
    }
    drop_nulls(&mut value);
    serde_json::from_value(value).map_err(|e| Status::invalid_argument(e.to_string()))
}

/// Remove every `null` member of every object in `value`.
fn drop_nulls(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(members) => {
            members.retain(|_, v| !v.is_null());
            members.values_mut().for_each(drop_nulls);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// A gRPC request carrying the HTTP caller's token.
fn request<T>(headers: &HeaderMap, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| tonic::metadata::MetadataValue::try_from(v.as_bytes()).ok())
    {
        req.metadata_mut().insert("authorization", v);
    }
    req
}

/// A unary route: parse, call, encode.
async fn unary<Req, Resp, F, Fut>(headers: HeaderMap, body: Bytes, call: F) -> Response
where
    Req: DeserializeOwned + Default,
    Resp: Serialize,
    F: FnOnce(tonic::Request<Req>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
{
    let msg = match parse::<Req>(&body) {
        Ok(m) => m,
        Err(s) => return error(s),
    };
    match call(request(&headers, msg)).await {
        Ok(r) => json(r.get_ref()),
        Err(s) => error(s),
    }
}

/// The caller and the requests of a streamed route's body (or the error answer).
fn opening<Req: DeserializeOwned + Default>(
    etcd: &Etcd,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(crate::runtime::auth::Caller, Vec<Req>), Status> {
    let reqs = parse_all::<Req>(body)?;
    let caller = etcd.caller(&request(headers, ()))?;
    Ok((caller, reqs))
}

/// One streamed message as its `{"result": ...}` (or `{"error": ...}`) line.
fn stream_line<T: Serialize>(item: Result<T, Status>) -> Bytes {
    #[derive(Serialize)]
    struct Wrapped<'a, T> {
        result: &'a T,
    }
    let mut line = match item {
        Ok(m) => serde_json::to_vec(&Wrapped { result: &m }).unwrap_or_default(),
        Err(s) => {
            let mut v = b"{\"error\":".to_vec();
            v.extend(error_body(&s));
            v.push(b'}');
            v
        }
    };
    line.push(b'\n');
    Bytes::from(line)
}

/// A server stream as newline-delimited `{"result": ...}` (or a last `{"error": ...}`),
/// answered once its first message is ready. etcd's gateway sends the HTTP headers with the
/// first message, and clients rely on it: etcd3gw's `watch` returns when the headers come and
/// its caller then writes, expecting the watch to see it. Answering at once (as this did)
/// let such a write race the watch's creation. A stream whose first item is an error answers
/// the error's HTTP status, with the same line.
async fn ndjson<T: Serialize + Send + 'static>(
    stream: impl Stream<Item = Result<T, Status>> + Send + 'static,
) -> Response {
    // Fused: a stream that ended at once (an empty keepalive body) is polled again by the
    // chain below, and some streams panic when polled after their end.
    let mut stream = Box::pin(stream.fuse());
    let first = stream.next().await;
    let status = match &first {
        Some(Err(s)) => http_status(s.code()),
        _ => StatusCode::OK,
    };
    let lines = futures::stream::iter(first)
        .chain(stream)
        .map(|item| Ok::<_, std::convert::Infallible>(stream_line(item)));
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(lines),
    )
        .into_response()
}

/// The answer to a request that no route serves. A gRPC call (`content-type:
/// application/grpc...`) gets gRPC's `Unimplemented`, as tonic answers an unknown method; any
/// other request gets what etcd's gateway answers an unknown path, a plain 404 `404 page not
/// found`. (tonic's own fallback answered every request with HTTP 200 and an empty body, which
/// an HTTP client such as etcd3gw took for a success and failed to parse as JSON.)
pub(super) async fn unrouted(headers: HeaderMap) -> Response {
    let grpc = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if grpc {
        let (parts, ()) = Status::unimplemented("").into_http::<()>().into_parts();
        return Response::from_parts(parts, Body::empty());
    }
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "404 page not found\n",
    )
        .into_response()
}

/// etcd's `GET /version`.
async fn version() -> Response {
    json(&serde_json::json!({
        "etcdserver": ETCD_VERSION,
        "etcdcluster": format!("{}.0", &ETCD_VERSION[..ETCD_VERSION.rfind('.').unwrap_or(3)]),
    }))
}

/// The gateway's routes, on the etcd listener beside the gRPC services.
pub fn routes(etcd: Etcd) -> Router {
    let leader_check = etcd.clone();
    macro_rules! unary_route {
        ($router:expr, $path:expr, $svc:ident :: $method:ident) => {{
            let e = etcd.clone();
            $router.route(
                $path,
                post(move |headers: HeaderMap, GatewayBody(body): GatewayBody| {
                    let e = e.clone();
                    async move {
                        unary(headers, body, |r| async move { $svc::$method(&e, r).await }).await
                    }
                }),
            )
        }};
    }
    let mut r = Router::new();
    r = unary_route!(r, "/kv/range", Kv::range);
    r = unary_route!(r, "/kv/put", Kv::put);
    r = unary_route!(r, "/kv/deleterange", Kv::delete_range);
    r = unary_route!(r, "/kv/txn", Kv::txn);
    r = unary_route!(r, "/kv/compaction", Kv::compact);
    r = unary_route!(r, "/lease/grant", Lease::lease_grant);
    for path in ["/lease/revoke", "/kv/lease/revoke"] {
        r = unary_route!(r, path, Lease::lease_revoke);
    }
    for path in ["/lease/timetolive", "/kv/lease/timetolive"] {
        r = unary_route!(r, path, Lease::lease_time_to_live);
    }
    for path in ["/lease/leases", "/kv/lease/leases"] {
        r = unary_route!(r, path, Lease::lease_leases);
    }
    r = unary_route!(r, "/cluster/member/add", Cluster::member_add);
    r = unary_route!(r, "/cluster/member/remove", Cluster::member_remove);
    r = unary_route!(r, "/cluster/member/update", Cluster::member_update);
    r = unary_route!(r, "/cluster/member/list", Cluster::member_list);
    r = unary_route!(r, "/cluster/member/promote", Cluster::member_promote);
    r = unary_route!(r, "/lock/lock", Lock::lock);
    r = unary_route!(r, "/lock/unlock", Lock::unlock);
    r = unary_route!(r, "/election/campaign", Election::campaign);
    r = unary_route!(r, "/election/proclaim", Election::proclaim);
    r = unary_route!(r, "/election/leader", Election::leader);
    r = unary_route!(r, "/election/resign", Election::resign);
    r = unary_route!(r, "/maintenance/status", Maintenance::status);
    r = unary_route!(r, "/maintenance/alarm", Maintenance::alarm);
    r = unary_route!(r, "/maintenance/hash", Maintenance::hash_kv);
    r = unary_route!(r, "/maintenance/defragment", Maintenance::defragment);
    r = unary_route!(
        r,
        "/maintenance/transfer-leadership",
        Maintenance::move_leader
    );
    r = unary_route!(r, "/auth/authenticate", Auth::authenticate);
    r = unary_route!(r, "/auth/enable", Auth::auth_enable);
    r = unary_route!(r, "/auth/disable", Auth::auth_disable);
    r = unary_route!(r, "/auth/status", Auth::auth_status);
    r = unary_route!(r, "/auth/user/add", Auth::user_add);
    r = unary_route!(r, "/auth/user/get", Auth::user_get);
    r = unary_route!(r, "/auth/user/list", Auth::user_list);
    r = unary_route!(r, "/auth/user/delete", Auth::user_delete);
    r = unary_route!(r, "/auth/user/changepw", Auth::user_change_password);
    r = unary_route!(r, "/auth/user/grant", Auth::user_grant_role);
    r = unary_route!(r, "/auth/user/revoke", Auth::user_revoke_role);
    r = unary_route!(r, "/auth/role/add", Auth::role_add);
    r = unary_route!(r, "/auth/role/get", Auth::role_get);
    r = unary_route!(r, "/auth/role/list", Auth::role_list);
    r = unary_route!(r, "/auth/role/delete", Auth::role_delete);
    r = unary_route!(r, "/auth/role/grant", Auth::role_grant_permission);
    r = unary_route!(r, "/auth/role/revoke", Auth::role_revoke_permission);
    let e = etcd.clone();
    r = r.route(
        "/watch",
        post(
            move |conn: Option<Extension<ConnHandle>>,
                  headers: HeaderMap,
                  GatewayBody(body): GatewayBody| {
                let e = e.clone();
                async move {
                    let (caller, reqs) = match opening::<WatchRequest>(&e, &headers, &body) {
                        Ok(v) => v,
                        Err(s) => return error(s),
                    };
                    // The body's requests, then the stream stays open (as etcd's gateway
                    // does) until the client goes. `Grpc-Metadata-Hasleader: true` is the
                    // gateway's `hasleader`: such a stream ends as a gRPC one does.
                    let inbound = futures::stream::iter(reqs.into_iter().map(Ok))
                        .chain(futures::stream::pending());
                    let require_leader = super::requires_leader(&headers);
                    let conn = conn.map(|c| c.0);
                    ndjson(e.watch_session(caller, conn, require_leader, Box::pin(inbound))).await
                }
            },
        ),
    );
    let e = etcd.clone();
    r = r.route(
        "/election/observe",
        post(move |headers: HeaderMap, GatewayBody(body): GatewayBody| {
            let e = e.clone();
            async move {
                let msg = match parse::<LeaderRequest>(&body) {
                    Ok(m) => m,
                    Err(s) => return error(s),
                };
                match Election::observe(&e, request(&headers, msg)).await {
                    Ok(stream) => ndjson(stream.into_inner()).await,
                    Err(s) => error(s),
                }
            }
        }),
    );
    let e = etcd.clone();
    r = r.route(
        "/maintenance/snapshot",
        post(move |headers: HeaderMap, GatewayBody(body): GatewayBody| {
            let e = e.clone();
            async move {
                let msg = match parse::<SnapshotRequest>(&body) {
                    Ok(m) => m,
                    Err(s) => return error(s),
                };
                match Maintenance::snapshot(&e, request(&headers, msg)).await {
                    Ok(stream) => ndjson(stream.into_inner()).await,
                    Err(s) => error(s),
                }
            }
        }),
    );
    let e = etcd;
    r = r.route(
        "/lease/keepalive",
        post(move |headers: HeaderMap, GatewayBody(body): GatewayBody| {
            let e = e.clone();
            async move {
                let (caller, reqs) = match opening::<LeaseKeepAliveRequest>(&e, &headers, &body) {
                    Ok(v) => v,
                    Err(s) => return error(s),
                };
                let inbound = futures::stream::iter(reqs.into_iter().map(Ok));
                ndjson(e.keep_alive_stream(caller, Box::pin(inbound))).await
            }
        }),
    );
    // etcd 3.4 serves its gateway under `/v3` and, for clients written against 3.3, under
    // `/v3beta` too (3.3's `/v3alpha` it no longer serves, nor does leasecore): the same routes.
    Router::new()
        .route("/version", get(version))
        .nest("/v3", r.clone())
        .nest("/v3beta", r)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            leader_check,
            refuse_leaderless,
        ))
}

/// A gateway call asking for a member with a leader (`Grpc-Metadata-Hasleader: true`) on one
/// without is refused at once, in the gateway's JSON, as etcd's interceptor refuses the gRPC
/// call the gateway makes.
async fn refuse_leaderless(
    axum::extract::State(etcd): axum::extract::State<Etcd>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match etcd.refusal_for_no_leader(req.headers()) {
        Some(status) => error(status),
        None => next.run(req).await,
    }
}
