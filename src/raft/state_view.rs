//! The read view of the applied state ([`StateView`]): the current state behind a lock held
//! for a few lines, and the MVCC history for reads at past revisions and older watch events.
//!
//! # Invariants
//! - A reader that sees store revision `r` finds the history through `r` (the state machine
//!   writes the history before it releases the state's write lock).
//! - A history read checks the floor before and after reading: a compaction that applied
//!   meanwhile makes it answer `compacted`, never a half-swept answer.
//! - A history read that overlapped the compaction sweep's removal of history records reads
//!   again ([`read_unswept`]): it takes locations from the key index, then reads them, and
//!   a fold may have moved one meanwhile (a kept version whose record went is rewritten as a
//!   base). (A snapshot install raises the floor to the current revision before it rewrites
//!   the tree, so history reads answer `compacted` until it is done.)
//!
//! # What it must not do
//! Write anything, or hold its lock across an await.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::raft::off_workers::RwLock;
use std::time::Duration;

use tokio::sync::watch;

use super::mvcc_store;
use super::off_workers;
use super::state_machine::AppliedMark;
use crate::domain::history::{Batch, Compacted, KeyFilter, Resume};
use crate::domain::history_fill::{EventsPage, HistoryReach, KeysPage, MAX_PAGE_ITEMS, PAGE_BYTES};
use crate::domain::kv::{KvState, LeaseRecord, Versioned};
use crate::domain::mvcc;
use crate::domain::range::{RangeSpec, ReadBound, ResultBudget, ResultTooLarge};
use crate::domain::types::Revision;
use crate::domain::watch_batch::BatchLimit;

/// A cheap, cloneable read view of the applied state, for the HTTP layer.
#[derive(Clone)]
pub struct StateView {
    pub(super) kv: Arc<RwLock<KvState>>,
    pub(super) applied: watch::Receiver<AppliedMark>,
    /// The MVCC history and its key index (`mvcc_store`).
    pub(super) history: mvcc_store::History,
    /// Where this node's history begins (changed only with the state, under its write lock).
    pub(super) history_start: Arc<AtomicU64>,
    /// A compaction mark whose own event records may be gone (0 if none): a store swept by an
    /// older version, which removed the mark's records too. Set when the store is opened (the
    /// sweep no longer removes a mark's records; an install's history starts above its mark).
    pub(super) mark_swept: Revision,
    /// The state machine's removals of history records, for [`read_unswept`].
    pub(super) removals: HistoryRemovals,
    /// [`KvState::data_bytes`] as of the last applied batch, published by the state machine
    /// so that the size is read without the state's lock: the quota check of every write and
    /// the log compactor ask for it, and neither may wait out a long apply (the compactor
    /// asks while it holds openraft's metrics, which the Raft core then cannot publish).
    pub(super) data_bytes: Arc<AtomicU64>,
}

/// Counts the state machine's removals of history records; odd while one is being written.
/// Removals are written only under the state's write lock, so a reader holding the read lock
/// always sees an even count.
#[derive(Clone, Debug, Default)]
pub struct HistoryRemovals(Arc<AtomicU64>);

impl HistoryRemovals {
    /// Announce removals about to be written; the window closes when the guard drops (also
    /// on an error path, so the count is even again).
    pub fn begin(&self) -> RemovalWindow<'_> {
        self.0.fetch_add(1, Ordering::SeqCst);
        RemovalWindow(self)
    }

    fn stamp(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl StateView {
    /// Tests: how many times the state machine announced removals of history records (each
    /// announcement counts two).
    #[doc(hidden)]
    pub fn history_removals(&self) -> u64 {
        self.removals.stamp()
    }
}

/// An open window of removals ([`HistoryRemovals::begin`]).
pub struct RemovalWindow<'a>(&'a HistoryRemovals);

impl Drop for RemovalWindow<'_> {
    fn drop(&mut self) {
        self.0.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Optimistic reads of the history before [`read_unswept`] holds removals off.
const OPTIMISTIC_READS: usize = 4;

/// Run `read` until one run overlapped no removal of history records. `quiesce` returns a
/// guard under which no removal can start (the state's read lock); it is held only to take
/// the count, except after `OPTIMISTIC_READS` overlapped runs (a sweep running on every
/// applied group), when the last run is made under it: a reader is never starved, and apply
/// waits at most one read.
pub fn read_unswept<T, E, G>(
    removals: &HistoryRemovals,
    quiesce: impl Fn() -> G,
    mut read: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    for _ in 0..OPTIMISTIC_READS {
        let before = {
            let _held = quiesce();
            removals.stamp()
        };
        // An overlapped run's answer is dropped, an error too: a location a fold moved
        // meanwhile is missing.
        let out = read();
        if removals.stamp() == before {
            return out;
        }
    }
    let _held = quiesce();
    read()
}

/// Why the state at a revision cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("revision {revision} is compacted: the oldest revision held is {floor}")]
    Compacted { revision: Revision, floor: Revision },
    #[error("revision {revision} is in the future (the store is at {current})")]
    Future {
        revision: Revision,
        current: Revision,
    },
    #[error(transparent)]
    Storage(#[from] crate::storage::StorageError),
    /// The answer read would pass the request's budget ([`StateView::range_within`]).
    #[error(transparent)]
    TooLarge(#[from] ResultTooLarge),
}

impl StateView {
    /// Bytes of every live key and value (the state's share of the storage quota).
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes.load(Ordering::Acquire)
    }

    /// One key, as of the latest applied entry.
    pub fn get(&self, key: &str) -> (Revision, Option<Versioned>) {
        let kv = off_workers::read(&self.kv);
        (kv.revision(), kv.get(key).cloned())
    }

    /// Keys under `prefix`, sorted, at most `limit`.
    pub fn list(&self, prefix: &str, limit: usize) -> (Revision, Vec<(String, Versioned)>) {
        let kv = off_workers::read(&self.kv);
        let items = kv
            .list(prefix, limit)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        (kv.revision(), items)
    }

    /// One lease.
    pub fn lease(&self, name: &str) -> (Revision, Option<LeaseRecord>) {
        let kv = off_workers::read(&self.kv);
        (kv.revision(), kv.lease(name).cloned())
    }

    /// How many leases there are.
    pub fn lease_count(&self) -> usize {
        off_workers::read(&self.kv).leases().len()
    }

    /// Every lease's name, without its record (whose key set a list of ids has no use for).
    pub fn lease_names(&self) -> (Revision, Vec<String>) {
        let kv = off_workers::read(&self.kv);
        (kv.revision(), kv.leases().keys().cloned().collect())
    }

    /// Every lease, by name.
    pub fn leases(&self) -> (Revision, Vec<(String, LeaseRecord)>) {
        let kv = off_workers::read(&self.kv);
        let all = kv
            .leases()
            .iter()
            .map(|(n, l)| (n.clone(), l.clone()))
            .collect();
        (kv.revision(), all)
    }

    /// Run `f` on the applied state while no entry applies (keep `f` short).
    pub fn with_state<T>(&self, f: impl FnOnce(&KvState) -> T) -> T {
        let kv = off_workers::read(&self.kv);
        f(&kv)
    }

    /// `(floor, current)`: history is held above `floor` (ranges may read at it), the store
    /// is at `current`.
    fn bounds(&self) -> (Revision, Revision) {
        let kv = off_workers::read(&self.kv);
        let start = Revision(self.history_start.load(Ordering::Acquire));
        (mvcc::floor(kv.compact_revision(), start), kv.revision())
    }

    /// The highest revision a watch may not start from under `resume` (its events may be
    /// gone).
    fn watch_floor(&self, resume: Resume) -> Revision {
        let kv = off_workers::read(&self.kv);
        let start = Revision(self.history_start.load(Ordering::Acquire));
        mvcc::watch_floor(kv.compact_revision(), start, self.mark_swept, resume)
    }

    /// The floor, checked again after a read of the history: a compaction that applied
    /// meanwhile may have swept what the read saw, and then it must not answer.
    fn still_held(&self, revision: Revision, inclusive: bool) -> Result<(), HistoryError> {
        let (floor, _) = self.bounds();
        if revision < floor || (!inclusive && revision == floor) {
            return Err(HistoryError::Compacted { revision, floor });
        }
        Ok(())
    }

    /// The live keys of `range` at `revision` (`None`, 0 or the current revision: now), with
    /// the store revision, as an etcd range at a revision.
    pub fn range_at(
        &self,
        range: &crate::domain::auth::KeyRange,
        revision: Option<Revision>,
    ) -> Result<(Revision, Vec<(String, Versioned)>), HistoryError> {
        let revision = revision.filter(|r| r.0 > 0);
        {
            let kv = off_workers::read(&self.kv);
            let current = kv.revision();
            match revision {
                None => {
                    let now = kv.range(range).map(|(k, v)| (k.to_string(), v.clone()));
                    return Ok((current, now.collect()));
                }
                Some(r) if r == current => {
                    let now = kv.range(range).map(|(k, v)| (k.to_string(), v.clone()));
                    return Ok((current, now.collect()));
                }
                Some(r) if r > current => {
                    return Err(HistoryError::Future {
                        revision: r,
                        current,
                    });
                }
                Some(_) => {}
            }
        }
        let revision = revision.unwrap_or_default();
        self.read_past(revision, || self.history.range_at(range, revision))
    }

    /// The keys of `spec`'s range at `revision` (`None`, 0 or the current revision: now) that
    /// an answer to `spec` needs, within `budget` (what is left of the request's), with the
    /// store revision. As [`StateView::range_at`], but the keys are read a few at a time
    /// through a [`ReadBound`]: values the answer cannot hold are not kept, and the read
    /// stops with [`HistoryError::TooLarge`] once the answer would pass the budget, before
    /// the rest of the range is in memory.
    pub fn range_within(
        &self,
        spec: &RangeSpec,
        revision: Option<Revision>,
        budget: ResultBudget,
    ) -> Result<(Revision, Vec<(String, Versioned)>), HistoryError> {
        let revision = revision.filter(|r| r.0 > 0);
        {
            let kv = off_workers::read(&self.kv);
            let current = kv.revision();
            match revision {
                Some(r) if r > current => {
                    return Err(HistoryError::Future {
                        revision: r,
                        current,
                    });
                }
                Some(r) if r < current => {}
                _ => {
                    let mut bound = ReadBound::new(spec, budget);
                    let mut out = Vec::new();
                    for (k, v) in kv.range(&spec.range) {
                        let v = if bound.admit(k, v)? {
                            v.clone()
                        } else {
                            Versioned {
                                value: String::new(),
                                lease: v.lease.clone(),
                                ..*v
                            }
                        };
                        out.push((k.to_string(), v));
                    }
                    return Ok((current, out));
                }
            }
        }
        let revision = revision.unwrap_or_default();
        self.read_past(revision, || {
            // A fresh bound for each run: an overlapped run's charges are dropped with it.
            let mut bound = ReadBound::new(spec, budget);
            self.history
                .range_at_admitted(&spec.range, revision, &mut |k, v| {
                    Ok::<_, HistoryError>(bound.admit_owned(k, v)?)
                })
        })
    }

    /// `read` of the history at a past `revision`, with the store revision: `compacted` below
    /// the floor, retried while a compaction moves what it reads, and `compacted` (not the
    /// failed read) if an install rewrote the history meanwhile.
    fn read_past<T, E: Into<HistoryError>>(
        &self,
        revision: Revision,
        read: impl FnMut() -> Result<T, E>,
    ) -> Result<(Revision, T), HistoryError> {
        let (floor, current) = self.bounds();
        if revision < floor {
            return Err(HistoryError::Compacted { revision, floor });
        }
        let out = read_unswept(&self.removals, || off_workers::read(&self.kv), read);
        self.still_held(revision, true)?;
        Ok((current, out.map_err(Into::into)?))
    }

    /// The version of `key` before its change at `revision` (a watch's `prev_kv`), if it was
    /// live and is still held.
    pub fn version_before(&self, key: &str, revision: Revision) -> Option<Versioned> {
        let prev = read_unswept(
            &self.removals,
            || off_workers::read(&self.kv),
            || self.history.version_before(key, revision),
        )
        .ok()?;
        self.still_held(Revision(revision.0.saturating_sub(1)), true)
            .ok()?;
        prev
    }

    /// The latest applied mark.
    pub fn applied(&self) -> AppliedMark {
        *self.applied.borrow()
    }

    /// The applied marks as they are published.
    pub fn applied_marks(&self) -> watch::Receiver<AppliedMark> {
        self.applied.clone()
    }

    /// Wait until the applied index reaches `index`; false on timeout or shutdown.
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> bool {
        let mut rx = self.applied.clone();
        let reached = rx.wait_for(|m| m.log_index >= index);
        matches!(tokio::time::timeout(timeout, reached).await, Ok(Ok(_)))
    }

    /// Wait until the applied store revision reaches `revision`; false on timeout or shutdown.
    pub async fn wait_revision(&self, revision: Revision, timeout: Duration) -> bool {
        let mut rx = self.applied.clone();
        let reached = rx.wait_for(|m| m.revision >= revision);
        matches!(tokio::time::timeout(timeout, reached).await, Ok(Ok(_)))
    }

    /// The lowest revision this node's history can be read at (the compaction mark, or where
    /// its history starts when it began from a snapshot).
    pub fn history_floor(&self) -> Revision {
        self.bounds().0
    }

    /// The key index's size: keys with a version held, and versions held (what compaction
    /// bounds; each costs memory).
    pub fn history_size(&self) -> (usize, usize) {
        self.history.size()
    }

    /// How far back this node's history reaches (a peer's fill asks).
    pub fn reach(&self) -> HistoryReach {
        let (floor, revision) = self.bounds();
        HistoryReach { floor, revision }
    }

    /// A page of the live keys at `revision` after `after`, for a peer's fill.
    pub fn keys_page(
        &self,
        revision: Revision,
        after: Option<&str>,
        limit: usize,
    ) -> Result<KeysPage, HistoryError> {
        let (floor, current) = self.bounds();
        if revision < floor {
            return Err(HistoryError::Compacted { revision, floor });
        }
        if revision > current {
            return Err(HistoryError::Future { revision, current });
        }
        let limit = limit.clamp(1, MAX_PAGE_ITEMS);
        let page = read_unswept(
            &self.removals,
            || off_workers::read(&self.kv),
            || self.history.range_page(after, revision, limit, PAGE_BYTES),
        );
        self.still_held(revision, true)?;
        let (keys, done) = page?;
        Ok(KeysPage { keys, done })
    }

    /// A page of every event from `from` through `through`, for a peer's fill.
    pub fn events_page(
        &self,
        from: Revision,
        through: Revision,
        limit: usize,
    ) -> Result<EventsPage, HistoryError> {
        let (floor, current) = self.bounds();
        if from <= floor {
            return Err(HistoryError::Compacted {
                revision: from,
                floor,
            });
        }
        if through > current {
            return Err(HistoryError::Future {
                revision: through,
                current,
            });
        }
        let limit = limit.clamp(1, MAX_PAGE_ITEMS);
        let everything = KeyFilter::Prefix(String::new());
        let batch = mvcc_store::events_since(
            &self.history.tree,
            from,
            through,
            &everything,
            BatchLimit {
                events: limit,
                bytes: PAGE_BYTES,
            },
        )?;
        self.still_held(from, false)?;
        Ok(EventsPage {
            events: batch.events,
            through: batch.through,
        })
    }

    /// A receiver of applied marks (for drivers that follow progress).
    pub fn subscribe(&self) -> watch::Receiver<AppliedMark> {
        self.applied.clone()
    }
}

impl crate::domain::history::OlderEvents for StateView {
    fn floor(&self, resume: Resume) -> Revision {
        self.watch_floor(resume)
    }

    fn since(
        &self,
        from: Revision,
        through: Revision,
        filter: &KeyFilter,
        limit: BatchLimit,
        resume: Resume,
    ) -> Result<Batch, Compacted> {
        let compacted = |floor| Compacted { compacted: floor };
        let floor = self.watch_floor(resume);
        if from <= floor {
            return Err(compacted(floor));
        }
        let batch = mvcc_store::events_since(&self.history.tree, from, through, filter, limit)
            .map_err(|e| {
                tracing::error!(error = %e, "reading the history");
                compacted(through)
            })?;
        // A compaction that applied meanwhile may have swept what the read saw.
        let floor = self.watch_floor(resume);
        if from <= floor {
            return Err(compacted(floor));
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A long apply holds the state's write lock for seconds. The state's size must still
    /// answer at once: the log compactor reads it while it holds openraft's metrics, and the
    /// Raft core, unable to publish its own metrics meanwhile, stopped answering heartbeats
    /// until the leader stepped down (found with `etcdctl check perf --load l`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_state_size_is_read_without_waiting_for_the_state_lock() {
        use crate::raft::state_machine::{DiscardEvents, StateMachine};
        use openraft::storage::RaftStateMachine;
        use openraft::{CommittedLeaderId, EntryPayload, LogId};

        let dir = tempfile::TempDir::new().unwrap();
        let db = crate::storage::open_db(dir.path(), 16 << 20).unwrap();
        let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        let put = crate::domain::command::Command::Put {
            key: "key".into(),
            value: "value".into(),
            lease: None,
            prev_revision: None,
        };
        sm.apply(vec![crate::raft::Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), 1),
            payload: EntryPayload::Normal(put.into()),
        }])
        .await
        .unwrap();
        assert_eq!(view.data_bytes(), 8, "published by the apply");

        let held = view.kv.write();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = view.clone();
        std::thread::spawn(move || tx.send(reader.data_bytes()));
        let answered = rx.recv_timeout(Duration::from_secs(5));
        drop(held);
        assert_eq!(answered, Ok(8), "answered while the state was held");
    }

    #[test]
    fn a_read_that_overlapped_a_removal_reads_again() {
        let removals = HistoryRemovals::default();
        let quiesced = Cell::new(0);
        let quiesce = || quiesced.set(quiesced.get() + 1);
        let runs = Cell::new(0);
        let out: Result<u32, ()> = read_unswept(&removals, quiesce, || {
            runs.set(runs.get() + 1);
            if runs.get() == 1 {
                // A sweep's removals, written while this run read.
                drop(removals.begin());
                return Ok(1);
            }
            Ok(2)
        });
        assert_eq!(out, Ok(2), "the overlapped run's answer is dropped");
        assert_eq!(runs.get(), 2);
        // A run that overlapped nothing is taken as it is.
        runs.set(10);
        assert_eq!(read_unswept(&removals, || (), || Ok::<_, ()>(7)), Ok(7));
    }

    #[test]
    fn a_reader_overlapped_every_time_reads_with_removals_held_off() {
        let removals = HistoryRemovals::default();
        let held = Cell::new(false);
        struct Hold<'a>(&'a Cell<bool>);
        impl Drop for Hold<'_> {
            fn drop(&mut self) {
                self.0.set(false);
            }
        }
        let runs = Cell::new(0);
        let out: Result<bool, ()> = read_unswept(
            &removals,
            || {
                held.set(true);
                Hold(&held)
            },
            || {
                runs.set(runs.get() + 1);
                if !held.get() {
                    drop(removals.begin());
                }
                Ok(held.get())
            },
        );
        assert_eq!(out, Ok(true), "the last run is made with removals held off");
        assert_eq!(runs.get(), OPTIMISTIC_READS + 1);
        // An error is returned as it is, and leaves the count even.
        let err: Result<(), &str> = read_unswept(&removals, || (), || Err("io"));
        assert_eq!(err, Err("io"));
        assert_eq!(removals.stamp() % 2, 0);
    }
}
