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
//! # PaxosLease ([`Protocol::PaxosLease`])
//! The same rules with timespans: a written `Span` is kept as `Timed` until this acceptor's own
//! monotonic clock passes the span (counted from receipt), and is forgotten then, before any
//! rule looks at it (the epoch is remembered). Replies report the time left as a `Span`. No
//! message is judged by its wall-clock stamp. A value of the other protocol is refused.
//!
//! # Memory
//! A cell is created on first contact and collected once idle for `cell_gc_idle` with a free
//! value: collecting it makes the acceptor blank for that resource, which is as safe as a
//! restart because by then no lease it held can still be valid. Cells are compact because a node
//! may hold millions: a slab of fixed-size cells that hold their names, found through a hash
//! table of slot numbers (4 bytes per entry); owners interned (one allocation per owner, shared
//! by every cell it holds); the promise stored apart only while it is above the accepted ballot.

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::sync::Arc;

use hashbrown::HashTable;

use super::{Ballot, Envelope, Epoch, FleaseConfig, Judgement, Msg, Now, Protocol, Slot, judge};
use crate::domain::types::{MonoMillis, NodeId, WallMillis};

/// What a cell's value is (the owner and time live beside it in the cell).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    #[default]
    Empty,
    /// Flease: `until` is the wall-clock expiry.
    Lease,
    Released,
    /// PaxosLease: `until` is this acceptor's monotonic deadline.
    Timed,
}

#[derive(Clone, Debug, Default)]
struct Cell {
    /// The resource (empty in a free slot).
    name: Box<str>,
    write_k: Ballot,
    /// The promise, when above `write_k` (a promise at or below it is implied by the write).
    promised: Option<Box<Ballot>>,
    owner: Option<Arc<str>>,
    until: u64,
    /// The accepted value's epoch.
    value_epoch: Epoch,
    /// The highest epoch this acceptor has accepted for the resource.
    max_epoch: Epoch,
    /// Monotonic seconds of the last message (collection is coarse).
    last_touch_s: u32,
    kind: Kind,
}

impl Cell {
    fn read_k(&self) -> Ballot {
        self.promised.as_deref().copied().unwrap_or(self.write_k)
    }

    fn promise(&mut self, k: Ballot) {
        self.promised = (k > self.write_k).then(|| Box::new(k));
    }

    /// Accept `value` at `k`; `owner` is its owner, interned.
    fn accept(&mut self, k: Ballot, value: &Slot, owner: Option<Arc<str>>, now: Now) {
        let read_k = self.read_k().max(k);
        self.write_k = k;
        self.promise(read_k);
        self.max_epoch = self.max_epoch.max(value.epoch());
        self.value_epoch = value.epoch();
        let (kind, until) = match value {
            Slot::Empty => (Kind::Empty, 0),
            Slot::Released { .. } => (Kind::Released, 0),
            Slot::Lease { expires, .. } => (Kind::Lease, expires.0),
            Slot::Span { span_ms, .. } => (Kind::Timed, now.mono.0.saturating_add(*span_ms)),
            Slot::Timed { until, .. } => (Kind::Timed, until.0),
        };
        self.kind = kind;
        self.owner = owner;
        self.until = until;
    }

    /// The accepted value in its stored form.
    fn value(&self) -> Slot {
        let owner = || self.owner.as_deref().unwrap_or_default().to_string();
        let epoch = self.value_epoch;
        match self.kind {
            Kind::Empty => Slot::Empty,
            Kind::Released => Slot::Released { epoch },
            Kind::Lease => Slot::Lease {
                owner: owner(),
                expires: WallMillis(self.until),
                epoch,
            },
            Kind::Timed => Slot::Timed {
                owner: owner(),
                until: MonoMillis(self.until),
                epoch,
            },
        }
    }

    /// The accepted value as sent: PaxosLease values as the time left.
    fn wire_value(&self, now: Now) -> Slot {
        match self.value() {
            Slot::Timed {
                owner,
                until,
                epoch,
            } => Slot::Span {
                owner,
                span_ms: until.0.saturating_sub(now.mono.0),
                epoch,
            },
            v => v,
        }
    }

    /// PaxosLease: forget a value whose timer fired.
    fn expire(&mut self, now: Now) {
        if self.kind == Kind::Timed && now.mono.0 >= self.until {
            self.kind = Kind::Empty;
            self.owner = None;
            self.until = 0;
        }
    }

    fn is_free(&self, now: Now, eps_ms: u64) -> bool {
        match self.kind {
            Kind::Empty | Kind::Released => true,
            Kind::Timed => now.mono.0 >= self.until,
            Kind::Lease => matches!(judge(&self.value(), now.wall, eps_ms), Judgement::Free),
        }
    }
}

/// Counters of what an acceptor refused or noticed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AcceptorStats {
    pub nacks: u64,
    pub dropped_recovering: u64,
    pub dropped_stale: u64,
    pub skew_suspicions: u64,
    /// Writes of the other protocol's values.
    pub refused_values: u64,
}

/// This node's acceptor for every resource of one protocol.
#[derive(Debug)]
pub struct Acceptor {
    me: NodeId,
    cfg: FleaseConfig,
    proto: Protocol,
    /// Silent until then (restart or membership change).
    recovering_until: MonoMillis,
    /// Slots in `cells`, hashed by the cell's name.
    index: HashTable<u32>,
    hasher: hashbrown::DefaultHashBuilder,
    cells: Vec<Cell>,
    /// Slots of collected cells, reused first.
    free: Vec<u32>,
    /// Every owner some cell holds, once.
    owners: HashSet<Arc<str>>,
    stats: AcceptorStats,
}

impl Acceptor {
    /// A freshly started Flease acceptor: silent for the restart wait.
    pub fn new(me: NodeId, cfg: FleaseConfig, now: Now) -> Self {
        Self::for_protocol(Protocol::Flease, me, cfg, now)
    }

    /// A freshly started acceptor of `proto`: silent for the restart wait.
    pub fn for_protocol(proto: Protocol, me: NodeId, cfg: FleaseConfig, now: Now) -> Self {
        Acceptor {
            me,
            cfg,
            proto,
            recovering_until: now.mono.plus(cfg.restart_wait_ms),
            index: HashTable::new(),
            hasher: Default::default(),
            cells: Vec::new(),
            free: Vec::new(),
            owners: HashSet::new(),
            stats: AcceptorStats::default(),
        }
    }

    pub fn protocol(&self) -> Protocol {
        self.proto
    }

    /// The membership changed: forget everything and stay silent for the restart wait again.
    pub fn rearm(&mut self, now: Now) {
        self.index = HashTable::new();
        self.cells = Vec::new();
        self.free = Vec::new();
        self.owners = HashSet::new();
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
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// What this acceptor last accepted for a resource, in its stored form (local knowledge,
    /// for inspection; PaxosLease values as `Timed`, possibly past their timer).
    pub fn accepted(&self, resource: &str) -> Option<Slot> {
        self.slot(resource).map(|i| self.cells[i].value())
    }

    /// What this acceptor alone knows of `resource` now: (holder, how long it may still act as
    /// seen from here, already reduced by `eps`, epoch). A hint, not a quorum read: for Flease
    /// judged on this wall clock, for PaxosLease by this acceptor's own timer.
    pub fn local_view(&self, resource: &str, now: Now) -> (Option<String>, u64, Epoch) {
        let Some(i) = self.slot(resource) else {
            return (None, 0, 0);
        };
        let cell = &self.cells[i];
        let eps = self.cfg.eps_ms;
        match (cell.kind, cell.owner.as_deref()) {
            (Kind::Timed, Some(owner)) if now.mono.0 < cell.until => (
                Some(owner.to_string()),
                (cell.until - now.mono.0).saturating_sub(eps),
                cell.value_epoch,
            ),
            (Kind::Lease, _) => match judge(&cell.value(), now.wall, eps) {
                Judgement::HeldBy {
                    owner,
                    expires,
                    epoch,
                } => (
                    Some(owner),
                    expires.0.saturating_sub(now.wall.0 + eps),
                    epoch,
                ),
                _ => (None, 0, cell.value_epoch),
            },
            _ => (None, 0, cell.value_epoch),
        }
    }

    /// The slot of `resource`'s cell.
    fn slot(&self, resource: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(resource);
        self.index
            .find(hash, |i| &*self.cells[*i as usize].name == resource)
            .map(|i| *i as usize)
    }

    /// The shared copy of `owner`.
    fn intern(&mut self, owner: &str) -> Arc<str> {
        if let Some(o) = self.owners.get(owner) {
            return o.clone();
        }
        let o: Arc<str> = Arc::from(owner);
        self.owners.insert(o.clone());
        o
    }

    /// The ballot and owner of this acceptor's accepted lease of `resource`, if one is held now
    /// (for a release through the committing ballot).
    pub fn held_by(&self, resource: &str, now: Now) -> Option<(Ballot, &str)> {
        let cell = &self.cells[self.slot(resource)?];
        match cell.kind {
            Kind::Lease | Kind::Timed if !cell.is_free(now, 0) => {
                Some((cell.write_k, cell.owner.as_deref()?))
            }
            _ => None,
        }
    }

    fn cell_mut(&mut self, resource: &str) -> &mut Cell {
        let slot = match self.slot(resource) {
            Some(i) => i,
            None => {
                let i = match self.free.pop() {
                    Some(i) => i,
                    None => {
                        self.cells.push(Cell::default());
                        (self.cells.len() - 1) as u32
                    }
                };
                self.cells[i as usize].name = resource.into();
                let (cells, hasher) = (&self.cells, &self.hasher);
                let hash = hasher.hash_one(resource);
                self.index
                    .insert_unique(hash, i, |j| hasher.hash_one(&*cells[*j as usize].name));
                i as usize
            }
        };
        &mut self.cells[slot]
    }

    /// Handle one message; the reply, if any.
    pub fn on_message(&mut self, env: &Envelope, now: Now) -> Option<Envelope> {
        if env.proto != self.proto {
            return None;
        }
        if now.mono < self.recovering_until {
            self.stats.dropped_recovering += 1;
            return None;
        }
        if self.proto == Protocol::Flease {
            if now.wall.0 > env.sent_at.0.saturating_add(self.cfg.msg_max_age_ms) {
                self.stats.dropped_stale += 1;
                return None;
            }
            if env.sent_at.0 > now.wall.0.saturating_add(self.cfg.eps_ms) {
                self.stats.skew_suspicions += 1;
                return None;
            }
        }
        let touch = (now.mono.0 / 1000) as u32;
        let body = match &env.body {
            Msg::Read { k } => {
                let cell = self.cell_mut(&env.resource);
                cell.last_touch_s = touch;
                cell.expire(now);
                let seen = cell.read_k().max(cell.write_k);
                if seen >= *k {
                    self.stats.nacks += 1;
                    Msg::ReadNack { k: *k, seen }
                } else {
                    cell.promise(*k);
                    Msg::ReadAck {
                        k: *k,
                        write_k: cell.write_k,
                        value: cell.wire_value(now),
                        epoch: cell.max_epoch.max(cell.value_epoch),
                    }
                }
            }
            Msg::Write { k, value } => {
                let fits = match value {
                    Slot::Released { .. } => true,
                    Slot::Lease { .. } => self.proto == Protocol::Flease,
                    Slot::Span { .. } => self.proto == Protocol::PaxosLease,
                    Slot::Empty | Slot::Timed { .. } => false,
                };
                if !fits {
                    self.stats.refused_values += 1;
                    return None;
                }
                let owner = match value {
                    Slot::Lease { owner, .. } | Slot::Span { owner, .. } => Some(owner.as_str()),
                    _ => None,
                };
                let owner = owner.map(|o| self.intern(o));
                let cell = self.cell_mut(&env.resource);
                cell.last_touch_s = touch;
                cell.expire(now);
                let seen = cell.read_k().max(cell.write_k);
                if seen > *k {
                    self.stats.nacks += 1;
                    Msg::WriteNack { k: *k, seen }
                } else {
                    cell.accept(*k, value, owner, now);
                    Msg::WriteAck { k: *k }
                }
            }
            Msg::Release { grant_k, owner } => {
                let mut released = false;
                if let Some(i) = self.slot(&env.resource) {
                    let cell = &mut self.cells[i];
                    cell.last_touch_s = touch;
                    cell.expire(now);
                    if cell.write_k == *grant_k {
                        match cell.kind {
                            Kind::Lease | Kind::Timed
                                if cell.owner.as_deref() == Some(owner.as_str()) =>
                            {
                                cell.kind = Kind::Released;
                                cell.owner = None;
                                cell.until = 0;
                                released = true;
                            }
                            // A duplicate of a release already applied.
                            Kind::Released => released = true,
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
            proto: self.proto,
            resource: env.resource.clone(),
            from: self.me,
            to: env.from,
            sent_at: now.wall,
            body,
        })
    }

    /// Drop cells idle for `cell_gc_idle` whose value is free by then; returns how many.
    pub fn collect_idle(&mut self, now: Now) -> usize {
        let before = self.index.len();
        // Touches are kept in whole seconds: one more second keeps the idle time at least as long
        // as configured.
        let idle_s = self.cfg.cell_gc_idle_ms.div_ceil(1000) + 1;
        let now_s = now.mono.0 / 1000;
        let eps = self.cfg.eps_ms;
        let (cells, free) = (&mut self.cells, &mut self.free);
        self.index.retain(|i| {
            let cell = &mut cells[*i as usize];
            let keep =
                now_s.saturating_sub(cell.last_touch_s as u64) < idle_s || !cell.is_free(now, eps);
            if !keep {
                *cell = Cell::default();
                free.push(*i);
            }
            keep
        });
        // Owners no cell holds any more (the set's own reference is the last).
        self.owners.retain(|o| Arc::strong_count(o) > 1);
        before - self.index.len()
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

    use crate::domain::flease::test_at as at;

    fn env(body: Msg, sent_at: u64) -> Envelope {
        Envelope {
            proto: Protocol::Flease,
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
        assert_eq!(a.accepted("r"), Some(lease(3)));
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
        assert_eq!(a.accepted("r"), Some(Slot::Released { epoch: 3 }));
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
        assert_eq!(a.collect_idle(at(7999)), 0);
        // "r" is idle and empty; "held" is idle but its lease runs until 10 000.
        assert_eq!(a.collect_idle(at(8000)), 1);
        assert!(a.accepted("held").is_some());
        b.body = Msg::Read { k: k(2) };
        assert_eq!(a.collect_idle(at(10_051)), 1);
        assert!(a.is_empty());
    }

    #[test]
    fn the_local_view_reports_held_time_less_eps_for_both_protocols() {
        let mut a = ready();
        send(
            &mut a,
            Msg::Write {
                k: k(5),
                value: lease(3),
            },
            3000,
        );
        // Flease: held until 10 000 on the wall clock, minus eps 50; free from then on.
        assert_eq!(a.local_view("r", at(9000)), (Some("o".into()), 950, 3));
        assert_eq!(a.local_view("r", at(9960)), (Some("o".into()), 0, 3));
        assert_eq!(a.local_view("r", at(10_000)), (None, 0, 3));
        assert_eq!(a.local_view("missing", at(0)), (None, 0, 0));
        // PaxosLease: held for the span from receipt on this acceptor's monotonic clock.
        let mut p = Acceptor::for_protocol(Protocol::PaxosLease, 1, CFG, at(0));
        let span = Envelope {
            proto: Protocol::PaxosLease,
            ..env(
                Msg::Write {
                    k: k(5),
                    value: Slot::Span {
                        owner: "o".into(),
                        span_ms: 2000,
                        epoch: 4,
                    },
                },
                3000,
            )
        };
        p.on_message(&span, at(3000));
        assert_eq!(p.local_view("r", at(4000)), (Some("o".into()), 950, 4));
        assert_eq!(p.local_view("r", at(5000)), (None, 0, 4));
    }

    #[test]
    fn paxoslease_cells_are_collected_only_after_their_timer() {
        let mut p = Acceptor::for_protocol(Protocol::PaxosLease, 1, CFG, at(0));
        let write = |span_ms| Envelope {
            proto: Protocol::PaxosLease,
            ..env(
                Msg::Write {
                    k: k(1),
                    value: Slot::Span {
                        owner: "o".into(),
                        span_ms,
                        epoch: 1,
                    },
                },
                3000,
            )
        };
        // A value timed for far longer than the idle period is kept while its timer runs.
        p.on_message(&write(60_000), at(3000));
        assert_eq!(p.collect_idle(at(62_999)), 0);
        assert_eq!(p.collect_idle(at(63_000)), 1);
        assert!(p.is_empty());
    }
}
