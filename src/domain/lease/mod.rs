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
//!
//! # Layout
//! - here: the vocabulary (the tunables, the facts promote takes, what a refresh, an expiry or a
//!   checkpoint yields), the tracker's state and [`should_track`].
//! - `deadlines`: promote and demote, registrations and removals, refreshes, expiries, and the
//!   next wakeup.
//! - `checkpoints`: the lease clock and its stamps, the checkpoints due, and the clears that
//!   supersede them.
//! - `commands`: the log entries the leader proposes for expiries, checkpoints and clears.
//! - [`clock`]: the lease clock as one node can vouch for it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::types::{MonoMillis, Revision};

mod checkpoints;
pub mod clock;
mod commands;
mod deadlines;

pub use clock::{ClockReading, ClockWitness};
pub use commands::{checkpoint_command, clear_command, expire_command};

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
    ///
    /// [`Command::LeaseClock`]: crate::domain::command::Command::LeaseClock
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
    /// The lease's name, shared with its entries in both queues: a refresh moves those entries
    /// (under the hub's lock, at every heartbeat) without allocating a key.
    name: Arc<str>,
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
    leases: BTreeMap<Arc<str>, Tracked>,
    /// Expiry queue: (deadline or retry time, name).
    queue: BTreeSet<(MonoMillis, Arc<str>)>,
    /// Checkpoint queue: (due time, name).
    checkpoints: BTreeSet<(MonoMillis, Arc<str>)>,
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
}

#[cfg(test)]
mod tests;
