//! `LeaseKeeper`: keep a lease alive and know, on this process's own clock, whether it still is.
//!
//! # The client's view (DESIGN.md section 4)
//! A lease is valid until `send time of the last acknowledged refresh + ttl`, measured on the
//! client's monotonic clock. The send time, not the answer time: the leader starts the new
//! deadline no earlier than when the refresh arrived, which is after it was sent, so this view
//! never outlives the leader's. The keeper refreshes every `ttl / 3`, retries faster after a
//! failure, and reports the lease lost when a refresh is refused (`lease_not_found`) or when its
//! own validity runs out before any refresh succeeded. Once lost, it stops: a lost lease is
//! never silently re-created (the holder must learn that its fencing token changed).
//!
//! The decision "valid or not" is [`LeaseStatus::valid_at`], a pure function of a clock reading.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{Client, ClientError};
use crate::clock::{Clock, SystemClock};
use crate::types::{MonoMillis, Revision};

/// What the keeper knows about its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// Held until `until` on the keeper's clock.
    Valid {
        until: MonoMillis,
        /// The lease's fencing token.
        revision: Revision,
        /// Refreshes acknowledged so far.
        refreshes: u64,
    },
    /// Gone, for this reason. Final.
    Lost { reason: String },
}

impl LeaseStatus {
    /// Whether the lease may be relied on at `now` (on the keeper's clock).
    pub fn valid_at(&self, now: MonoMillis) -> bool {
        matches!(self, LeaseStatus::Valid { until, .. } if now < *until)
    }
}

/// Keeps one lease alive in the background.
pub struct LeaseKeeper {
    name: String,
    ttl_ms: u64,
    clock: Arc<dyn Clock>,
    status: watch::Receiver<LeaseStatus>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
    client: Arc<Client>,
}

impl LeaseKeeper {
    /// Register `name` with `ttl_ms` and keep it alive. With `adopt`, a lease that already
    /// exists is taken over (refreshed) instead of refused: for a process that restarts and
    /// finds its own lease still there.
    pub async fn start(
        client: Arc<Client>,
        name: &str,
        ttl_ms: u64,
        adopt: bool,
    ) -> Result<LeaseKeeper, ClientError> {
        Self::start_with_clock(client, name, ttl_ms, adopt, Arc::new(SystemClock::new())).await
    }

    /// [`LeaseKeeper::start`] on a given clock.
    pub async fn start_with_clock(
        client: Arc<Client>,
        name: &str,
        ttl_ms: u64,
        adopt: bool,
        clock: Arc<dyn Clock>,
    ) -> Result<LeaseKeeper, ClientError> {
        let sent = clock.mono();
        let (revision, ttl_ms) = match client.grant(name, ttl_ms).await {
            Ok(granted) => (granted.revision, granted.ttl_ms),
            Err(e) if adopt && e.code() == Some("lease_exists") => {
                // Adopt: a refresh proves it is alive; its ttl is the lease's own.
                let ack = client.refresh(name, None).await?;
                let info = client.lease(name).await?;
                let revision = info.map(|i| i.revision).unwrap_or_default();
                (revision, ack.ttl_ms)
            }
            Err(e) => return Err(e),
        };
        let initial = LeaseStatus::Valid {
            until: sent.plus(ttl_ms),
            revision,
            refreshes: 0,
        };
        let (tx, rx) = watch::channel(initial);
        let cancel = CancellationToken::new();
        let task = tokio::spawn(keep_alive(
            client.clone(),
            name.to_string(),
            ttl_ms,
            clock.clone(),
            tx,
            cancel.clone(),
        ));
        Ok(LeaseKeeper {
            name: name.to_string(),
            ttl_ms,
            clock,
            status: rx,
            cancel,
            task: Some(task),
            client,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// The current status.
    pub fn status(&self) -> LeaseStatus {
        self.status.borrow().clone()
    }

    /// Whether the lease may be relied on right now.
    pub fn is_valid(&self) -> bool {
        self.status.borrow().valid_at(self.clock.mono())
    }

    /// A receiver that changes at every acknowledged refresh and at loss.
    pub fn watch(&self) -> watch::Receiver<LeaseStatus> {
        self.status.clone()
    }

    /// Stop refreshing; with `revoke`, also delete the lease (and its keys) now.
    pub async fn stop(mut self, revoke: bool) -> Result<(), ClientError> {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        if revoke {
            match self.client.revoke(&self.name).await {
                Ok(_) => {}
                Err(e) if e.code() == Some("lease_not_found") => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn keep_alive(
    client: Arc<Client>,
    name: String,
    ttl_ms: u64,
    clock: Arc<dyn Clock>,
    status: watch::Sender<LeaseStatus>,
    cancel: CancellationToken,
) {
    let period = Duration::from_millis((ttl_ms / 3).max(1));
    let retry = Duration::from_millis((ttl_ms / 10).clamp(1, 1000));
    let mut wait = period;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let (until, revision, refreshes) = match &*status.borrow() {
            LeaseStatus::Valid {
                until,
                revision,
                refreshes,
            } => (*until, *revision, *refreshes),
            LeaseStatus::Lost { .. } => return,
        };
        let sent = clock.mono();
        if sent >= until {
            status.send_replace(LeaseStatus::Lost {
                reason: "no refresh succeeded before the lease ran out".into(),
            });
            return;
        }
        // An answer after `until` is useless: bound each attempt by what is left.
        let left = Duration::from_millis(sent.until(until));
        match client.refresh(&name, Some(left.min(period))).await {
            Ok(ack) => {
                status.send_replace(LeaseStatus::Valid {
                    until: sent.plus(ack.ttl_ms),
                    revision,
                    refreshes: refreshes + 1,
                });
                wait = period;
            }
            Err(e) if e.code() == Some("lease_not_found") => {
                status.send_replace(LeaseStatus::Lost {
                    reason: format!("the cluster no longer has lease {name:?}"),
                });
                return;
            }
            Err(e) => {
                tracing::warn!(lease = %name, error = %e, "refresh failed; retrying");
                wait = retry;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validity_ends_exactly_at_until() {
        let s = LeaseStatus::Valid {
            until: MonoMillis(1000),
            revision: Revision(1),
            refreshes: 0,
        };
        assert!(s.valid_at(MonoMillis(999)));
        assert!(!s.valid_at(MonoMillis(1000)));
        assert!(!LeaseStatus::Lost { reason: "x".into() }.valid_at(MonoMillis(0)));
    }
}
