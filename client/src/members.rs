//! The member calls of [`Client`]: register a member (a lease and a key, in one entry),
//! heartbeat it, deregister it, list the live members ([`crate::agent`] runs them beside a
//! service).
//!
//! # Invariants
//! - A heartbeat is idempotent, retried across endpoints, each attempt bounded by the caller's
//!   timeout; a registration or a leave is sent again only when it certainly did not arrive.
//!
//! # What it must not do
//! Register a member again on its own: the agent decides when a registration was lost.

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::Method;

use super::{CallOptions, Client, ClientError, encode_query};
use crate::api::{Heartbeat, MemberLeft, MemberList, MemberRegistered, RegisterMemberRequest};

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
}
