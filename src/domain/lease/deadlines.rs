//! The tracker's deadlines: promote and demote, registrations and removals from the apply path,
//! refreshes, expiries, and when the driver must next wake up.
//!
//! # Invariants
//! - Only a primary tracks: a follower's tracker holds nothing, refuses refreshes
//!   ([`RefreshError::NotPrimary`]) and expires nothing.
//! - Promote gives each lease `ttl + extension` (plus the drift margin), or a checkpoint's
//!   remaining time aged by the lease clock and no new extension.
//! - A lease expires at its deadline, not a millisecond before; once decided to expire it is
//!   refused every refresh and re-armed at `now + retry` until it is removed.
//! - A refresh of a lease with a checkpoint decision not yet cleared carries a [`ClearTicket`].
//! - Each lease sits in the expiry queue exactly once, at its deadline or its retry time.
//!
//! # What it must not do
//! Read a clock or propose anything: the driver passes `now` in and turns what comes out into
//! log entries.

use super::{
    ClearTicket, ClockReading, Expired, LeaseFacts, LeaseTracker, RefreshError, Refreshed, Tracked,
    drift_margin, idle_after,
};
use std::sync::Arc;

use crate::domain::types::{MonoMillis, Revision};

impl LeaseTracker {
    /// Start tracking every lease of the replicated state (see the module docs). `clock` is
    /// this node's reading of the lease clock.
    pub fn promote(
        &mut self,
        now: MonoMillis,
        clock: ClockReading,
        leases: impl IntoIterator<Item = LeaseFacts>,
    ) {
        self.demote();
        self.primary = true;
        self.clock = ClockReading {
            value: clock.at(now),
            seen_at: now,
        };
        self.next_clock_tick = now;
        for facts in leases {
            // The extension is granted once, on top of a TTL counted from this promote; a
            // checkpoint already carries the extension its leader granted, and adding it again
            // at every promote would let leaders that change faster than it keep a lease alive
            // for ever.
            let (base, extension) = match (facts.checkpoint_ms, facts.checkpoint_clock_ms) {
                (Some(remaining), Some(stamp)) => (
                    remaining.saturating_sub(self.clock.value.saturating_sub(stamp)),
                    0,
                ),
                // A checkpoint from before the lease clock cannot be aged.
                (Some(remaining), None) => (remaining, self.cfg.promote_extension_ms),
                (None, _) => (facts.ttl_ms, self.cfg.promote_extension_ms),
            };
            let deadline = now.plus(base).plus(drift_margin(base)).plus(extension);
            let checkpointed = facts.checkpoint_ms.is_some();
            // A checkpoint in force must be cleared by the next refresh.
            self.insert(
                &facts.name,
                facts.revision,
                facts.ttl_ms,
                deadline,
                now,
                u64::from(checkpointed),
            );
            if !self.cfg.checkpoints {
                continue;
            }
            if checkpointed {
                // Aging keeps a checkpoint in force exact: nothing to record until a refresh.
                self.unschedule_checkpoint(&facts.name);
            } else {
                // Record this deadline at once, so the next leader ages it rather than
                // granting the full TTL again.
                self.schedule_checkpoint(&facts.name, now);
            }
        }
    }

    /// Stop tracking: forget every deadline.
    pub fn demote(&mut self) {
        self.primary = false;
        self.leases.clear();
        self.queue.clear();
        self.checkpoints.clear();
    }

    fn insert(
        &mut self,
        name: &str,
        revision: Revision,
        ttl_ms: u64,
        deadline: MonoMillis,
        now: MonoMillis,
        checkpoint_seq: u64,
    ) {
        self.forget(name);
        let name: Arc<str> = Arc::from(name);
        let next_checkpoint = self.cfg.checkpoints.then(|| {
            let due = idle_after(now, ttl_ms);
            self.checkpoints.insert((due, name.clone()));
            due
        });
        self.queue.insert((deadline, name.clone()));
        self.leases.insert(
            name.clone(),
            Tracked {
                name,
                revision,
                ttl_ms,
                deadline,
                queued_at: deadline,
                expiring: false,
                checkpoint_seq,
                cleared_seq: 0,
                next_checkpoint,
            },
        );
    }

    fn forget(&mut self, name: &str) {
        if let Some(old) = self.leases.remove(name) {
            self.queue.remove(&(old.queued_at, old.name.clone()));
            if let Some(due) = old.next_checkpoint {
                self.checkpoints.remove(&(due, old.name));
            }
        }
    }

    /// A lease was registered (from the apply path). Ignored unless primary; idempotent for a
    /// lease already tracked at the same revision. `checkpointed`: the registration carried a
    /// lease clock stamp, so it is a checkpoint in force (the first refresh must clear it, and
    /// nothing needs recording until then).
    pub fn on_registered(
        &mut self,
        name: &str,
        revision: Revision,
        ttl_ms: u64,
        now: MonoMillis,
        checkpointed: bool,
    ) {
        if !self.primary {
            return;
        }
        if self
            .leases
            .get(name)
            .is_some_and(|t| t.revision == revision)
        {
            return;
        }
        self.insert(
            name,
            revision,
            ttl_ms,
            now.plus(ttl_ms),
            now,
            u64::from(checkpointed),
        );
        if checkpointed {
            self.unschedule_checkpoint(name);
        }
    }

    /// A lease was removed (revoked or expired, from the apply path).
    pub fn on_removed(&mut self, name: &str) {
        self.forget(name);
    }

    /// Refresh a lease: its deadline becomes `now + ttl`.
    pub fn refresh(&mut self, name: &str, now: MonoMillis) -> Result<Refreshed, RefreshError> {
        if !self.primary {
            return Err(RefreshError::NotPrimary);
        }
        let t = self.leases.get_mut(name).ok_or(RefreshError::NotFound)?;
        if t.expiring {
            return Err(RefreshError::NotFound);
        }
        let old_queue = t.queued_at;
        t.deadline = now.plus(t.ttl_ms);
        t.queued_at = t.deadline;
        let refreshed = Refreshed {
            ttl_ms: t.ttl_ms,
            revision: t.revision,
            clear: (t.checkpoint_seq > t.cleared_seq).then(|| ClearTicket {
                name: name.to_string(),
                revision: t.revision,
                seq: t.checkpoint_seq,
            }),
        };
        let new_queue = t.queued_at;
        let ttl_ms = t.ttl_ms;
        // The entry moves with its own key: no allocation under the hub's lock.
        if let Some((_, key)) = self.queue.take(&(old_queue, t.name.clone())) {
            self.queue.insert((new_queue, key));
        }
        if self.cfg.checkpoints {
            self.schedule_checkpoint(name, idle_after(now, ttl_ms));
        }
        Ok(refreshed)
    }

    /// The leases whose deadline is `<= now`, at most `limit`, marked expiring and re-armed at
    /// `now + retry` in case their expiry proposal fails.
    pub fn expired(&mut self, now: MonoMillis, limit: usize) -> Vec<Expired> {
        let mut out = Vec::new();
        if !self.primary {
            return out;
        }
        while out.len() < limit {
            let Some((at, _)) = self.queue.first() else {
                break;
            };
            if *at > now {
                break;
            }
            let Some((_, name)) = self.queue.pop_first() else {
                break;
            };
            let Some(t) = self.leases.get_mut(&name) else {
                continue;
            };
            t.expiring = true;
            t.queued_at = now.plus(self.cfg.retry_ms.max(1));
            out.push(Expired {
                name: name.to_string(),
                revision: t.revision,
                deadline: t.deadline,
            });
            self.queue.insert((t.queued_at, name));
        }
        out
    }

    /// The earliest time anything is due (an expiry or a checkpoint).
    pub fn next_wakeup(&self) -> Option<MonoMillis> {
        let expiry = self.queue.first().map(|(at, _)| *at);
        let checkpoint = self.checkpoints.first().map(|(at, _)| *at);
        let tick =
            (self.cfg.clock_tick_ms > 0 && !self.leases.is_empty()).then_some(self.next_clock_tick);
        [expiry, checkpoint, tick].into_iter().flatten().min()
    }

    /// Time left on a lease (0 once expiring); `None` if untracked.
    pub fn remaining(&self, name: &str, now: MonoMillis) -> Option<u64> {
        let t = self.leases.get(name)?;
        Some(if t.expiring { 0 } else { now.until(t.deadline) })
    }
}
