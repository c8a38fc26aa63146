//! Flease: decentralized, diskless, per-resource leases among the member nodes. Pure.
//!
//! Kolbeck et al., "Flease: Lease Coordination without a Lock Server" (../shared/papers/004,
//! algorithms 1 to 4), with the specification of `research/flease-brief.md` section 7.
//!
//! # The protocol
//! Each resource has a round-based register (Boichat et al.) on every member: an acceptor cell
//! `(read_k, write_k, value)`. A node acquiring a lease for an owner runs a round:
//! 1. read phase: `Read(k)` to all; a majority of `ReadAck`s returns the value with the highest
//!    `write_k` (Paxos value adoption) and the highest epoch any of them knows;
//! 2. it judges that value on its wall clock ([`judge`]): free (empty, released, or past
//!    `expires + eps`), held, or *in doubt* (between `expires` and `expires + eps`: someone's
//!    clock may still say it is valid, so wait, never overwrite);
//! 3. write phase: `Write(k, v)` to all, where `v` is a fresh lease `(owner, t0 + t_max, epoch)` if
//!    free or renewed by its own owner, or the value found written back unchanged if someone
//!    else holds it; a majority of `WriteAck`s commits `v`.
//!
//! A single NACK aborts a phase (the round retries with a higher ballot after a backoff).
//!
//! # Time
//! Wall clocks are loosely synchronized: any two differ by at most `eps`. A new lease expires at
//! `t0 + t_max`, where `t0` is the proposer's wall clock when the round *started* (before the
//! first message), so a slow or paused proposer can only shorten its own lease. The holder may act
//! for `t_max - eps` from `t0`, on its monotonic clock ([`Round`] reports `valid_until`); others
//! take over only past `expires + eps` on their own clocks. By the skew bound the holder has
//! stopped by then, with `eps` to spare for rate drift.
//!
//! # Ballots: totally ordered and unique
//! `Ballot { era, counter, boot, node }` ordered lexicographically (a derived `Ord`): `era` is the
//! wall clock divided by `ballot_era`, `counter` starts at a random value inside an era (so the
//! fastest clock does not always win within one era, the paper's fairness intent, without its
//! non-transitive "equal within epsilon" comparison), `boot` is the process start time, and `node`
//! makes ballots of different nodes distinct. Per node, ballots strictly increase while the
//! process lives; across restarts `boot` grows (the restart wait exceeds any clock step allowed).
//!
//! # Fencing epochs with no disk write
//! A fresh grant takes `epoch = max(highest epoch reported by the read quorum + 1, t0 in
//! microseconds)`; a renewal keeps its epoch. Why epochs strictly increase from one tenure to the
//! next for a resource:
//! - *Without acceptor restarts:* the second grant's read quorum intersects the first grant's
//!   write quorum at an acceptor that processed the first `Write` before the second `Read` (a
//!   higher `Read` first would have NACKed the lower `Write`), so it reports at least the first
//!   epoch and the second is at least one more. No clock is involved.
//! - *With restarts (state lost):* a restarted acceptor stays silent for `restart_wait >= t_max +
//!   2 eps + msg_max_age`. If the read quorum reports nothing of an earlier grant, every acceptor
//!   of that grant's write quorum in the read quorum restarted after acknowledging it and answered
//!   only after its wait, so the new round started after `commit + restart_wait - round_timeout`,
//!   which is more than `eps` after the earlier grant's commit, hence (on any clock within `eps`)
//!   after its round start: `t0` in microseconds exceeds the earlier epoch. (Earlier epochs are
//!   themselves at most their round start in microseconds plus the number of grants since, and a
//!   round takes far longer than a microsecond per grant.)
//!
//! An owner that acquires while its own lease is still in the register (its release was lost,
//! or its node restarted) renews it and keeps the epoch: nobody else held the resource in
//! between, so to the protected resource this is one continuing tenure.
//!
//! The simulator in `tests/flease_sim.rs` checks both properties after every step, and shows that
//! its checker catches an overlap when the skew bound is violated.
//!
//! # PaxosLease: the same register with timespans ([`Protocol::PaxosLease`])
//! Trencseni et al., "PaxosLease" (../shared/papers/003). No clock synchronization, only a bound
//! on clock *rate* drift:
//! - the value is `(owner, timespan T)` ([`Slot::Span`]), never an absolute time;
//! - the proposer starts its timer (the round's monotonic start `m0`) before its first message,
//!   and the holder may act until `m0 + T - eps` ([`FleaseConfig::valid_ms`]), where `eps` here
//!   covers rate drift over one lease time;
//! - an acceptor starts its own timer on receipt of the `Write` and forgets the value when it
//!   fires ([`Slot::Timed`], on its monotonic clock): every acceptor's timer starts after the
//!   holder's, so the holder's view always ends first;
//! - a proposer writes only its own value: if any acceptor of the read quorum still holds
//!   another owner's unexpired value the answer is "busy" (nothing is written back). Safety is
//!   Paxos' intersection argument: a chosen value is held by a majority until their timers fire,
//!   and every later read quorum meets one of them;
//! - extension: the holder re-proposes when the quorum answered "empty" or "its own value"; it
//!   keeps its epoch unless a later write in the quorum ended its tenure (an expired or
//!   released copy under a higher ballot that remembers an epoch at least the tenure's:
//!   ballots alone cannot order writes across acceptor restarts, their eras come from wall
//!   clocks);
//!   release: as for Flease, the holder stops, then the acceptors holding its ballot forget it;
//! - no message is dropped for its wall-clock stamp (clocks are not comparable across nodes), and
//!   a restarted acceptor stays silent for the restart wait, which exceeds the lease time.
//!
//! Epochs follow the Flease rule. Intersection makes them increase while any acceptor of the
//! earlier grant's quorum remembers it (acceptors keep the highest epoch after a value expires,
//! until the cell is collected). Across a full loss of that memory (restarts, collection) the
//! fallback is the round's start in wall-clock microseconds, which is monotonic only if wall
//! clocks agree within the restart wait minus the lease time: mutual exclusion never depends on
//! wall clocks, fencing after total amnesia does.
//!
//! # What it must not do
//! Read a clock, do I/O, or keep state on disk: a restarted node relies on the restart wait.

pub mod acceptor;
pub mod proposer;
pub mod validate;

use serde::{Deserialize, Serialize};

use super::types::{MonoMillis, NodeId, WallMillis};

pub use acceptor::Acceptor;
pub use proposer::{Intent, Round, RoundEvent};

pub use leasecore_client::api::Protocol;

/// A resource name (client-chosen).
pub type ResourceId = String;
/// A fencing token: strictly increasing from one tenure of a resource to the next.
pub type Epoch = u64;

/// Both clock readings, taken once by the shell and passed in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Now {
    pub wall: WallMillis,
    pub mono: MonoMillis,
}

/// Timing of Flease, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleaseConfig {
    /// The pairwise clock-skew bound.
    pub eps_ms: u64,
    /// Lease duration.
    pub t_max_ms: u64,
    /// How long a phase waits for a quorum.
    pub round_timeout_ms: u64,
    /// Messages older than this (sender stamp against local wall clock) are dropped.
    pub msg_max_age_ms: u64,
    /// Renew when this much or less remains.
    pub renew_lead_ms: u64,
    /// Below this much remaining, do not renew: let it lapse and acquire afresh.
    pub renew_min_remaining_ms: u64,
    /// Acceptor silence after a start or a membership change.
    pub restart_wait_ms: u64,
    /// Idle acceptor cells are dropped after this.
    pub cell_gc_idle_ms: u64,
    /// The time bucket of ballots.
    pub ballot_era_ms: u64,
}

impl Default for FleaseConfig {
    /// 10 s leases, 500 ms skew bound, 500 ms rounds (restart wait 12 s).
    fn default() -> Self {
        FleaseConfig::derived(10_000, 500, 500)
    }
}

impl FleaseConfig {
    /// A consistent configuration from the three numbers that matter: the lease time, the
    /// clock-skew bound and the round timeout (the rest follow the brief's section 7.2).
    pub fn derived(t_max_ms: u64, eps_ms: u64, round_timeout_ms: u64) -> Self {
        // Old enough for a slow-clock peer's messages to survive (eps + a round), never below 2 eps.
        let age = (eps_ms + round_timeout_ms).max(2 * eps_ms);
        let restart = t_max_ms + 2 * eps_ms + age;
        FleaseConfig {
            eps_ms,
            t_max_ms,
            round_timeout_ms,
            msg_max_age_ms: age,
            renew_lead_ms: t_max_ms / 2,
            renew_min_remaining_ms: 2 * round_timeout_ms + eps_ms,
            restart_wait_ms: restart,
            cell_gc_idle_ms: (2 * t_max_ms).max(restart),
            ballot_era_ms: 2 * eps_ms,
        }
    }
}

/// A configuration Flease cannot be safe or live with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid flease configuration: {0}")]
pub struct ConfigError(pub String);

impl FleaseConfig {
    /// Check the constraints of the brief, section 7.2 (C1 to C6).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let c = self;
        let fail = |m: String| Err(ConfigError(m));
        if c.eps_ms == 0 || c.round_timeout_ms == 0 || c.ballot_era_ms == 0 {
            return fail("eps, round timeout and ballot era must be positive".into());
        }
        if c.t_max_ms <= 2 * c.eps_ms {
            return fail(format!(
                "lease time {} must exceed twice the clock-skew bound ({})",
                c.t_max_ms, c.eps_ms
            ));
        }
        if c.t_max_ms < 2 * c.eps_ms + 4 * c.round_timeout_ms {
            return fail(format!(
                "lease time {} must be at least 2 eps + 4 round timeouts ({})",
                c.t_max_ms,
                2 * c.eps_ms + 4 * c.round_timeout_ms
            ));
        }
        if c.renew_lead_ms < c.renew_min_remaining_ms + c.round_timeout_ms
            || c.t_max_ms < c.renew_lead_ms + 2 * c.round_timeout_ms + c.eps_ms
        {
            return fail(format!(
                "renewal is not always schedulable: need renew_lead ({}) >= renew_min_remaining ({}) + round timeout ({}) and lease time ({}) >= renew_lead + 2 round timeouts + eps",
                c.renew_lead_ms, c.renew_min_remaining_ms, c.round_timeout_ms, c.t_max_ms
            ));
        }
        let floor = c.t_max_ms + 2 * c.eps_ms + c.msg_max_age_ms;
        if c.restart_wait_ms < floor {
            return fail(format!(
                "restart wait {} must be at least lease time + 2 eps + message age ({floor})",
                c.restart_wait_ms
            ));
        }
        if c.cell_gc_idle_ms < floor {
            return fail(format!(
                "idle cell collection after {} ms would forget live leases (needs {floor})",
                c.cell_gc_idle_ms
            ));
        }
        if c.restart_wait_ms < c.ballot_era_ms + 2 * c.eps_ms {
            return fail("restart wait must exceed one ballot era + 2 eps".into());
        }
        Ok(())
    }

    /// How long the holder may act, counted from the round's start.
    pub fn valid_ms(&self) -> u64 {
        self.t_max_ms - self.eps_ms
    }
}

/// A ballot. The field order is the order.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Ballot {
    pub era: u64,
    pub counter: u32,
    pub boot: u64,
    pub node: NodeId,
}

/// Issues this node's ballots: strictly increasing, above everything seen.
#[derive(Clone, Copy, Debug)]
pub struct BallotGen {
    node: NodeId,
    boot: u64,
    era_ms: u64,
    last: Ballot,
}

impl BallotGen {
    /// `boot` distinguishes process lifetimes (the start time in ms serves: it grows across
    /// restarts because of the restart wait).
    pub fn new(node: NodeId, boot: u64, era_ms: u64) -> Self {
        BallotGen {
            node,
            boot,
            era_ms: era_ms.max(1),
            last: Ballot::default(),
        }
    }

    /// A ballot above `seen` and above every ballot issued before. `random` spreads the counter
    /// (the caller's randomness: this core holds none).
    pub fn next(&mut self, now: WallMillis, seen: Ballot, random: u32) -> Ballot {
        let floor = self.last.max(seen);
        let era_now = now.0 / self.era_ms;
        let (era, counter) = if era_now > floor.era {
            (era_now, random % 16)
        } else {
            match floor.counter.checked_add(1 + random % 8) {
                Some(c) => (floor.era, c),
                None => (floor.era + 1, 0),
            }
        };
        let mut k = Ballot {
            era,
            counter,
            boot: self.boot,
            node: self.node,
        };
        if k <= floor {
            // Same era and counter as `floor` but a lower boot or node: step past it.
            k.counter = floor.counter.saturating_add(1);
            if k <= floor {
                k = Ballot {
                    era: floor.era + 1,
                    counter: 0,
                    ..k
                };
            }
        }
        self.last = k;
        k
    }
}

/// What a register holds for a resource.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Slot {
    #[default]
    Empty,
    /// Held by `owner` until `expires` (wall clock; for PaxosLease, the acceptor's own deadline).
    Lease {
        owner: String,
        expires: WallMillis,
        epoch: Epoch,
    },
    /// Released by its holder; free for anyone.
    Released { epoch: Epoch },
    /// PaxosLease, on the wire: held by `owner` for `span_ms` from now (in a `Write`, the lease
    /// time; in a `ReadAck`, what the acceptor's timer has left).
    Span {
        owner: String,
        span_ms: u64,
        epoch: Epoch,
    },
    /// PaxosLease, inside an acceptor only (never sent): held until `until` on that acceptor's
    /// monotonic clock.
    Timed {
        owner: String,
        until: MonoMillis,
        epoch: Epoch,
    },
}

impl Slot {
    pub fn epoch(&self) -> Epoch {
        match self {
            Slot::Empty => 0,
            Slot::Lease { epoch, .. }
            | Slot::Released { epoch }
            | Slot::Span { epoch, .. }
            | Slot::Timed { epoch, .. } => *epoch,
        }
    }
}

/// What a value means at a given wall time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Judgement {
    /// Anyone may take it.
    Free,
    /// Held and valid for everyone.
    HeldBy {
        owner: String,
        expires: WallMillis,
        epoch: Epoch,
    },
    /// Expired on this clock but maybe not on a slower one: wait until `until`.
    InDoubt { until: WallMillis },
}

/// The one validity predicate: free only past `expires + eps`, in doubt from `expires` to
/// `expires + eps`, held before `expires`.
///
/// For PaxosLease values (relative, already expired by the acceptor that reported them) a
/// reported span is held; the wall clock plays no part.
pub fn judge(slot: &Slot, now: WallMillis, eps_ms: u64) -> Judgement {
    match slot {
        Slot::Empty | Slot::Released { .. } => Judgement::Free,
        Slot::Span {
            owner,
            span_ms,
            epoch,
        } => Judgement::HeldBy {
            owner: owner.clone(),
            expires: WallMillis(now.0.saturating_add(*span_ms)),
            epoch: *epoch,
        },
        // Judged by the acceptor that holds it, on its own clock.
        Slot::Timed { owner, epoch, .. } => Judgement::HeldBy {
            owner: owner.clone(),
            expires: WallMillis(u64::MAX),
            epoch: *epoch,
        },
        Slot::Lease {
            owner,
            expires,
            epoch,
        } => {
            let free_after = expires.0.saturating_add(eps_ms);
            if now.0 > free_after {
                Judgement::Free
            } else if now >= *expires {
                Judgement::InDoubt {
                    until: WallMillis(free_after + 1),
                }
            } else {
                Judgement::HeldBy {
                    owner: owner.clone(),
                    expires: *expires,
                    epoch: *epoch,
                }
            }
        }
    }
}

/// A message between nodes about one resource.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    pub proto: Protocol,
    pub resource: ResourceId,
    pub from: NodeId,
    pub to: NodeId,
    /// The sender's wall clock when it sent the message.
    pub sent_at: WallMillis,
    pub body: Msg,
}

/// The register protocol. (Externally tagged: peers exchange it as compact MessagePack, and
/// an internally tagged enum would be buffered on every decode.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Msg {
    Read {
        k: Ballot,
    },
    ReadAck {
        k: Ballot,
        write_k: Ballot,
        value: Slot,
        /// The highest epoch this acceptor knows for the resource.
        epoch: Epoch,
    },
    ReadNack {
        k: Ballot,
        seen: Ballot,
    },
    Write {
        k: Ballot,
        value: Slot,
    },
    WriteAck {
        k: Ballot,
    },
    WriteNack {
        k: Ballot,
        seen: Ballot,
    },
    /// The holder stopped using `grant_k`'s lease: acceptors holding it mark it released.
    Release {
        grant_k: Ballot,
        owner: String,
    },
    ReleaseAck {
        grant_k: Ballot,
        /// Whether this acceptor now holds the lease as released (it held `grant_k`'s lease of
        /// that owner, now or already). A quorum of these completes a fast release.
        released: bool,
    },
}

/// Fast timing for unit tests: 2 s leases, 50 ms skew bound, 100 ms rounds.
#[cfg(test)]
pub(crate) const TEST_CONFIG: FleaseConfig = FleaseConfig {
    eps_ms: 50,
    t_max_ms: 2000,
    round_timeout_ms: 100,
    msg_max_age_ms: 300,
    renew_lead_ms: 1000,
    renew_min_remaining_ms: 300,
    restart_wait_ms: 2500,
    cell_gc_idle_ms: 4000,
    ballot_era_ms: 100,
};

/// Both clocks reading `ms` (unit tests: one clock for wall and monotonic time).
#[cfg(test)]
pub(crate) fn test_at(ms: u64) -> Now {
    Now {
        wall: WallMillis(ms),
        mono: MonoMillis(ms),
    }
}

/// A quorum of `n`.
pub fn quorum(n: usize) -> usize {
    n / 2 + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lease(expires: u64) -> Slot {
        Slot::Lease {
            owner: "a".into(),
            expires: WallMillis(expires),
            epoch: 7,
        }
    }

    #[test]
    fn judge_at_its_boundaries() {
        let eps = 50;
        let held = |t| {
            matches!(
                judge(&lease(1000), WallMillis(t), eps),
                Judgement::HeldBy { .. }
            )
        };
        let doubt = |t| {
            matches!(
                judge(&lease(1000), WallMillis(t), eps),
                Judgement::InDoubt { .. }
            )
        };
        let free = |t| judge(&lease(1000), WallMillis(t), eps) == Judgement::Free;
        assert!(held(999));
        assert!(doubt(1000));
        assert!(doubt(1050));
        assert!(free(1051));
        assert_eq!(
            judge(&lease(1000), WallMillis(1000), eps),
            Judgement::InDoubt {
                until: WallMillis(1051)
            }
        );
        assert_eq!(judge(&Slot::Empty, WallMillis(0), eps), Judgement::Free);
        assert_eq!(
            judge(&Slot::Released { epoch: 3 }, WallMillis(0), eps),
            Judgement::Free
        );
    }

    #[test]
    fn the_default_config_is_valid_and_bad_ones_are_refused() {
        assert_eq!(FleaseConfig::default().validate(), Ok(()));
        let d = FleaseConfig::default();
        for bad in [
            FleaseConfig {
                t_max_ms: 1000,
                ..d
            }, // C1/C2
            FleaseConfig {
                t_max_ms: 14_000,
                round_timeout_ms: 6_000,
                ..d
            }, // XtreemFS #461
            FleaseConfig {
                restart_wait_ms: d.t_max_ms,
                ..d
            }, // C4
            FleaseConfig {
                cell_gc_idle_ms: 1000,
                ..d
            }, // C5
            FleaseConfig {
                renew_lead_ms: 100,
                ..d
            }, // C3
            FleaseConfig { eps_ms: 0, ..d },
        ] {
            assert!(bad.validate().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn derived_configs_are_valid() {
        for (t, e, r) in [(10_000, 500, 500), (2000, 50, 100), (60_000, 1000, 500)] {
            assert_eq!(
                FleaseConfig::derived(t, e, r).validate(),
                Ok(()),
                "{t} {e} {r}"
            );
        }
        assert!(FleaseConfig::derived(1000, 500, 100).validate().is_err());
    }

    #[test]
    fn generated_ballots_increase_and_beat_what_was_seen() {
        let mut g = BallotGen::new(2, 100, 1000);
        let a = g.next(WallMillis(5_000), Ballot::default(), 3);
        let b = g.next(WallMillis(5_000), Ballot::default(), 0);
        assert!(b > a);
        let seen = Ballot {
            era: 9,
            counter: u32::MAX,
            boot: 1,
            node: 3,
        };
        let c = g.next(WallMillis(5_000), seen, 1);
        assert!(c > seen && c > b);
        // A later era starts afresh.
        let d = g.next(WallMillis(50_000), Ballot::default(), 5);
        assert_eq!((d.era, d.counter), (50, 5));
    }

    fn ballot() -> impl Strategy<Value = Ballot> {
        (0u64..4, 0u32..4, 0u64..3, 0u64..3).prop_map(|(era, counter, boot, node)| Ballot {
            era,
            counter,
            boot,
            node,
        })
    }

    proptest! {
        /// The order is total, antisymmetric and transitive (it is lexicographic).
        #[test]
        fn ballot_order_is_a_total_order(a in ballot(), b in ballot(), c in ballot()) {
            prop_assert!(a <= b || b <= a);
            prop_assert_eq!(a <= b && b <= a, a == b);
            if a <= b && b <= c { prop_assert!(a <= c); }
        }

        /// Ballots from different nodes or boots never collide; each node's are increasing.
        #[test]
        fn ballots_are_unique_across_nodes_and_restarts(
            steps in prop::collection::vec((0usize..4, 0u64..3000, any::<u32>()), 1..200)
        ) {
            // Nodes 1 and 2, each with two lifetimes (boots 10 and 20).
            let mut gens = [
                BallotGen::new(1, 10, 1000), BallotGen::new(1, 20, 1000),
                BallotGen::new(2, 10, 1000), BallotGen::new(2, 20, 1000),
            ];
            let mut all = std::collections::BTreeSet::new();
            let mut last = [Ballot::default(); 4];
            let mut seen = Ballot::default();
            for (g, t, r) in steps {
                let k = gens[g].next(WallMillis(t), seen, r);
                prop_assert!(k > last[g]);
                prop_assert!(k > seen);
                prop_assert!(all.insert(k), "duplicate ballot {:?}", k);
                last[g] = k;
                if r % 3 == 0 { seen = seen.max(k); }
            }
        }
    }
}
