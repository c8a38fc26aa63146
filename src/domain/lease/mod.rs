//! `LeaseTracker`: the leader's lease deadlines, on its own monotonic clock. Pure.
//!
//! # The protocol (DESIGN.md section 4; the Consistent Core lease pattern)
//! The replicated state holds facts only: a lease is `{name, ttl, revision, keys}`, plus an
//! optional checkpointed remaining time. Deadlines exist only here, on the leader, measured on
//! its monotonic clock. Followers run no tracker (`primary == false`) and never expire anything.
//!
//! - **Promote.** A node starts tracking only once it is leader *and* has applied every entry up
//!   to the first entry of its own term (so it knows every lease the old leader knew). Each lease
//!   then gets `now + ttl + extension`. Why this is safe: the old leader acknowledged a refresh
//!   only after a quorum confirmed its leadership in a round that started after the refresh
//!   arrived, and this node could only be elected after that quorum moved on. So `now` here is
//!   later than any acknowledged refresh, and the lease lives at least as long as any client was
//!   told. It may live longer across a failover, never shorter. The extension is a margin, not
//!   part of the argument: a tenth of the election timeout, plus 0.1% of the time granted for
//!   monotonic clocks that run at slightly different rates on different nodes.
//! - **Demote.** The moment a node is no longer leader, it forgets every deadline.
//! - **Refresh** moves the deadline to `now + ttl`. It is refused (`NotFound`, a 404) once the
//!   tracker has decided the lease expires, even before the `ExpireLeases` entry applies: a lease
//!   is never both "refreshed" to a client and "expired" in the log.
//! - **Expiry.** `expired(now)` returns the leases whose deadline is `<= now` (at the deadline,
//!   not a millisecond before), marks them expiring, and re-arms each at `now + retry`: if the
//!   proposal fails while this node is still leader, the lease comes back and is proposed again.
//!   Each carries its registration revision, so an `ExpireLeases` entry that applies late can
//!   never remove a newer lease of the same name.
//!
//! # Checkpoints: no lease restarts its full TTL at every failover
//! Promote gives `ttl + extension`, so under back-to-back elections an abandoned lease could live
//! for ever: every new leader granted the full TTL again (the etcd complaint). So:
//! - **at registration**: the leader stamps `RegisterLease`/`RegisterMember` with its lease
//!   clock when it submits them, which makes the registration itself a checkpoint (`remaining =
//!   ttl`): the stamp is taken after the client sent the request, so the deadline it implies is
//!   after the client's. The first refresh clears it (one log entry per lease, once);
//! - **at promote**, the new leader checkpoints every lease that has no checkpoint in force
//!   (`remaining = ttl + extension`, the deadline it just gave), so the *next* leader does not
//!   start from the full TTL again;
//! - **when idle**: a lease not refreshed for half its TTL is checkpointed once. A client that
//!   refreshes at a third of the TTL (as [`crate::client::keeper`] does) never is, so healthy
//!   refreshes still write nothing to the log; an abandoned lease costs one checkpoint entry
//!   (batched with others) besides its expiry;
//! - a new leader promotes a checkpointed lease with the checkpoint's remaining time **aged by
//!   the lease clock** (below) and no new extension (the checkpoint holds the one its leader
//!   granted); a checkpoint never needs rewriting.
//!
//! So an abandoned lease outlives its TTL by at most half its TTL (none if it was never
//! refreshed) plus one failover plus the extension, whatever the number of leader changes after
//! it (before: every leader granted the full TTL again).
//!
//! # The lease clock: aging a checkpoint without trusting anyone's clock
//! Every checkpoint is stamped with the leader's reading of the *lease clock*, and the
//! replicated state keeps the highest stamp applied. Each node keeps a [`ClockWitness`]: when it
//! received the entry that carried that stamp (or applied it, if it does not know). A leader's
//! lease clock starts at promote from that [`ClockReading`], `value + (now - seen_at)`, and runs
//! on its monotonic clock. A new leader ages a checkpoint `(stamp, remaining)` to
//! `remaining - (clock_now - stamp)`. It subtracts at most the real time that passed since the
//! checkpoint, so the deadline stays after the old leader's deadline. Why that holds, and why
//! stamps are dated at receipt, is in [`clock`]. No wall clock is involved, and no clock is
//! ever compared across nodes.
//!
//! A checkpoint must never shorten a lease below what a client was told. A checkpoint written
//! at `t_c` says "at most `r` left", which is false as soon as a refresh is acknowledged after
//! `t_c`. So: **a refresh after a checkpoint must win**. The tracker counts checkpoint
//! decisions per lease (`checkpoint_seq`); a refresh of a lease with an uncleared decision gets
//! a [`ClearTicket`], and the caller must commit a clearing entry through Raft before it
//! acknowledges the refresh. The leader submits proposals in the order it decides them (one
//! ordered queue), so the clear lands in the log after every checkpoint decided before the
//! refresh. A ticket clears only up to the decision it saw (`seq`): a checkpoint decided after
//! the refresh stays in force and the next refresh clears it again. A failover therefore
//! promotes with either a checkpoint taken after the last acknowledged refresh (`remaining`
//! measured after that refresh, so the deadline is later than the client's view) or with the
//! full TTL.
//!
//! # What it must not do
//! Read a clock, do I/O, or decide anything on a follower.

use std::collections::{BTreeMap, BTreeSet};

use super::command::{Command, LeaseCheckpoint, LeaseRef};
use super::types::{MonoMillis, Revision};

pub mod clock;
pub use clock::{ClockReading, ClockWitness};

/// The promote condition: a node tracks leases only while it is the leader of `current_term`
/// and has applied an entry of that term (so every earlier entry is applied too, and it knows
/// every lease the previous leader knew).
pub fn should_track(is_leader: bool, current_term: u64, applied_term: u64) -> bool {
    is_leader && applied_term == current_term
}

/// Tracker tunables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrackerConfig {
    /// Added to every deadline at promote (the election timeout).
    pub promote_extension_ms: u64,
    /// How long before an expiring lease is returned again by [`LeaseTracker::expired`].
    pub retry_ms: u64,
    /// Checkpoint leases at promote and when idle (see the module docs); `false` disables
    /// checkpoints (tests of the protocol without them).
    pub checkpoints: bool,
    /// While a checkpoint is in force, the longest the leader goes without stamping its lease
    /// clock into the log (a [`Command::LeaseClock`] if nothing else did); 0: never. A node
    /// that restarts dates the latest stamp at its start, so this bounds how far behind its
    /// clock runs if it leads next (see [`clock`]).
    pub clock_tick_ms: u64,
}

/// A lease as the replicated state knows it: what promote needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseFacts {
    pub name: String,
    pub revision: Revision,
    pub ttl_ms: u64,
    /// The checkpointed remaining time, if a checkpoint is in force.
    pub checkpoint_ms: Option<u64>,
    /// The lease clock when it was checkpointed (`None`: an old, unaged checkpoint).
    pub checkpoint_clock_ms: Option<u64>,
}

/// When a lease refreshed (or granted) at `at` counts as idle: after half its TTL, later than
/// a healthy client's next refresh (at a third).
fn idle_after(at: MonoMillis, ttl_ms: u64) -> MonoMillis {
    at.plus(ttl_ms / 2)
}

/// Margin for monotonic clocks that run at different rates: 0.1% of the time granted.
fn drift_margin(ms: u64) -> u64 {
    ms / 1000
}

/// Why a refresh was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RefreshError {
    /// This node is not tracking (not the leader, or not yet caught up in its term).
    #[error("this node is not tracking leases")]
    NotPrimary,
    /// No such lease, or it has been decided to expire.
    #[error("no such lease")]
    NotFound,
}

/// A checkpoint the caller must clear (commit through Raft) before acknowledging a refresh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClearTicket {
    pub name: String,
    pub revision: Revision,
    /// The checkpoint decision this clear supersedes.
    pub seq: u64,
}

/// A successful refresh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refreshed {
    pub ttl_ms: u64,
    pub revision: Revision,
    /// `Some`: commit this clear before acknowledging.
    pub clear: Option<ClearTicket>,
}

/// A lease whose deadline passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expired {
    pub name: String,
    pub revision: Revision,
    /// Its deadline (for lateness metrics).
    pub deadline: MonoMillis,
}

/// A checkpoint to record through Raft.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub name: String,
    pub revision: Revision,
    pub remaining_ms: u64,
    /// The lease clock when `remaining_ms` was measured.
    pub clock_ms: u64,
}

#[derive(Clone, Debug)]
struct Tracked {
    revision: Revision,
    ttl_ms: u64,
    /// When the lease expires.
    deadline: MonoMillis,
    /// Where it sits in the expiry queue: the deadline, or the retry time once expiring.
    queued_at: MonoMillis,
    /// Decided to expire: refreshes are refused from now on.
    expiring: bool,
    /// Checkpoint decisions so far, and the highest one a committed clear superseded.
    checkpoint_seq: u64,
    cleared_seq: u64,
    /// When the lease counts as idle and is checkpointed, unless refreshed before.
    next_checkpoint: Option<MonoMillis>,
}

/// The leader's lease deadlines.
#[derive(Debug)]
pub struct LeaseTracker {
    cfg: TrackerConfig,
    /// Tracking at all: only on a caught-up leader.
    primary: bool,
    leases: BTreeMap<String, Tracked>,
    /// Expiry queue: (deadline or retry time, name).
    queue: BTreeSet<(MonoMillis, String)>,
    /// Checkpoint queue: (due time, name).
    checkpoints: BTreeSet<(MonoMillis, String)>,
    /// The lease clock since promote: (its value at promote, the local time of promote).
    clock: ClockReading,
    /// When the leader next considers stamping its clock into the log (see
    /// [`TrackerConfig::clock_tick_ms`]); any stamp it writes pushes this back.
    next_clock_tick: MonoMillis,
}

impl LeaseTracker {
    /// A tracker that tracks nothing until promoted.
    pub fn new(cfg: TrackerConfig) -> Self {
        LeaseTracker {
            cfg,
            primary: false,
            leases: BTreeMap::new(),
            queue: BTreeSet::new(),
            checkpoints: BTreeSet::new(),
            clock: ClockReading {
                value: 0,
                seen_at: MonoMillis(0),
            },
            next_clock_tick: MonoMillis(0),
        }
    }

    pub fn config(&self) -> TrackerConfig {
        self.cfg
    }

    pub fn is_primary(&self) -> bool {
        self.primary
    }

    /// The number of tracked leases.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

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

    fn schedule_checkpoint(&mut self, name: &str, due: MonoMillis) {
        if let Some(t) = self.leases.get_mut(name) {
            if let Some(old) = t.next_checkpoint.replace(due) {
                self.checkpoints.remove(&(old, name.to_string()));
            }
            self.checkpoints.insert((due, name.to_string()));
        }
    }

    fn unschedule_checkpoint(&mut self, name: &str) {
        if let Some(t) = self.leases.get_mut(name)
            && let Some(old) = t.next_checkpoint.take()
        {
            self.checkpoints.remove(&(old, name.to_string()));
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
        let next_checkpoint = self.cfg.checkpoints.then(|| {
            let due = idle_after(now, ttl_ms);
            self.checkpoints.insert((due, name.to_string()));
            due
        });
        self.queue.insert((deadline, name.to_string()));
        self.leases.insert(
            name.to_string(),
            Tracked {
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
            self.queue.remove(&(old.queued_at, name.to_string()));
            if let Some(due) = old.next_checkpoint {
                self.checkpoints.remove(&(due, name.to_string()));
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
        self.queue.remove(&(old_queue, name.to_string()));
        self.queue.insert((new_queue, name.to_string()));
        if self.cfg.checkpoints {
            self.schedule_checkpoint(name, idle_after(now, ttl_ms));
        }
        Ok(refreshed)
    }

    /// A clear was committed: checkpoints decided up to `seq` no longer bind refreshes.
    pub fn on_cleared(&mut self, ticket: &ClearTicket) {
        if let Some(t) = self.leases.get_mut(&ticket.name)
            && t.revision == ticket.revision
        {
            t.cleared_seq = t.cleared_seq.max(ticket.seq);
        }
    }

    /// The leases whose deadline is `<= now`, at most `limit`, marked expiring and re-armed at
    /// `now + retry` in case their expiry proposal fails.
    pub fn expired(&mut self, now: MonoMillis, limit: usize) -> Vec<Expired> {
        let mut out = Vec::new();
        if !self.primary {
            return out;
        }
        while out.len() < limit {
            let Some((at, name)) = self.queue.first().cloned() else {
                break;
            };
            if at > now {
                break;
            }
            self.queue.pop_first();
            let Some(t) = self.leases.get_mut(&name) else {
                continue;
            };
            t.expiring = true;
            t.queued_at = now.plus(self.cfg.retry_ms.max(1));
            self.queue.insert((t.queued_at, name.clone()));
            out.push(Expired {
                name,
                revision: t.revision,
                deadline: t.deadline,
            });
        }
        out
    }

    /// Checkpoints due at `now` (promote checkpoints and idle leases), at most `limit`.
    /// Expiring leases are not checkpointed.
    pub fn checkpoints_due(&mut self, now: MonoMillis, limit: usize) -> Vec<Checkpoint> {
        let mut out = Vec::new();
        if !self.primary {
            return out;
        }
        while out.len() < limit {
            let Some((due, name)) = self.checkpoints.first().cloned() else {
                break;
            };
            if due > now {
                break;
            }
            self.checkpoints.pop_first();
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
                name,
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

/// The entry that expires these leases (each by its incarnation).
pub fn expire_command(expired: &[Expired]) -> Command {
    Command::ExpireLeases {
        leases: expired
            .iter()
            .map(|e| LeaseRef {
                name: e.name.clone(),
                revision: e.revision,
            })
            .collect(),
    }
}

/// The entry that records these checkpoints.
pub fn checkpoint_command(due: Vec<Checkpoint>) -> Command {
    Command::CheckpointLeases {
        checkpoints: due
            .into_iter()
            .map(|c| LeaseCheckpoint {
                name: c.name,
                revision: c.revision,
                remaining_ms: Some(c.remaining_ms),
                clock_ms: Some(c.clock_ms),
            })
            .collect(),
    }
}

/// The entry that clears a checkpoint before a refresh is acknowledged.
pub fn clear_command(ticket: &ClearTicket) -> Command {
    Command::CheckpointLeases {
        checkpoints: vec![LeaseCheckpoint {
            name: ticket.name.clone(),
            revision: ticket.revision,
            remaining_ms: None,
            clock_ms: None,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: TrackerConfig = TrackerConfig {
        promote_extension_ms: 1000,
        retry_ms: 500,
        checkpoints: false,
        clock_tick_ms: 0,
    };

    fn facts(name: &str, ttl: u64) -> LeaseFacts {
        LeaseFacts {
            name: name.into(),
            revision: Revision(1),
            ttl_ms: ttl,
            checkpoint_ms: None,
            checkpoint_clock_ms: None,
        }
    }

    /// A lease clock reading of `value` applied at local time `seen_at`.
    fn clock(value: u64, seen_at: u64) -> ClockReading {
        ClockReading {
            value,
            seen_at: MonoMillis(seen_at),
        }
    }

    fn names(v: Vec<Expired>) -> Vec<String> {
        v.into_iter().map(|e| e.name).collect()
    }

    fn primary() -> LeaseTracker {
        let mut t = LeaseTracker::new(CFG);
        t.promote(MonoMillis(0), clock(0, 0), []);
        t
    }

    #[test]
    fn tracking_starts_only_after_applying_an_entry_of_the_own_term() {
        assert!(!should_track(false, 3, 3));
        assert!(!should_track(true, 3, 2));
        assert!(should_track(true, 3, 3));
    }

    #[test]
    fn expires_exactly_at_the_deadline_and_not_a_millisecond_before() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 3000, MonoMillis(100), false);
        assert!(t.expired(MonoMillis(3099), 10).is_empty());
        assert_eq!(names(t.expired(MonoMillis(3100), 10)), ["a"]);
    }

    #[test]
    fn promote_gives_ttl_plus_extension_then_retries_until_removed() {
        let mut t = LeaseTracker::new(TrackerConfig {
            checkpoints: true,
            ..CFG
        });
        t.promote(MonoMillis(0), clock(0, 0), [facts("a", 3000)]);
        // The deadline is recorded at once (ttl + 0.1% drift margin + extension)...
        assert_eq!(t.next_wakeup(), Some(MonoMillis(0)));
        let due = t.checkpoints_due(MonoMillis(0), 10);
        assert_eq!(
            (due.len(), due[0].remaining_ms, due[0].clock_ms),
            (1, 4003, 0)
        );
        // ... once: aging keeps it exact, until a refresh.
        assert_eq!(t.next_wakeup(), Some(MonoMillis(4003)));
        assert!(t.expired(MonoMillis(4002), 10).is_empty());
        assert_eq!(names(t.expired(MonoMillis(4003), 10)), ["a"]);
        // Re-armed for a retry, not before.
        assert!(t.expired(MonoMillis(4502), 10).is_empty());
        assert_eq!(names(t.expired(MonoMillis(4503), 10)), ["a"]);
        t.on_removed("a");
        assert!(t.expired(MonoMillis(99_999), 10).is_empty());
        assert_eq!(t.next_wakeup(), None);
    }

    #[test]
    fn refresh_moves_the_deadline() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
        let r = t.refresh("a", MonoMillis(800)).unwrap();
        assert_eq!((r.ttl_ms, r.clear), (1000, None));
        assert!(t.expired(MonoMillis(1799), 10).is_empty());
        assert_eq!(t.remaining("a", MonoMillis(1000)), Some(800));
        assert_eq!(names(t.expired(MonoMillis(1800), 10)), ["a"]);
    }

    #[test]
    fn a_lease_decided_to_expire_refuses_refresh() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
        assert_eq!(names(t.expired(MonoMillis(1000), 10)), ["a"]);
        assert_eq!(
            t.refresh("a", MonoMillis(1001)),
            Err(RefreshError::NotFound)
        );
        assert_eq!(t.remaining("a", MonoMillis(1001)), Some(0));
    }

    #[test]
    fn demote_clears_everything_and_followers_track_nothing() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
        t.demote();
        assert_eq!(t.refresh("a", MonoMillis(1)), Err(RefreshError::NotPrimary));
        assert!(t.expired(MonoMillis(99_999), 10).is_empty());
        assert_eq!(t.next_wakeup(), None);
        // A follower ignores registrations.
        t.on_registered("b", Revision(2), 1000, MonoMillis(0), false);
        assert!(t.is_empty());
    }

    #[test]
    fn next_wakeup_follows_earlier_registrations() {
        let mut t = primary();
        t.on_registered("slow", Revision(1), 10_000, MonoMillis(0), false);
        assert_eq!(t.next_wakeup(), Some(MonoMillis(10_000)));
        t.on_registered("fast", Revision(2), 2_000, MonoMillis(100), false);
        assert_eq!(t.next_wakeup(), Some(MonoMillis(2_100)));
        t.on_removed("fast");
        assert_eq!(t.next_wakeup(), Some(MonoMillis(10_000)));
    }

    #[test]
    fn unknown_leases_and_limits() {
        let mut t = primary();
        assert_eq!(
            t.refresh("nope", MonoMillis(0)),
            Err(RefreshError::NotFound)
        );
        for i in 0..5 {
            t.on_registered(&format!("l{i}"), Revision(i), 100, MonoMillis(0), false);
        }
        assert_eq!(t.expired(MonoMillis(100), 3).len(), 3);
        assert_eq!(t.expired(MonoMillis(100), 3).len(), 2);
    }

    #[test]
    fn registration_is_idempotent_per_revision_and_replaced_by_a_new_one() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
        t.on_registered("a", Revision(1), 1000, MonoMillis(500), false);
        assert_eq!(t.remaining("a", MonoMillis(0)), Some(1000));
        t.on_registered("a", Revision(7), 1000, MonoMillis(500), false);
        let e = t.expired(MonoMillis(1500), 10);
        assert_eq!(
            (e[0].revision, e[0].deadline),
            (Revision(7), MonoMillis(1500))
        );
    }

    #[test]
    fn checkpoints_bound_promote_and_a_refresh_must_clear_them() {
        let cfg = TrackerConfig {
            checkpoints: true,
            ..CFG
        };
        let mut t = LeaseTracker::new(cfg);
        t.promote(MonoMillis(0), clock(0, 0), []);
        t.on_registered("long", Revision(3), 10_000, MonoMillis(0), false);
        t.on_registered("short", Revision(4), 3_000, MonoMillis(0), false);
        assert_eq!(t.next_wakeup(), Some(MonoMillis(1500)));
        // A healthy client (refreshing at a third of the TTL) is never idle: no checkpoint, no
        // log write.
        for at in [1000, 2000, 3000, 4000, 4900] {
            assert_eq!(t.refresh("short", MonoMillis(at)).unwrap().clear, None);
            assert!(t.checkpoints_due(MonoMillis(at), 10).is_empty());
        }
        // An idle one (half its TTL without refresh) is checkpointed once.
        let due = t.checkpoints_due(MonoMillis(5000), 10);
        assert_eq!(
            due,
            vec![Checkpoint {
                name: "long".into(),
                revision: Revision(3),
                remaining_ms: 5000,
                clock_ms: 5000,
            }]
        );
        assert!(t.checkpoints_due(MonoMillis(5400), 10).is_empty());
        // A refresh after that decision carries a ticket; until it is cleared, every refresh does.
        let r = t.refresh("long", MonoMillis(5500)).unwrap();
        let ticket = r.clear.expect("must clear the checkpoint");
        assert_eq!(ticket.seq, 1);
        assert!(t.refresh("long", MonoMillis(5600)).unwrap().clear.is_some());
        // A checkpoint decided after the ticket is not cleared by it.
        let due = t.checkpoints_due(MonoMillis(10_600), 10);
        assert!(due.iter().any(|c| c.name == "long"), "{due:?}");
        t.on_cleared(&ticket);
        assert_eq!(
            t.refresh("long", MonoMillis(10_700))
                .unwrap()
                .clear
                .map(|c| c.seq),
            Some(2)
        );
        t.on_cleared(&ClearTicket { seq: 2, ..ticket });
        assert_eq!(t.refresh("long", MonoMillis(10_800)).unwrap().clear, None);

        // A new leader promotes a checkpointed lease with remaining + extension, and the first
        // refresh after promote must clear the checkpoint.
        let mut next = LeaseTracker::new(cfg);
        next.promote(
            MonoMillis(50_000),
            clock(0, 50_000),
            [LeaseFacts {
                name: "long".into(),
                revision: Revision(3),
                ttl_ms: 10_000,
                checkpoint_ms: Some(4_000),
                checkpoint_clock_ms: None,
            }],
        );
        assert_eq!(next.remaining("long", MonoMillis(50_000)), Some(5_004));
        assert!(
            next.refresh("long", MonoMillis(50_001))
                .unwrap()
                .clear
                .is_some()
        );
    }

    #[test]
    fn a_new_leader_ages_a_checkpoint_by_the_lease_clock() {
        let cfg = TrackerConfig {
            checkpoints: true,
            ..CFG
        };
        // Stamped at clock 10_000 with 3_000 left. This node applied clock 12_000 at its local
        // 500 and promotes at its local 1_000: the clock reads 12_500, so 500 ms are left.
        let mut t = LeaseTracker::new(cfg);
        t.promote(
            MonoMillis(1_000),
            clock(12_000, 500),
            [LeaseFacts {
                checkpoint_ms: Some(3_000),
                checkpoint_clock_ms: Some(10_000),
                ..facts("a", 5_000)
            }],
        );
        assert_eq!(t.remaining("a", MonoMillis(1_000)), Some(500));
        assert_eq!(t.clock_at(MonoMillis(1_600)), 13_100);
        // A checkpoint in force is not re-recorded at promote (aging keeps it exact).
        assert!(t.checkpoints_due(MonoMillis(1_000), 10).is_empty());
        // Fully aged: nothing left (and no underflow).
        let mut t = LeaseTracker::new(cfg);
        t.promote(
            MonoMillis(0),
            clock(99_000, 0),
            [LeaseFacts {
                checkpoint_ms: Some(3_000),
                checkpoint_clock_ms: Some(10_000),
                ..facts("a", 5_000)
            }],
        );
        assert_eq!(t.remaining("a", MonoMillis(0)), Some(0));
    }

    #[test]
    fn back_to_back_failovers_do_not_extend_an_abandoned_lease() {
        // Leaders change every 900 ms of true time, each promoting 300 ms after the previous
        // one applied its checkpoints. The lease is never refreshed: without the promote
        // checkpoint and the clock, each leader would grant the full TTL again.
        let cfg = TrackerConfig {
            checkpoints: true,
            ..CFG
        };
        let mut log = crate::domain::kv::KvState::new();
        log.apply(&Command::RegisterLease {
            name: "a".into(),
            ttl_ms: 3_000,
            clock_ms: None,
        });
        let mut now = 0u64; // true time; every node's monotonic clock reads it + its offset
        let mut seen = clock(0, 0);
        let mut gone_at = None;
        for round in 0..20u64 {
            let offset = round * 7_777;
            let local = |t: u64| MonoMillis(t + offset);
            let mut t = LeaseTracker::new(cfg);
            // This node saw the latest stamp when it was applied (true time seen.seen_at).
            let reading = clock(seen.value, seen.seen_at.0 + offset);
            t.promote(local(now), reading, log.lease_facts());
            let due = t.checkpoints_due(local(now), 10);
            if !due.is_empty() {
                log.apply(&checkpoint_command(due));
                seen = clock(log.lease_clock_ms(), now);
            }
            let end = now + 900;
            while now < end {
                now += 10;
                let expired = t.expired(local(now), 10);
                if !expired.is_empty() {
                    log.apply(&expire_command(&expired));
                    gone_at.get_or_insert(now);
                }
            }
            if gone_at.is_some() {
                break;
            }
            now += 300; // the election
        }
        let gone_at = gone_at.expect("the abandoned lease was never expired");
        // Abandoned at 0 with ttl 3 s: one extension, one drift margin and the elections it
        // could not see are all it may add.
        assert!(gone_at >= 3_000, "expired early, at {gone_at}");
        assert!(
            gone_at <= 3_000 + 1_000 + 3 + 300 + 20,
            "expired at {gone_at}"
        );
    }

    #[test]
    fn a_stamped_registration_is_a_checkpoint() {
        let cfg = TrackerConfig {
            checkpoints: true,
            ..CFG
        };
        let mut log = crate::domain::kv::KvState::new();
        let mut t = LeaseTracker::new(cfg);
        t.promote(MonoMillis(0), clock(0, 0), []);
        let stamp = t.clock_at(MonoMillis(400));
        let out = log.apply(&Command::RegisterLease {
            name: "a".into(),
            ttl_ms: 3000,
            clock_ms: Some(stamp),
        });
        assert_eq!(log.lease_clock_ms(), 400);
        let crate::domain::command::LeaseChange::Registered { checkpointed, .. } =
            out.lease_changes[0]
        else {
            panic!("not a registration")
        };
        assert!(checkpointed);
        t.on_registered("a", Revision(1), 3000, MonoMillis(450), checkpointed);
        // Nothing to record: the registration is the checkpoint...
        assert!(t.checkpoints_due(MonoMillis(10_000), 10).is_empty());
        // ... and the first refresh must clear it before it is acknowledged.
        assert!(t.refresh("a", MonoMillis(1000)).unwrap().clear.is_some());
        // A leader that never saw a refresh ages it from the stamp: 3000 ms from clock 400.
        let mut next = LeaseTracker::new(cfg);
        next.promote(MonoMillis(77), clock(400, 50), log.lease_facts());
        assert_eq!(next.remaining("a", MonoMillis(77)), Some(3000 - 27 + 2));
    }

    #[test]
    fn the_leader_ticks_its_clock_into_the_log_only_while_a_checkpoint_is_in_force() {
        let mut t = LeaseTracker::new(TrackerConfig {
            checkpoints: true,
            clock_tick_ms: 500,
            ..CFG
        });
        t.promote(MonoMillis(0), clock(100, 0), []);
        // Nothing to age: no tick, and the next look is a tick later.
        assert_eq!(t.clock_tick_due(MonoMillis(0)), None);
        // A stamped registration is a checkpoint in force; its stamp counts as a tick.
        let stamp = t.stamp(MonoMillis(200));
        assert_eq!(stamp, 300);
        t.on_registered("a", Revision(1), 3000, MonoMillis(210), true);
        assert_eq!(t.next_wakeup(), Some(MonoMillis(700)));
        assert_eq!(t.clock_tick_due(MonoMillis(699)), None);
        assert_eq!(t.clock_tick_due(MonoMillis(700)), Some(800));
        assert_eq!(t.clock_tick_due(MonoMillis(1100)), None);
        assert_eq!(t.clock_tick_due(MonoMillis(1200)), Some(1300));
        // The client refreshes and the clear commits: nothing in force, no more ticks.
        let ticket = t.refresh("a", MonoMillis(1300)).unwrap().clear.unwrap();
        t.on_cleared(&ticket);
        assert_eq!(t.clock_tick_due(MonoMillis(5000)), None);
        // A follower never ticks.
        t.demote();
        assert_eq!(t.clock_tick_due(MonoMillis(9000)), None);
    }
}
