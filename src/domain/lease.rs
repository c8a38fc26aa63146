//! `LeaseTracker`: the leader's lease deadlines, on its own monotonic clock. Pure.
//!
//! # The protocol (DESIGN.md section 4; the Consistent Core lease pattern)
//! The replicated state holds facts only: a lease is `{name, ttl, revision, keys}`, plus an
//! optional checkpointed remaining time. Deadlines exist only here, on the leader, measured on
//! its monotonic clock. Followers run no tracker (`primary == false`) and never expire anything.
//!
//! - **Promote.** A node starts tracking only once it is leader *and* has applied every entry up
//!   to the first entry of its own term (so it knows every lease the old leader knew). Each lease
//!   then gets `now + ttl + extension` (`extension` = the election timeout). Why this is safe: the
//!   old leader acknowledged a refresh only after a quorum confirmed its leadership in a round
//!   that started after the refresh arrived, and this node could only be elected after that
//!   quorum moved on. So `now` here is later than any acknowledged refresh, and the lease lives
//!   at least as long as any client was told. It may live longer across a failover, never
//!   shorter.
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
//! # Checkpoints: long leases do not restart their full TTL at every failover
//! Promote gives `ttl + extension`, so under frequent elections an hour-long lease could live
//! for ever (the etcd complaint). For leases whose TTL exceeds the checkpoint interval, the
//! leader periodically records the remaining time through Raft; a new leader then promotes with
//! `remaining + extension` instead of `ttl + extension`.
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
    /// Leases with a TTL above this are checkpointed this often; 0 disables checkpoints.
    pub checkpoint_interval_ms: u64,
}

/// A lease as the replicated state knows it: what promote needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseFacts {
    pub name: String,
    pub revision: Revision,
    pub ttl_ms: u64,
    /// The checkpointed remaining time, if a checkpoint is in force.
    pub checkpoint_ms: Option<u64>,
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
    /// When the next checkpoint is due (long leases only).
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

    /// Start tracking every lease of the replicated state (see the module docs).
    pub fn promote(&mut self, now: MonoMillis, leases: impl IntoIterator<Item = LeaseFacts>) {
        self.demote();
        self.primary = true;
        for facts in leases {
            let base = facts.checkpoint_ms.unwrap_or(facts.ttl_ms);
            let deadline = now.plus(base).plus(self.cfg.promote_extension_ms);
            // A checkpoint in force must be cleared by the next refresh.
            let seq = u64::from(facts.checkpoint_ms.is_some());
            self.insert(
                &facts.name,
                facts.revision,
                facts.ttl_ms,
                deadline,
                now,
                seq,
            );
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
        let next_checkpoint = self.checkpointed(ttl_ms).then(|| {
            let due = now.plus(self.cfg.checkpoint_interval_ms);
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

    fn checkpointed(&self, ttl_ms: u64) -> bool {
        self.cfg.checkpoint_interval_ms > 0 && ttl_ms > self.cfg.checkpoint_interval_ms
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
    /// lease already tracked at the same revision.
    pub fn on_registered(&mut self, name: &str, revision: Revision, ttl_ms: u64, now: MonoMillis) {
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
        self.insert(name, revision, ttl_ms, now.plus(ttl_ms), now, 0);
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
        self.queue.remove(&(old_queue, name.to_string()));
        self.queue.insert((new_queue, name.to_string()));
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

    /// Checkpoints due at `now` (long leases only), at most `limit`; each is rescheduled one
    /// interval later. Expiring leases are not checkpointed.
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
            let Some(t) = self.leases.get_mut(&name) else {
                continue;
            };
            let next = now.plus(self.cfg.checkpoint_interval_ms);
            t.next_checkpoint = Some(next);
            self.checkpoints.insert((next, name.clone()));
            if t.expiring {
                continue;
            }
            t.checkpoint_seq += 1;
            out.push(Checkpoint {
                name,
                revision: t.revision,
                remaining_ms: now.until(t.deadline),
            });
        }
        out
    }

    /// The earliest time anything is due (an expiry or a checkpoint).
    pub fn next_wakeup(&self) -> Option<MonoMillis> {
        let expiry = self.queue.first().map(|(at, _)| *at);
        let checkpoint = self.checkpoints.first().map(|(at, _)| *at);
        match (expiry, checkpoint) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: TrackerConfig = TrackerConfig {
        promote_extension_ms: 1000,
        retry_ms: 500,
        checkpoint_interval_ms: 0,
    };

    fn facts(name: &str, ttl: u64) -> LeaseFacts {
        LeaseFacts {
            name: name.into(),
            revision: Revision(1),
            ttl_ms: ttl,
            checkpoint_ms: None,
        }
    }

    fn names(v: Vec<Expired>) -> Vec<String> {
        v.into_iter().map(|e| e.name).collect()
    }

    fn primary() -> LeaseTracker {
        let mut t = LeaseTracker::new(CFG);
        t.promote(MonoMillis(0), []);
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
        t.on_registered("a", Revision(1), 3000, MonoMillis(100));
        assert!(t.expired(MonoMillis(3099), 10).is_empty());
        assert_eq!(names(t.expired(MonoMillis(3100), 10)), ["a"]);
    }

    #[test]
    fn promote_gives_ttl_plus_extension_then_retries_until_removed() {
        let mut t = LeaseTracker::new(CFG);
        t.promote(MonoMillis(0), [facts("a", 3000)]);
        assert_eq!(t.next_wakeup(), Some(MonoMillis(4000)));
        assert!(t.expired(MonoMillis(3999), 10).is_empty());
        assert_eq!(names(t.expired(MonoMillis(4000), 10)), ["a"]);
        // Re-armed for a retry, not before.
        assert!(t.expired(MonoMillis(4499), 10).is_empty());
        assert_eq!(names(t.expired(MonoMillis(4500), 10)), ["a"]);
        t.on_removed("a");
        assert!(t.expired(MonoMillis(99_999), 10).is_empty());
        assert_eq!(t.next_wakeup(), None);
    }

    #[test]
    fn refresh_moves_the_deadline() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 1000, MonoMillis(0));
        let r = t.refresh("a", MonoMillis(800)).unwrap();
        assert_eq!((r.ttl_ms, r.clear), (1000, None));
        assert!(t.expired(MonoMillis(1799), 10).is_empty());
        assert_eq!(t.remaining("a", MonoMillis(1000)), Some(800));
        assert_eq!(names(t.expired(MonoMillis(1800), 10)), ["a"]);
    }

    #[test]
    fn a_lease_decided_to_expire_refuses_refresh() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 1000, MonoMillis(0));
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
        t.on_registered("a", Revision(1), 1000, MonoMillis(0));
        t.demote();
        assert_eq!(t.refresh("a", MonoMillis(1)), Err(RefreshError::NotPrimary));
        assert!(t.expired(MonoMillis(99_999), 10).is_empty());
        assert_eq!(t.next_wakeup(), None);
        // A follower ignores registrations.
        t.on_registered("b", Revision(2), 1000, MonoMillis(0));
        assert!(t.is_empty());
    }

    #[test]
    fn next_wakeup_follows_earlier_registrations() {
        let mut t = primary();
        t.on_registered("slow", Revision(1), 10_000, MonoMillis(0));
        assert_eq!(t.next_wakeup(), Some(MonoMillis(10_000)));
        t.on_registered("fast", Revision(2), 2_000, MonoMillis(100));
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
            t.on_registered(&format!("l{i}"), Revision(i), 100, MonoMillis(0));
        }
        assert_eq!(t.expired(MonoMillis(100), 3).len(), 3);
        assert_eq!(t.expired(MonoMillis(100), 3).len(), 2);
    }

    #[test]
    fn registration_is_idempotent_per_revision_and_replaced_by_a_new_one() {
        let mut t = primary();
        t.on_registered("a", Revision(1), 1000, MonoMillis(0));
        t.on_registered("a", Revision(1), 1000, MonoMillis(500));
        assert_eq!(t.remaining("a", MonoMillis(0)), Some(1000));
        t.on_registered("a", Revision(7), 1000, MonoMillis(500));
        let e = t.expired(MonoMillis(1500), 10);
        assert_eq!(
            (e[0].revision, e[0].deadline),
            (Revision(7), MonoMillis(1500))
        );
    }

    #[test]
    fn checkpoints_bound_promote_and_a_refresh_must_clear_them() {
        let cfg = TrackerConfig {
            checkpoint_interval_ms: 1000,
            ..CFG
        };
        let mut t = LeaseTracker::new(cfg);
        t.promote(MonoMillis(0), []);
        t.on_registered("long", Revision(3), 10_000, MonoMillis(0));
        t.on_registered("short", Revision(4), 1_000, MonoMillis(0));
        assert_eq!(t.next_wakeup(), Some(MonoMillis(1000)));
        let due = t.checkpoints_due(MonoMillis(1000), 10);
        assert_eq!(
            due,
            vec![Checkpoint {
                name: "long".into(),
                revision: Revision(3),
                remaining_ms: 9000
            }]
        );
        // A refresh after that decision carries a ticket; until it is cleared, every refresh does.
        let r = t.refresh("long", MonoMillis(1500)).unwrap();
        let ticket = r.clear.expect("must clear the checkpoint");
        assert_eq!(ticket.seq, 1);
        assert!(t.refresh("long", MonoMillis(1600)).unwrap().clear.is_some());
        // A checkpoint decided after the ticket is not cleared by it.
        t.checkpoints_due(MonoMillis(2000), 10);
        t.on_cleared(&ticket);
        assert_eq!(
            t.refresh("long", MonoMillis(2100))
                .unwrap()
                .clear
                .map(|c| c.seq),
            Some(2)
        );
        t.on_cleared(&ClearTicket { seq: 2, ..ticket });
        assert_eq!(t.refresh("long", MonoMillis(2200)).unwrap().clear, None);

        // A new leader promotes a checkpointed lease with remaining + extension, and the first
        // refresh after promote must clear the checkpoint.
        let mut next = LeaseTracker::new(cfg);
        next.promote(
            MonoMillis(50_000),
            [LeaseFacts {
                name: "long".into(),
                revision: Revision(3),
                ttl_ms: 10_000,
                checkpoint_ms: Some(4_000),
            }],
        );
        assert_eq!(next.remaining("long", MonoMillis(50_000)), Some(5_000));
        assert!(
            next.refresh("long", MonoMillis(50_001))
                .unwrap()
                .clear
                .is_some()
        );
    }
}
