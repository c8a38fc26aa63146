//! Linearizable reads (ReadIndex): [`Consensus::read_barrier`] and the read rounds behind it.
//! A round confirms leadership with a quorum on the leader ([`local_read_round`]), or goes to
//! the leader's read index route, one round for all of a follower's waiting callers
//! ([`any_read_round`]); concurrent callers share rounds through the handle's
//! `RoundBatcher`s.
//!
//! # Invariants
//! - A caller is answered only by a round that started after it called, and the barrier
//!   returns only once this node has applied up to that round's read index.
//! - A leader handing its leadership over confirms nothing (a confirmation would refresh the
//!   lease the transfer waits out): its round waits for the transfer's end and says
//!   `NotLeader`.
//! - A read round changes nothing, so a forwarded one is retried after any failure.
//!
//! # What it must not do
//! Read the state: it only says when a local read is linearizable.

use super::*;

/// The pause between two confirmations of leadership that found no quorum: a follower that
/// refuses connections fails one at once, and the next must not follow it in a hot loop.
const CONFIRM_RETRY_PAUSE: Duration = Duration::from_millis(10);

/// One leader-side read round: confirm leadership with a quorum, return the read index.
/// During a leadership transfer the round waits for its end and says `NotLeader` (a
/// confirmation would refresh the lease the transfer waits out).
///
/// openraft 0.9 confirms with one heartbeat to each voter, each timing out after a heartbeat
/// interval, and a follower syncing an append answers later than that: on a busy, healthy
/// cluster a confirmation finds "quorum not enough" now and then. A read round changes
/// nothing, so it is tried again for up to `patience` (an election timeout: a leader that
/// hears from no quorum for that long steps down, and the round then says `NotLeader`); only
/// then does it say `NoQuorum`.
pub(super) fn local_read_round(
    raft: Raft,
    mut leaving: watch::Receiver<bool>,
    patience: Duration,
) -> RoundFuture<u64, ConsensusError> {
    Box::pin(async move {
        if *leaving.borrow() {
            transfer::until_settled(&mut leaving).await;
            return Err(ConsensusError::NotLeader);
        }
        let confirm = async {
            loop {
                match raft.get_read_log_id().await.map_err(from_check_error) {
                    Ok((read_log_id, _applied)) => {
                        return Ok(read_log_id.map(|l| l.index).unwrap_or(0));
                    }
                    Err(ConsensusError::NoQuorum) => {
                        tokio::time::sleep(CONFIRM_RETRY_PAUSE).await;
                        // A transfer begun meanwhile: a later confirmation would refresh the
                        // lease it waits out, so this round ends as one begun during it.
                        if *leaving.borrow() {
                            transfer::until_settled(&mut leaving).await;
                            return Err(ConsensusError::NotLeader);
                        }
                    }
                    Err(other) => return Err(other),
                }
            }
        };
        tokio::time::timeout(patience, confirm)
            .await
            .unwrap_or(Err(ConsensusError::NoQuorum))
    })
}

/// One read round from any node: local on the leader, forwarded from a follower.
pub(super) fn any_read_round(
    raft: Raft,
    me: NodeId,
    peers: PeerClient,
    timeouts: ConsensusTimeouts,
    cut_off: Arc<AtomicBool>,
    leaving: watch::Receiver<bool>,
) -> RoundFuture<u64, ConsensusError> {
    Box::pin(async move {
        let mut stale = None;
        // A leader that handed its leadership over: the round goes to the next one.
        let mut after_transfer = false;
        loop {
            match leader_ref(&raft, me) {
                LeaderRef::Me => {
                    match local_read_round(raft.clone(), leaving.clone(), timeouts.election_timeout)
                        .await
                    {
                        Err(ConsensusError::NotLeader) if !after_transfer => {
                            after_transfer = true;
                            if !matches!(leader_ref(&raft, me), LeaderRef::Me) {
                                stale = Some(me);
                            } else {
                                continue;
                            }
                        }
                        result => return result,
                    }
                }
                LeaderRef::Other { id, addr } => {
                    let answer: Result<Result<u64, ConsensusError>, _> = peers
                        .post_json(&addr, routes::READ_INDEX, &(), timeouts.request)
                        .await;
                    match answer {
                        Ok(Err(ConsensusError::NotLeader)) => stale = Some(id),
                        Ok(result) => return result,
                        // A read round changes nothing, so any failure can be retried.
                        Err(_) => stale = Some(id),
                    }
                }
                LeaderRef::Unknown if cut_off.load(Ordering::Relaxed) => {
                    return Err(cut_off_error(&raft, me, &peers, timeouts.election_timeout));
                }
                LeaderRef::Unknown => {}
            }
            if !wait_for_new_leader(&raft, stale, timeouts.leader_wait).await {
                return Err(leaderless(&raft, me, &peers, timeouts.election_timeout));
            }
        }
    })
}

impl Consensus {
    /// Confirm with a quorum that this node is still the leader, in a round that starts after
    /// this call (shared with concurrent callers).
    pub async fn confirm_leadership(&self) -> Result<(), ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        self.inner.leader_reads.confirm().await.map(|_| ())
    }

    /// Make the next local read linearizable: confirm leadership with a quorum (shared with
    /// concurrent callers) and wait until this node has applied up to the read index.
    pub async fn read_barrier(&self) -> Result<(), ConsensusError> {
        let t = self.inner.timeouts.request;
        let index = match tokio::time::timeout(t, self.inner.reads.confirm()).await {
            Ok(result) => result.map_err(no_leader_for_clients)?,
            Err(_) => {
                return Err(ConsensusError::Timeout {
                    ms: t.as_millis() as u64,
                });
            }
        };
        if self.inner.view.wait_applied(index, t).await {
            Ok(())
        } else {
            Err(ConsensusError::Timeout {
                ms: t.as_millis() as u64,
            })
        }
    }

    /// The read index, confirmed by this node as leader (the target of forwarded read rounds).
    pub async fn read_index_here(&self) -> Result<u64, ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        self.inner.leader_reads.confirm().await
    }
}
