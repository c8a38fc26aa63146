//! The tracker's checkpoints and its lease clock: the stamps the leader writes, the checkpoints
//! due (promote checkpoints and idle leases), and the clears that supersede them.
//!
//! # Invariants
//! - Each checkpoint decision increments the lease's `checkpoint_seq`; a committed clear
//!   supersedes decisions up to the one its ticket saw, never a later one.
//! - A lease is checkpointed once per idle spell: the next refresh schedules the next one.
//!   Expiring leases are not checkpointed.
//! - Every checkpoint carries the lease clock at the time it was measured; any stamp the leader
//!   writes pushes its next clock tick back.
//!
//! # What it must not do
//! Read a clock, or write a checkpoint itself: it says what is due, and the driver proposes it.

use super::{Checkpoint, ClearTicket, LeaseTracker};
use crate::domain::types::MonoMillis;

impl LeaseTracker {
    /// The lease clock at `now` (meaningful while primary).
    pub fn clock_at(&self, now: MonoMillis) -> u64 {
        self.clock.at(now)
    }

    /// The lease clock at `now`, for a stamp the leader is about to write (a registration's):
    /// the next [`LeaseTracker::clock_tick_due`] is not needed before a tick from now.
    pub fn stamp(&mut self, now: MonoMillis) -> u64 {
        self.stamped(now);
        self.clock.at(now)
    }

    fn stamped(&mut self, now: MonoMillis) {
        self.next_clock_tick = self.next_clock_tick.max(now.plus(self.cfg.clock_tick_ms));
    }

    /// The lease clock to record as a [`Command::LeaseClock`], when a tick has passed without a
    /// stamp and some lease has a checkpoint in force (a lease the next leader will age by the
    /// clock). Healthy clients clear their checkpoint at their first refresh, so a cluster
    /// whose clients are alive writes none.
    ///
    /// [`Command::LeaseClock`]: crate::domain::command::Command::LeaseClock
    pub fn clock_tick_due(&mut self, now: MonoMillis) -> Option<u64> {
        if !self.primary || self.cfg.clock_tick_ms == 0 || now < self.next_clock_tick {
            return None;
        }
        self.next_clock_tick = now.plus(self.cfg.clock_tick_ms);
        self.leases
            .values()
            .any(|t| t.checkpoint_seq > t.cleared_seq && !t.expiring)
            .then(|| self.clock.at(now))
    }

    pub(super) fn schedule_checkpoint(&mut self, name: &str, due: MonoMillis) {
        if let Some(t) = self.leases.get_mut(name) {
            let key = match t.next_checkpoint.replace(due) {
                Some(old) => self.checkpoints.take(&(old, t.name.clone())),
                None => None,
            };
            let key = key.map_or_else(|| t.name.clone(), |(_, key)| key);
            self.checkpoints.insert((due, key));
        }
    }

    pub(super) fn unschedule_checkpoint(&mut self, name: &str) {
        if let Some(t) = self.leases.get_mut(name)
            && let Some(old) = t.next_checkpoint.take()
        {
            self.checkpoints.remove(&(old, t.name.clone()));
        }
    }

    /// A clear was committed: checkpoints decided up to `seq` no longer bind refreshes.
    pub fn on_cleared(&mut self, ticket: &ClearTicket) {
        if let Some(t) = self.leases.get_mut(ticket.name.as_str())
            && t.revision == ticket.revision
        {
            t.cleared_seq = t.cleared_seq.max(ticket.seq);
        }
    }

    /// Checkpoints due at `now` (promote checkpoints and idle leases), at most `limit`.
    /// Expiring leases are not checkpointed.
    pub fn checkpoints_due(&mut self, now: MonoMillis, limit: usize) -> Vec<Checkpoint> {
        let mut out = Vec::new();
        if !self.primary {
            return out;
        }
        while out.len() < limit {
            let Some((due, _)) = self.checkpoints.first() else {
                break;
            };
            if *due > now {
                break;
            }
            let Some((_, name)) = self.checkpoints.pop_first() else {
                break;
            };
            let clock_ms = self.clock.at(now);
            let Some(t) = self.leases.get_mut(&name) else {
                continue;
            };
            // Once: the clock ages it from now on; the next refresh schedules the next one.
            t.next_checkpoint = None;
            if t.expiring {
                continue;
            }
            t.checkpoint_seq += 1;
            out.push(Checkpoint {
                name: name.to_string(),
                revision: t.revision,
                remaining_ms: now.until(t.deadline),
                clock_ms,
            });
        }
        if !out.is_empty() {
            self.stamped(now);
        }
        out
    }
}
