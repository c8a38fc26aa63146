//! What a [`Round`] does once a phase has its quorum: after the read phase, the value it
//! writes (`choose` for Flease, `choose_span` for PaxosLease); after the write phase,
//! what the committed value means for the owner (`committed`).
//!
//! # Invariants
//! - A fresh tenure takes an epoch above every epoch the read quorum knows and above the
//!   round's start in microseconds; a renewal keeps its epoch (see the module docs of `flease`).
//! - Flease adopts the value with the highest write ballot (a release wins a tie) and writes
//!   someone else's valid lease back unchanged; PaxosLease writes only this owner's value, and
//!   another owner's unexpired value anywhere in the quorum makes the resource busy.
//! - A value in doubt (past `expires` but within `eps`) is never overwritten: the round retries
//!   after the doubt window.
//! - A release writes `Released` only over this owner's own lease.
//! - A commit too close to expiry to be of use is not granted: the round reports `TooLate`.
//!
//! # What it must not do
//! Read a clock or send anything itself: it takes the clock readings it is given and returns
//! the messages for the shell to send.

use std::collections::{BTreeMap, BTreeSet};

use super::{Grant, Intent, Phase, RetryWhy, Round, RoundEvent};
use crate::domain::flease::{Ballot, Epoch, Judgement, Msg, Now, Protocol, Slot, judge};
use crate::domain::types::{NodeId, WallMillis};

impl Round {
    /// PaxosLease: a read quorum answered. Only this owner's value is ever written: another
    /// owner's unexpired value anywhere in the quorum makes the resource busy.
    fn choose_span(
        &mut self,
        acks: BTreeMap<NodeId, (Ballot, Slot, Epoch)>,
        now: Now,
    ) -> RoundEvent {
        let mut emax: Epoch = 0;
        let mut other: Option<(String, u64, Epoch)> = None;
        // This owner's live value with the highest write ballot, if the quorum holds one.
        let own_live = acks
            .values()
            .filter_map(|(k, slot, _)| match slot {
                Slot::Span { owner, epoch, .. } if *owner == self.owner => Some((*k, *epoch)),
                _ => None,
            })
            .max();
        // The most recent write the quorum knows of that could end this owner's tenure, and
        // whether it is this owner's live value. A copy that is not (expired, released,
        // someone else's) ends it, unless it remembers no epoch as high as the tenure's: a
        // later tenure starts above every epoch its read quorum knows, and that quorum met
        // this tenure's. Ballots alone cannot say "later": after acceptors restart, a
        // committed write may carry a lower ballot than an older, expired one (wall clocks set
        // ballot eras). On a tie an expired copy wins: the holder's timer ran out before any
        // acceptor's.
        let mut latest: Option<(Ballot, Option<Epoch>)> = None;
        for (write_k, slot, epoch) in acks.into_values() {
            emax = emax.max(epoch).max(slot.epoch());
            let own = match &slot {
                Slot::Span { owner, epoch, .. } if *owner == self.owner => Some(*epoch),
                _ => None,
            };
            let could_end =
                own.is_some() || own_live.is_none_or(|(_, e)| epoch.max(slot.epoch()) >= e);
            if could_end && latest.is_none_or(|(k, o)| write_k > k || (write_k == k && o.is_some()))
            {
                latest = Some((write_k, own));
            }
            if let Slot::Span {
                owner,
                span_ms,
                epoch,
            } = slot
                && owner != self.owner
                && other.as_ref().is_none_or(|o| span_ms > o.1)
            {
                other = Some((owner, span_ms, epoch));
            }
        }
        // This owner's tenure goes on only if the latest such write is its value, still timed;
        // otherwise (released, expired, or a later tenure of someone else) it starts anew.
        let own = latest.and_then(|(_, own)| own);
        if let Some((owner, span_ms, epoch)) = other {
            self.phase = Phase::Done;
            if self.intent == Intent::Release {
                return RoundEvent::NotHeld;
            }
            return RoundEvent::Busy {
                owner,
                // A hint on this node's wall clock: only the holder knows its lease exactly.
                expires: WallMillis(now.wall.0.saturating_add(span_ms)),
                epoch,
            };
        }
        let value = match (self.intent, own) {
            (Intent::Release, Some(epoch)) => Slot::Released { epoch },
            (Intent::Release, None) => {
                self.phase = Phase::Done;
                return RoundEvent::NotHeld;
            }
            (Intent::Acquire, own) => Slot::Span {
                owner: self.owner.clone(),
                span_ms: self.cfg.t_max_ms,
                // An extension keeps its epoch.
                epoch: match own {
                    Some(e) => {
                        self.renewal = true;
                        e
                    }
                    None => (emax + 1).max(self.t0.0.saturating_mul(1000)),
                },
            },
        };
        self.write(value, now)
    }

    /// A read quorum answered: pick the value to write.
    pub(super) fn choose(
        &mut self,
        acks: BTreeMap<NodeId, (Ballot, Slot, Epoch)>,
        now: Now,
    ) -> RoundEvent {
        if self.proto == Protocol::PaxosLease {
            return self.choose_span(acks, now);
        }
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
                self.renewal = true;
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
    pub(super) fn committed(&mut self, value: Slot, now: Now) -> RoundEvent {
        self.phase = Phase::Done;
        match value {
            Slot::Span { owner, epoch, .. } if owner == self.owner => {
                let valid_until = self.m0.plus(self.cfg.valid_ms());
                if now.mono.plus(self.cfg.renew_min_remaining_ms) >= valid_until {
                    // Committed too late to be of use; it lapses by itself.
                    return RoundEvent::Retry {
                        why: RetryWhy::TooLate,
                        seen: self.k,
                        not_before: None,
                    };
                }
                RoundEvent::Granted(Grant {
                    resource: self.resource.clone(),
                    owner,
                    epoch,
                    ballot: self.k,
                    // A hint on this node's wall clock (PaxosLease has no absolute expiry).
                    expires: WallMillis(self.t0.0.saturating_add(self.cfg.t_max_ms)),
                    valid_until,
                    started: self.m0,
                    renewal: self.renewal,
                })
            }
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
                    renewal: self.renewal,
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
            // Never written by a round: an empty slot, another owner's span, an acceptor's form.
            Slot::Empty | Slot::Span { .. } | Slot::Timed { .. } => RoundEvent::Retry {
                why: RetryWhy::Nack,
                seen: self.k,
                not_before: None,
            },
        }
    }
}
