//! The key calls of [`Client`]: put (with compare-and-set), get, list, delete, transactions,
//! compaction, and one long poll of the watch.
//!
//! # Invariants
//! - Keys are escaped with [`encode_path`] (slashes kept), query values with [`encode_query`].
//! - Reads and the watch poll are retried like reads; put, delete, txn and compact are sent
//!   again only when they certainly did not arrive.
//! - A missing key is `Ok(None)` from `get`, not an error.
//!
//! # What it must not do
//! Retry a write whose outcome is unknown, or judge an answer beyond decoding it.

use std::time::Duration;

use reqwest::Method;
use serde_json::Value;

use super::{CallOptions, Client, ClientError, WatchFilter, encode_path, encode_query};
use crate::api::{
    DeleteResponse, GetResponse, ListResponse, PutRequest, PutResponse, WatchResponse,
};

impl Client {
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
