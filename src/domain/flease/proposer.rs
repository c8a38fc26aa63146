//! The proposer: one round (read phase, then write phase) for one owner and one resource.
//!
//! A [`Round`] is pure: it takes replies and clock readings and returns what to do. The shell
//! keeps rounds, timers and retries (with backoff and a fresh, higher ballot each time).
//!
//! # Quorum accounting
//! Only acknowledgements for this round's ballot, from distinct members, count. A single NACK
//! aborts the phase whatever the order of arrival: once any acceptor refused `k`, a write at `k`
//! may not commit everywhere it needs to, and the round retries above what that acceptor saw.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{Ballot, Envelope, Epoch, FleaseConfig, Judgement, Msg, Now, ResourceId, Slot, judge};
use crate::domain::types::{MonoMillis, NodeId, WallMillis};

/// What the round is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Intent {
    /// Take the lease, or renew it if this owner holds it.
    Acquire,
    /// Give it up: mark this owner's lease released (the owner has stopped already).
    Release,
}

/// A committed lease of this round's owner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub resource: ResourceId,
    pub owner: String,
    /// The fencing token: strictly increasing from one tenure to the next, kept by renewals.
    pub epoch: Epoch,
    /// The ballot that committed it.
    pub ballot: Ballot,
    /// The absolute expiry others judge by (they take over only past `expires + eps`).
    pub expires: WallMillis,
    /// The holder may act until then, on this node's monotonic clock (`t_max - eps` after the
    /// round started).
    pub valid_until: MonoMillis,
    /// The round started at this monotonic time (`valid_ms` counts from it).
    pub started: MonoMillis,
}

/// Why a round must be retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryWhy {
    /// An acceptor had promised a higher ballot.
    Nack,
    /// No quorum answered within the round timeout.
    Timeout,
    /// The last lease is expired on this clock but maybe not on others': wait for it.
    InDoubt,
    /// Too little was left to renew: let it lapse, then acquire afresh (new epoch).
    TooLate,
}

/// What the shell must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoundEvent {
    /// Keep waiting for replies (or the deadline).
    Pending,
    /// Send these.
    Send(Vec<Envelope>),
    /// The owner holds the lease.
    Granted(Grant),
    /// Someone else holds it (their value was written back unchanged).
    Busy {
        owner: String,
        expires: WallMillis,
        epoch: Epoch,
    },
    /// This owner's lease was released (committed): anyone may acquire now.
    Released { epoch: Epoch },
    /// A release found no lease of this owner: nothing to do.
    NotHeld,
    /// Retry with a ballot above `seen`, not before `not_before` (wall clock for doubt windows,
    /// else immediately after a backoff the shell chooses).
    Retry {
        why: RetryWhy,
        seen: Ballot,
        not_before: Option<WallMillis>,
    },
}

#[derive(Clone, Debug)]
enum Phase {
    Reading {
        acks: BTreeMap<NodeId, (Ballot, Slot, Epoch)>,
    },
    Writing {
        value: Slot,
        acks: BTreeSet<NodeId>,
    },
    Done,
}

/// One round for `owner` on `resource`.
#[derive(Clone, Debug)]
pub struct Round {
    me: NodeId,
    resource: ResourceId,
    owner: String,
    intent: Intent,
    members: Vec<NodeId>,
    cfg: FleaseConfig,
    k: Ballot,
    /// Wall and monotonic clocks when the round started (before its first message).
    t0: WallMillis,
    m0: MonoMillis,
    deadline: MonoMillis,
    phase: Phase,
}

impl Round {
    /// Start an acquire round with ballot `k`: the `Read`s to send to every member (self
    /// included: the shell routes those to the local acceptor like any message).
    pub fn start(
        me: NodeId,
        resource: &str,
        owner: &str,
        members: &[NodeId],
        k: Ballot,
        cfg: FleaseConfig,
        now: Now,
    ) -> (Round, Vec<Envelope>) {
        Self::start_for(Intent::Acquire, me, resource, owner, members, k, cfg, now)
    }

    /// Start a round for `intent`.
    #[allow(clippy::too_many_arguments)]
    pub fn start_for(
        intent: Intent,
        me: NodeId,
        resource: &str,
        owner: &str,
        members: &[NodeId],
        k: Ballot,
        cfg: FleaseConfig,
        now: Now,
    ) -> (Round, Vec<Envelope>) {
        let round = Round {
            me,
            resource: resource.to_string(),
            owner: owner.to_string(),
            intent,
            members: members.to_vec(),
            cfg,
            k,
            t0: now.wall,
            m0: now.mono,
            deadline: now.mono.plus(cfg.round_timeout_ms),
            phase: Phase::Reading {
                acks: BTreeMap::new(),
            },
        };
        let msgs = round.broadcast(Msg::Read { k }, now);
        (round, msgs)
    }

    pub fn ballot(&self) -> Ballot {
        self.k
    }

    pub fn owner(&self) -> &str {
        &self.owner
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// When the current phase gives up.
    pub fn deadline(&self) -> MonoMillis {
        self.deadline
    }

    fn broadcast(&self, body: Msg, now: Now) -> Vec<Envelope> {
        self.members
            .iter()
            .map(|to| Envelope {
                resource: self.resource.clone(),
                from: self.me,
                to: *to,
                sent_at: now.wall,
                body: body.clone(),
            })
            .collect()
    }

    fn quorum(&self) -> usize {
        super::quorum(self.members.len())
    }

    fn retry(&mut self, why: RetryWhy, seen: Ballot, not_before: Option<WallMillis>) -> RoundEvent {
        self.phase = Phase::Done;
        RoundEvent::Retry {
            why,
            seen: seen.max(self.k),
            not_before,
        }
    }

    /// The phase deadline passed without a quorum.
    pub fn on_timeout(&mut self, now: Now) -> RoundEvent {
        if self.is_done() || now.mono < self.deadline {
            return RoundEvent::Pending;
        }
        self.retry(RetryWhy::Timeout, self.k, None)
    }

    /// A reply from an acceptor.
    pub fn on_reply(&mut self, env: &Envelope, now: Now) -> RoundEvent {
        if self.is_done() || now.mono >= self.deadline || !self.members.contains(&env.from) {
            return RoundEvent::Pending;
        }
        let quorum = self.quorum();
        match (&mut self.phase, &env.body) {
            (
                Phase::Reading { acks },
                Msg::ReadAck {
                    k,
                    write_k,
                    value,
                    epoch,
                },
            ) if *k == self.k => {
                acks.insert(env.from, (*write_k, value.clone(), *epoch));
                if acks.len() >= quorum {
                    let acks = std::mem::take(acks);
                    return self.choose(acks, now);
                }
                RoundEvent::Pending
            }
            (Phase::Reading { .. }, Msg::ReadNack { k, seen })
            | (Phase::Writing { .. }, Msg::WriteNack { k, seen })
                if *k == self.k =>
            {
                let seen = *seen;
                self.retry(RetryWhy::Nack, seen, None)
            }
            (Phase::Writing { value, acks }, Msg::WriteAck { k }) if *k == self.k => {
                acks.insert(env.from);
                if acks.len() >= quorum {
                    let value = value.clone();
                    return self.committed(value, now);
                }
                RoundEvent::Pending
            }
            _ => RoundEvent::Pending,
        }
    }

    /// A read quorum answered: pick the value to write.
    fn choose(&mut self, acks: BTreeMap<NodeId, (Ballot, Slot, Epoch)>, now: Now) -> RoundEvent {
        // The value with the highest write ballot wins (adoption); on a tie a release wins (the
        // holder stopped before releasing).
        let mut highest: Option<(Ballot, Slot)> = None;
        let mut emax: Epoch = 0;
        for (write_k, slot, epoch) in acks.into_values() {
            emax = emax.max(epoch).max(slot.epoch());
            let better = match &highest {
                None => true,
                Some((hk, hv)) => {
                    write_k > *hk
                        || (write_k == *hk
                            && matches!(slot, Slot::Released { .. })
                            && !matches!(hv, Slot::Released { .. }))
                }
            };
            if better {
                highest = Some((write_k, slot));
            }
        }
        let found = highest.map(|(_, v)| v).unwrap_or_default();
        if self.intent == Intent::Release {
            // Only this owner's own lease, valid or not yet free for others, is released.
            let value = match &found {
                Slot::Lease { owner, epoch, .. } if *owner == self.owner => {
                    Slot::Released { epoch: *epoch }
                }
                _ => {
                    self.phase = Phase::Done;
                    return RoundEvent::NotHeld;
                }
            };
            return self.write(value, now);
        }
        let expires = WallMillis(self.t0.0.saturating_add(self.cfg.t_max_ms));
        let value = match judge(&found, now.wall, self.cfg.eps_ms) {
            Judgement::Free => Slot::Lease {
                owner: self.owner.clone(),
                expires,
                // A fresh tenure: above every epoch the quorum knows, and above the round's
                // start in microseconds (see the module docs of `flease`).
                epoch: (emax + 1).max(self.t0.0.saturating_mul(1000)),
            },
            Judgement::HeldBy {
                owner,
                expires: held_until,
                epoch,
            } if owner == self.owner => {
                if held_until.0.saturating_sub(now.wall.0) < self.cfg.renew_min_remaining_ms {
                    let free_at = WallMillis(held_until.0 + self.cfg.eps_ms + 1);
                    return self.retry(RetryWhy::TooLate, self.k, Some(free_at));
                }
                Slot::Lease {
                    owner,
                    expires,
                    epoch,
                }
            }
            // Someone else's valid lease: write it back unchanged (it may be committed only at
            // a minority so far).
            Judgement::HeldBy { .. } => found,
            Judgement::InDoubt { until } => {
                return self.retry(RetryWhy::InDoubt, self.k, Some(until));
            }
        };
        self.write(value, now)
    }

    /// Enter the write phase with `value`.
    fn write(&mut self, value: Slot, now: Now) -> RoundEvent {
        self.deadline = now.mono.plus(self.cfg.round_timeout_ms);
        let msgs = self.broadcast(
            Msg::Write {
                k: self.k,
                value: value.clone(),
            },
            now,
        );
        self.phase = Phase::Writing {
            value,
            acks: BTreeSet::new(),
        };
        RoundEvent::Send(msgs)
    }

    /// A write quorum acknowledged `value`.
    fn committed(&mut self, value: Slot, now: Now) -> RoundEvent {
        self.phase = Phase::Done;
        match value {
            Slot::Lease {
                owner,
                expires,
                epoch,
            } if owner == self.owner => {
                if now.wall.0.saturating_add(self.cfg.renew_min_remaining_ms) >= expires.0 {
                    // Committed too late to be of use; let it lapse.
                    return RoundEvent::Retry {
                        why: RetryWhy::TooLate,
                        seen: self.k,
                        not_before: Some(WallMillis(expires.0 + self.cfg.eps_ms + 1)),
                    };
                }
                RoundEvent::Granted(Grant {
                    resource: self.resource.clone(),
                    owner,
                    epoch,
                    ballot: self.k,
                    expires,
                    valid_until: self.m0.plus(self.cfg.valid_ms()),
                    started: self.m0,
                })
            }
            Slot::Lease {
                owner,
                expires,
                epoch,
            } => RoundEvent::Busy {
                owner,
                expires,
                epoch,
            },
            Slot::Released { epoch } => RoundEvent::Released { epoch },
            // An empty slot is never written.
            Slot::Empty => RoundEvent::Retry {
                why: RetryWhy::Nack,
                seen: self.k,
                not_before: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::flease::Acceptor;

    const CFG: FleaseConfig = super::super::TEST_CONFIG;

    fn at(ms: u64) -> Now {
        Now {
            wall: WallMillis(ms),
            mono: MonoMillis(ms),
        }
    }

    fn k(node: NodeId, counter: u32) -> Ballot {
        Ballot {
            era: 1,
            counter,
            boot: 0,
            node,
        }
    }

    /// Three acceptors past their restart wait.
    fn acceptors() -> Vec<Acceptor> {
        (1..=3).map(|i| Acceptor::new(i, CFG, at(0))).collect()
    }

    /// Deliver `msgs` to the acceptors in `order` and the replies to the round, in order.
    fn run(round: &mut Round, acc: &mut [Acceptor], msgs: Vec<Envelope>, t: u64) -> RoundEvent {
        let mut pending = msgs;
        loop {
            let mut next = Vec::new();
            for m in pending {
                let reply = acc[(m.to - 1) as usize].on_message(&m, at(t));
                if let Some(r) = reply {
                    match round.on_reply(&r, at(t)) {
                        RoundEvent::Send(more) => next.extend(more),
                        RoundEvent::Pending => {}
                        done => return done,
                    }
                }
            }
            if next.is_empty() {
                return RoundEvent::Pending;
            }
            pending = next;
        }
    }

    fn acquire(
        acc: &mut [Acceptor],
        node: NodeId,
        owner: &str,
        ballot: Ballot,
        t: u64,
    ) -> RoundEvent {
        let (mut r, msgs) = Round::start(node, "r", owner, &[1, 2, 3], ballot, CFG, at(t));
        run(&mut r, acc, msgs, t)
    }

    #[test]
    fn an_uncontended_acquire_is_granted_and_renewal_keeps_the_epoch() {
        let mut acc = acceptors();
        let RoundEvent::Granted(g) = acquire(&mut acc, 1, "alice", k(1, 1), 3000) else {
            panic!("not granted")
        };
        assert_eq!(g.expires, WallMillis(5000));
        assert_eq!(g.valid_until, MonoMillis(3000 + 2000 - 50));
        assert_eq!(g.epoch, 3_000_000);
        // The holder renews through another node: same epoch, later expiry.
        let RoundEvent::Granted(r) = acquire(&mut acc, 2, "alice", k(2, 2), 4000) else {
            panic!("not renewed")
        };
        assert_eq!((r.epoch, r.expires), (g.epoch, WallMillis(6000)));
    }

    #[test]
    fn a_held_lease_is_written_back_and_reported_busy() {
        let mut acc = acceptors();
        acquire(&mut acc, 1, "alice", k(1, 1), 3000);
        assert_eq!(
            acquire(&mut acc, 2, "bob", k(2, 2), 3500),
            RoundEvent::Busy {
                owner: "alice".into(),
                expires: WallMillis(5000),
                epoch: 3_000_000
            }
        );
    }

    #[test]
    fn the_doubt_window_waits_and_then_a_new_epoch_is_granted() {
        let mut acc = acceptors();
        acquire(&mut acc, 1, "alice", k(1, 1), 3000); // expires at 5000
        for t in [5000, 5050] {
            assert!(matches!(
                acquire(&mut acc, 2, "bob", k(2, t as u32), t),
                RoundEvent::Retry {
                    why: RetryWhy::InDoubt,
                    not_before: Some(WallMillis(5051)),
                    ..
                }
            ));
        }
        let RoundEvent::Granted(g) = acquire(&mut acc, 2, "bob", k(2, 9000), 5051) else {
            panic!("not granted after the doubt window")
        };
        assert!(g.epoch > 3_000_000);
    }

    #[test]
    fn a_single_nack_aborts_whatever_the_arrival_order() {
        // Acceptor 3 promised a higher ballot; acceptors 1 and 2 would acknowledge.
        for nack_first in [true, false] {
            let mut acc = acceptors();
            let high = Envelope {
                resource: "r".into(),
                from: 2,
                to: 3,
                sent_at: WallMillis(3000),
                body: Msg::Read { k: k(2, 50) },
            };
            acc[2].on_message(&high, at(3000));
            let (mut round, msgs) =
                Round::start(1, "r", "alice", &[1, 2, 3], k(1, 1), CFG, at(3000));
            let mut replies: Vec<Envelope> = msgs
                .iter()
                .filter_map(|m| acc[(m.to - 1) as usize].on_message(m, at(3000)))
                .collect();
            if nack_first {
                replies.reverse();
            }
            // Deliver only the NACK and one ACK: no quorum of ACKs, and the NACK aborts.
            let mut outcome = RoundEvent::Pending;
            for r in replies.iter().filter(|r| r.from != 2) {
                match round.on_reply(r, at(3000)) {
                    RoundEvent::Pending => {}
                    e => {
                        outcome = e;
                        break;
                    }
                }
            }
            assert!(
                matches!(outcome, RoundEvent::Retry { why: RetryWhy::Nack, seen, .. } if seen == k(2, 50)),
                "nack_first={nack_first}: {outcome:?}"
            );
            // Late replies to a finished round change nothing.
            assert_eq!(round.on_reply(&replies[0], at(3000)), RoundEvent::Pending);
        }
    }

    #[test]
    fn duplicate_and_foreign_acks_do_not_make_a_quorum() {
        let mut acc = acceptors();
        let (mut round, msgs) = Round::start(1, "r", "alice", &[1, 2, 3], k(1, 1), CFG, at(3000));
        let ack = acc[0].on_message(&msgs[0], at(3000)).unwrap();
        assert_eq!(round.on_reply(&ack, at(3000)), RoundEvent::Pending);
        assert_eq!(round.on_reply(&ack, at(3000)), RoundEvent::Pending);
        let foreign = Envelope {
            from: 7,
            ..ack.clone()
        };
        assert_eq!(round.on_reply(&foreign, at(3000)), RoundEvent::Pending);
        // The deadline passes: retry.
        assert!(matches!(
            round.on_timeout(at(3100)),
            RoundEvent::Retry {
                why: RetryWhy::Timeout,
                ..
            }
        ));
    }

    #[test]
    fn release_frees_the_owners_lease_for_the_next_owner_at_once() {
        let mut acc = acceptors();
        let RoundEvent::Granted(g) = acquire(&mut acc, 1, "alice", k(1, 1), 3000) else {
            panic!("not granted")
        };
        let release = |acc: &mut [Acceptor], owner: &str, b: Ballot| {
            let (mut r, msgs) =
                Round::start_for(Intent::Release, 2, "r", owner, &[1, 2, 3], b, CFG, at(3100));
            run(&mut r, acc, msgs, 3100)
        };
        // Someone else cannot release alice's lease.
        assert_eq!(release(&mut acc, "bob", k(2, 2)), RoundEvent::NotHeld);
        assert_eq!(
            release(&mut acc, "alice", k(2, 3)),
            RoundEvent::Released { epoch: g.epoch }
        );
        // Bob acquires long before alice's lease would have expired, with a higher epoch.
        let RoundEvent::Granted(b) = acquire(&mut acc, 3, "bob", k(3, 4), 3200) else {
            panic!("not granted after release")
        };
        assert!(b.epoch > g.epoch);
    }

    #[test]
    fn renewing_too_close_to_expiry_lets_it_lapse() {
        let mut acc = acceptors();
        acquire(&mut acc, 1, "alice", k(1, 1), 3000); // expires at 5000
        assert!(matches!(
            acquire(&mut acc, 1, "alice", k(1, 2), 4800),
            RoundEvent::Retry {
                why: RetryWhy::TooLate,
                ..
            }
        ));
    }
}
