//! Locks and elections (`/v1/locks`, `/v1/elections`): the calls, and helpers that wait in
//! line until they hold (a [`crate::Session`] holds them on one kept-alive lease).
//!
//! A lock or a campaign belongs to a lease: the server queues the key
//! `locks/<name>/<lease>` and answers once it is the oldest (200) or when the call's wait runs
//! out (202, still queued). The calls here are safe to repeat (the same lease keeps its place),
//! so they are retried like reads.

use std::time::Duration;

use reqwest::Method;

use crate::api::{
    ContendRequest, Leadership, LeaseRef, ProclaimRequest, Proclaimed, Released, Standing,
};
use crate::{CallOptions, Client, ClientError, encode_path, encode_query};

/// How long one long poll waits on the server before answering 202.
const POLL_MS: u64 = 30_000;

impl Client {
    /// One lock call: queue `lease` for lock `name` and wait up to `timeout_ms` to hold it.
    /// `held` in the answer says which; when held, `revision` is the fencing token.
    pub async fn lock_once(
        &self,
        name: &str,
        lease: &str,
        timeout_ms: u64,
    ) -> Result<Standing, ClientError> {
        let path = format!("/v1/locks/{}", encode_path(name));
        self.contend(&path, lease, String::new(), timeout_ms).await
    }

    /// Wait in line until `lease` holds lock `name` (however long that takes).
    pub async fn lock(&self, name: &str, lease: &str) -> Result<Standing, ClientError> {
        loop {
            let s = self.lock_once(name, lease, POLL_MS).await?;
            if s.held {
                return Ok(s);
            }
        }
    }

    /// Release lock `name` held (or waited for) by `lease`.
    pub async fn unlock(&self, name: &str, lease: &str) -> Result<Released, ClientError> {
        let path = format!(
            "/v1/locks/{}?lease={}",
            encode_path(name),
            encode_query(lease)
        );
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    /// One campaign call: queue `lease` (with `value`) for election `name` and wait up to
    /// `timeout_ms` to lead.
    pub async fn campaign_once(
        &self,
        name: &str,
        lease: &str,
        value: &str,
        timeout_ms: u64,
    ) -> Result<Standing, ClientError> {
        let path = format!("/v1/elections/{}/campaign", encode_path(name));
        self.contend(&path, lease, value.to_string(), timeout_ms)
            .await
    }

    /// Campaign until `lease` leads election `name`.
    pub async fn campaign(
        &self,
        name: &str,
        lease: &str,
        value: &str,
    ) -> Result<Standing, ClientError> {
        loop {
            let s = self.campaign_once(name, lease, value, POLL_MS).await?;
            if s.held {
                return Ok(s);
            }
        }
    }

    /// Change the value of the election `name` that `lease` leads.
    pub async fn proclaim(
        &self,
        name: &str,
        lease: &str,
        value: &str,
    ) -> Result<Proclaimed, ClientError> {
        let path = format!("/v1/elections/{}/proclaim", encode_path(name));
        let body = ProclaimRequest {
            lease: lease.to_string(),
            value: value.to_string(),
        };
        self.call(Method::PUT, &path, Some(&body)).await
    }

    /// Stop leading (or campaigning for) election `name`.
    pub async fn resign(&self, name: &str, lease: &str) -> Result<Released, ClientError> {
        let path = format!("/v1/elections/{}/resign", encode_path(name));
        let body = LeaseRef {
            lease: lease.to_string(),
        };
        let opts = CallOptions {
            idempotent: true,
            timeout: None,
        };
        self.call_with(Method::POST, &path, Some(&body), opts).await
    }

    /// The leader of election `name`: `None` while nobody campaigns.
    pub async fn leader(&self, name: &str) -> Result<Option<Leadership>, ClientError> {
        let path = format!("/v1/elections/{}", encode_path(name));
        match self.call(Method::GET, &path, None::<&()>).await {
            Ok(l) => Ok(Some(l)),
            Err(e) if e.code() == Some("no_leader_elected") => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn contend(
        &self,
        path: &str,
        lease: &str,
        value: String,
        timeout_ms: u64,
    ) -> Result<Standing, ClientError> {
        let body = ContendRequest {
            lease: lease.to_string(),
            value,
            timeout_ms: Some(timeout_ms),
        };
        // Repeating a contend call keeps the caller's place: safe to retry after any failure.
        let opts = CallOptions {
            idempotent: true,
            timeout: Some(Duration::from_millis(timeout_ms) + Duration::from_secs(5)),
        };
        self.call_with(Method::POST, path, Some(&body), opts).await
    }
}
