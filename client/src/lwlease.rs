//! The Chockler–Malkhi light-weight lease: a lease built from one read/write register, without
//! compare-and-set, for any number of contenders that need not know each other. Pure.
//!
//! # The algorithm
//! The paper is "Light-Weight Leases for Storage-Centric Coordination" (Chockler and Malkhi).
//! It is Fischer's timing-based lock, with expiry and renewal. Timing: every register operation
//! of a correct process completes within `δ` ("delta") once the system is stable; the lease
//! lasts `Δ` ("lease"). Every write carries a timestamp that no one else ever writes: the
//! contender's id and its own counter.
//!
//! - **contend**: read `r'`. Then repeat: wait `Δ + 6δ`, read `r''`. If `r'' ≠ r'`, someone
//!   wrote meanwhile (a holder renewing, or a contender), so set `r' = r''` and wait again.
//!   Otherwise the register was quiet for a whole lease: write a fresh timestamp `ts`, wait
//!   `2δ`, read `r`. If `r = ts`, no one overwrote it: hold the lease for `Δ` from now. If not,
//!   back off: `r' = r` and wait again.
//! - **renew**, when the held lease runs out: read. If the register still holds this holder's
//!   last timestamp, write a fresh one, wait `2δ` and read it back. Success holds the lease for
//!   another `Δ`; failure means the lease is lost.
//!
//! Safety: once the system is stable, no two holders overlap. Liveness: a contender
//! eventually holds, and a correct holder that renews on time keeps the lease. The paper
//! proves both (Lemmas 8 to 11); `tests/lwlease_sim.rs` checks them over thousands of seeded
//! runs, and shows that operations slower than `δ` break safety.
//!
//! # Where this follows the paper and where it differs
//! - It follows the ◊ND variant (eventually known delay): contend waits `Δ + 6δ`, and renew
//!   re-reads its own timestamp before it writes. That is the variant that stabilizes to a
//!   single holder even after a period in which the timing bound did not hold. The cheaper ND
//!   renewal (a blind write) is safe only when the bound always held.
//! - Contend always waits at least once before its first write, even when the register is
//!   empty. The paper's figure is not in our copy; this choice only makes a first acquisition
//!   slower, never less safe, because every write still follows a quiet interval of a whole
//!   lease.
//! - The holder's view ends at `return time + Δ`, measured on its own clock. Clocks are assumed
//!   to run at the same rate (the paper's `ρ = 0`). A user with drifting clocks must subtract
//!   the drift over `Δ` from the time it acts on, as with any lease.
//! - There is no release. Stopping renewals lets the lease lapse after `Δ`; the next
//!   contender then needs up to `Δ + 6δ` more to see the register go quiet.
//!
//! # What it must not do
//! Read a clock, touch the register or sleep: the shell (the register runner, [`crate::register`],
//! the simulator) performs each [`Step`] and reports its completion with the time.

use thiserror::Error;

use crate::types::MonoMillis;

/// A value written to the register: who wrote it and its own counter (never written twice).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Stamp {
    pub owner: String,
    pub seq: u64,
}

/// The timing parameters: `δ` bounds one register operation, `Δ` is the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    delta_ms: u64,
    lease_ms: u64,
}

/// Timing parameters that cannot work.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum TimingError {
    #[error("delta must be at least 1 ms")]
    ZeroDelta,
    #[error(
        "the lease ({lease_ms} ms) must be longer than 4 × delta ({delta_ms} ms): a renewal takes up to that long"
    )]
    LeaseTooShort { lease_ms: u64, delta_ms: u64 },
}

impl Timing {
    /// `delta_ms`: the longest one register operation of a correct process takes; `lease_ms`:
    /// how long a successful contend or renew holds the lease.
    pub fn new(delta_ms: u64, lease_ms: u64) -> Result<Self, TimingError> {
        if delta_ms == 0 {
            return Err(TimingError::ZeroDelta);
        }
        if lease_ms <= delta_ms.saturating_mul(4) {
            return Err(TimingError::LeaseTooShort { lease_ms, delta_ms });
        }
        Ok(Timing { delta_ms, lease_ms })
    }

    pub fn delta_ms(&self) -> u64 {
        self.delta_ms
    }

    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }

    /// How long the register must stay quiet before a contender writes.
    fn quiet_ms(&self) -> u64 {
        self.lease_ms + 6 * self.delta_ms
    }
}

/// What the shell must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read the register; report with [`Contender::read_done`].
    Read,
    /// Write this stamp; report with [`Contender::write_done`].
    Write(Stamp),
    /// Do nothing until then; report with [`Contender::woke`].
    SleepUntil(MonoMillis),
    /// The lease is held until then; call [`Contender::renew`] at that time to keep it.
    Hold(MonoMillis),
    /// A renewal failed: someone else wrote. Contend again to try for it.
    Lost,
    /// A report the contender did not ask for (a shell bug): nothing changed; it still waits
    /// for the operation it asked for.
    Busy,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    /// contend: the first read (`r'`).
    FirstRead,
    /// contend: waiting for the register to stay quiet.
    Quiet,
    /// contend: the read after the quiet wait (`r''`).
    QuietRead,
    /// contend or renew: the write, then the `2δ` wait, then the read back.
    Writing {
        renewing: bool,
    },
    Settling {
        renewing: bool,
    },
    ReadBack {
        renewing: bool,
    },
    /// renew: the read of the holder's own last stamp.
    RenewRead,
    Holding {
        until: MonoMillis,
    },
}

/// One contender's side of the lease.
#[derive(Clone, Debug)]
pub struct Contender {
    id: String,
    timing: Timing,
    seq: u64,
    phase: Phase,
    /// `r'`: the register's value when the current quiet wait began.
    seen: Option<Stamp>,
    /// The last stamp this contender wrote.
    mine: Option<Stamp>,
}

impl Contender {
    /// `id` must be unique among everyone who may ever use the register. `seq_start` makes the
    /// counter unique across restarts (e.g. the wall clock in microseconds at start).
    pub fn new(id: impl Into<String>, timing: Timing, seq_start: u64) -> Self {
        Contender {
            id: id.into(),
            timing,
            seq: seq_start,
            phase: Phase::Idle,
            seen: None,
            mine: None,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// Whether the lease is held at `now`.
    pub fn holds(&self, now: MonoMillis) -> bool {
        matches!(self.phase, Phase::Holding { until } if now < until)
    }

    /// Start contending.
    pub fn contend(&mut self) -> Step {
        self.phase = Phase::FirstRead;
        Step::Read
    }

    /// Start renewing the lease held (at its end, `Step::Hold`'s time). Without a lease held,
    /// this is `Lost`.
    /// Take up a lease this contender's id held before (a process that restarted and found
    /// its own stamp `mine` in the register): the next [`Contender::renew`] renews it if the
    /// register still holds exactly that stamp, as any renewal would. Nothing is held until
    /// that renewal succeeds.
    pub fn resume(&mut self, mine: Stamp) {
        self.seq = self.seq.max(mine.seq);
        self.mine = Some(mine);
        self.phase = Phase::Holding {
            until: MonoMillis(0),
        };
    }

    pub fn renew(&mut self) -> Step {
        if !matches!(self.phase, Phase::Holding { .. }) {
            self.phase = Phase::Idle;
            return Step::Lost;
        }
        self.phase = Phase::RenewRead;
        Step::Read
    }

    /// A read returned `value` at `now`.
    pub fn read_done(&mut self, value: Option<Stamp>, now: MonoMillis) -> Step {
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::FirstRead => self.wait_quiet(value, now),
            Phase::QuietRead if value == self.seen => self.write(false),
            Phase::QuietRead => self.wait_quiet(value, now),
            Phase::ReadBack { renewing } => {
                if value.is_some() && value == self.mine {
                    let until = now.plus(self.timing.lease_ms);
                    self.phase = Phase::Holding { until };
                    Step::Hold(until)
                } else if renewing {
                    Step::Lost
                } else {
                    self.wait_quiet(value, now)
                }
            }
            Phase::RenewRead if value.is_some() && value == self.mine => self.write(true),
            Phase::RenewRead => Step::Lost,
            other => {
                // A completion the contender did not ask for: ignore it, keep its state.
                self.phase = other;
                self.pending_step()
            }
        }
    }

    /// The write asked for completed at `now`.
    pub fn write_done(&mut self, now: MonoMillis) -> Step {
        match self.phase {
            Phase::Writing { renewing } => {
                let until = now.plus(2 * self.timing.delta_ms);
                self.phase = Phase::Settling { renewing };
                Step::SleepUntil(until)
            }
            _ => self.pending_step(),
        }
    }

    /// A sleep asked for ended at `now`.
    pub fn woke(&mut self, _now: MonoMillis) -> Step {
        match self.phase {
            Phase::Quiet => {
                self.phase = Phase::QuietRead;
                Step::Read
            }
            Phase::Settling { renewing } => {
                self.phase = Phase::ReadBack { renewing };
                Step::Read
            }
            _ => self.pending_step(),
        }
    }

    fn wait_quiet(&mut self, value: Option<Stamp>, now: MonoMillis) -> Step {
        self.seen = value;
        self.phase = Phase::Quiet;
        Step::SleepUntil(now.plus(self.timing.quiet_ms()))
    }

    fn write(&mut self, renewing: bool) -> Step {
        self.seq += 1;
        let stamp = Stamp {
            owner: self.id.clone(),
            seq: self.seq,
        };
        self.mine = Some(stamp.clone());
        self.phase = Phase::Writing { renewing };
        Step::Write(stamp)
    }

    /// What the contender is waiting for, for a completion it did not expect.
    fn pending_step(&self) -> Step {
        match &self.phase {
            Phase::Holding { until } => Step::Hold(*until),
            Phase::Idle => Step::Lost,
            _ => Step::Busy,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_contender_renews_only_its_own_unchanged_stamp() {
        let timing = Timing::new(10, 100).unwrap();
        let old = Stamp {
            owner: "a".into(),
            seq: 41,
        };
        let mut a = Contender::new("a", timing, 0);
        a.resume(old.clone());
        assert!(
            !a.holds(MonoMillis(1)),
            "nothing is held before the renewal"
        );
        assert_eq!(a.renew(), Step::Read);
        let Step::Write(fresh) = a.read_done(Some(old.clone()), MonoMillis(5)) else {
            panic!("the renewal writes");
        };
        assert!(fresh.seq > old.seq && fresh.owner == "a");
        // Someone else wrote meanwhile: the resumed lease is lost.
        let mut b = Contender::new("a", timing, 0);
        b.resume(old);
        b.renew();
        let other = Stamp {
            owner: "c".into(),
            seq: 1,
        };
        assert_eq!(b.read_done(Some(other), MonoMillis(5)), Step::Lost);
    }

    fn stamp(owner: &str, seq: u64) -> Option<Stamp> {
        Some(Stamp {
            owner: owner.into(),
            seq,
        })
    }

    #[test]
    fn timing_is_validated() {
        assert_eq!(Timing::new(0, 100), Err(TimingError::ZeroDelta));
        assert!(matches!(
            Timing::new(10, 40),
            Err(TimingError::LeaseTooShort { .. })
        ));
        assert!(Timing::new(10, 41).is_ok());
    }

    #[test]
    fn an_uncontended_contender_acquires_after_one_quiet_lease_and_renews() {
        let t = Timing::new(10, 100).unwrap();
        let mut c = Contender::new("a", t, 0);
        assert_eq!(c.contend(), Step::Read);
        assert_eq!(
            c.read_done(None, MonoMillis(5)),
            Step::SleepUntil(MonoMillis(165))
        );
        assert_eq!(c.woke(MonoMillis(165)), Step::Read);
        assert_eq!(
            c.read_done(None, MonoMillis(170)),
            Step::Write(stamp("a", 1).unwrap())
        );
        assert_eq!(
            c.write_done(MonoMillis(175)),
            Step::SleepUntil(MonoMillis(195))
        );
        assert_eq!(c.woke(MonoMillis(195)), Step::Read);
        assert_eq!(
            c.read_done(stamp("a", 1), MonoMillis(199)),
            Step::Hold(MonoMillis(299))
        );
        assert!(c.holds(MonoMillis(298)) && !c.holds(MonoMillis(299)));
        // Renewal: the register still holds our stamp.
        assert_eq!(c.renew(), Step::Read);
        assert_eq!(
            c.read_done(stamp("a", 1), MonoMillis(301)),
            Step::Write(stamp("a", 2).unwrap())
        );
        assert_eq!(
            c.write_done(MonoMillis(305)),
            Step::SleepUntil(MonoMillis(325))
        );
        assert_eq!(c.woke(MonoMillis(325)), Step::Read);
        assert_eq!(
            c.read_done(stamp("a", 2), MonoMillis(330)),
            Step::Hold(MonoMillis(430))
        );
    }

    #[test]
    fn a_write_seen_during_the_quiet_wait_restarts_it_and_an_overwrite_loses_a_renewal() {
        let t = Timing::new(10, 100).unwrap();
        let mut c = Contender::new("a", t, 0);
        c.contend();
        c.read_done(stamp("b", 1), MonoMillis(0));
        c.woke(MonoMillis(160));
        // b renewed meanwhile: wait a whole quiet interval again.
        assert_eq!(
            c.read_done(stamp("b", 2), MonoMillis(161)),
            Step::SleepUntil(MonoMillis(321))
        );
        c.woke(MonoMillis(321));
        c.read_done(stamp("b", 2), MonoMillis(322));
        c.write_done(MonoMillis(325));
        c.woke(MonoMillis(345));
        // b's write landed over ours: back off.
        assert_eq!(
            c.read_done(stamp("b", 3), MonoMillis(346)),
            Step::SleepUntil(MonoMillis(506))
        );
        // A holder whose register was overwritten loses at renewal.
        let mut h = Contender::new("h", t, 0);
        h.phase = Phase::Holding {
            until: MonoMillis(10),
        };
        h.mine = stamp("h", 7);
        assert_eq!(h.renew(), Step::Read);
        assert_eq!(h.read_done(stamp("x", 1), MonoMillis(11)), Step::Lost);
        assert!(!h.holds(MonoMillis(11)));
    }
}
