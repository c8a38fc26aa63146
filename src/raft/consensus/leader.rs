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
    let m = raft.metrics();
    let m = m.borrow();
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
pub(super) async fn wait_for_new_leader(
    raft: &Raft,
    stale: Option<NodeId>,
    wait: Duration,
) -> bool {
    let mut rx = raft.metrics();
    let changed = rx.wait_for(|m| {
        m.current_leader.is_some()
            && m.current_leader != stale
            && (m.current_leader != Some(m.id) || m.state == ServerState::Leader)
    });
    matches!(tokio::time::timeout(wait, changed).await, Ok(Ok(_)))
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
