//! The Raft log's sync thread: makes appends durable, one fdatasync for every group of appends
//! queued meanwhile (group commit), completes their callbacks in order and raises the durable
//! mark; and leaves the leader's own groups unsynced where both followers hold them first.
//!
//! # Invariants
//! - An append that waits for its callback (a follower's, or the leader's blank and membership
//!   entries) completes only after an fdatasync that started after it was written.
//! - The own durable mark rises only by a sync; a group of the leader's early-acknowledged
//!   appends that is skipped ([`LeaderGroups`]) raises nothing: a quorum of followers holds
//!   it, which is all its commit needs (`super::durability`), and the next sync covers it.
//! - A failed sync is final (`Durability::failed`): every later callback gets the error.
//!
//! # What it must not do
//! Block the async workers: it is a plain thread, and only it calls fdatasync on the log.

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

/// How long the sync thread gives the followers to acknowledge a group of the leader's own
/// appends before it syncs the group itself. Nothing waits for the linger while they keep up:
/// the group commits as soon as both followers hold it. Under load their answers take a few
/// rounds of a few milliseconds each (measured: after 1 and 2 ms of linger they held under a
/// twentieth of the groups; after 6 ms, three quarters).
const LEADER_SYNC_LINGER: std::time::Duration = std::time::Duration::from_millis(5);

/// While the followers miss the linger (one down, or slow), one group in this many still
/// lingers, to find out when they keep up again; the others are synced at once, so a group
/// commits late by the linger only this rarely.
const LINGER_PROBE_EVERY: u32 = 32;

/// The sync thread's rule for groups made only of the leader's early-acknowledged appends: a
/// quorum of followers (its own copy not counted) that holds a group makes the leader's sync
/// of it unneeded for any commit (`raft::durability`), so it is skipped. The followers are
/// given [`LEADER_SYNC_LINGER`] to get there while they keep up (they held the previous group
/// in time); otherwise the leader's sync is on the commit's path, and is made at once.
#[derive(Default)]
struct LeaderGroups {
    /// Whether the followers held the previous group within the linger.
    keeping_up: bool,
    /// Groups synced at once since the followers last kept up.
    missed: u32,
}

impl LeaderGroups {
    /// Whether `batch` need not be synced (it may wait [`LEADER_SYNC_LINGER`] to tell).
    fn held_by_followers(&mut self, batch: &[SyncJob], durability: &Durability) -> bool {
        let leaders_own = batch.iter().all(|job| job.callback.is_none());
        let last = batch
            .iter()
            .filter_map(|job| job.last)
            .map(|l| l.index)
            .max();
        let (true, Some(last)) = (leaders_own, last) else {
            return false;
        };
        if durability.followers_hold(last) {
            self.keeping_up = true;
            self.missed = 0;
            return true;
        }
        let probe = self.missed.is_multiple_of(LINGER_PROBE_EVERY);
        if !self.keeping_up && !probe {
            self.missed += 1;
            return false;
        }
        std::thread::sleep(LEADER_SYNC_LINGER);
        self.keeping_up = durability.followers_hold(last);
        self.missed = if self.keeping_up { 0 } else { self.missed + 1 };
        self.keeping_up
    }
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
                // The base of the slow-sync warnings' pace (a measurement, as `started`).
                #[allow(clippy::disallowed_methods)]
                let base = std::time::Instant::now();
                let mut leader_groups = LeaderGroups::default();
                while let Some(first) = waiting.blocking_recv() {
                    batch.push(first);
                    while let Ok(more) = waiting.try_recv() {
                        batch.push(more);
                    }
                    if leader_groups.held_by_followers(&batch, &durability) {
                        observed.skipped();
                        batch.clear();
                        continue;
                    }
                    // A measurement for the metrics only: nothing decides on it.
                    #[allow(clippy::disallowed_methods)]
                    let started = std::time::Instant::now();
                    let synced = entries.sync();
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
                        Err(e) => {
                            tracing::error!(error = %e, "syncing the raft log failed");
                            durability.failed();
                        }
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

#[cfg(test)]
mod leader_group_tests {
    use std::collections::BTreeSet;

    use openraft::{CommittedLeaderId, Vote};

    use super::{LINGER_PROBE_EVERY, LeaderGroups, SyncJob};
    use crate::raft::durability::Durability;
    use crate::raft::{LogId, NodeId};

    fn id(index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(2, 1), index)
    }

    fn early(index: u64) -> SyncJob {
        SyncJob {
            callback: None,
            last: Some(id(index)),
            generation: 0,
        }
    }

    /// Deterministic (no acknowledgement arrives during a linger): which groups are skipped,
    /// which lingered and which were synced at once.
    #[test]
    fn the_leaders_own_groups_are_skipped_only_where_both_followers_hold_them() {
        let d = Durability::new(None);
        d.set_me(1);
        d.membership(0, vec![BTreeSet::<NodeId>::from([1, 2, 3])]);
        let mut lead = Vote::new(2, 1);
        lead.commit();
        d.vote_saved(&lead);
        let view = d.view();
        let mut groups = LeaderGroups::default();

        // Nothing acknowledged: the first group lingers (a probe), then is synced.
        assert!(!groups.held_by_followers(&[early(1)], &d));
        assert!(!groups.keeping_up);
        // Until the next probe, groups are synced at once.
        for i in 2..=LINGER_PROBE_EVERY as u64 {
            assert!(!groups.held_by_followers(&[early(i)], &d));
        }
        assert_eq!(groups.missed, LINGER_PROBE_EVERY);
        // One follower is no quorum of three without the leader.
        view.acknowledged(2, &lead, id(40));
        assert!(!groups.held_by_followers(&[early(40)], &d));
        // Both hold the group: skipped, and the followers keep up again.
        view.acknowledged(3, &lead, id(41));
        assert!(groups.held_by_followers(&[early(39), early(40)], &d));
        assert!(groups.keeping_up);
        // A group past what they hold lingers (they keep up), then is synced.
        assert!(!groups.held_by_followers(&[early(41), early(42)], &d));
        assert!(!groups.keeping_up);
        assert_eq!(groups.missed, 1);
        // Not leading any more: nothing is held by followers.
        d.vote_saved(&Vote::new(3, 2));
        assert!(!groups.held_by_followers(&[early(10)], &d));
    }
}
