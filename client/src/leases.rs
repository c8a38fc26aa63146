//! The lease calls of [`Client`]: grant, refresh, look up, list and revoke named leases
//! ([`crate::LeaseKeeper`] keeps one alive).
//!
//! # Invariants
//! - A refresh is idempotent, retried across endpoints, each attempt bounded by the caller's
//!   timeout; a grant or a revoke is sent again only when it certainly did not arrive.
//! - A missing lease is `Ok(None)` from `lease`, not an error.
//!
//! # What it must not do
//! Judge whether a lease is still valid: the keeper does, on the client's own clock.

use std::time::Duration;

use reqwest::Method;

use super::{CallOptions, Client, ClientError, encode_query};
use crate::api::{
    LeaseGranted, LeaseInfo, LeaseList, LeaseRevoked, RefreshAck, RegisterLeaseRequest,
};

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
