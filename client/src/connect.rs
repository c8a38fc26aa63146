//! Building a [`Client`]: its endpoints (normalized: a bare `host:port` gets the scheme its TLS
//! setting implies), its HTTP client, and the TLS it uses: its own ([`Client::with_tls`]), else
//! the process's ([`use_tls`], set once), else the platform's trust store.
//!
//! # Invariants
//! - The process's TLS is set at most once: setting it again with the same files is a no-op,
//!   with other files an error. A client keeps the TLS it was built with.
//! - A client has at least one endpoint.
//! - A missing system trust store does not stop a build: then nothing is trusted, and plain
//!   http still works.
//!
//! # What it must not do
//! Send anything: it builds clients; `call` sends.

use std::sync::OnceLock;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use super::{Client, ClientError, WaitHook};

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

    /// The endpoints, normalized.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
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

#[cfg(test)]
mod tests {
    use super::*;

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
