//! The proposer: one round (read phase, then write phase) for one owner and one resource.
//!
//! A [`Round`] is pure: it takes replies and clock readings and returns what to do. The shell
//! keeps rounds, timers and retries (with backoff and a fresh, higher ballot each time).
//!
//! # Quorum accounting
//! Only acknowledgements for this round's ballot, from distinct members, count. A single NACK
//! aborts the phase whatever the order of arrival: once any acceptor refused `k`, a write at `k`
//! may not commit everywhere it needs to, and the round retries above what that acceptor saw.
//!
//! # Layout
//! - here: the vocabulary ([`Intent`], [`Grant`], [`RetryWhy`], [`RoundEvent`]), the round's
//!   state, its start and the replies it counts ([`Round::on_reply`], [`Round::on_timeout`]).
//! - `choose`: what a round does once a phase has its quorum: the value to write after the
//!   read phase (Flease and PaxosLease), and what the committed value means.
//! - `fast_release`: [`FastRelease`], the one-round-trip release through the granting ballot.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{Ballot, Envelope, Epoch, FleaseConfig, Msg, Now, Protocol, ResourceId, Slot};
use crate::domain::types::{MonoMillis, NodeId, WallMillis};

mod choose;
mod fast_release;

pub use fast_release::FastRelease;

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
    /// This extended the owner's tenure (same epoch) rather than starting one.
    pub renewal: bool,
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
    proto: Protocol,
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
    /// The value being written extends this owner's tenure.
    renewal: bool,
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
        Self::start_in(
            Protocol::Flease,
            Intent::Acquire,
            me,
            resource,
            owner,
            members,
            k,
            cfg,
            now,
        )
    }

    /// Start a round of `proto` for `intent`.
    #[allow(clippy::too_many_arguments)]
    pub fn start_in(
        proto: Protocol,
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
            proto,
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
            renewal: false,
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
                proto: self.proto,
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
}

#[cfg(test)]
mod tests;
