//! Where a batch of watch events ends: by a count of events and by the bytes of their keys
//! and values, always on a revision's end. Pure.
//!
//! Every path that builds a batch for a watcher (the in-memory history, the on-disk MVCC
//! history, a peer's history fill) offers its matching events, in order, to one
//! [`BatchCut`], which says whether each is taken or the batch ends before it.
//!
//! # Invariants
//! - A batch ends on a revision's end: the events of one revision are never split, since a
//!   watcher resumes after the last revision it was sent (half a revision would be lost).
//! - Bytes: a batch stops *before* a revision that would take it past [`BatchLimit::bytes`],
//!   so it is within the bound unless its only revision alone is larger (that one then goes
//!   alone: the watcher could not get past it otherwise).
//! - Count: a batch that has reached [`BatchLimit::events`] ends at the end of the revision
//!   it is in (that last revision may take it past the count).
//! - A batch always holds at least one whole revision when any event matched, so the next
//!   batch (from `through + 1`) always makes progress.
//!
//! # Why a byte bound
//! Without it a batch of 1,000 events of 1 MiB values was a gigabyte in each watcher's memory,
//! and an etcd watch response of over 4 MiB failed to encode (`OutOfRange`) every time the
//! watcher retried: a watcher resuming from an old revision could never get past it. etcd's
//! watch responses are bounded too (its `fragment` splits a revision too large alone).
//!
//! # What it must not do
//! Read or copy events: callers offer each event's revision and cost, and copy only what is
//! taken.

use super::command::Event;
use super::types::Revision;

/// Bytes of keys and values a watch batch holds at most, unless one revision alone is larger:
/// etcd's default `--max-request-bytes` (1.5 MiB), so that a response with each event's
/// previous version too (`prev_kv`) stays within the etcd API's 4 MiB message.
pub const BATCH_BYTES: usize = 3 << 19;

/// How large one batch may grow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimit {
    /// Events: once reached, the batch ends at the end of the revision it is in.
    pub events: usize,
    /// Bytes of keys and values ([`batch_cost`]): the batch ends before a revision that would
    /// pass them, unless that revision is alone in it.
    pub bytes: usize,
}

impl BatchLimit {
    /// At most `events` events and [`BATCH_BYTES`] bytes.
    pub const fn events(events: usize) -> Self {
        BatchLimit {
            events,
            bytes: BATCH_BYTES,
        }
    }

    /// No bound at all (a replay of the whole history onto a snapshot's keys).
    pub const UNBOUNDED: BatchLimit = BatchLimit {
        events: usize::MAX,
        bytes: usize::MAX,
    };
}

/// What one event costs in a batch's byte bound: its key and value, as stored.
pub fn batch_cost(e: &Event) -> usize {
    e.key.len() + e.value.as_ref().map_or(0, String::len)
}

/// The answer to one offered event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Take it.
    Take,
    /// The batch is the first `keep` events taken (this one, and any taken of its revision,
    /// are not in it), and answers every matching event through `through`: the next batch
    /// starts at `through + 1`.
    End { keep: usize, through: Revision },
}

/// Decides where one batch ends (see the module docs). Offer the matching events in revision
/// order; once it answers [`Cut::End`], the batch is done.
#[derive(Clone, Debug)]
pub struct BatchCut {
    limit: BatchLimit,
    taken: usize,
    bytes: usize,
    /// The revision of the last event taken.
    revision: Option<Revision>,
    /// Events taken before `revision` began.
    revision_start: usize,
}

impl BatchCut {
    pub fn new(limit: BatchLimit) -> Self {
        BatchCut {
            limit,
            taken: 0,
            bytes: 0,
            revision: None,
            revision_start: 0,
        }
    }

    /// Offer the next matching event: its revision and its [`batch_cost`].
    pub fn offer(&mut self, revision: Revision, cost: usize) -> Cut {
        let before = Revision(revision.0.saturating_sub(1));
        if self.revision != Some(revision) {
            // A revision starts: end before it if the batch is full.
            if self.taken > 0 && (self.taken >= self.limit.events || self.bytes >= self.limit.bytes)
            {
                return Cut::End {
                    keep: self.taken,
                    through: before,
                };
            }
            self.revision = Some(revision);
            self.revision_start = self.taken;
        }
        self.taken += 1;
        self.bytes = self.bytes.saturating_add(cost);
        if self.bytes > self.limit.bytes && self.revision_start > 0 {
            // This revision would take the batch past its bound: it starts the next one.
            return Cut::End {
                keep: self.revision_start,
                through: before,
            };
        }
        Cut::Take
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Cut `events` ((revision, cost), in order) into batches from the first revision on, as
    /// a watcher reads them: each batch from the revision after the previous one's `through`.
    fn batches(events: &[(u64, usize)], limit: BatchLimit) -> Vec<Vec<(u64, usize)>> {
        let last = events.last().map_or(0, |e| e.0);
        let mut out = Vec::new();
        let mut from = 1;
        while from <= last {
            let mut cut = BatchCut::new(limit);
            let mut batch = Vec::new();
            let mut through = last;
            for &(rev, cost) in events.iter().filter(|e| e.0 >= from) {
                match cut.offer(Revision(rev), cost) {
                    Cut::Take => batch.push((rev, cost)),
                    Cut::End { keep, through: t } => {
                        batch.truncate(keep);
                        through = t.0;
                        break;
                    }
                }
            }
            assert!(through >= from, "no progress from {from}");
            out.push(batch);
            from = through + 1;
        }
        out
    }

    #[test]
    fn a_batch_ends_before_the_revision_that_would_pass_the_bytes() {
        let limit = BatchLimit {
            events: 100,
            bytes: 10,
        };
        // Revisions 1 and 2 fit (4 + 4); 3 (two events of 2) would make 12: next batch.
        let got = batches(&[(1, 4), (2, 4), (3, 2), (3, 2), (4, 1)], limit);
        assert_eq!(
            got,
            vec![vec![(1, 4), (2, 4)], vec![(3, 2), (3, 2), (4, 1)]]
        );
    }

    #[test]
    fn a_revision_larger_than_the_bound_goes_alone() {
        let limit = BatchLimit {
            events: 100,
            bytes: 10,
        };
        let got = batches(&[(1, 3), (2, 8), (2, 8), (3, 1)], limit);
        assert_eq!(
            got,
            vec![vec![(1, 3)], vec![(2, 8), (2, 8)], vec![(3, 1)]],
            "revision 2 (16 bytes) alone, neither before nor after anything"
        );
    }

    #[test]
    fn the_count_ends_a_batch_at_its_revisions_end() {
        let limit = BatchLimit {
            events: 2,
            bytes: usize::MAX,
        };
        let got = batches(&[(1, 0), (2, 0), (2, 0), (2, 0), (3, 0)], limit);
        assert_eq!(
            got,
            vec![vec![(1, 0), (2, 0), (2, 0), (2, 0)], vec![(3, 0)]]
        );
    }

    proptest! {
        /// Batches cut by bytes deliver every event exactly once, in order, each batch within
        /// the bound unless a single revision exceeds it, and each ends on a revision's end.
        #[test]
        fn batches_deliver_every_event_once_in_order_within_the_bound(
            // Each revision: how many events, each of what cost (revisions may be skipped:
            // events a filter did not match).
            revisions in prop::collection::vec(
                (1u64..3, prop::collection::vec(0usize..40, 1..4)), 1..40),
            bytes in 1usize..100,
            events in 1usize..8,
        ) {
            let mut all = Vec::new();
            let mut rev = 0;
            for (step, costs) in &revisions {
                rev += step;
                all.extend(costs.iter().map(|c| (rev, *c)));
            }
            let limit = BatchLimit { events, bytes };
            let got = batches(&all, limit);
            let joined: Vec<_> = got.iter().flatten().copied().collect();
            prop_assert_eq!(&joined, &all);
            for b in &got {
                prop_assert!(!b.is_empty(), "an empty batch between events");
                let first = b[0].0;
                let alone = b.iter().all(|e| e.0 == first);
                let size: usize = b.iter().map(|e| e.1).sum();
                prop_assert!(size <= bytes || alone, "{:?} is over {} bytes", b, bytes);
                // Past the count only by the events of its last revision.
                let last = b.last().unwrap().0;
                let before_last = b.iter().filter(|e| e.0 != last).count();
                prop_assert!(before_last < events, "{:?} over {} events", b, events);
                // Whole revisions: no revision shows up in two batches.
                let end = b.last().unwrap().0;
                prop_assert_eq!(all.iter().filter(|e| e.0 == end).count(), b.iter().filter(|e| e.0 == end).count());
            }
        }
    }
}
