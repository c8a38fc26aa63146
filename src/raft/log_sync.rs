//! The Raft log's sync thread: makes appends durable, one fdatasync for every group of appends
//! queued meanwhile (group commit), completes their callbacks in order and raises the durable
//! mark.
//!
//! # Invariants
//! - An append completes (its callback, or the durable mark for the leader's early-acknowledged
//!   ones) only after an fdatasync that started after it was written.
//! - A failed sync is final (`Durability::failed`): every later callback gets the error.
//!
//! # What it must not do
//! Block the async workers (it is a plain thread), or decide what is durable beyond the syncs
//! it made: the log store and `super::durability` own the rest.

use std::sync::Arc;

use openraft::storage::LogFlushed;

use super::durability::Durability;
use super::segment_log::SegmentLog;
use super::{LogId, TypeConfig};
use crate::domain::types::MonoMillis;
use crate::metrics::SyncStats;

/// The name of the thread that makes appends durable.
pub const SYNC_THREAD: &str = "raft log sync";

/// How many appends may wait for a sync before `append` itself waits (back-pressure on the
/// Raft core instead of an unbounded queue).
const SYNC_QUEUE: usize = 4096;

/// A sync at least this slow is reported: a follower acknowledges nothing while its sync runs
/// (openraft 0.9 keeps a follower's log I/O in its core), so its leader's quorum acknowledgement
/// ages as long, and at an election timeout the leader steps down. Half the shortest default
/// election timeout: an operator who sees a step-down, or a client that saw `no leader`, finds
/// the stalled disk beside it in the log.
const SLOW_SYNC: std::time::Duration = std::time::Duration::from_millis(200);

/// At most one slow-sync warning in this long (slow syncs meanwhile are counted in the next).
const SLOW_SYNC_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// The slow syncs since the last warning: the warnings' pace, and the slowest held back.
#[derive(Debug)]
struct SlowSyncs {
    warnings: crate::domain::health::WarnThrottle,
    slowest: std::time::Duration,
}

impl Default for SlowSyncs {
    fn default() -> Self {
        SlowSyncs {
            warnings: crate::domain::health::WarnThrottle::new(
                SLOW_SYNC_LOG_EVERY.as_millis() as u64
            ),
            slowest: std::time::Duration::ZERO,
        }
    }
}

impl SlowSyncs {
    /// Note a sync that took `took`, ending at `now` (ms on the sync thread's own clock): the
    /// count and the slowest since the last warning when one is due now.
    fn note(
        &mut self,
        took: std::time::Duration,
        now: MonoMillis,
    ) -> Option<(u64, std::time::Duration)> {
        if took < SLOW_SYNC {
            return None;
        }
        self.slowest = self.slowest.max(took);
        let count = self.warnings.occurred(now)?;
        Some((count, std::mem::take(&mut self.slowest)))
    }
}

/// Completes appends once a sync covers them: one thread per log store, which takes every
/// waiting append, syncs once, raises the durable mark and completes the callbacks in order. A
/// plain thread rather than a task: an fdatasync blocks, and a blocking-pool hop per sync costs
/// two more wake-ups. It ends when every clone of the log store is dropped, after completing
/// what is queued.
#[derive(Clone)]
pub(super) struct Syncer {
    pub(super) queue: tokio::sync::mpsc::Sender<SyncJob>,
    /// How long each sync took, for the node's metrics.
    pub(super) times: Arc<SyncStats>,
}

/// One append waiting for its sync.
pub(super) struct SyncJob {
    /// `None` when the append was acknowledged early (the leader's own entries).
    pub(super) callback: Option<LogFlushed<TypeConfig>>,
    /// Its last entry, and the log's generation when it was written.
    pub(super) last: Option<LogId>,
    pub(super) generation: u64,
}

impl Syncer {
    pub(super) fn start(
        entries: Arc<SegmentLog>,
        durability: Durability,
    ) -> Result<Syncer, std::io::Error> {
        let (queue, mut waiting) = tokio::sync::mpsc::channel::<SyncJob>(SYNC_QUEUE);
        let times = Arc::new(SyncStats::default());
        let observed = times.clone();
        std::thread::Builder::new()
            .name(SYNC_THREAD.into())
            .spawn(move || {
                let mut batch = Vec::new();
                let mut slow = SlowSyncs::default();
                let mut failed = None;
                // The base of the slow-sync warnings' pace (a measurement, as `started`).
                #[allow(clippy::disallowed_methods)]
                let base = std::time::Instant::now();
                while let Some(first) = waiting.blocking_recv() {
                    batch.push(first);
                    while let Ok(more) = waiting.try_recv() {
                        batch.push(more);
                    }
                    // A measurement for the metrics only: nothing decides on it.
                    #[allow(clippy::disallowed_methods)]
                    let started = std::time::Instant::now();
                    let failed_before = failed.is_some();
                    let synced = after_earlier_syncs(&mut failed, || entries.sync());
                    let took = started.elapsed();
                    observed.observe(took);
                    let now = MonoMillis(base.elapsed().as_millis() as u64);
                    if let Some((count, slowest)) = slow.note(took, now) {
                        tracing::warn!(
                            took_ms = took.as_millis() as u64,
                            slowest_ms = slowest.as_millis() as u64,
                            slow_syncs = count,
                            "the raft log's fdatasync was slow: the disk stalled, and nothing this \
                             node appended was acknowledged meanwhile (a leader without a quorum's \
                             acknowledgement for an election timeout steps down; see \
                             leasecore_raft_log_fsync_duration_seconds)"
                        );
                    }
                    match &synced {
                        Ok(()) => {
                            for job in &batch {
                                if let Some(last) = job.last {
                                    durability.synced(last, job.generation);
                                }
                            }
                        }
                        Err(e) if !failed_before => {
                            tracing::error!(error = %e, "syncing the raft log failed");
                            durability.failed();
                        }
                        Err(_) => {}
                    }
                    for job in batch.drain(..) {
                        let result = match &synced {
                            Ok(()) => Ok(()),
                            Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
                        };
                        if let Some(callback) = job.callback {
                            callback.log_io_completed(result);
                        }
                    }
                }
            })?;
        Ok(Syncer { queue, times })
    }
}

/// A sync's outcome as its appends must see it: once a sync failed, every later one fails
/// too, whatever the kernel would say (after a failed fdatasync it may have dropped the dirty
/// pages and report the next sync fine), so `sync` is not even called again. `failed` keeps
/// the first failure.
fn after_earlier_syncs(
    failed: &mut Option<(std::io::ErrorKind, String)>,
    sync: impl FnOnce() -> std::io::Result<()>,
) -> std::io::Result<()> {
    if failed.is_none()
        && let Err(e) = sync()
    {
        *failed = Some((e.kind(), e.to_string()));
    }
    match failed {
        Some((kind, message)) => Err(std::io::Error::new(
            *kind,
            format!("an earlier sync of the raft log failed: {message}"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod failed_sync_tests {
    use super::after_earlier_syncs;
    use std::io::{Error, ErrorKind};

    #[test]
    fn after_a_failed_sync_every_later_one_fails() {
        let mut failed = None;
        assert!(after_earlier_syncs(&mut failed, || Ok(())).is_ok());
        let first = after_earlier_syncs(&mut failed, || Err(Error::other("EIO")));
        assert!(first.unwrap_err().to_string().contains("EIO"));
        // The kernel would report the next sync fine: its appends still get the first
        // failure, and the sync is not made at all.
        let later = after_earlier_syncs(&mut failed, || panic!("synced after a failure"));
        assert!(later.unwrap_err().to_string().contains("EIO"));
        let other = || Err(Error::new(ErrorKind::StorageFull, "ENOSPC"));
        let last = after_earlier_syncs(&mut failed, other).unwrap_err();
        assert_eq!(last.kind(), ErrorKind::Other);
    }
}

#[cfg(test)]
mod slow_sync_tests {
    use std::time::Duration;

    use super::{SLOW_SYNC, SLOW_SYNC_LOG_EVERY, SlowSyncs};
    use crate::domain::types::MonoMillis;

    #[test]
    fn slow_syncs_are_reported_at_most_once_per_interval_with_what_came_between() {
        let t0 = MonoMillis(1_000);
        let at = |d: Duration| MonoMillis(t0.0 + d.as_millis() as u64);
        let mut slow = SlowSyncs::default();
        assert_eq!(
            slow.note(SLOW_SYNC / 2, t0),
            None,
            "a fast sync is not slow"
        );
        let first = SLOW_SYNC + Duration::from_millis(5);
        assert_eq!(slow.note(first, t0), Some((1, first)));
        // Within the interval: counted, not reported.
        let worst = SLOW_SYNC * 4;
        assert_eq!(slow.note(worst, at(Duration::from_secs(1))), None);
        assert_eq!(slow.note(SLOW_SYNC, at(Duration::from_secs(2))), None);
        // The next report carries both, and the slowest of them.
        let third = SLOW_SYNC * 2;
        assert_eq!(slow.note(third, at(SLOW_SYNC_LOG_EVERY)), Some((3, worst)),);
        assert_eq!(slow.note(SLOW_SYNC, at(SLOW_SYNC_LOG_EVERY)), None);
    }
}
