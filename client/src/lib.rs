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
//!
//! # Layout
//! This file holds [`Client`], its errors, its call options, its credentials and the URL
//! escapes; `connect` builds clients (endpoints, TLS), `call` sends a call with failover; the
//! calls by area are in `kv` (keys, transactions, the watch poll), `cluster`, `leases`,
//! `members`, `resources` (Flease, PaxosLease), and the public `auth` and `recipes`.

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

mod call;
mod cluster;
mod connect;
mod kv;
mod leases;
mod members;
mod resources;

pub use call::{WaitHook, Waiting};
pub use connect::{http_builder, use_tls};
pub use keeper::{LeaseKeeper, LeaseStatus};
pub use session::Session;
pub use watcher::{WatchFilter, WatchItem, Watcher};

use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use reqwest::Method;
use serde_json::Value;
use thiserror::Error;

use crate::api::{Credentials, TokenResponse};

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
}
