//! The watch hub: the node's event history and the wake-ups of waiting watches.
//!
//! # Invariants
//! - Fed only by the apply path (it is an [`ApplyObserver`]): the history holds exactly the
//!   applied events, in revision order, and events reach it before any proposer is answered.
//! - **Subscribe before checking.** A watch registers its wake-up, then reads the history, then
//!   waits. An event applied between the read and the wait fires the registered wake-up, so no
//!   event slips between the check and the wait.
//! - **Wake only who matches.** Wake-ups are indexed by exact key and by prefix; an applied
//!   event wakes the watches of its key and of each registered prefix of its key (looked up by
//!   the prefix lengths in use), never the others. 10,000 idle watches cost an index entry and
//!   a parked task each, and no CPU.
//! - A wake-up is one-shot and a registration is removed when its watch ends (a guard), so
//!   abandoned long polls leave nothing behind.
//! - At start-up the in-memory history is empty at the persisted revision: a watch resuming
//!   from before it reads the MVCC store ([`WatchHub::set_older`]), so a restart does not by
//!   itself make a resuming watch `410`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::domain::history::{
    Batch, Compacted, EventHistory, HistoryLimits, KeyFilter, OlderEvents, Resume, text_prefixes,
};
use crate::domain::types::Revision;
use crate::domain::watch_batch::BatchLimit;
use crate::raft::state_machine::{AppliedBatch, ApplyObserver};

type Wakers = HashMap<u64, oneshot::Sender<()>>;

#[derive(Default)]
struct Waiters {
    by_key: HashMap<String, Wakers>,
    by_prefix: HashMap<String, Wakers>,
    /// How many registered prefixes have each length (to look up only lengths in use).
    prefix_lens: BTreeMap<usize, usize>,
}

impl Waiters {
    fn insert(&mut self, filter: &KeyFilter, id: u64, waker: oneshot::Sender<()>) {
        match filter {
            KeyFilter::Key(k) => {
                self.by_key.entry(k.clone()).or_default().insert(id, waker);
            }
            KeyFilter::Prefix(p) => {
                let set = self.by_prefix.entry(p.clone()).or_default();
                if set.is_empty() {
                    *self.prefix_lens.entry(p.len()).or_default() += 1;
                }
                set.insert(id, waker);
            }
        }
    }

    fn remove(&mut self, filter: &KeyFilter, id: u64) {
        match filter {
            KeyFilter::Key(k) => {
                if let Some(set) = self.by_key.get_mut(k) {
                    set.remove(&id);
                    if set.is_empty() {
                        self.by_key.remove(k);
                    }
                }
            }
            KeyFilter::Prefix(p) => {
                if let Some(set) = self.by_prefix.get_mut(p) {
                    set.remove(&id);
                    if set.is_empty() {
                        self.drop_prefix(p);
                    }
                }
            }
        }
    }

    fn drop_prefix(&mut self, p: &str) {
        self.by_prefix.remove(p);
        self.forget_len(p.len());
    }

    fn forget_len(&mut self, len: usize) {
        if let Some(n) = self.prefix_lens.get_mut(&len) {
            *n -= 1;
            if *n == 0 {
                self.prefix_lens.remove(&len);
            }
        }
    }

    /// Wake every watch whose filter matches `key`.
    fn wake_matching(&mut self, key: &str) {
        if let Some(set) = self.by_key.remove(key) {
            set.into_values().for_each(|w| {
                let _ = w.send(());
            });
        }
        // (A raw key is never longer than its stored form.)
        let lens: Vec<usize> = self
            .prefix_lens
            .range(..=key.len())
            .map(|(l, _)| *l)
            .collect();
        let prefixes: Vec<Cow<str>> = text_prefixes(key, lens.into_iter())
            .filter(|p| self.by_prefix.contains_key(p.as_ref()))
            .collect();
        for prefix in prefixes {
            // A registered prefix always has wakers: empty sets are removed.
            if let Some(set) = self.by_prefix.remove(prefix.as_ref()) {
                self.forget_len(prefix.len());
                set.into_values().for_each(|w| {
                    let _ = w.send(());
                });
            }
        }
    }

    fn wake_all(&mut self) {
        for (_, set) in self.by_key.drain() {
            set.into_values().for_each(|w| {
                let _ = w.send(());
            });
        }
        for (_, set) in self.by_prefix.drain() {
            set.into_values().for_each(|w| {
                let _ = w.send(());
            });
        }
        self.prefix_lens.clear();
    }

    fn len(&self) -> usize {
        self.by_key.values().map(HashMap::len).sum::<usize>()
            + self.by_prefix.values().map(HashMap::len).sum::<usize>()
    }
}

/// The event history of this node and its waiting watches.
pub struct WatchHub {
    history: Mutex<EventHistory>,
    waiters: Mutex<Waiters>,
    /// The applied revision, for streams that follow every key (multi-watch streams match
    /// their many filters themselves: one wake-up per stream, not per filter).
    advanced: tokio::sync::watch::Sender<Revision>,
    next_id: AtomicU64,
    /// Fires at node shutdown: every long poll returns.
    cancel: CancellationToken,
    /// Where events older than the in-memory history are read (the MVCC store), once set.
    older: std::sync::OnceLock<Arc<dyn OlderEvents>>,
}

/// Removes a watch's wake-up when the watch ends, however it ends.
struct Registration<'a> {
    hub: &'a WatchHub,
    filter: &'a KeyFilter,
    id: u64,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.hub.waiters().remove(self.filter, self.id);
    }
}

impl WatchHub {
    /// A hub for a store currently at `revision` (nothing before it is known).
    pub fn new(limits: HistoryLimits, revision: Revision, cancel: CancellationToken) -> Self {
        WatchHub {
            history: Mutex::new(EventHistory::new(limits, revision)),
            waiters: Mutex::new(Waiters::default()),
            advanced: tokio::sync::watch::Sender::new(revision),
            next_id: AtomicU64::new(1),
            cancel,
            older: std::sync::OnceLock::new(),
        }
    }

    /// Read events older than the in-memory history from `older` (set once, at start-up).
    pub fn set_older(&self, older: Arc<dyn OlderEvents>) {
        let _ = self.older.set(older);
    }

    /// Matching events from `from` on: from memory, or, for revisions it no longer holds,
    /// from the store (a batch that ends where memory begins; the next call goes on there).
    /// `resume` says whether a start at the compaction mark is answered (etcd) or not (`/v1`).
    fn since(
        &self,
        from: Revision,
        filter: &KeyFilter,
        limit: BatchLimit,
        resume: Resume,
    ) -> Result<Batch, Compacted> {
        if let Some(older) = self.older.get() {
            let floor = older.floor(resume);
            if from <= floor {
                return Err(Compacted { compacted: floor });
            }
        }
        let in_memory = self.history().since(from, filter, limit);
        let (Err(Compacted { compacted }), Some(older)) = (&in_memory, self.older.get()) else {
            return in_memory;
        };
        let batch = older.since(from, *compacted, filter, limit, resume)?;
        if !batch.events.is_empty() || batch.through < *compacted {
            return Ok(batch);
        }
        // Nothing matched in the stored span: go on in memory from where it ends.
        self.history().since(compacted.next(), filter, limit)
    }

    fn history(&self) -> std::sync::MutexGuard<'_, EventHistory> {
        self.history.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn waiters(&self) -> std::sync::MutexGuard<'_, Waiters> {
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the node is shutting down (streams end).
    pub fn is_closed(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Resolves when the node shuts down.
    pub async fn closed(&self) {
        self.cancel.cancelled().await
    }

    /// The store revision as of the latest applied batch.
    pub fn current(&self) -> Revision {
        self.history().current()
    }

    /// Told of every applied revision. Subscribe (and mark seen) before reading the history:
    /// an event applied after the read then shows as a change.
    pub fn revisions(&self) -> tokio::sync::watch::Receiver<Revision> {
        self.advanced.subscribe()
    }

    /// Every event from `from` on, within `limit`, without waiting (`/v1`'s rule: a start at
    /// or below the compaction mark is compacted).
    pub fn since_all(&self, from: Revision, limit: BatchLimit) -> Result<Batch, Compacted> {
        self.since(
            from,
            &KeyFilter::Prefix(String::new()),
            limit,
            Resume::AfterMark,
        )
    }

    /// (retained events, retained bytes, compacted revision, waiting watches).
    pub fn stats(&self) -> (usize, usize, Revision, usize) {
        let (len, bytes, compacted) = {
            let h = self.history();
            (h.len(), h.bytes(), h.compacted())
        };
        (len, bytes, compacted, self.waiters().len())
    }

    /// Matching events with revision `>= from` (default: after the current revision), within
    /// `limit` (a count and bytes, whole revisions: [`crate::domain::watch_batch`]); if there
    /// are none, wait up to `timeout` for one. An empty batch at the timeout
    /// says how far the watch has looked (`through`): resume from `through + 1`. A start
    /// before what `resume` leaves answerable is `Compacted`.
    pub async fn watch(
        &self,
        filter: &KeyFilter,
        from: Option<Revision>,
        timeout: Duration,
        limit: BatchLimit,
        resume: Resume,
    ) -> Result<Batch, Compacted> {
        let from = from.unwrap_or_else(|| self.current().next());
        let expired = tokio::time::sleep(timeout);
        tokio::pin!(expired);
        loop {
            // Subscribe first, then check (see the module docs).
            let (waker, woken) = oneshot::channel();
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            self.waiters().insert(filter, id, waker);
            let _registration = Registration {
                hub: self,
                filter,
                id,
            };
            let batch = self.since(from, filter, limit, resume)?;
            if !batch.events.is_empty() {
                return Ok(batch);
            }
            tokio::select! {
                _ = woken => {}
                _ = &mut expired => return self.since(from, filter, limit, resume),
                _ = self.cancel.cancelled() => return Ok(batch),
            }
        }
    }
}

impl ApplyObserver for WatchHub {
    fn on_applied(&self, batch: &AppliedBatch) {
        if batch.reset {
            // A snapshot replaced the state: the history of the gap is unknown. Waiting
            // watches wake and find their start compacted.
            self.history().reset(batch.mark.revision);
            self.waiters().wake_all();
            self.advanced.send_replace(batch.mark.revision);
            return;
        }
        // History first, wake-ups second: a woken watch must find its events.
        self.history()
            .push(batch.events.iter().cloned(), batch.mark.revision);
        if batch.events.is_empty() {
            return;
        }
        self.advanced.send_replace(batch.mark.revision);
        let mut w = self.waiters();
        for e in &batch.events {
            w.wake_matching(&e.key);
        }
    }
}

/// A shared hub.
pub type SharedWatchHub = Arc<WatchHub>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::{Cause, Event, EventKind};
    use crate::raft::state_machine::AppliedMark;

    fn batch(keys: &[&str], first_rev: u64) -> AppliedBatch {
        let events: Vec<Event> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| Event {
                kind: EventKind::Put,
                create_revision: None,
                version: None,
                key: k.to_string(),
                value: Some("v".into()),
                revision: Revision(first_rev + i as u64),
                lease: None,
                cause: Cause::Client,
            })
            .collect();
        AppliedBatch {
            mark: AppliedMark {
                log_index: first_rev,
                term: 1,
                revision: Revision(first_rev + keys.len() as u64 - 1),
            },
            events,
            lease_changes: vec![],
            reset: false,
            lease_clock_ms: 0,
        }
    }

    fn hub() -> Arc<WatchHub> {
        Arc::new(WatchHub::new(
            HistoryLimits::default(),
            Revision(0),
            CancellationToken::new(),
        ))
    }

    #[tokio::test]
    async fn a_waiting_watch_wakes_on_its_key_only() {
        let h = hub();
        let waiting = {
            let h = h.clone();
            tokio::spawn(async move {
                h.watch(
                    &KeyFilter::Prefix("a/".into()),
                    None,
                    Duration::from_secs(10),
                    BatchLimit::events(100),
                    Resume::AfterMark,
                )
                .await
            })
        };
        // Let it park, then apply a non-matching and a matching event.
        while h.stats().3 == 0 {
            tokio::task::yield_now().await;
        }
        h.on_applied(&batch(&["b/1"], 1));
        assert_eq!(h.stats().3, 1, "a non-matching event woke the watch");
        h.on_applied(&batch(&["a/1"], 2));
        let got = waiting.await.unwrap().unwrap();
        assert_eq!(got.events[0].key, "a/1");
        assert_eq!(h.stats().3, 0, "the registration was removed");
    }

    #[tokio::test]
    async fn timeouts_return_progress_and_clean_up() {
        let h = hub();
        h.on_applied(&batch(&["x"], 1));
        let got = h
            .watch(
                &KeyFilter::Key("y".into()),
                None,
                Duration::from_millis(5),
                BatchLimit::events(100),
                Resume::AfterMark,
            )
            .await
            .unwrap();
        assert!(got.events.is_empty());
        assert_eq!(got.through, Revision(1));
        assert_eq!(h.stats().3, 0);
    }

    #[tokio::test]
    async fn a_reset_compacts_and_wakes_everyone() {
        let h = hub();
        let waiting = {
            let h = h.clone();
            tokio::spawn(async move {
                h.watch(
                    &KeyFilter::Key("k".into()),
                    Some(Revision(1)),
                    Duration::from_secs(10),
                    BatchLimit::events(100),
                    Resume::AfterMark,
                )
                .await
            })
        };
        while h.stats().3 == 0 {
            tokio::task::yield_now().await;
        }
        h.on_applied(&AppliedBatch {
            mark: AppliedMark {
                log_index: 90,
                term: 2,
                revision: Revision(90),
            },
            reset: true,
            lease_clock_ms: 0,
            ..AppliedBatch::default()
        });
        assert_eq!(
            waiting.await.unwrap(),
            Err(Compacted {
                compacted: Revision(90)
            })
        );
    }
}
#[cfg(test)]
mod revision_tests {
    use super::*;
    use crate::domain::command::{Cause, Event, EventKind};
    use crate::raft::state_machine::AppliedMark;

    #[tokio::test]
    async fn revisions_report_every_applied_batch() {
        let h = WatchHub::new(
            HistoryLimits::default(),
            Revision(0),
            CancellationToken::new(),
        );
        let mut rx = h.revisions();
        rx.borrow_and_update();
        h.on_applied(&AppliedBatch {
            mark: AppliedMark {
                log_index: 1,
                term: 1,
                revision: Revision(1),
            },
            events: vec![Event {
                kind: EventKind::Put,
                create_revision: None,
                version: None,
                key: "k".into(),
                value: Some("v".into()),
                revision: Revision(1),
                lease: None,
                cause: Cause::Client,
            }],
            lease_changes: vec![],
            reset: false,
            lease_clock_ms: 0,
        });
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), Revision(1));
        assert_eq!(
            h.since_all(Revision(1), BatchLimit::events(10))
                .unwrap()
                .events
                .len(),
            1
        );
    }
}
