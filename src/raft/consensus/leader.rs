//! Where the leader is, and how an operation reaches it: [`Consensus::on_leader`] runs it here
//! when this node leads, or forwards it to the leader's peer route; while no leader is known it
//! waits (up to `leader_wait`) for one, then says why there is none ([`leaderless`]: an
//! election under way, or a lost quorum).
//!
//! # Invariants
//! - An operation that is not idempotent ([`Delivery::AtMostOnce`]) is sent again only when
//!   its first delivery certainly failed or the leader refused it (`NotLeader`: it did
//!   nothing); a delivery in doubt is `OutcomeUnknown`.
//! - A node that stepped down for lack of a quorum answers at once (`NoQuorum`, or
//!   `QuorumLost`) instead of waiting for a leader.
//! - No lock is held across an await: where the leader is comes from openraft's metrics, read
//!   anew each time.
//!
//! # What it must not do
//! Decide an operation's outcome: it finds the leader, carries the request and reports what
//! came back.

use super::*;

/// Whether a forwarded operation may be delivered twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Idempotent (a read, a refresh): resend after any transport failure.
    Retryable,
    /// Not idempotent (a write): resend only when the first send certainly never arrived.
    AtMostOnce,
}

/// An error that can travel back from a forwarded operation.
pub trait Forwardable: From<ConsensusError> + DeserializeOwned {
    /// The target was not the leader and did nothing: safe to try the next leader.
    fn is_not_leader(&self) -> bool;
}

impl Forwardable for ConsensusError {
    fn is_not_leader(&self) -> bool {
        matches!(self, ConsensusError::NotLeader)
    }
}

/// Where the leader is, as far as this node knows.
pub(super) enum LeaderRef {
    Me,
    Other { id: NodeId, addr: String },
    Unknown,
}

pub(super) fn leader_ref(raft: &Raft, me: NodeId) -> LeaderRef {
    leader_ref_of(&raft.metrics().borrow(), me)
}

fn leader_ref_of(m: &openraft::RaftMetrics<NodeId, openraft::BasicNode>, me: NodeId) -> LeaderRef {
    match m.current_leader {
        Some(id) if id == me && m.state == ServerState::Leader => LeaderRef::Me,
        Some(id) if id != me => match m.membership_config.membership().get_node(&id) {
            Some(node) => LeaderRef::Other {
                id,
                addr: node.addr.clone(),
            },
            None => LeaderRef::Unknown,
        },
        _ => LeaderRef::Unknown,
    }
}

/// Wait until the known leader differs from `stale` (or one appears), at most `wait`.
///
/// The leader must also be one [`leader_ref`] can use: this node leading, or a node of its
/// membership (whose address it knows). A node that joined empty learns its leader's vote (from
/// an append its log does not match yet, or a heartbeat) before the membership entries that
/// name the leader; a wait that ended then would have its caller, which finds the leader
/// `Unknown`, wait again at once, in a loop that never yields (a node with one async worker
/// then answers nothing, its appends included, and never learns the membership). Found by
/// the openraft 0.10 port's tests, where heartbeats travel apart from the entries and the
/// window is wider (`docs/spikes/openraft-0.10-step1.patch`).
pub(super) async fn wait_for_new_leader(
    raft: &Raft,
    stale: Option<NodeId>,
    wait: Duration,
) -> bool {
    let mut rx = raft.metrics();
    let changed = rx.wait_for(|m| usable_new_leader(m, stale));
    matches!(tokio::time::timeout(wait, changed).await, Ok(Ok(_)))
}

/// Whether `m` names a leader other than `stale` that [`leader_ref`] can use: one rule for
/// both, so that a wait never ends on a leader its caller then finds `Unknown`.
fn usable_new_leader(
    m: &openraft::RaftMetrics<NodeId, openraft::BasicNode>,
    stale: Option<NodeId>,
) -> bool {
    m.current_leader != stale && !matches!(leader_ref_of(m, m.id), LeaderRef::Unknown)
}

impl Consensus {
    /// Run an operation on the leader: `here` if this node leads, otherwise forwarded to the
    /// leader's peer route `path` with `req`. While no leader is known, waits up to
    /// `leader_wait` for one. An operation that is not idempotent is never sent twice when its
    /// first delivery is uncertain (see the module docs).
    pub async fn on_leader<Req, T, E, F, Fut>(
        &self,
        path: &str,
        req: &Req,
        delivery: Delivery,
        here: F,
    ) -> Result<T, E>
    where
        Req: Serialize + ?Sized,
        T: DeserializeOwned,
        E: Forwardable,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let inner = &self.inner;
        let mut stale = None;
        // Adding a node waits for the learner to catch up; everything else is quick.
        let timeout = if path == routes::ADMIN {
            inner.timeouts.catch_up + inner.timeouts.request
        } else {
            inner.timeouts.request
        };
        loop {
            match leader_ref(&inner.raft, inner.id) {
                LeaderRef::Me => {
                    return here().await.map_err(|e| {
                        if e.is_not_leader() {
                            E::from(ConsensusError::NoLeader)
                        } else {
                            e
                        }
                    });
                }
                LeaderRef::Other { id, addr } => {
                    let answer: Result<Result<T, E>, _> =
                        inner.peers.post_json(&addr, path, req, timeout).await;
                    match answer {
                        // The leader refused before doing anything: try the next leader.
                        Ok(Err(e)) if e.is_not_leader() => stale = Some(id),
                        Ok(result) => return result,
                        Err(e) if e.not_delivered() || delivery == Delivery::Retryable => {
                            stale = Some(id)
                        }
                        Err(e @ PeerError::NoRoute { .. }) => {
                            return Err(E::from(ConsensusError::Unsupported {
                                detail: e.to_string(),
                            }));
                        }
                        Err(e) => {
                            return Err(E::from(ConsensusError::OutcomeUnknown {
                                detail: e.to_string(),
                            }));
                        }
                    }
                }
                LeaderRef::Unknown if inner.cut_off.load(Ordering::Relaxed) => {
                    return Err(E::from(cut_off_error(
                        &inner.raft,
                        inner.id,
                        &inner.peers,
                        inner.timeouts.election_timeout,
                    )));
                }
                LeaderRef::Unknown => {}
            }
            if !wait_for_new_leader(&inner.raft, stale, inner.timeouts.leader_wait).await {
                return Err(E::from(leaderless(
                    &inner.raft,
                    inner.id,
                    &inner.peers,
                    inner.timeouts.election_timeout,
                )));
            }
        }
    }
}

/// Why no leader could be found: the quorum is lost when too few voters were heard from
/// lately (`domain::health::voter_contact` decides), else an election is (probably) under way.
pub(super) fn leaderless(
    raft: &Raft,
    me: NodeId,
    peers: &PeerClient,
    election_timeout: Duration,
) -> ConsensusError {
    let voters: Vec<NodeId> = raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .voter_ids()
        .collect();
    let contact = crate::domain::health::voter_contact(
        &voters,
        me,
        &peers.contacts().ages(),
        election_timeout.as_millis() as u64,
    );
    if contact.quorum_lost() {
        ConsensusError::QuorumLost {
            heard: contact.heard,
            voters: contact.voters,
            needed: contact.needed,
        }
    } else {
        ConsensusError::NoLeader
    }
}

/// Why a node that stepped down for lack of a quorum cannot serve: the quorum is lost (with
/// how many voters it hears, when it still hears too few), or at least no quorum answered it.
pub(super) fn cut_off_error(
    raft: &Raft,
    me: NodeId,
    peers: &PeerClient,
    election_timeout: Duration,
) -> ConsensusError {
    match leaderless(raft, me, peers, election_timeout) {
        ConsensusError::NoLeader => ConsensusError::NoQuorum,
        lost => lost,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Arc;

    use openraft::{BasicNode, Membership, RaftMetrics, StoredMembership};

    use super::*;

    fn metrics(
        me: NodeId,
        leader: Option<NodeId>,
        members: &[NodeId],
    ) -> RaftMetrics<NodeId, BasicNode> {
        let mut m = RaftMetrics::new_initial(me);
        m.current_leader = leader;
        let voters: BTreeSet<NodeId> = members.iter().copied().collect();
        let nodes: BTreeMap<NodeId, BasicNode> = members
            .iter()
            .map(|id| (*id, BasicNode::new(format!("127.0.0.1:{}", 7000 + id))))
            .collect();
        if !members.is_empty() {
            m.membership_config = Arc::new(StoredMembership::new(
                None,
                Membership::new(vec![voters], nodes),
            ));
        }
        m
    }

    #[test]
    fn a_leader_outside_the_known_membership_is_not_a_usable_one() {
        // A node that joined empty: it knows its leader's vote, not yet the membership naming
        // it. Ending the wait there made its callers spin on `LeaderRef::Unknown`.
        assert!(!usable_new_leader(&metrics(4, Some(1), &[]), None));
        assert!(matches!(
            leader_ref_of(&metrics(4, Some(1), &[]), 4),
            LeaderRef::Unknown
        ));
        // Once the membership names it, it is.
        assert!(usable_new_leader(&metrics(4, Some(1), &[1, 2, 3, 4]), None));
        // Still not the stale one, nor this node unless it leads.
        assert!(!usable_new_leader(
            &metrics(4, Some(1), &[1, 2, 3, 4]),
            Some(1)
        ));
        assert!(!usable_new_leader(
            &metrics(4, Some(4), &[1, 2, 3, 4]),
            None
        ));
        let mut leading = metrics(4, Some(4), &[1, 2, 3, 4]);
        leading.state = ServerState::Leader;
        assert!(usable_new_leader(&leading, None));
        assert!(!usable_new_leader(&metrics(4, None, &[1, 2, 3, 4]), None));
    }
}
