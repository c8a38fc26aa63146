//! The Rust client of leasecore: keys, leases, watches, members, Flease and PaxosLease, and
//! the API's documents ([`api`]). It depends on reqwest, serde and tokio only, never on the
//! server (the server and its CLI depend on it, for the same documents).
//!
//! ```no_run
//! # async fn demo() -> Result<(), leasecore_client::ClientError> {
//! use leasecore_client::Client;
//! let client = Client::new(&["http://127.0.0.1:7001", "http://127.0.0.1:7002"])?;
//! let put = client.put("config/color", "blue", None, None).await?;
//! // Compare-and-set: only if nobody wrote it since.
//! client.put("config/color", "green", None, Some(put.revision.0)).await?;
//! # Ok(()) }
//! ```
//!
//! A [`Client`] holds a list of endpoints and fails over between them:
//! - a request that certainly did not reach a node (connection refused) goes to the next one;
//! - a 503 with a retryable code (`no_leader`, `no_quorum`, `shutting_down`) is retried, on the
//!   next endpoint, with a short growing backoff: nothing was applied;
//! - a request that may have reached a node and then failed is retried only if it is a read.
//!   A write in that state returns its error (`outcome_unknown`) instead of risking a duplicate.
//!
//! Errors come back typed: [`ClientError::Api`] carries the server's code and message.
//!
//! [`LeaseKeeper`] (in [`keeper`]) keeps a lease alive and tracks its validity on the client's
//! own monotonic clock.
//!
//! TLS: `https://` endpoints are verified against the CA given with [`Client::with_tls`] (or,
//! for every client the process builds, once with [`use_tls`]: the CLI's `--cacert`,
//! `--cert`, `--key`), else against the platform's trust store; a client certificate is
//! presented when one is given. With TLS configured, a bare `host:port` endpoint means https.

pub mod agent;
pub mod api;
pub mod auth;
pub mod clock;
pub mod keeper;
pub mod lwlease;
pub mod recipes;
pub mod register;
pub mod session;
pub mod tls;
pub mod transport;
pub mod types;
pub mod watcher;
pub use keeper::{LeaseKeeper, LeaseStatus};
pub use session::Session;
pub use watcher::{WatchFilter, WatchItem, Watcher};

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use reqwest::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use thiserror::Error;

use crate::api::ClusterView;
use crate::clock::Clock;
use crate::types::NodeId;
use std::collections::BTreeMap;

use crate::api::LeaseView;
use crate::api::Protocol;
use crate::api::RefreshAck;
use crate::api::{
    AddNodeRequest, Credentials, DeleteResponse, ErrorBody, GetResponse, Heartbeat, LeaseGranted,
    LeaseInfo, LeaseList, LeaseRevoked, ListResponse, MemberLeft, MemberList, MemberRegistered,
    MoveLeaderRequest, PutRequest, PutResponse, RegisterLeaseRequest, RegisterMemberRequest,
    TokenResponse, WatchResponse,
};

/// Characters escaped in a key path segment. `/` stays literal: keys may contain it.
const KEY_ESCAPES: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'\\')
    .add(b'^')
    .add(b'|')
    .add(b'[')
    .add(b']')
    .add(b'+')
    .add(b'&')
    .add(b'=');

/// Characters escaped in a query parameter value.
const QUERY_ESCAPES: &AsciiSet = &KEY_ESCAPES.add(b'/');

/// Escape a key (or any text) for a URL path.
pub fn encode_path(key: &str) -> String {
    utf8_percent_encode(key, KEY_ESCAPES).to_string()
}

/// Escape a query parameter value.
pub fn encode_query(v: &str) -> String {
    utf8_percent_encode(v, QUERY_ESCAPES).to_string()
}

/// A failed call.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The server answered with an error document.
    #[error("{code} ({status}): {message}")]
    Api {
        status: u16,
        code: String,
        message: String,
        body: Value,
    },
    /// No endpoint gave a usable answer (each one's last failure is in the message).
    #[error("the cluster did not answer: {0}")]
    Unavailable(String),
    /// A write reached a node that then failed: it may or may not have been applied.
    #[error("the request may have been applied, but no answer came back: {0}")]
    Uncertain(String),
    /// Bad arguments before anything was sent.
    #[error("{0}")]
    Usage(String),
}

impl ClientError {
    /// The server's error code, if the server answered.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The HTTP status, if the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// How one call may be retried.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallOptions {
    /// Safe to send again after a failure that may have reached the server.
    pub idempotent: bool,
    /// A deadline for each attempt, shorter than the client's default.
    pub timeout: Option<Duration>,
}

/// The TLS every client of this process uses unless given its own (set once, by [`use_tls`]).
static PROCESS_TLS: OnceLock<rustls::ClientConfig> = OnceLock::new();
/// The files [`PROCESS_TLS`] was built from.
static PROCESS_TLS_FILES: OnceLock<crate::tls::ClientTls> = OnceLock::new();

/// Use `tls` for every client this process builds from now on without a TLS of its own
/// ([`Client::new`], [`Client::with_timeout`], [`http_builder`]): the CLI calls it once with
/// its `--cacert`/`--cert`/`--key`. Calling it again with the same files is a no-op; with
/// other files it is refused.
pub fn use_tls(tls: &crate::tls::ClientTls) -> Result<(), ClientError> {
    if let Some(set) = PROCESS_TLS_FILES.get() {
        return if set == tls {
            Ok(())
        } else {
            Err(ClientError::Usage("the client TLS is already set".into()))
        };
    }
    let config = tls.build().map_err(|e| ClientError::Usage(e.to_string()))?;
    if PROCESS_TLS_FILES.set(tls.clone()).is_ok() {
        let _ = PROCESS_TLS.set(config);
    }
    Ok(())
}

/// A reqwest builder with the process's client TLS (see [`use_tls`]), for callers that talk
/// HTTP themselves (the benchmark's workers, snapshot downloads).
pub fn http_builder() -> reqwest::ClientBuilder {
    with_tls_backend(reqwest::Client::builder(), PROCESS_TLS.get().cloned())
}

fn with_tls_backend(
    builder: reqwest::ClientBuilder,
    tls: Option<rustls::ClientConfig>,
) -> reqwest::ClientBuilder {
    match tls {
        Some(config) => builder.tls_backend_preconfigured(config),
        // The system trust store when the host has one; without one (a scratch container),
        // reqwest's default could not build at all, so trust nothing: http still works.
        None if system_trust_store_available() => builder,
        None => builder.tls_backend_preconfigured(crate::tls::trust_nothing()),
    }
}

/// Whether reqwest's default TLS (the platform verifier) can load a trust store here.
fn system_trust_store_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| reqwest::Client::builder().build().is_ok())
}

/// What a call that keeps failing over reports while it waits (see [`Client::on_wait`]).
#[derive(Clone, Debug)]
pub struct Waiting {
    /// Since the call started.
    pub elapsed: Duration,
    /// Attempts made so far.
    pub attempts: usize,
    /// Why the last attempt failed, with its endpoint.
    pub last_failure: String,
}

/// Called with `Some` after a failed attempt once a call has waited a second or more, and
/// with `None` when such a call ends (to clear a progress line).
pub type WaitHook = std::sync::Arc<dyn Fn(Option<&Waiting>) + Send + Sync>;

/// Failures before a progress report: quick failovers stay silent.
const REPORT_WAITS_AFTER: Duration = Duration::from_secs(1);

/// A failed attempt in words a person acts on: the endpoint, then the cause.
fn transport_failure(url: &str, e: &reqwest::Error) -> String {
    format!(
        "{}: {}",
        crate::transport::endpoint_of(url),
        crate::transport::cause(e)
    )
}

/// The last failure of each endpoint tried, in endpoint order: what a person needs to see
/// when the whole call fails.
fn summarize(failures: &BTreeMap<usize, String>) -> String {
    failures.values().cloned().collect::<Vec<_>>().join("; ")
}

/// A client of a leasecore cluster.
pub struct Client {
    endpoints: Vec<String>,
    http: reqwest::Client,
    /// The endpoint to try first (the last one that answered).
    preferred: AtomicUsize,
    /// Attempts per call, across endpoints.
    attempts: usize,
    /// The bearer token and the credentials that renew it (auth on).
    session: std::sync::Mutex<AuthState>,
    /// Told about long waits (the CLI draws a progress line on a terminal).
    on_wait: Option<WaitHook>,
}

/// What the client authenticates with. Never printed.
#[derive(Default)]
struct AuthState {
    token: Option<String>,
    credentials: Option<(String, String)>,
}

impl Client {
    /// A client of the endpoints in `LEASECORE_ENDPOINTS` (comma-separated), as the CLI reads
    /// them; `http://127.0.0.1:7001` when it is unset.
    pub fn from_env() -> Result<Self, ClientError> {
        let endpoints = std::env::var("LEASECORE_ENDPOINTS")
            .unwrap_or_else(|_| "http://127.0.0.1:7001".to_string());
        Self::new(&endpoints.split(',').map(str::trim).collect::<Vec<_>>())
    }

    /// A client of the given endpoints (`http://host:port`, or `host:port`).
    pub fn new<S: AsRef<str>>(endpoints: &[S]) -> Result<Self, ClientError> {
        Self::with_timeout(endpoints, Duration::from_secs(15))
    }

    /// A client whose requests each time out after `timeout`.
    pub fn with_timeout<S: AsRef<str>>(
        endpoints: &[S],
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::build(endpoints, timeout, PROCESS_TLS.get().cloned())
    }

    /// A client that verifies servers and presents a certificate as `tls` says (whatever
    /// [`use_tls`] set).
    pub fn with_tls<S: AsRef<str>>(
        endpoints: &[S],
        timeout: Duration,
        tls: &crate::tls::ClientTls,
    ) -> Result<Self, ClientError> {
        let config = tls.build().map_err(|e| ClientError::Usage(e.to_string()))?;
        Self::build(endpoints, timeout, Some(config))
    }

    fn build<S: AsRef<str>>(
        endpoints: &[S],
        timeout: Duration,
        tls: Option<rustls::ClientConfig>,
    ) -> Result<Self, ClientError> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| normalize_endpoint(e.as_ref(), scheme))
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Err(ClientError::Usage("no endpoint given".into()));
        }
        let http = with_tls_backend(reqwest::Client::builder(), tls)
            .connect_timeout(Duration::from_secs(2))
            .timeout(timeout)
            // Below the server's header timeout (10 s by default): a pooled connection is
            // dropped here before the server closes it under a request.
            .pool_idle_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ClientError::Usage(e.to_string()))?;
        let attempts = (endpoints.len() * 3).max(6);
        Ok(Client {
            endpoints,
            http,
            preferred: AtomicUsize::new(0),
            attempts,
            session: Default::default(),
            on_wait: None,
        })
    }

    /// Report waits longer than a second to `hook` (see [`WaitHook`]).
    pub fn on_wait(mut self, hook: WaitHook) -> Self {
        self.on_wait = Some(hook);
        self
    }

    /// Send `token` as `Authorization: Bearer` on every call.
    pub fn with_token(self, token: impl Into<String>) -> Self {
        self.session_mut().token = Some(token.into());
        self
    }

    /// Authenticate as `user` on the first call, and again whenever the token expires.
    pub fn with_credentials(self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.session_mut().credentials = Some((user.into(), password.into()));
        self
    }

    fn session_mut(&self) -> std::sync::MutexGuard<'_, AuthState> {
        self.session.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current token, if any.
    pub fn token(&self) -> Option<String> {
        self.session_mut().token.clone()
    }

    /// Get a token for `user` (`POST /v1/auth/authenticate`) and use it from now on.
    pub async fn authenticate(
        &self,
        user: &str,
        password: &str,
    ) -> Result<TokenResponse, ClientError> {
        let body = Credentials {
            name: user.to_string(),
            password: password.to_string(),
        };
        let opts = CallOptions {
            idempotent: true,
            timeout: None,
        };
        let value = self
            .send_raw(
                Method::POST,
                "/v1/auth/authenticate",
                Some(&body),
                opts,
                None,
            )
            .await?;
        let answer: TokenResponse = serde_json::from_value(value)
            .map_err(|e| ClientError::Unavailable(format!("undecodable answer: {e}")))?;
        self.session_mut().token = Some(answer.token.clone());
        Ok(answer)
    }

    /// The endpoints, normalized.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Send one call with failover; decode the success document as `T`. GETs are retried
    /// after any failure, other methods only when they certainly did not arrive.
    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<T, ClientError> {
        let opts = CallOptions {
            idempotent: method == Method::GET,
            timeout: None,
        };
        self.call_with(method, path, body, opts).await
    }

    /// [`Client::call`] with explicit retry and timeout choices.
    pub async fn call_with<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
        opts: CallOptions,
    ) -> Result<T, ClientError> {
        let value = self.call_raw(method, path, body, opts).await?;
        serde_json::from_value(value)
            .map_err(|e| ClientError::Unavailable(format!("undecodable answer: {e}")))
    }

    /// Send one call with failover; return the success document as JSON. With credentials,
    /// authenticates first if it has no token, and once more if the token was refused (401).
    pub async fn call_raw(
        &self,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
        opts: CallOptions,
    ) -> Result<Value, ClientError> {
        let (token, credentials) = {
            let s = self.session_mut();
            (s.token.clone(), s.credentials.clone())
        };
        let token = match (token, &credentials) {
            (None, Some((user, password))) => self.log_in(user, password).await?,
            (token, _) => token,
        };
        let first = self
            .send_raw(method.clone(), path, body, opts, token.as_deref())
            .await;
        match (&first, credentials) {
            (Err(e), Some((user, password))) if e.status() == Some(401) => {
                let token = self.log_in(&user, &password).await?;
                self.send_raw(method, path, body, opts, token.as_deref())
                    .await
            }
            _ => first,
        }
    }

    /// A token for the credentials, or none while the cluster has auth off (as etcd's
    /// clients do: `--user` is harmless before `auth enable`, and `auth enable --user root`
    /// works).
    async fn log_in(&self, user: &str, password: &str) -> Result<Option<String>, ClientError> {
        match self.authenticate(user, password).await {
            Ok(answer) => Ok(Some(answer.token)),
            Err(e) if e.code() == Some("auth_not_enabled") => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn send_raw(
        &self,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
        opts: CallOptions,
        token: Option<&str>,
    ) -> Result<Value, ClientError> {
        let body = match body {
            Some(b) => Some(serde_json::to_vec(b).map_err(|e| ClientError::Usage(e.to_string()))?),
            None => None,
        };
        let idempotent = opts.idempotent;
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed);
        let clock = crate::clock::SystemClock::new();
        let started = clock.mono();
        let mut failures = BTreeMap::new();
        let mut reported = false;
        let result = 'call: {
            for attempt in 0..self.attempts {
                let index = (first + attempt) % n;
                let url = format!("{}{}", self.endpoints[index], path);
                let mut req = self.http.request(method.clone(), &url);
                if let Some(t) = opts.timeout {
                    req = req.timeout(t);
                }
                if let Some(token) = token {
                    req = req.bearer_auth(token);
                }
                if let Some(b) = &body {
                    req = req
                        .header(reqwest::header::CONTENT_TYPE, "application/json")
                        .body(b.clone());
                }
                match req.send().await {
                    Err(e) => {
                        let failure = transport_failure(&url, &e);
                        if !(e.is_connect() || idempotent) {
                            break 'call Err(ClientError::Uncertain(failure));
                        }
                        failures.insert(index, failure);
                    }
                    Ok(resp) => {
                        let status = resp.status();
                        let bytes = match resp.bytes().await {
                            Ok(b) => b,
                            Err(e) if idempotent => {
                                failures.insert(index, transport_failure(&url, &e));
                                continue;
                            }
                            Err(e) => {
                                break 'call Err(ClientError::Uncertain(transport_failure(
                                    &url, &e,
                                )));
                            }
                        };
                        if status.is_success() {
                            self.preferred.store(index, Ordering::Relaxed);
                            break 'call serde_json::from_slice(&bytes).map_err(|e| {
                                ClientError::Unavailable(format!("{url}: undecodable answer: {e}"))
                            });
                        }
                        let err = api_error(status, &bytes);
                        let retry = status == StatusCode::SERVICE_UNAVAILABLE
                            && matches!(
                                err.code(),
                                Some("no_leader" | "no_quorum" | "shutting_down")
                            );
                        if !retry {
                            break 'call Err(err);
                        }
                        failures.insert(index, format!("{}: {err}", self.endpoints[index]));
                    }
                }
                // Back off a little more on each pass over the endpoints.
                let pass = (attempt / n) as u64;
                if let Some(hook) = &self.on_wait {
                    let elapsed = Duration::from_millis(started.until(clock.mono()));
                    if elapsed >= REPORT_WAITS_AFTER {
                        reported = true;
                        hook(Some(&Waiting {
                            elapsed,
                            attempts: attempt + 1,
                            last_failure: failures.get(&index).cloned().unwrap_or_default(),
                        }));
                    }
                }
                tokio::time::sleep(Duration::from_millis(50 + 150 * pass)).await;
            }
            Err(ClientError::Unavailable(summarize(&failures)))
        };
        if reported && let Some(hook) = &self.on_wait {
            hook(None);
        }
        result
    }

    /// Put a key; `prev_revision` makes it a compare-and-set (0: must not exist).
    pub async fn put(
        &self,
        key: &str,
        value: &str,
        lease: Option<&str>,
        prev_revision: Option<u64>,
    ) -> Result<PutResponse, ClientError> {
        let mut path = format!("/v1/kv/{}", encode_path(key));
        if let Some(p) = prev_revision {
            path.push_str(&format!("?prev_revision={p}"));
        }
        let body = PutRequest {
            value: value.to_string(),
            lease: lease.map(str::to_string),
        };
        self.call(Method::PUT, &path, Some(&body)).await
    }

    /// Get a key: `Ok(None)` when it does not exist.
    pub async fn get(&self, key: &str, local: bool) -> Result<Option<GetResponse>, ClientError> {
        let mut path = format!("/v1/kv/{}", encode_path(key));
        if local {
            path.push_str("?consistency=local");
        }
        match self.call(Method::GET, &path, None::<&()>).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.code() == Some("key_not_found") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// List keys under a prefix.
    pub async fn list(
        &self,
        prefix: &str,
        limit: Option<usize>,
        local: bool,
    ) -> Result<ListResponse, ClientError> {
        let mut path = format!("/v1/kv?prefix={}", encode_query(prefix));
        if let Some(l) = limit {
            path.push_str(&format!("&limit={l}"));
        }
        if local {
            path.push_str("&consistency=local");
        }
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// Delete a key; `prev_revision` makes it conditional.
    pub async fn delete(
        &self,
        key: &str,
        prev_revision: Option<u64>,
    ) -> Result<DeleteResponse, ClientError> {
        let mut path = format!("/v1/kv/{}", encode_path(key));
        if let Some(p) = prev_revision {
            path.push_str(&format!("?prev_revision={p}"));
        }
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    /// The cluster as the first answering node sees it.
    /// `POST /v1/txn`: a transaction in `/v1`'s JSON (see the API document); the answer as
    /// JSON. Sent once (a transaction is not idempotent).
    pub async fn txn(&self, txn: &Value) -> Result<Value, ClientError> {
        self.call(Method::POST, "/v1/txn", Some(txn)).await
    }

    /// `POST /v1/compact`: forget the key versions below `revision`, on every node.
    pub async fn compact(&self, revision: u64) -> Result<Value, ClientError> {
        self.call(
            Method::POST,
            "/v1/compact",
            Some(&serde_json::json!({ "revision": revision })),
        )
        .await
    }

    pub async fn cluster_status(&self) -> Result<ClusterView, ClientError> {
        self.call(Method::GET, "/v1/cluster", None::<&()>).await
    }

    /// Hand the leadership to node `id` (a voter); answers once it leads.
    pub async fn move_leader(&self, id: NodeId) -> Result<ClusterView, ClientError> {
        self.call(
            Method::POST,
            "/v1/cluster/leader",
            Some(&MoveLeaderRequest { id }),
        )
        .await
    }

    /// Add a node (as learner, then voter).
    pub async fn add_node(&self, id: NodeId, address: &str) -> Result<ClusterView, ClientError> {
        let body = AddNodeRequest {
            id,
            address: address.to_string(),
        };
        self.call(Method::POST, "/v1/cluster/nodes", Some(&body))
            .await
    }

    /// Add a node; the answer says whether it became a voter, and why not.
    pub async fn add_node_detailed(
        &self,
        id: NodeId,
        address: &str,
    ) -> Result<crate::api::AddNodeResponse, ClientError> {
        let body = AddNodeRequest {
            id,
            address: address.to_string(),
        };
        self.call(Method::POST, "/v1/cluster/nodes", Some(&body))
            .await
    }

    /// `GET /readyz` of the first endpoint that answers: `Ok` with the document if that node
    /// is ready, the `not_ready` error otherwise.
    pub async fn readyz(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, "/readyz", None::<&()>).await
    }

    /// Remove a node from the cluster.
    pub async fn remove_node(&self, id: NodeId) -> Result<ClusterView, ClientError> {
        self.call(
            Method::DELETE,
            &format!("/v1/cluster/nodes/{id}"),
            None::<&()>,
        )
        .await
    }
}

impl Client {
    /// Register a lease. `revision` in the answer is its fencing token.
    pub async fn grant(&self, name: &str, ttl_ms: u64) -> Result<LeaseGranted, ClientError> {
        let body = RegisterLeaseRequest {
            name: name.to_string(),
            ttl_ms,
        };
        self.call(Method::POST, "/v1/leases", Some(&body)).await
    }

    /// Refresh a lease (idempotent: retried across endpoints), each attempt bounded by
    /// `timeout` if given.
    pub async fn refresh(
        &self,
        name: &str,
        timeout: Option<Duration>,
    ) -> Result<RefreshAck, ClientError> {
        let path = format!("/v1/leases/{}/refresh", encode_query(name));
        let opts = CallOptions {
            idempotent: true,
            timeout,
        };
        self.call_with(Method::POST, &path, None::<&()>, opts).await
    }

    /// One lease: `Ok(None)` when it does not exist.
    pub async fn lease(&self, name: &str) -> Result<Option<LeaseInfo>, ClientError> {
        let path = format!("/v1/leases/{}", encode_query(name));
        match self.call(Method::GET, &path, None::<&()>).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.code() == Some("lease_not_found") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Leases whose name starts with `prefix`.
    pub async fn leases(
        &self,
        prefix: &str,
        limit: Option<usize>,
    ) -> Result<LeaseList, ClientError> {
        let mut path = format!("/v1/leases?prefix={}", encode_query(prefix));
        if let Some(l) = limit {
            path.push_str(&format!("&limit={l}"));
        }
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// Revoke a lease, deleting its keys.
    pub async fn revoke(&self, name: &str) -> Result<LeaseRevoked, ClientError> {
        let path = format!("/v1/leases/{}", encode_query(name));
        self.call(Method::DELETE, &path, None::<&()>).await
    }
}

impl Client {
    /// Register a member (lease `members/{id}` and key `members/{id}`, in one entry).
    pub async fn register_member(
        &self,
        id: &str,
        address: &str,
        ttl_ms: u64,
        meta: BTreeMap<String, String>,
    ) -> Result<MemberRegistered, ClientError> {
        let body = RegisterMemberRequest {
            id: id.to_string(),
            address: address.to_string(),
            ttl_ms,
            meta,
        };
        self.call(Method::POST, "/v1/members", Some(&body)).await
    }

    /// Heartbeat a member (idempotent), each attempt bounded by `timeout` if given.
    pub async fn heartbeat(
        &self,
        id: &str,
        timeout: Option<Duration>,
    ) -> Result<Heartbeat, ClientError> {
        let path = format!("/v1/members/{}/heartbeat", encode_query(id));
        let opts = CallOptions {
            idempotent: true,
            timeout,
        };
        self.call_with(Method::POST, &path, None::<&()>, opts).await
    }

    /// Deregister a member now.
    pub async fn leave(&self, id: &str) -> Result<MemberLeft, ClientError> {
        let path = format!("/v1/members/{}", encode_query(id));
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    /// The live members.
    pub async fn members(&self) -> Result<MemberList, ClientError> {
        self.call(Method::GET, "/v1/members", None::<&()>).await
    }

    /// One long poll of `GET /v1/watch`.
    pub async fn watch_once(
        &self,
        filter: &WatchFilter,
        from: Option<u64>,
        timeout_ms: u64,
    ) -> Result<WatchResponse, ClientError> {
        let mut path = match filter {
            WatchFilter::Key(k) => format!("/v1/watch?key={}", encode_query(k)),
            WatchFilter::Prefix(p) => format!("/v1/watch?prefix={}", encode_query(p)),
        };
        path.push_str(&format!("&timeout_ms={timeout_ms}"));
        if let Some(f) = from {
            path.push_str(&format!("&from_revision={f}"));
        }
        let opts = CallOptions {
            idempotent: true,
            // The server holds the poll for `timeout_ms`; allow for that.
            timeout: Some(Duration::from_millis(timeout_ms) + Duration::from_secs(5)),
        };
        self.call_with(Method::GET, &path, None::<&()>, opts).await
    }
}

impl Client {
    /// Acquire (or renew) a Flease lease on `resource` for `owner`.
    pub async fn flease_acquire(
        &self,
        resource: &str,
        owner: &str,
    ) -> Result<LeaseView, ClientError> {
        self.resource_acquire(Protocol::Flease, resource, owner)
            .await
    }

    /// Release `owner`'s Flease lease on `resource`: true if it held it.
    pub async fn flease_release(&self, resource: &str, owner: &str) -> Result<bool, ClientError> {
        self.resource_release(Protocol::Flease, resource, owner)
            .await
    }

    /// What the answering node knows of a Flease `resource`.
    pub async fn flease_get(&self, resource: &str) -> Result<LeaseView, ClientError> {
        self.resource_get(Protocol::Flease, resource).await
    }

    /// Acquire (or renew) a per-resource lease of `proto` for `owner`.
    pub async fn resource_acquire(
        &self,
        proto: Protocol,
        resource: &str,
        owner: &str,
    ) -> Result<LeaseView, ClientError> {
        let path = format!("/v1/{}/{}/acquire", proto.name(), encode_query(resource));
        let body = serde_json::json!({ "owner": owner });
        // Idempotent for one owner: acquiring again renews.
        let opts = CallOptions {
            idempotent: true,
            timeout: None,
        };
        self.call_with(Method::POST, &path, Some(&body), opts).await
    }

    /// Release `owner`'s lease of `proto` on `resource`: true if it held it.
    pub async fn resource_release(
        &self,
        proto: Protocol,
        resource: &str,
        owner: &str,
    ) -> Result<bool, ClientError> {
        let path = format!("/v1/{}/{}/release", proto.name(), encode_query(resource));
        let body = serde_json::json!({ "owner": owner });
        let opts = CallOptions {
            idempotent: true,
            timeout: None,
        };
        let v: Value = self
            .call_with(Method::POST, &path, Some(&body), opts)
            .await?;
        Ok(v["released"].as_bool().unwrap_or(false))
    }

    /// What the answering node knows of a `resource` of `proto`.
    pub async fn resource_get(
        &self,
        proto: Protocol,
        resource: &str,
    ) -> Result<LeaseView, ClientError> {
        let path = format!("/v1/{}/{}", proto.name(), encode_query(resource));
        self.call(Method::GET, &path, None::<&()>).await
    }
}

/// `scheme://host:port` (a bare `host:port` gets `scheme`).
fn normalize_endpoint(e: &str, scheme: &str) -> String {
    let e = e.trim().trim_end_matches('/');
    if e.is_empty() || e.starts_with("http://") || e.starts_with("https://") {
        e.to_string()
    } else {
        format!("{scheme}://{e}")
    }
}

fn api_error(status: StatusCode, body: &[u8]) -> ClientError {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(doc) => ClientError::Api {
            status: status.as_u16(),
            code: doc.error.code,
            message: doc.error.message,
            body: serde_json::from_slice(body).unwrap_or(Value::Null),
        },
        Err(_) => ClientError::Api {
            status: status.as_u16(),
            code: "http_error".into(),
            message: String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned(),
            body: Value::Null,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_slashes_and_escape_reserved_characters() {
        assert_eq!(encode_path("a/b/c"), "a/b/c");
        assert_eq!(encode_path("a b?c#d%"), "a%20b%3Fc%23d%25");
        assert_eq!(encode_path("é"), "%C3%A9");
        assert_eq!(encode_query("a/b&c"), "a%2Fb%26c");
    }

    #[test]
    fn endpoints_are_normalized() {
        assert_eq!(
            normalize_endpoint("127.0.0.1:7001/", "http"),
            "http://127.0.0.1:7001"
        );
        assert_eq!(normalize_endpoint("http://h:1", "https"), "http://h:1");
        assert_eq!(normalize_endpoint("h:1", "https"), "https://h:1");
    }
}
