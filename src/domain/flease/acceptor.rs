//! The acceptor: one round-based register cell per resource, volatile.
//!
//! # Rules (Boichat's register, brief section 7.5)
//! - `Read(k)`: NACK if `read_k >= k` or `write_k >= k`; else promise (`read_k = k`) and answer
//!   with `(write_k, value, epoch)`.
//! - `Write(k, v)`: NACK if `read_k > k` or `write_k > k`; else accept (`write_k = k`, value `v`).
//! - `Release(grant_k, owner)`: if the accepted value is `owner`'s lease written at `grant_k`, it
//!   becomes `Released` (ballots unchanged); always acknowledged (idempotent).
//!
//! # Admission (before any rule)
//! - A restarted acceptor (or one whose membership changed) answers nothing until its restart
//!   wait has passed on its monotonic clock: it has forgotten its promises.
//! - A message older than `msg_max_age`, or stamped more than `eps` in the future, is dropped
//!   (the latter counts as a clock-skew suspicion).
//!
//! # Memory
//! A cell is created on first contact and collected once idle for `cell_gc_idle` with a free
//! value: collecting it makes the acceptor blank for that resource, which is as safe as a
//! restart because by then no lease it held can still be valid.

use std::collections::HashMap;

use super::{Ballot, Envelope, Epoch, FleaseConfig, Judgement, Msg, Now, ResourceId, Slot, judge};
use crate::domain::types::{MonoMillis, NodeId};

#[derive(Clone, Debug, Default)]
struct Cell {
    read_k: Ballot,
    write_k: Ballot,
    value: Slot,
    /// The highest epoch this acceptor has accepted for the resource.
    epoch: Epoch,
    last_touch: MonoMillis,
}

/// Counters of what an acceptor refused or noticed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AcceptorStats {
    pub nacks: u64,
    pub dropped_recovering: u64,
    pub dropped_stale: u64,
    pub skew_suspicions: u64,
}

/// This node's acceptor for every resource.
#[derive(Debug)]
pub struct Acceptor {
    me: NodeId,
    cfg: FleaseConfig,
    /// Silent until then (restart or membership change).
    recovering_until: MonoMillis,
    cells: HashMap<ResourceId, Cell>,
    stats: AcceptorStats,
}

impl Acceptor {
    /// A freshly started acceptor: silent for the restart wait.
    pub fn new(me: NodeId, cfg: FleaseConfig, now: Now) -> Self {
        Acceptor {
            me,
            cfg,
            recovering_until: now.mono.plus(cfg.restart_wait_ms),
            cells: HashMap::new(),
            stats: AcceptorStats::default(),
        }
    }

    /// The membership changed: forget everything and stay silent for the restart wait again.
    pub fn rearm(&mut self, now: Now) {
        self.cells.clear();
        self.recovering_until = now.mono.plus(self.cfg.restart_wait_ms);
    }

    /// Whether the restart wait is still running.
    pub fn is_recovering(&self, now: Now) -> bool {
        now.mono < self.recovering_until
    }

    pub fn stats(&self) -> AcceptorStats {
        self.stats
    }

    /// Cells held.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }

    /// What this acceptor last accepted for a resource (local knowledge, for inspection).
    pub fn accepted(&self, resource: &str) -> Option<&Slot> {
        self.cells.get(resource).map(|c| &c.value)
    }

    /// Handle one message; the reply, if any.
    pub fn on_message(&mut self, env: &Envelope, now: Now) -> Option<Envelope> {
        if now.mono < self.recovering_until {
            self.stats.dropped_recovering += 1;
            return None;
        }
        if now.wall.0 > env.sent_at.0.saturating_add(self.cfg.msg_max_age_ms) {
            self.stats.dropped_stale += 1;
            return None;
        }
        if env.sent_at.0 > now.wall.0.saturating_add(self.cfg.eps_ms) {
            self.stats.skew_suspicions += 1;
            return None;
        }
        let body = match &env.body {
            Msg::Read { k } => {
                let cell = self.cells.entry(env.resource.clone()).or_default();
                cell.last_touch = now.mono;
                if cell.read_k >= *k || cell.write_k >= *k {
                    self.stats.nacks += 1;
                    Msg::ReadNack {
                        k: *k,
                        seen: cell.read_k.max(cell.write_k),
                    }
                } else {
                    cell.read_k = *k;
                    Msg::ReadAck {
                        k: *k,
                        write_k: cell.write_k,
                        value: cell.value.clone(),
                        epoch: cell.epoch.max(cell.value.epoch()),
                    }
                }
            }
            Msg::Write { k, value } => {
                let cell = self.cells.entry(env.resource.clone()).or_default();
                cell.last_touch = now.mono;
                if cell.read_k > *k || cell.write_k > *k {
                    self.stats.nacks += 1;
                    Msg::WriteNack {
                        k: *k,
                        seen: cell.read_k.max(cell.write_k),
                    }
                } else {
                    cell.write_k = *k;
                    cell.read_k = cell.read_k.max(*k);
                    cell.epoch = cell.epoch.max(value.epoch());
                    cell.value = value.clone();
                    Msg::WriteAck { k: *k }
                }
            }
            Msg::Release { grant_k, owner } => {
                let mut released = false;
                if let Some(cell) = self.cells.get_mut(&env.resource) {
                    cell.last_touch = now.mono;
                    if cell.write_k == *grant_k {
                        match &cell.value {
                            Slot::Lease {
                                owner: held, epoch, ..
                            } if held == owner => {
                                cell.value = Slot::Released { epoch: *epoch };
                                released = true;
                            }
                            // A duplicate of a release already applied.
                            Slot::Released { .. } => released = true,
                            _ => {}
                        }
                    }
                }
                Msg::ReleaseAck {
                    grant_k: *grant_k,
                    released,
                }
            }
            // Replies are for proposers.
            Msg::ReadAck { .. }
            | Msg::ReadNack { .. }
            | Msg::WriteAck { .. }
            | Msg::WriteNack { .. }
            | Msg::ReleaseAck { .. } => return None,
        };
        Some(Envelope {
            resource: env.resource.clone(),
            from: self.me,
            to: env.from,
            sent_at: now.wall,
            body,
        })
    }

    /// Drop cells idle for `cell_gc_idle` whose value is free by then; returns how many.
    pub fn collect_idle(&mut self, now: Now) -> usize {
        let before = self.cells.len();
        let (idle, eps) = (self.cfg.cell_gc_idle_ms, self.cfg.eps_ms);
        self.cells.retain(|_, c| {
            now.mono.0.saturating_sub(c.last_touch.0) < idle
                || !matches!(judge(&c.value, now.wall, eps), Judgement::Free)
        });
        before - self.cells.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::types::WallMillis;

    const CFG: FleaseConfig = super::super::TEST_CONFIG;

    fn k(counter: u32) -> Ballot {
        Ballot {
            era: 1,
            counter,
            boot: 0,
            node: 9,
        }
    }

    fn at(ms: u64) -> Now {
        Now {
            wall: WallMillis(ms),
            mono: MonoMillis(ms),
        }
    }

    fn env(body: Msg, sent_at: u64) -> Envelope {
        Envelope {
            resource: "r".into(),
            from: 9,
            to: 1,
            sent_at: WallMillis(sent_at),
            body,
        }
    }

    fn ready() -> Acceptor {
        Acceptor::new(1, CFG, at(0))
    }

    fn send(a: &mut Acceptor, body: Msg, t: u64) -> Option<Msg> {
        a.on_message(&env(body, t), at(t)).map(|e| e.body)
    }

    fn lease(epoch: u64) -> Slot {
        Slot::Lease {
            owner: "o".into(),
            expires: WallMillis(10_000),
            epoch,
        }
    }

    #[test]
    fn silent_during_the_restart_wait() {
        let mut a = ready();
        assert_eq!(send(&mut a, Msg::Read { k: k(1) }, 2499), None);
        assert!(matches!(
            send(&mut a, Msg::Read { k: k(1) }, 2500),
            Some(Msg::ReadAck { .. })
        ));
        a.rearm(at(3000));
        assert_eq!(send(&mut a, Msg::Read { k: k(2) }, 3100), None);
    }

    #[test]
    fn register_rules_for_equal_and_lower_ballots() {
        let mut a = ready();
        let t = 3000;
        assert!(matches!(
            send(&mut a, Msg::Read { k: k(5) }, t),
            Some(Msg::ReadAck { .. })
        ));
        // A read with the same ballot is refused; a write with it is accepted.
        assert!(matches!(
            send(&mut a, Msg::Read { k: k(5) }, t),
            Some(Msg::ReadNack { .. })
        ));
        assert_eq!(
            send(
                &mut a,
                Msg::Write {
                    k: k(5),
                    value: lease(3)
                },
                t
            ),
            Some(Msg::WriteAck { k: k(5) })
        );
        // Lower ballots are refused in both phases, and the NACK says what was seen.
        assert_eq!(
            send(
                &mut a,
                Msg::Write {
                    k: k(4),
                    value: lease(4)
                },
                t
            ),
            Some(Msg::WriteNack {
                k: k(4),
                seen: k(5)
            })
        );
        assert!(matches!(
            send(&mut a, Msg::Read { k: k(4) }, t),
            Some(Msg::ReadNack { .. })
        ));
        // A higher read sees the accepted value and its epoch.
        assert_eq!(
            send(&mut a, Msg::Read { k: k(6) }, t),
            Some(Msg::ReadAck {
                k: k(6),
                write_k: k(5),
                value: lease(3),
                epoch: 3
            })
        );
        // After promising k(6), a write at k(5) is refused.
        assert!(matches!(
            send(
                &mut a,
                Msg::Write {
                    k: k(5),
                    value: lease(9)
                },
                t
            ),
            Some(Msg::WriteNack { .. })
        ));
    }

    #[test]
    fn stale_and_future_messages_are_dropped() {
        let mut a = ready();
        let now = at(5000);
        assert_eq!(a.on_message(&env(Msg::Read { k: k(1) }, 4699), now), None);
        assert_eq!(a.on_message(&env(Msg::Read { k: k(1) }, 5051), now), None);
        assert_eq!(a.stats().skew_suspicions, 1);
        assert_eq!(a.stats().dropped_stale, 1);
        assert!(
            a.on_message(&env(Msg::Read { k: k(1) }, 4700), now)
                .is_some()
        );
    }

    #[test]
    fn release_frees_only_the_matching_grant() {
        let mut a = ready();
        let t = 3000;
        send(
            &mut a,
            Msg::Write {
                k: k(5),
                value: lease(3),
            },
            t,
        );
        // Wrong grant, wrong owner: nothing changes (still acknowledged).
        send(
            &mut a,
            Msg::Release {
                grant_k: k(4),
                owner: "o".into(),
            },
            t,
        );
        send(
            &mut a,
            Msg::Release {
                grant_k: k(5),
                owner: "x".into(),
            },
            t,
        );
        assert_eq!(a.accepted("r"), Some(&lease(3)));
        assert_eq!(
            send(
                &mut a,
                Msg::Release {
                    grant_k: k(5),
                    owner: "o".into()
                },
                t
            ),
            Some(Msg::ReleaseAck {
                grant_k: k(5),
                released: true
            })
        );
        assert_eq!(a.accepted("r"), Some(&Slot::Released { epoch: 3 }));
    }

    #[test]
    fn idle_free_cells_are_collected_and_live_leases_kept() {
        let mut a = ready();
        send(&mut a, Msg::Read { k: k(1) }, 3000);
        let mut b = Envelope {
            resource: "held".into(),
            ..env(
                Msg::Write {
                    k: k(1),
                    value: lease(1),
                },
                3000,
            )
        };
        a.on_message(&b, at(3000));
        assert_eq!(a.len(), 2);
        assert_eq!(a.collect_idle(at(6999)), 0);
        // "r" is idle and empty; "held" is idle but its lease runs until 10 000.
        assert_eq!(a.collect_idle(at(7000)), 1);
        assert!(a.accepted("held").is_some());
        b.body = Msg::Read { k: k(2) };
        assert_eq!(a.collect_idle(at(10_051)), 1);
        assert!(a.is_empty());
    }
}
