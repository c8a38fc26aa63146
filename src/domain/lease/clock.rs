//! The lease clock as one node can vouch for it: [`ClockReading`] and [`ClockWitness`]. Pure.
//!
//! # What the lease clock is for
//! A checkpoint says "at lease clock `Y`, this lease had `r` left", so its deadline is lease
//! clock `Y + r`. A new leader expires it when its own lease clock reaches that. This is safe
//! only if the new leader's clock has not advanced *more* than real time since `Y` was
//! written. Every leader's clock is a *chain*: `value + (now - seen_at)`, with a constant
//! offset `value - seen_at` from its monotonic clock. So the rule is: a leader's offset never
//! exceeds the offset of any leader whose stamps it may age.
//!
//! # Why the rule holds
//! - Committed stamps never decrease along the log. A leader promotes from the highest stamp
//!   applied, and that value is part of the replicated state, persisted and carried by
//!   snapshots (a node that rebuilt it lower after a restart would break this).
//! - A node dates the highest stamp no earlier than it was made. Two datings are safe: the
//!   time this node *received* the entry carrying the stamp, and the time it applied it. The
//!   receive time is after the leader stamped the entry and appended it to its own log. When
//!   several entries carry the same highest stamp, the latest receive time counts. A stamp
//!   made by a later leader in the same millisecond as its promote repeats the value of an
//!   older chain.
//! - By induction over terms: a leader's offset is `value - seen_at <= value - made_at`, the
//!   offset of the leader that made `value`. That leader's offset is in turn at most that of
//!   every leader before it. So every checkpoint a leader can age was written by a chain at
//!   least as far ahead as its own. Aging subtracts at most the real time that passed, and the
//!   deadline never moves earlier than the one the writer promised.
//!
//! # Why the receive time, not the apply time
//! Entries that a dying leader replicated are committed only by the next leader's first entry,
//! often a whole election later. Dated at apply, a stamp looked that much younger. The new
//! leader's clock then ran an election behind, and every lease it aged expired an election
//! late (issue 10: p99 lateness around 4 s under back-to-back leader kills). Dated at receipt,
//! the clock loses only the replication delay.
//!
//! # What it must not do
//! - Trust a stamp that is not committed. An entry that is later truncated was never part of
//!   the log; its stamp belongs to a deposed chain that may run ahead of the leader that
//!   replaced it.
//! - Prefer a higher offset to a higher value. The newest chain may run behind an older one,
//!   and the newest chain is the one whose checkpoints are aged.
//! - Read a clock.

use std::collections::BTreeMap;

use crate::domain::types::MonoMillis;

/// A reading of the replicated lease clock: `value` was the highest stamp applied, and this
/// node can vouch that it had been made by local monotonic time `seen_at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockReading {
    pub value: u64,
    pub seen_at: MonoMillis,
}

impl ClockReading {
    /// The lease clock at `now`, as far as this node can vouch: never ahead of the chain that
    /// made `value`.
    pub fn at(&self, now: MonoMillis) -> u64 {
        self.value.saturating_add(self.seen_at.until(now))
    }
}

/// The most stamped entries a node remembers receiving before they apply. Past it, the receive
/// time of the overflow is forgotten and those stamps are dated when they apply (later, so safe).
pub const MAX_PENDING_STAMPS: usize = 65_536;

/// One node's evidence about the lease clock: when it received each stamped log entry that has
/// not applied yet, and its reading of the highest stamp applied.
#[derive(Clone, Debug, Default)]
pub struct ClockWitness {
    reading: Option<ClockReading>,
    /// Unapplied entries that carry a stamp: log index -> (highest stamp in it, received at).
    received: BTreeMap<u64, (u64, MonoMillis)>,
    /// The last index applied (or installed by a snapshot).
    applied_through: u64,
    /// Entries up to this index may carry stamps whose receive time was not kept (overflow).
    blind_through: u64,
}

impl ClockWitness {
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries `first..=last` were written to this node's log at `now`. `stamps` lists
    /// `(index, highest stamp)` for those that carry one. Whatever was known of those indices
    /// before is replaced: a rewritten suffix is a different entry.
    pub fn received(
        &mut self,
        first: u64,
        last: u64,
        stamps: impl IntoIterator<Item = (u64, u64)>,
        now: MonoMillis,
    ) {
        if first > last {
            return;
        }
        let mut tail = self.received.split_off(&first);
        self.received
            .extend(tail.split_off(&last.saturating_add(1)));
        for (index, stamp) in stamps {
            if !(first..=last).contains(&index) {
                continue;
            }
            if self.received.len() >= MAX_PENDING_STAMPS {
                self.blind_through = self.blind_through.max(last);
                break;
            }
            self.received.insert(index, (stamp, now));
        }
    }

    /// The log was truncated from `index` on: those entries will never apply.
    pub fn truncated(&mut self, index: u64) {
        self.received.split_off(&index);
    }

    /// Entries up to `index` applied, leaving the replicated clock at `value`. `reset`: a
    /// snapshot replaced the state (what this node received up to `index` is superseded).
    pub fn applied(&mut self, index: u64, value: u64, reset: bool, now: MonoMillis) {
        let rest = self.received.split_off(&index.saturating_add(1));
        let applied = std::mem::replace(&mut self.received, rest);
        let blind = self.blind_through > self.applied_through;
        self.applied_through = self.applied_through.max(index);
        if reset {
            self.reading = Some(ClockReading {
                value,
                seen_at: now,
            });
            return;
        }
        // When this node can vouch that `value` had been made: the latest receipt of an entry
        // carrying it; `now` if one may have gone unrecorded.
        let received_at = if blind {
            Some(now)
        } else {
            applied
                .values()
                .filter(|(stamp, _)| *stamp == value)
                .map(|(_, at)| *at)
                .max()
        };
        self.reading = Some(match self.reading {
            Some(r) if value < r.value => r,
            Some(r) if value == r.value => ClockReading {
                value,
                seen_at: received_at.map_or(r.seen_at, |at| at.max(r.seen_at)),
            },
            _ => ClockReading {
                value,
                seen_at: received_at.unwrap_or(now),
            },
        });
    }

    /// The reading a node promotes with when the state's clock is `value`: its dating of that
    /// value, or `now` when it has none (it restarted since, or never applied it).
    pub fn reading(&self, value: u64, now: MonoMillis) -> ClockReading {
        match self.reading {
            Some(r) if r.value == value => r,
            _ => ClockReading {
                value,
                seen_at: now,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(value: u64, seen_at: u64) -> ClockReading {
        ClockReading {
            value,
            seen_at: MonoMillis(seen_at),
        }
    }

    #[test]
    fn a_stamp_is_dated_when_its_entry_arrived_not_when_it_applied() {
        let mut w = ClockWitness::new();
        w.received(1, 3, [(2, 500)], MonoMillis(100));
        // Committed an election later, by the next leader's first entry.
        w.applied(4, 500, false, MonoMillis(1700));
        assert_eq!(w.reading(500, MonoMillis(1800)), reading(500, 100));
    }

    #[test]
    fn a_value_without_a_known_receipt_is_dated_at_apply() {
        let mut w = ClockWitness::new();
        w.applied(3, 500, false, MonoMillis(1700));
        assert_eq!(w.reading(500, MonoMillis(1800)), reading(500, 1700));
        // A node that never applied the state's value (a restart) vouches only for now.
        assert_eq!(w.reading(600, MonoMillis(1800)), reading(600, 1800));
    }

    #[test]
    fn the_same_value_again_keeps_the_latest_receipt_and_ignores_later_applies() {
        let mut w = ClockWitness::new();
        w.received(1, 1, [(1, 500)], MonoMillis(100));
        w.applied(1, 500, false, MonoMillis(150));
        // Batches without stamps leave the dating alone.
        w.applied(2, 500, false, MonoMillis(900));
        assert_eq!(w.reading(500, MonoMillis(1000)), reading(500, 100));
        // A later leader stamped the same value (in the millisecond of its promote): its chain
        // is the newer one, and it made the stamp no earlier than this node received it.
        w.received(3, 3, [(3, 500)], MonoMillis(1200));
        w.applied(3, 500, false, MonoMillis(1300));
        assert_eq!(w.reading(500, MonoMillis(1400)), reading(500, 1200));
    }

    #[test]
    fn truncated_and_rewritten_entries_lose_their_receipt() {
        let mut w = ClockWitness::new();
        w.received(1, 2, [(1, 300), (2, 500)], MonoMillis(100));
        w.truncated(2);
        // Index 2 is rewritten by another leader, with a stamp of its own.
        w.received(2, 2, [(2, 400)], MonoMillis(700));
        w.applied(2, 400, false, MonoMillis(800));
        assert_eq!(w.reading(400, MonoMillis(900)), reading(400, 700));
        // Rewritten without truncation: the newer receipt replaces the older.
        w.received(3, 3, [(3, 450)], MonoMillis(1000));
        w.received(3, 3, [], MonoMillis(1100));
        w.applied(3, 450, false, MonoMillis(1200));
        assert_eq!(w.reading(450, MonoMillis(1300)), reading(450, 1200));
    }

    #[test]
    fn a_snapshot_supersedes_what_was_received() {
        let mut w = ClockWitness::new();
        w.received(1, 5, [(5, 900)], MonoMillis(100));
        w.applied(9, 900, true, MonoMillis(500));
        assert_eq!(w.reading(900, MonoMillis(600)), reading(900, 500));
    }

    #[test]
    fn an_overflow_dates_what_it_forgot_at_apply() {
        let mut w = ClockWitness::new();
        let n = MAX_PENDING_STAMPS as u64;
        w.received(1, n + 10, (1..=n + 10).map(|i| (i, i)), MonoMillis(100));
        w.applied(n + 10, n + 10, false, MonoMillis(5000));
        assert_eq!(w.reading(n + 10, MonoMillis(5000)), reading(n + 10, 5000));
        // Once the overflow applied, receipts count again.
        w.received(n + 11, n + 11, [(n + 11, n + 11)], MonoMillis(6000));
        w.applied(n + 11, n + 11, false, MonoMillis(7000));
        assert_eq!(w.reading(n + 11, MonoMillis(7000)), reading(n + 11, 6000));
    }
}
