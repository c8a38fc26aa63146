//! `EventHistory`: the recent changes of the store, in revision order, for watches. Pure.
//!
//! # Invariants
//! - Fed only by the apply path, in log order: events arrive with non-decreasing revisions
//!   (the changes of one request share its revision), and the history is identical on every
//!   replica that retains the same span.
//! - A revision is answered whole or not at all: a batch cut by its limits (a count and
//!   bytes, [`super::watch_batch`]) ends at a revision boundary, and a revision only partly
//!   retained counts as compacted.
//! - Bounded by a count and a byte budget. The oldest events are dropped first, and
//!   `compacted` (the highest revision no longer answerable) only grows.
//! - `since(from)` answers "every matching event with revision >= from" exactly, or says it
//!   cannot (`Compacted`): it never returns a partial answer with a silent gap.
//! - A history that starts at a snapshot or at node start-up knows nothing before the store
//!   revision it started at: that revision is its first compaction mark.

use std::borrow::Cow;
use std::collections::VecDeque;

use super::command::Event;
use super::key_bytes;
use super::types::Revision;
use super::watch_batch::{BatchCut, BatchLimit, Cut, batch_cost};

/// Which keys a watch follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyFilter {
    /// Exactly this stored key.
    Key(String),
    /// Every key whose raw bytes start with this prefix (`""`: every key): binary keys
    /// written through the etcd API ([`key_bytes`]) by their raw bytes, as etcd matches them.
    Prefix(String),
}

impl KeyFilter {
    pub fn matches(&self, key: &str) -> bool {
        match self {
            KeyFilter::Key(k) => k == key,
            KeyFilter::Prefix(p) => key_bytes::raw_starts_with(key, p.as_bytes()),
        }
    }
}

/// The prefixes of the stored key `key`, at the lengths `lens` (ascending), that a
/// [`KeyFilter::Prefix`] may hold: the UTF-8 prefixes of its raw bytes.
pub(crate) fn text_prefixes<'k>(
    key: &'k str,
    lens: impl Iterator<Item = usize> + 'k,
) -> impl Iterator<Item = Cow<'k, str>> + 'k {
    let raw = key_bytes::is_encoded(key).then(|| key_bytes::bytes(key).into_owned());
    lens.filter_map(move |len| match &raw {
        None => key.get(..len).map(Cow::Borrowed),
        Some(raw) => raw
            .get(..len)
            .and_then(|p| std::str::from_utf8(p).ok())
            .map(|p| Cow::Owned(p.to_string())),
    })
}

/// Many filters of one watch stream, each with its watch id: which watches an event's key
/// matches, in time independent of the number of watches (an exact-key index, and a prefix
/// index probed only at the prefix lengths in use).
#[derive(Clone, Debug, Default)]
pub struct FilterSet {
    ids: Vec<String>,
    by_key: std::collections::HashMap<String, Vec<u32>>,
    by_prefix: std::collections::HashMap<String, Vec<u32>>,
    prefix_lens: std::collections::BTreeSet<usize>,
}

impl FilterSet {
    pub fn new(watches: impl IntoIterator<Item = (String, KeyFilter)>) -> Self {
        let mut set = FilterSet::default();
        for (id, filter) in watches {
            let i = set.ids.len() as u32;
            set.ids.push(id);
            match filter {
                KeyFilter::Key(k) => set.by_key.entry(k).or_default().push(i),
                KeyFilter::Prefix(p) => {
                    set.prefix_lens.insert(p.len());
                    set.by_prefix.entry(p).or_default().push(i);
                }
            }
        }
        set
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The ids of the watches `key` matches, in the order they were given.
    pub fn matching(&self, key: &str) -> Vec<&str> {
        let mut hits: Vec<u32> = Vec::new();
        if let Some(ids) = self.by_key.get(key) {
            hits.extend_from_slice(ids);
        }
        // (A raw key is never longer than its stored form.)
        for prefix in text_prefixes(key, self.prefix_lens.range(..=key.len()).copied()) {
            if let Some(ids) = self.by_prefix.get(prefix.as_ref()) {
                hits.extend(ids);
            }
        }
        hits.sort_unstable();
        hits.into_iter()
            .map(|i| self.ids[i as usize].as_str())
            .collect()
    }
}

/// Where a watch may start after a compaction to revision `C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// After `C` only: `/v1`'s documented rule (`POST /v1/compact`: watches from at or below
    /// the mark answer `compacted`, whose `compact_revision` is the mark).
    AfterMark,
    /// At `C` or after: etcd's rule (a compaction to `C` removes only the revisions below it,
    /// so a watch from `C` delivers `C`'s events; etcd's mvcc `watchable_store`).
    AtMark,
}

/// The start of a watch is older than the retained history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("history before revision {compacted} (inclusive) is compacted")]
pub struct Compacted {
    /// Events at or below this revision are gone: watch from `compacted + 1` or later.
    pub compacted: Revision,
}

/// A matching batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub events: Vec<Event>,
    /// Every matching event up to this revision is in `events` (resume from `through + 1`).
    pub through: Revision,
}

/// Events older than an [`EventHistory`] retains, from wherever the node keeps them (its
/// MVCC store): a watch resumes from any revision still held there.
pub trait OlderEvents: Send + Sync {
    /// The highest revision no longer answerable under `resume` (the compaction mark for
    /// [`Resume::AfterMark`], the revision below it for [`Resume::AtMark`], or where the
    /// store's history began): a watch starting at or below it is compacted, even where
    /// memory still holds its events, so that every node answers alike.
    fn floor(&self, resume: Resume) -> Revision;

    /// Matching events with revision `>= from`, up to `through`, within `limit` (whole
    /// revisions, as [`EventHistory::since`]); `Compacted` if `from` is not above
    /// [`OlderEvents::floor`] under `resume`.
    fn since(
        &self,
        from: Revision,
        through: Revision,
        filter: &KeyFilter,
        limit: BatchLimit,
        resume: Resume,
    ) -> Result<Batch, Compacted>;
}

/// Bounds of the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryLimits {
    pub max_events: usize,
    pub max_bytes: usize,
}

impl Default for HistoryLimits {
    fn default() -> Self {
        HistoryLimits {
            max_events: 100_000,
            max_bytes: 64 << 20,
        }
    }
}

/// The retained recent events.
#[derive(Debug)]
pub struct EventHistory {
    limits: HistoryLimits,
    events: VecDeque<Event>,
    bytes: usize,
    /// The highest revision whose events are no longer retained (or never were).
    compacted: Revision,
    /// The store revision as of the latest applied batch.
    current: Revision,
}

/// What one event costs in the byte budget.
fn cost(e: &Event) -> usize {
    64 + e.key.len()
        + e.value.as_ref().map_or(0, String::len)
        + e.lease.as_ref().map_or(0, String::len)
}

impl EventHistory {
    /// An empty history of a store at revision `start`: nothing at or before it is known.
    pub fn new(limits: HistoryLimits, start: Revision) -> Self {
        EventHistory {
            limits,
            events: VecDeque::new(),
            bytes: 0,
            compacted: start,
            current: start,
        }
    }

    pub fn current(&self) -> Revision {
        self.current
    }

    pub fn compacted(&self) -> Revision {
        self.compacted
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Retained bytes (by the budget's measure).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Append the events of one applied batch; the store is at `revision` after it. The
    /// history is trimmed as each event arrives, so a batch far over the budget (a range
    /// delete of 100,000 keys) is never held whole: what the history holds stays within its
    /// budget and one event.
    pub fn push(&mut self, events: impl IntoIterator<Item = Event>, revision: Revision) {
        let before = self.current;
        for e in events {
            debug_assert!(
                e.revision > before && e.revision >= self.current,
                "events arrive in revision order"
            );
            self.current = self.current.max(e.revision);
            self.bytes += cost(&e);
            self.events.push_back(e);
            self.trim();
        }
        self.current = self.current.max(revision);
    }

    /// Drop the oldest events until the history is within its limits.
    fn trim(&mut self) {
        while self.events.len() > self.limits.max_events || self.bytes > self.limits.max_bytes {
            let Some(old) = self.events.pop_front() else {
                break;
            };
            self.bytes -= cost(&old);
            self.compacted = self.compacted.max(old.revision);
        }
    }

    /// Forget everything at or before `revision` (a snapshot replaced the state: the history
    /// of the gap is unknown).
    pub fn reset(&mut self, revision: Revision) {
        self.events.clear();
        self.bytes = 0;
        self.compacted = self.compacted.max(revision);
        self.current = self.current.max(revision);
    }

    /// Matching events with revision `>= from`, within `limit` ([`super::watch_batch`]: whole
    /// revisions, and bounded by bytes unless one revision alone is larger). Only what the
    /// batch holds is copied.
    pub fn since(
        &self,
        from: Revision,
        filter: &KeyFilter,
        limit: BatchLimit,
    ) -> Result<Batch, Compacted> {
        if from <= self.compacted {
            return Err(Compacted {
                compacted: self.compacted,
            });
        }
        // Events are in revision order: find the first at or after `from`.
        let start = self.events.partition_point(|e| e.revision < from);
        let mut cut = BatchCut::new(limit);
        let mut taken: Vec<usize> = Vec::new();
        let mut through = self.current;
        for (i, e) in self.events.range(start..).enumerate() {
            if !filter.matches(&e.key) {
                continue;
            }
            match cut.offer(e.revision, batch_cost(e)) {
                Cut::Take => taken.push(start + i),
                Cut::End { keep, through: t } => {
                    taken.truncate(keep);
                    through = t;
                    break;
                }
            }
        }
        Ok(Batch {
            events: taken.into_iter().map(|i| self.events[i].clone()).collect(),
            through,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::{Cause, EventKind};
    use proptest::prelude::*;

    fn ev(key: &str, rev: u64) -> Event {
        Event {
            kind: EventKind::Put,
            create_revision: None,
            version: None,
            key: key.into(),
            value: Some("v".into()),
            revision: Revision(rev),
            lease: None,
            cause: Cause::Client,
        }
    }

    #[test]
    fn a_revision_is_never_split_by_the_limit_or_by_eviction() {
        let mut h = EventHistory::new(limits(100), Revision(0));
        // Revision 2 is one request with three changes (a lease revoke, say).
        h.push([ev("a", 1)], Revision(1));
        h.push([ev("b", 2), ev("c", 2), ev("d", 2)], Revision(2));
        h.push([ev("e", 3)], Revision(3));
        let all = KeyFilter::Prefix(String::new());
        // Limit 2 from revision 1: revision 2 starts within the limit, so all of it comes.
        let b = h.since(Revision(1), &all, n(2)).unwrap();
        assert_eq!((revs(&b), b.through), (vec![1, 2, 2, 2], Revision(2)));
        // Limit 1: revision 1 alone, and revision 2 is left whole for the next batch.
        let b = h.since(Revision(1), &all, n(1)).unwrap();
        assert_eq!((revs(&b), b.through), (vec![1], Revision(1)));
        // Limit 1 from revision 2: the whole of revision 2 even past the limit.
        let b = h.since(Revision(2), &all, n(1)).unwrap();
        assert_eq!((revs(&b), b.through), (vec![2, 2, 2], Revision(2)));
        // Evicting part of revision 2 compacts all of it.
        let mut small = EventHistory::new(limits(3), Revision(0));
        small.push([ev("a", 1)], Revision(1));
        small.push([ev("b", 2), ev("c", 2), ev("d", 2)], Revision(2));
        assert_eq!(small.compacted(), Revision(1));
        small.push([ev("e", 3)], Revision(3));
        assert_eq!(
            small.compacted(),
            Revision(2),
            "b went: revision 2 is no longer whole"
        );
        assert!(small.since(Revision(2), &all, n(10)).is_err());
        assert_eq!(
            revs(&small.since(Revision(3), &all, n(10)).unwrap()),
            vec![3]
        );
    }

    /// At most `events` events, no byte bound.
    fn n(events: usize) -> BatchLimit {
        BatchLimit {
            events,
            bytes: usize::MAX,
        }
    }

    fn revs(b: &Batch) -> Vec<u64> {
        b.events.iter().map(|e| e.revision.0).collect()
    }

    fn limits(max_events: usize) -> HistoryLimits {
        HistoryLimits {
            max_events,
            max_bytes: usize::MAX,
        }
    }

    #[test]
    fn since_filters_by_key_and_prefix_from_a_revision() {
        let mut h = EventHistory::new(limits(100), Revision(0));
        h.push([ev("a/1", 1), ev("b", 2), ev("a/2", 3)], Revision(3));
        h.push([ev("a", 4)], Revision(4));
        let p = KeyFilter::Prefix("a/".into());
        assert_eq!(revs(&h.since(Revision(1), &p, n(10)).unwrap()), [1, 3]);
        assert_eq!(revs(&h.since(Revision(2), &p, n(10)).unwrap()), [3]);
        assert_eq!(
            revs(&h.since(Revision(4), &p, n(10)).unwrap()),
            Vec::<u64>::new()
        );
        let k = KeyFilter::Key("a".into());
        assert_eq!(revs(&h.since(Revision(1), &k, n(10)).unwrap()), [4]);
        let all = KeyFilter::Prefix(String::new());
        assert_eq!(
            revs(&h.since(Revision(1), &all, n(10)).unwrap()),
            [1, 2, 3, 4]
        );
        // Nothing yet beyond the current revision; `through` says how far it looked.
        let later = h.since(Revision(5), &all, n(10)).unwrap();
        assert!(later.events.is_empty());
        assert_eq!(later.through, Revision(4));
    }

    #[test]
    fn a_bounded_batch_says_where_to_resume() {
        let mut h = EventHistory::new(limits(100), Revision(0));
        h.push((1..=10).map(|r| ev("k", r)), Revision(10));
        let b = h
            .since(Revision(1), &KeyFilter::Key("k".into()), n(3))
            .unwrap();
        assert_eq!(revs(&b), [1, 2, 3]);
        assert_eq!(b.through, Revision(3));
        let next = h
            .since(b.through.next(), &KeyFilter::Key("k".into()), n(100))
            .unwrap();
        assert_eq!(revs(&next), (4..=10).collect::<Vec<_>>());
        assert_eq!(next.through, Revision(10));
    }

    #[test]
    fn compaction_boundaries_are_exact() {
        let mut h = EventHistory::new(limits(3), Revision(0));
        h.push((1..=5).map(|r| ev("k", r)), Revision(5));
        // 1 and 2 were dropped.
        assert_eq!(h.compacted(), Revision(2));
        let all = KeyFilter::Prefix(String::new());
        assert_eq!(
            h.since(Revision(2), &all, n(10)),
            Err(Compacted {
                compacted: Revision(2)
            })
        );
        assert_eq!(revs(&h.since(Revision(3), &all, n(10)).unwrap()), [3, 4, 5]);
        // A history started at revision 7 knows nothing at or before 7.
        let fresh = EventHistory::new(limits(3), Revision(7));
        assert!(fresh.since(Revision(7), &all, n(10)).is_err());
        assert!(
            fresh
                .since(Revision(8), &all, n(10))
                .unwrap()
                .events
                .is_empty()
        );
    }

    #[test]
    fn the_byte_budget_bounds_the_history() {
        let mut h = EventHistory::new(
            HistoryLimits {
                max_events: 1000,
                max_bytes: 1000,
            },
            Revision(0),
        );
        h.push((1..=100).map(|r| ev("key", r)), Revision(100));
        assert!(h.bytes() <= 1000);
        assert!(h.len() < 100);
        assert_eq!(h.compacted().0, 100 - h.len() as u64);
    }

    #[test]
    fn reset_forgets_the_gap() {
        let mut h = EventHistory::new(limits(100), Revision(0));
        h.push([ev("k", 1)], Revision(1));
        h.reset(Revision(50));
        let all = KeyFilter::Prefix(String::new());
        assert!(h.since(Revision(2), &all, n(10)).is_err());
        assert!(
            h.since(Revision(51), &all, n(10))
                .unwrap()
                .events
                .is_empty()
        );
    }

    proptest! {
        /// Reading in bounded batches from any retained start returns exactly the matching
        /// events, in order, with no gap and no duplicate.
        #[test]
        fn batched_reads_are_exact(
            keys in prop::collection::vec(prop::sample::select(vec!["a", "a/x", "b", "ab"]), 1..80),
            max in 5usize..100,
            limit in 1usize..7,
            start in 1u64..80,
        ) {
            let mut h = EventHistory::new(limits(max), Revision(0));
            let events: Vec<Event> = keys.iter().enumerate().map(|(i, k)| ev(k, i as u64 + 1)).collect();
            h.push(events.clone(), Revision(events.len() as u64));
            let filter = KeyFilter::Prefix("a".into());
            let mut from = Revision(start);
            let mut got = Vec::new();
            match h.since(from, &filter, n(limit)) {
                Err(c) => prop_assert!(from <= c.compacted),
                Ok(_) => loop {
                    let b = h.since(from, &filter, n(limit)).unwrap();
                    got.extend(b.events.iter().map(|e| e.revision.0));
                    if b.through >= h.current() { break; }
                    from = b.through.next();
                },
            }
            if !got.is_empty() || h.since(Revision(start), &filter, n(1)).is_ok() {
                let want: Vec<u64> = events.iter()
                    .filter(|e| e.revision.0 >= start && filter.matches(&e.key))
                    .map(|e| e.revision.0).collect();
                prop_assert_eq!(got, want);
            }
        }

        /// Batches bounded by bytes (values of many sizes, revisions of several events) read
        /// every matching event exactly once, in order, each batch within the bound unless
        /// its only revision alone is larger, and copy nothing beyond the batch.
        #[test]
        fn batches_bounded_by_bytes_are_exact(
            revisions in prop::collection::vec(
                prop::collection::vec((prop::sample::select(vec!["a", "a/x", "b"]), 0usize..300), 1..4),
                1..50),
            bytes in 1usize..1000,
        ) {
            let mut h = EventHistory::new(limits(10_000), Revision(0));
            let mut all = Vec::new();
            for (i, changes) in revisions.iter().enumerate() {
                let rev = i as u64 + 1;
                let events: Vec<Event> = changes.iter().map(|(k, len)| Event {
                    value: Some("v".repeat(*len)),
                    ..ev(k, rev)
                }).collect();
                all.extend(events.clone());
                h.push(events, Revision(rev));
            }
            let filter = KeyFilter::Prefix("a".into());
            let limit = BatchLimit { events: 1000, bytes };
            let mut from = Revision(1);
            let mut got = Vec::new();
            loop {
                let b = h.since(from, &filter, limit).unwrap();
                let size: usize = b.events.iter().map(batch_cost).sum();
                let alone = b.events.iter().all(|e| e.revision == b.events[0].revision);
                prop_assert!(size <= bytes || alone, "{} bytes over {}", size, bytes);
                prop_assert!(b.through >= from || b.through >= h.current());
                got.extend(b.events.iter().map(|e| (e.revision, e.key.clone(), e.value.clone())));
                if b.through >= h.current() { break; }
                from = b.through.next();
            }
            let want: Vec<_> = all.iter()
                .filter(|e| filter.matches(&e.key))
                .map(|e| (e.revision, e.key.clone(), e.value.clone()))
                .collect();
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_filter_set_finds_exactly_the_matching_watches() {
        let set = FilterSet::new([
            ("all".to_string(), KeyFilter::Prefix(String::new())),
            ("a".to_string(), KeyFilter::Prefix("a/".into())),
            ("ax".to_string(), KeyFilter::Prefix("a/x".into())),
            ("key".to_string(), KeyFilter::Key("a/x1".into())),
            ("b".to_string(), KeyFilter::Key("b".into())),
        ]);
        assert_eq!(set.matching("a/x1"), ["all", "a", "ax", "key"]);
        assert_eq!(set.matching("a/y"), ["all", "a"]);
        assert_eq!(set.matching("b"), ["all", "b"]);
        assert_eq!(set.matching("bb"), ["all"]);
        assert!(FilterSet::new([]).matching("x").is_empty());
    }

    proptest::proptest! {
        /// The index agrees with matching every filter one by one.
        #[test]
        fn a_filter_set_agrees_with_brute_force(
            filters in proptest::collection::vec(("[ab/é]{0,3}", proptest::bool::ANY), 0..20),
            keys in proptest::collection::vec("[ab/é]{0,4}", 1..20),
        ) {
            let watches: Vec<(String, KeyFilter)> = filters
                .iter()
                .enumerate()
                .map(|(i, (f, exact))| {
                    let filter = if *exact { KeyFilter::Key(f.clone()) } else { KeyFilter::Prefix(f.clone()) };
                    (format!("w{i:02}"), filter)
                })
                .collect();
            let set = FilterSet::new(watches.clone());
            for key in &keys {
                let want: Vec<&str> = watches
                    .iter()
                    .filter(|(_, f)| f.matches(key))
                    .map(|(id, _)| id.as_str())
                    .collect();
                proptest::prop_assert_eq!(set.matching(key), want);
            }
        }
    }
}
