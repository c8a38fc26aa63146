//! The per-resource lease calls of [`Client`]: acquire, release and read a lease on a resource
//! under Flease or PaxosLease ([`Protocol`]).
//!
//! # Invariants
//! - Acquire and release are safe to repeat for one owner (acquiring again renews), so they
//!   are retried like reads.
//!
//! # What it must not do
//! Decide who holds a resource: the protocol's rounds on the servers do.

use reqwest::Method;
use serde_json::Value;

use super::{CallOptions, Client, ClientError, encode_query};
use crate::api::{LeaseView, Protocol};

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
