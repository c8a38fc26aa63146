//! The newest log entries, decoded, beside the segment files.
//!
//! Why: every entry is read back soon after it is appended: by the state machine on every node,
//! and by the leader's replication, once per follower. From the files that is a `pread`, a
//! checksum and a MessagePack decode each time (the decode of a `Command` goes through serde's
//! buffered form of an internally tagged enum, the costliest part of it). The cache answers
//! those reads with clones.
//!
//! # Invariants
//! - The cache holds a contiguous run `first..next` of the log's entries, exactly as appended,
//!   and its end is the log's end: the store tells it of every append, truncation and purge
//!   (an append that does not continue the run replaces it).
//! - A read is answered only if it starts inside the run; otherwise the caller reads the
//!   files. Its answer is what the files would give for the same range and byte budget.
//! - Bounded: at most `max_bytes` of encoded entries and `max_entries` entries; the oldest go
//!   first.
//!
//! # What it must not do
//! Decide what is in the log: it mirrors the segment files and never outlives a change to them.

use std::collections::VecDeque;

use super::Entry;

/// Encoded bytes of entries the log store keeps decoded.
pub const DEFAULT_MAX_BYTES: usize = 16 << 20;
/// Entries the log store keeps decoded.
pub const DEFAULT_MAX_ENTRIES: usize = 32 * 1024;

pub struct EntryCache {
    /// The index of `entries[0]`.
    first: u64,
    /// Each entry with its encoded size (the byte budget of reads counts those).
    entries: VecDeque<(Entry, usize)>,
    bytes: usize,
    max_bytes: usize,
    max_entries: usize,
}

impl EntryCache {
    pub fn new(max_bytes: usize, max_entries: usize) -> Self {
        EntryCache {
            first: 0,
            entries: VecDeque::new(),
            bytes: 0,
            max_bytes,
            max_entries,
        }
    }

    /// One past the last cached index.
    fn next(&self) -> u64 {
        self.first + self.entries.len() as u64
    }

    /// Entries (with their encoded sizes) were appended to the log, in index order.
    pub fn appended(&mut self, appended: impl IntoIterator<Item = (Entry, usize)>) {
        for (entry, size) in appended {
            let index = entry.log_id.index;
            if self.entries.is_empty() || index != self.next() {
                if index > self.first && index < self.next() {
                    self.truncate_from(index);
                } else {
                    self.clear_at(index);
                }
            }
            self.bytes += size;
            self.entries.push_back((entry, size));
        }
        while self.bytes > self.max_bytes || self.entries.len() > self.max_entries {
            self.pop_front();
        }
    }

    /// The log lost its entries from `index` on.
    pub fn truncate_from(&mut self, index: u64) {
        while self.next() > index.max(self.first) {
            let Some((_, size)) = self.entries.pop_back() else {
                break;
            };
            self.bytes -= size;
        }
        if self.entries.is_empty() {
            self.clear_at(index);
        }
    }

    /// The log lost its entries up to and including `index`.
    pub fn purged_upto(&mut self, index: u64) {
        while self.first <= index && !self.entries.is_empty() {
            self.pop_front();
        }
        if self.entries.is_empty() {
            self.clear_at(self.first.max(index.saturating_add(1)));
        }
    }

    /// Forget everything (the log was replaced in a way the cache does not follow).
    pub fn clear(&mut self) {
        self.clear_at(0);
    }

    fn clear_at(&mut self, first: u64) {
        self.entries.clear();
        self.bytes = 0;
        self.first = first;
    }

    fn pop_front(&mut self) {
        if let Some((_, size)) = self.entries.pop_front() {
            self.bytes -= size;
            self.first += 1;
        }
    }

    /// The entries of `from..to` (clamped to the log's end), stopping before the entry that
    /// would take the total past `budget` encoded bytes (at least one is returned), if
    /// `from` is cached; `None` if the caller must read the files.
    pub fn read(&self, from: u64, to: u64, budget: usize) -> Option<Vec<Entry>> {
        if self.entries.is_empty() || from < self.first || from >= self.next() {
            return None;
        }
        let to = to.min(self.next());
        let mut out = Vec::new();
        let mut total = 0usize;
        for i in from..to {
            let (entry, size) = &self.entries[(i - self.first) as usize];
            total = total.saturating_add(*size);
            if total > budget && i > from {
                break;
            }
            out.push(entry.clone());
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload, LogId};
    use proptest::prelude::*;

    fn entry(term: u64, index: u64) -> (Entry, usize) {
        let e = Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Blank,
        };
        (e, (index % 7 + 1) as usize * 10)
    }

    /// What the log holds, as the files would answer: the reference the cache must agree with.
    #[derive(Default)]
    struct Model {
        log: Vec<(Entry, usize)>,
    }

    impl Model {
        fn read(&self, from: u64, to: u64, budget: usize) -> Vec<Entry> {
            let mut out = Vec::new();
            let mut total = 0;
            for (e, size) in &self.log {
                let i = e.log_id.index;
                if i < from || i >= to {
                    continue;
                }
                total += size;
                if total > budget && i > from {
                    break;
                }
                out.push(e.clone());
            }
            out
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Append { count: u64, term: u64 },
        Truncate { back: u64 },
        Purge { upto: u64 },
        Read { from: u64, len: u64, budget: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..6, 1u64..4).prop_map(|(count, term)| Op::Append { count, term }),
            (0u64..5).prop_map(|back| Op::Truncate { back }),
            (0u64..30).prop_map(|upto| Op::Purge { upto }),
            (0u64..40, 0u64..8, 1usize..200).prop_map(|(from, len, budget)| Op::Read {
                from,
                len,
                budget
            }),
        ]
    }

    proptest! {
        /// Whatever the log goes through, a read the cache answers is the files' answer.
        #[test]
        fn the_cache_answers_as_the_log_would(ops in prop::collection::vec(op(), 1..60), max_entries in 1usize..12) {
            let mut cache = EntryCache::new(200, max_entries);
            let mut model = Model::default();
            let mut purged = 0u64;
            for op in ops {
                match op {
                    Op::Append { count, term } => {
                        let start = model.log.last().map_or(purged + 1, |(e, _)| e.log_id.index + 1);
                        let batch: Vec<_> = (start..start + count).map(|i| entry(term, i)).collect();
                        model.log.extend(batch.iter().cloned());
                        cache.appended(batch);
                    }
                    Op::Truncate { back } => {
                        let Some((last, _)) = model.log.last() else { continue };
                        let from = last.log_id.index.saturating_sub(back).max(purged + 1);
                        model.log.retain(|(e, _)| e.log_id.index < from);
                        cache.truncate_from(from);
                    }
                    Op::Purge { upto } => {
                        let last = model.log.last().map_or(purged, |(e, _)| e.log_id.index);
                        let upto = upto.min(last);
                        if upto > purged {
                            model.log.retain(|(e, _)| e.log_id.index > upto);
                            purged = upto;
                            cache.purged_upto(upto);
                        }
                    }
                    Op::Read { from, len, budget } => {
                        if let Some(got) = cache.read(from, from + len, budget) {
                            prop_assert_eq!(got, model.read(from, from + len, budget));
                        }
                    }
                }
                prop_assert!(cache.entries.len() <= max_entries);
            }
        }
    }

    #[test]
    fn reads_outside_the_run_go_to_the_files() {
        let mut cache = EntryCache::new(1 << 20, 4);
        assert!(cache.read(1, 5, usize::MAX).is_none());
        cache.appended((1..=6).map(|i| entry(1, i)));
        // 1 and 2 were evicted (at most 4 entries).
        assert!(cache.read(2, 5, usize::MAX).is_none());
        assert_eq!(cache.read(3, 100, usize::MAX).unwrap().len(), 4);
        assert!(cache.read(7, 8, usize::MAX).is_none());
        // A budget smaller than one entry still returns it.
        assert_eq!(cache.read(3, 6, 1).unwrap().len(), 1);
        cache.truncate_from(5);
        assert_eq!(cache.read(3, 100, usize::MAX).unwrap().len(), 2);
        // An append that does not continue the run replaces it.
        cache.appended([entry(2, 9)]);
        assert!(cache.read(3, 100, usize::MAX).is_none());
        assert_eq!(cache.read(9, 10, usize::MAX).unwrap()[0].log_id.index, 9);
        cache.clear();
        assert!(cache.read(9, 10, usize::MAX).is_none());
    }
}
