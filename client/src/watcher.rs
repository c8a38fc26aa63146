//! `Watcher`: every change to a key or prefix, for ever, in order, without gaps or duplicates.
//!
//! It long-polls `GET /v1/watch` from the revision after the last one it delivered, failing
//! over between endpoints (any node serves watches from its applied history). If the start has
//! been compacted (410), it re-lists the keys and yields a [`WatchItem::Resync`] with the full
//! current state and its revision, then follows from there: the consumer replaces its view.
//!
//! # Invariant
//! The resume point only moves forward: a lagging node that reports a lower revision never
//! makes the watcher replay what it already delivered.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::{Client, ClientError};
use crate::api::Event;
use crate::api::KeyValue;
use crate::types::Revision;

/// What to follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchFilter {
    Key(String),
    Prefix(String),
}

/// What the watcher yields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchItem {
    /// One change, in revision order.
    Event(Event),
    /// The history was compacted past the resume point: here is the whole current state
    /// (matching keys) at `revision`; events follow from `revision + 1`.
    Resync {
        revision: Revision,
        items: Vec<KeyValue>,
    },
}

/// Told when a watch loses the cluster (`Some(error)`) and when it is following again
/// (`None`); the second argument is the revision it resumes from.
pub type InterruptionHook = Arc<dyn Fn(Option<&ClientError>, Option<u64>) + Send + Sync>;

/// A never-ending, resumable watch.
pub struct Watcher {
    client: Arc<Client>,
    filter: WatchFilter,
    /// The first revision not yet delivered (`None`: start after the current revision).
    next: Option<u64>,
    buffer: VecDeque<WatchItem>,
    poll_ms: u64,
    /// Fail instead of retrying until the first poll has succeeded (a command line reports a
    /// stopped cluster at once rather than waiting for it silently).
    fail_until_connected: bool,
    /// Whether a poll has ever succeeded.
    connected: bool,
    /// Whether the last poll failed (an interruption was reported, if anyone listens).
    interrupted: bool,
    on_interruption: Option<InterruptionHook>,
}

impl Watcher {
    /// Follow `filter` from revision `from` (inclusive), or from now.
    pub fn new(client: Arc<Client>, filter: WatchFilter, from: Option<u64>) -> Self {
        Watcher {
            client,
            filter,
            next: from,
            buffer: VecDeque::new(),
            poll_ms: 30_000,
            fail_until_connected: false,
            connected: false,
            interrupted: false,
            on_interruption: None,
        }
    }

    /// Return the error of a failed first poll instead of retrying (once connected, the
    /// watcher rides out unavailability as always).
    pub fn fail_until_connected(mut self, yes: bool) -> Self {
        self.fail_until_connected = yes;
        self
    }

    /// Report interruptions and resumptions to `hook` (once each per outage).
    pub fn on_interruption(mut self, hook: InterruptionHook) -> Self {
        self.on_interruption = Some(hook);
        self
    }

    /// The long-poll wait per request (1 ms to the server's 5 minutes).
    pub fn poll_timeout(mut self, ms: u64) -> Self {
        self.poll_ms = ms.clamp(1, 300_000);
        self
    }

    /// The first revision the watcher has not delivered yet.
    pub fn resume_revision(&self) -> Option<u64> {
        self.next
    }

    /// The next item. Retries (with backoff) through unavailability; returns an error only
    /// for a request the cluster refuses (a bad filter).
    pub async fn next(&mut self) -> Result<WatchItem, ClientError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            if let Some(item) = self.buffer.pop_front() {
                return Ok(item);
            }
            match self
                .client
                .watch_once(&self.filter, self.next, self.poll_ms)
                .await
            {
                Ok(batch) => {
                    backoff = Duration::from_millis(100);
                    self.connected = true;
                    if std::mem::take(&mut self.interrupted)
                        && let Some(hook) = &self.on_interruption
                    {
                        hook(None, self.next);
                    }
                    let resume = batch.revision.0 + 1;
                    // Never deliver what was delivered before (a lagging node). The floor is
                    // fixed for the batch: several events may share a revision.
                    let floor = self.next;
                    for e in batch.events {
                        if floor.is_none_or(|n| e.revision.0 >= n) {
                            self.next = Some(e.revision.0 + 1);
                            self.buffer.push_back(WatchItem::Event(e));
                        }
                    }
                    self.next = Some(self.next.map_or(resume, |n| n.max(resume)));
                }
                Err(e) if e.code() == Some("compacted") => {
                    let (revision, items) = self.relist().await?;
                    self.next = Some(revision.0 + 1);
                    return Ok(WatchItem::Resync { revision, items });
                }
                Err(
                    e @ ClientError::Api {
                        status: 400..=499, ..
                    },
                ) => return Err(e),
                Err(e) if self.fail_until_connected && !self.connected => return Err(e),
                Err(e) => {
                    if !std::mem::replace(&mut self.interrupted, true)
                        && let Some(hook) = &self.on_interruption
                    {
                        hook(Some(&e), self.next);
                    }
                    tracing::warn!(error = %e, "watch interrupted; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    async fn relist(&self) -> Result<(Revision, Vec<KeyValue>), ClientError> {
        match &self.filter {
            WatchFilter::Prefix(p) => {
                let list = self.client.list(p, Some(100_000), false).await?;
                Ok((list.revision, list.items))
            }
            WatchFilter::Key(k) => {
                // A linearizable read of one key; its store revision is the resync point.
                match self.client.get(k, false).await? {
                    Some(g) => Ok((g.revision, vec![g.kv])),
                    None => {
                        let list = self.client.list(k, Some(1), false).await?;
                        Ok((list.revision, Vec::new()))
                    }
                }
            }
        }
    }
}
