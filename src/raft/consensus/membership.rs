//! Membership changes on the leader: a learner first, a voter once it answered and caught up
//! (within a bounded wait), removal; one change at a time. See the parent module's invariants:
//! once a step may have taken effect, losing leadership is `OutcomeUnknown`, never `NoLeader`.
//!
//! Replacement (`AdminRequest::RemoveForReplacement`, asked by a node that came back with an
//! empty data dir, before it answers anything): the node is removed, then added back as a
//! learner, so that no replication progress of the log it lost survives. Invariants: the
//! removal is proposed only if the voters that answer, without the node, are a majority of
//! the configuration (so it commits without the node's empty log); never while the leader
//! still hears from a node of that id (another process with the id); only at the address the
//! membership records (no takeover from elsewhere); and the two steps run to their end even
//! if the asking node hangs up. It must not promote the node: the node asks that itself
//! (`AddNode`), and only if it was a voter.

use super::*;
use crate::domain::bootstrap;

impl Consensus {
    /// Apply a membership request from any node (forwarded to the leader).
    pub async fn admin(&self, req: AdminRequest) -> Result<AdminOutcome, ConsensusError> {
        self.on_leader(routes::ADMIN, &req, Delivery::AtMostOnce, || {
            self.admin_here(req.clone())
        })
        .await
    }

    /// Apply a membership request on this node as leader.
    pub async fn admin_here(&self, req: AdminRequest) -> Result<AdminOutcome, ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        if self.quorum_lost() {
            return Err(ConsensusError::NoQuorum);
        }
        let membership = self.inner.raft.metrics().borrow().membership_config.clone();
        let membership = membership.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        match req {
            AdminRequest::AddNode { id, address } => {
                let existing = membership.get_node(&id).map(|n| n.addr.clone());
                // A voter of the configuration being entered counts as a voter only once the
                // joint configuration is left: adding it again finishes the change.
                let is_voter = voters.contains(&id) && membership.get_joint_config().len() == 1;
                if existing.as_deref() == Some(address.as_str())
                    && voters.contains(&id)
                    && !is_voter
                {
                    let ids = BTreeSet::from([id]);
                    self.change_membership(ChangeMembers::AddVoterIds(ids))
                        .await?;
                    return Ok(AdminOutcome::Done);
                }
                self.add_node_here(id, address, existing, is_voter).await
            }
            AdminRequest::RemoveNode { id } => {
                if membership.get_node(&id).is_none() {
                    return Err(ConsensusError::NodeNotFound { id });
                }
                let ids = BTreeSet::from([id]);
                let change = if voters.contains(&id) {
                    if voters.len() == 1 {
                        return Err(ConsensusError::InvalidMembership {
                            message: format!("node {id} is the last voter; it cannot be removed"),
                        });
                    }
                    ChangeMembers::RemoveVoters(ids)
                } else {
                    ChangeMembers::RemoveNodes(ids)
                };
                self.change_membership(change).await?;
                Ok(AdminOutcome::Done)
            }
            AdminRequest::RemoveForReplacement { id, address } => {
                let recorded = membership
                    .get_node(&id)
                    .map(|n| n.addr.clone())
                    .ok_or(ConsensusError::NodeNotFound { id })?;
                if recorded != address {
                    return Err(ConsensusError::InvalidMembership {
                        message: format!(
                            "node {id} is a member at {recorded}, not {address}: a replacement \
                             keeps the address (to move a node, remove it and add it at the new \
                             one)"
                        ),
                    });
                }
                if id == self.inner.id {
                    return Err(ConsensusError::StillAnswering { id });
                }
                let et = self.election_timeout_ms();
                let ages = self.inner.peers.contacts().ages();
                if health::reachable(ages.get(&id).copied(), et) {
                    return Err(ConsensusError::StillAnswering { id });
                }
                self.removal_can_commit(id, membership)?;
                // Bounded by the calls' own timeouts; a core shutting down fails them at once.
                self.replace_to_the_end(id, address, voters.contains(&id))
                    .await
            }
            AdminRequest::ReplaceHeldVoter { id, address } => {
                let recorded = membership
                    .get_node(&id)
                    .map(|n| n.addr.clone())
                    .ok_or(ConsensusError::NodeNotFound { id })?;
                if recorded != address || !voters.contains(&id) || id == self.inner.id {
                    return Err(ConsensusError::InvalidMembership {
                        message: format!(
                            "node {id} at {address} is not a voter of this leader's \
                             configuration (recorded: {recorded}): nothing to replace"
                        ),
                    });
                }
                // The node answers (it is the one asking): no "still answering" wait. As for
                // a replacement asked at start, the node asks to be promoted itself.
                self.removal_can_commit(id, membership)?;
                self.replace_to_the_end(id, address, true).await
            }
        }
    }

    /// Whether the removal of `id` can commit without it: the voters that answer this leader,
    /// without `id`, are more than half of the configuration openraft builds the next one from
    /// (the last of a joint pair).
    fn removal_can_commit(
        &self,
        id: NodeId,
        membership: &openraft::Membership<NodeId, BasicNode>,
    ) -> Result<(), ConsensusError> {
        let et = self.election_timeout_ms();
        let ages = self.inner.peers.contacts().ages();
        let answers = |v: &NodeId| health::reachable(ages.get(v).copied(), et);
        let last: BTreeSet<NodeId> = membership
            .get_joint_config()
            .last()
            .cloned()
            .unwrap_or_default();
        let me = self.inner.id;
        let answering: BTreeSet<NodeId> = last
            .iter()
            .copied()
            .filter(|v| *v != id && (*v == me || answers(v)))
            .collect();
        if bootstrap::removal_commits_without(&last, id, &answering) {
            return Ok(());
        }
        Err(ConsensusError::InvalidMembership {
            message: format!(
                "node {id} cannot be replaced now: its removal needs more than half of the {} \
                 voters without it, and only {} others answer the leader; start the missing \
                 voters first",
                last.len(),
                answering.len()
            ),
        })
    }

    /// Replace node `id`, whose log went back (it acknowledged entries it no longer has:
    /// `raft::network::reversion`), as a node that asks for its replacement is replaced: only
    /// if its removal commits without it; then, if it was a voter, promote it again once it
    /// has caught up (it does not ask: it does not know it lost anything).
    pub async fn replace_reverted(&self, id: NodeId) -> Result<AdminOutcome, ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        let membership = self.inner.raft.metrics().borrow().membership_config.clone();
        let membership = membership.membership();
        let address = membership
            .get_node(&id)
            .map(|n| n.addr.clone())
            .ok_or(ConsensusError::NodeNotFound { id })?;
        let voter = membership.voter_ids().any(|v| v == id);
        self.removal_can_commit(id, membership)?;
        self.replace_to_the_end(id, address.clone(), voter).await?;
        if !voter {
            return Ok(AdminOutcome::Done);
        }
        self.add_node_here(id, address.clone(), Some(address), false)
            .await
    }

    /// [`Self::replace_here`] on a task of its own, so that it runs to its end even if the
    /// caller's future is dropped (an asking node that hangs up): cut between the removal and
    /// the learner add, the node would be out of the cluster for good.
    async fn replace_to_the_end(
        &self,
        id: NodeId,
        address: String,
        voter: bool,
    ) -> Result<AdminOutcome, ConsensusError> {
        let this = self.clone();
        tokio::spawn(async move { this.replace_here(id, address, voter).await })
            .await
            .unwrap_or_else(|e| {
                Err(ConsensusError::OutcomeUnknown {
                    detail: format!("the replacement of node {id} failed: {e}"),
                })
            })
    }

    /// Remove `id` (a `voter` or a learner), then add it back at `address` as a learner, with
    /// replication progress started afresh (a member kept through the change would keep the
    /// progress of the log it lost); the node asks to be promoted once it serves. The learner
    /// add is tried again while this node leads and the refusal says to retry.
    async fn replace_here(
        &self,
        id: NodeId,
        address: String,
        voter: bool,
    ) -> Result<AdminOutcome, ConsensusError> {
        const LEARNER_TRIES: u32 = 5;
        let ids = BTreeSet::from([id]);
        let change = if voter {
            ChangeMembers::RemoveVoters(ids)
        } else {
            ChangeMembers::RemoveNodes(ids)
        };
        self.change_membership(change).await?;
        let mut tries = 1;
        loop {
            match self.add_learner_here(id, address.clone()).await {
                Ok(_) => break,
                Err(ConsensusError::ChangeInProgress { .. } | ConsensusError::Timeout { .. })
                    if tries < LEARNER_TRIES && self.is_leader() =>
                {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    return Err(ConsensusError::OutcomeUnknown {
                        detail: format!(
                            "node {id} was removed but not added back as a learner ({e}); add \
                             it with `leasecore cluster add`"
                        ),
                    });
                }
            }
        }
        tracing::warn!(
            node = id,
            voter,
            "node {id} came back with an empty data dir: replaced (removed, and added back as a \
             learner{})",
            if voter {
                " to be promoted once caught up"
            } else {
                ""
            }
        );
        Ok(AdminOutcome::Done)
    }

    /// Add `id` as a learner (unless it is one), wait (bounded) until it answered and caught
    /// up, then promote it to voter. On timeout it stays a learner.
    async fn add_node_here(
        &self,
        id: NodeId,
        address: String,
        existing: Option<String>,
        is_voter: bool,
    ) -> Result<AdminOutcome, ConsensusError> {
        let raft = &self.inner.raft;
        let membership_index = match existing {
            Some(addr) if addr != address => {
                return Err(ConsensusError::InvalidMembership {
                    message: format!(
                        "node {id} is already in the cluster at {addr}; remove it first"
                    ),
                });
            }
            Some(_) if is_voter => return Ok(AdminOutcome::Done),
            // Already a learner (an earlier add that timed out): resume waiting. The
            // membership that holds it is the current one.
            Some(_) => {
                let m = raft.metrics().borrow().membership_config.clone();
                m.log_id().map(|l| l.index).unwrap_or(0)
            }
            // Learner first: it catches up (by snapshot if the log was purged) without
            // counting toward any quorum.
            None => self.add_learner_here(id, address).await?,
        };
        // From here on the learner is in the membership: an error must not claim that nothing
        // was done.
        let after_learner = |e: ConsensusError| match e {
            ConsensusError::NotLeader
            | ConsensusError::NoLeader
            | ConsensusError::QuorumLost { .. }
            | ConsensusError::ShuttingDown => ConsensusError::OutcomeUnknown {
                detail: format!(
                    "node {id} was added as a learner, then this node lost the leadership \
                         or stopped while promoting it; check `GET /v1/cluster`"
                ),
            },
            ConsensusError::ChangeInProgress { message } => ConsensusError::ChangeInProgress {
                message: format!("node {id} stays a learner: {message}"),
            },
            other => other,
        };
        let wait = self.inner.timeouts.catch_up;
        let mut metrics = raft.metrics();
        let judged = metrics.wait_for(|m| {
            let gone = m.membership_config.membership().get_node(&id).is_none();
            let deposed = m.state != ServerState::Leader;
            gone || deposed || caught_up(m, id, membership_index)
        });
        // Only whether it settled: the metrics guard must not live across the awaits below.
        let settled = matches!(tokio::time::timeout(wait, judged).await, Ok(Ok(_)));
        let m = raft.metrics().borrow().clone();
        if m.membership_config.membership().get_node(&id).is_none() {
            return Ok(AdminOutcome::Removed {
                message: format!("node {id} was removed while it was catching up"),
            });
        }
        if m.state != ServerState::Leader {
            // The learner's entry committed (add_learner returned) and no promotion was
            // proposed: the outcome is known, and it is not "nothing was done".
            return Ok(AdminOutcome::Learner {
                message: format!(
                    "node {id} stays a learner: this node lost the leadership while it was \
                     catching up; add it again to promote it, or remove it"
                ),
            });
        }
        if !settled || !caught_up(&m, id, membership_index) {
            let matched = replicated_index(&m, id);
            return Ok(AdminOutcome::Learner {
                message: format!(
                    "node {id} stays a learner: within {} ms it did not answer and catch up \
                     (acknowledged log index {}, leader at {}, membership entry {membership_index}); \
                     remove it, or add it again to keep waiting",
                    wait.as_millis(),
                    matched.map_or("none".to_string(), |i| i.to_string()),
                    m.last_log_index.unwrap_or(0),
                ),
            });
        }
        let ids = BTreeSet::from([id]);
        self.change_membership(ChangeMembers::AddVoterIds(ids))
            .await
            .map_err(after_learner)?;
        Ok(AdminOutcome::Done)
    }

    /// Add `id` at `address` as a learner and return the index of the membership entry. Not
    /// `blocking`: openraft's own wait judges "caught up" by a lag threshold alone, which a
    /// node that never answered passes while the log is short.
    async fn add_learner_here(&self, id: NodeId, address: String) -> Result<u64, ConsensusError> {
        // Its replication starts afresh: what a node of this id acknowledged before it was
        // removed (by hand, or for a replacement) says nothing about its log now.
        if let Some(guard) = self.inner.reversions.get() {
            guard.forget(id);
        }
        let t = self.inner.timeouts.request;
        let add = self
            .inner
            .raft
            .add_learner(id, BasicNode::new(address), false);
        match tokio::time::timeout(t, add).await {
            Ok(Ok(resp)) => Ok(resp.log_id.index),
            // Refused before anything was written: the caller may retry elsewhere; but a core
            // that stopped may have the learner entry in its log.
            Ok(Err(e)) => Err(match from_write_error(e) {
                ConsensusError::ShuttingDown => ConsensusError::OutcomeUnknown {
                    detail: format!(
                        "this node stopped while adding node {id}; check `GET /v1/cluster`"
                    ),
                },
                other => other,
            }),
            Err(_) => Err(ConsensusError::Timeout {
                ms: t.as_millis() as u64,
            }),
        }
    }

    /// Propose a membership change (joint, then uniform), bounded by the request timeout.
    async fn change_membership(
        &self,
        change: ChangeMembers<NodeId, BasicNode>,
    ) -> Result<(), ConsensusError> {
        let t = self.inner.timeouts.request;
        let change = self.inner.raft.change_membership(change, false);
        match tokio::time::timeout(t, change).await {
            Ok(Ok(_)) => Ok(()),
            // A leader change in the middle may leave the joint configuration proposed.
            // So may a Raft core that stops with the change in its log (the next leader may
            // commit it): neither is "nothing was done".
            Ok(Err(e)) => Err(match from_write_error(e) {
                ConsensusError::NotLeader | ConsensusError::ShuttingDown => {
                    ConsensusError::OutcomeUnknown {
                        detail: "this node lost the leadership or stopped during the membership \
                                 change; check `GET /v1/cluster`"
                            .into(),
                    }
                }
                other => other,
            }),
            Err(_) => Err(ConsensusError::Timeout {
                ms: t.as_millis() as u64,
            }),
        }
    }
}

/// Whether learner `id`, added by the membership entry at `membership_index`, may be promoted.
fn caught_up(
    m: &openraft::RaftMetrics<NodeId, BasicNode>,
    id: NodeId,
    membership_index: u64,
) -> bool {
    health::learner_caught_up(
        replicated_index(m, id),
        membership_index,
        m.last_log_index.unwrap_or(0),
        PROMOTE_MAX_LAG,
    )
}
