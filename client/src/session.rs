//! [`Session`]: one lease kept alive for a client, with its locks and campaigns attached (as
//! etcd's `concurrency.Session`).
//!
//! The lease is kept by a [`LeaseKeeper`]: refreshed every `ttl / 3`, its validity counted
//! from each refresh's send time on this process's monotonic clock. A session's locks and
//! campaigns are keys attached to that one lease, so a session with a hundred locks costs one
//! refresh per `ttl / 3`, and losing the lease releases them all at once.
//!
//! # Loss is never silent
//! [`Session::lost`] resolves the moment the keeper knows the lease is gone (a refresh
//! refused, or its validity ran out before a refresh got through). Everything held through the
//! session must be treated as lost from then: the next holder may already act, with a higher
//! fencing token. A session is never silently re-created; [`Session::renew`] makes a new one
//! (a new lease, new tokens) when the caller decides to.

use std::sync::Arc;

use tokio::sync::watch;

use crate::api::Standing;
use crate::keeper::{LeaseKeeper, LeaseStatus};
use crate::{Client, ClientError};

/// A kept-alive lease to attach locks and campaigns to.
pub struct Session {
    client: Arc<Client>,
    keeper: LeaseKeeper,
}

impl Session {
    /// A session on a new lease with a unique name (`session-<random>`), `ttl_ms` long.
    pub async fn new(client: Arc<Client>, ttl_ms: u64) -> Result<Session, ClientError> {
        Self::named(client, &unique_name("session"), ttl_ms).await
    }

    /// A session on a new lease named `lease`.
    pub async fn named(
        client: Arc<Client>,
        lease: &str,
        ttl_ms: u64,
    ) -> Result<Session, ClientError> {
        let keeper = LeaseKeeper::start(client.clone(), lease, ttl_ms, false).await?;
        Ok(Session { client, keeper })
    }

    /// A new session like this one (a new lease), for after [`Session::lost`].
    pub async fn renew(&self) -> Result<Session, ClientError> {
        Self::new(self.client.clone(), self.keeper.ttl_ms()).await
    }

    /// The session's lease.
    pub fn lease(&self) -> &str {
        self.keeper.name()
    }

    /// The client the session calls through.
    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// What the keeper knows now.
    pub fn status(&self) -> LeaseStatus {
        self.keeper.status()
    }

    /// Whether the lease may still be relied on.
    pub fn is_valid(&self) -> bool {
        self.keeper.is_valid()
    }

    /// Resolves, with the reason, once the lease is lost (at once if it already is).
    pub async fn lost(&self) -> String {
        lost(self.keeper.watch()).await
    }

    /// A future that resolves when the lease is lost, independent of `self` (to race
    /// against work in a `select!`).
    pub fn lost_signal(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        lost(self.keeper.watch())
    }

    /// Wait in line until this session holds lock `name`; the answer's `revision` is the
    /// fencing token.
    pub async fn lock(&self, name: &str) -> Result<Standing, ClientError> {
        self.client.lock(name, self.lease()).await
    }

    /// Release lock `name`.
    pub async fn unlock(&self, name: &str) -> Result<(), ClientError> {
        self.client.unlock(name, self.lease()).await.map(|_| ())
    }

    /// Campaign until this session leads election `name` with `value`.
    pub async fn campaign(&self, name: &str, value: &str) -> Result<Standing, ClientError> {
        self.client.campaign(name, self.lease(), value).await
    }

    /// Stop leading (campaigning for) election `name`.
    pub async fn resign(&self, name: &str) -> Result<(), ClientError> {
        self.client.resign(name, self.lease()).await.map(|_| ())
    }

    /// End the session: stop refreshing and revoke the lease (releasing everything attached).
    pub async fn close(self) -> Result<(), ClientError> {
        self.keeper.stop(true).await
    }
}

async fn lost(mut status: watch::Receiver<LeaseStatus>) -> String {
    loop {
        if let LeaseStatus::Lost { reason } = &*status.borrow_and_update() {
            return reason.clone();
        }
        if status.changed().await.is_err() {
            return "the lease keeper stopped".to_string();
        }
    }
}

/// `<prefix>-<16 hex digits>`, unique with overwhelming probability (std's per-process random
/// hash keys, the time and a counter).
pub fn unique_name(prefix: &str) -> String {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    format!("{prefix}-{:016x}", h.finish())
}
