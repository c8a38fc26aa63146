//! Sending one call with failover ([`Client::call`], [`Client::call_with`],
//! [`Client::call_raw`]): the endpoints in turn from the last one that answered, a short
//! growing backoff between passes, a log-in first with credentials and again once a token is
//! refused, reports of long waits ([`Waiting`]), and the server's error documents as
//! [`ClientError::Api`].
//!
//! # Invariants
//! - A call that may have reached a node and then failed is sent again only if it is
//!   idempotent ([`CallOptions::idempotent`]); otherwise it is [`ClientError::Uncertain`].
//! - Only a 503 whose code says nothing was applied (`no_leader`, `no_quorum`,
//!   `shutting_down`) is retried, and a 401 once after a fresh log-in (with credentials); any
//!   other error answer is returned at once.
//! - Attempts are bounded (per client, across endpoints); a call that used them up is
//!   [`ClientError::Unavailable`], with each endpoint's last failure.
//! - A hook told of a wait (`Some`) is told when the call ends (`None`).
//!
//! # What it must not do
//! Print the token or the credentials, or interpret a success document: callers decode it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{CallOptions, Client, ClientError};
use crate::api::ErrorBody;
use crate::clock::Clock;

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

impl Client {
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

    pub(super) async fn send_raw(
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
