//! Proposals: [`Consensus::propose`] from any node (here on the leader, else forwarded:
//! `forward`), [`Consensus::propose_here`] on the leader (the storage quota, and the wait for
//! the lease service before a registration), and [`Consensus::submit`], which enqueues a
//! command for the proposal queue (`queue`) and resolves with its applied result.
//!
//! # Invariants
//! - Proposals enqueued one after another reach the log in that order.
//! - A leader that lost its quorum, or hands its leadership over, enqueues nothing: the
//!   proposal fails having done nothing (`NoQuorum`; `NotLeader` once the transfer ended).
//! - A proposal in flight when its leader stops leading answers `OutcomeUnknown`, never an
//!   error that says nothing was done.
//! - Where a lease service is installed, a leader proposes a registration only once it tracks
//!   leases in the leader's term, stamped with its lease clock.
//! - A proposal forwarded here is never forwarded again: off the leader `propose_here` answers
//!   `NotLeader`.
//!
//! # What it must not do
//! Decide anything about a command (the state machine applies it), or call the lease stamper
//! for anything but a registration: callers submit other commands while holding the lease
//! tracker's lock.

use super::*;

impl Consensus {
    /// Install the lease clock reader that stamps registrations on this node as leader (see
    /// [`crate::domain::lease`]: a stamped registration is a checkpoint). Set once.
    pub fn set_lease_stamper(&self, stamper: LeaseStamper) {
        let _ = self.inner.lease_stamper.set(stamper);
    }

    /// Install the lease service's view of the term it tracks leases in.
    pub fn set_lease_tracking(&self, tracking: watch::Receiver<u64>) {
        let _ = self.inner.lease_tracking.set(tracking);
    }

    /// Wait (bounded by two election timeouts: a new leader tracks once it applied an entry of
    /// its term, usually within a heartbeat) until the lease service tracks leases in this
    /// leader's term. The one wait of everything that needs the leader's lease tracker: a
    /// refresh, and a registration, which proposed before that would carry no lease clock
    /// stamp, so that the next leader would grant it its whole TTL again from its own promote
    /// (an abandoned lease registered just after a failover outlived its TTL by a failover more).
    pub async fn until_lease_tracking(&self) -> Result<(), ConsensusError> {
        let Some(rx) = self.inner.lease_tracking.get() else {
            return Ok(());
        };
        let term = self.leader_term().ok_or(ConsensusError::NotLeader)?;
        let mut rx = rx.clone();
        match tokio::time::timeout(
            self.inner.timeouts.election_timeout * 2,
            rx.wait_for(|t| *t == term),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            // Nothing was proposed: the caller may retry (a new leader, or this one once it
            // has caught up).
            _ => Err(ConsensusError::NoLeader),
        }
    }

    /// A registration leaves the leader stamped with its lease clock, when it has one. Only
    /// registrations call the stamper, so callers that submit other commands while holding the
    /// lease tracker's lock (expiries, checkpoints, clears) never re-enter it.
    fn stamp(&self, mut cmd: Command) -> Command {
        if let Command::RegisterLease { clock_ms, .. } | Command::RegisterMember { clock_ms, .. } =
            cmd.inner_mut()
            && clock_ms.is_none()
            && let Some(stamper) = self.inner.lease_stamper.get()
        {
            *clock_ms = stamper();
        }
        cmd
    }

    /// Enqueue a proposal, synchronously: proposals enqueued one after another (by any caller)
    /// reach the log in that order. Resolves with the applied result. Only meaningful on the
    /// leader: elsewhere it fails with `NotLeader`.
    pub fn submit(
        &self,
        cmd: Command,
    ) -> impl Future<Output = Result<Response, ConsensusError>> + Send + 'static {
        // A leader handing its leadership over takes nothing new: the proposal waits for the
        // transfer's end and is then refused, never proposed (its caller goes to the next
        // leader).
        let transferring = self.inner.intake.is_leaving();
        let mut leaving = transferring.then(|| self.inner.intake.subscribe());
        let cmd = self.stamp(cmd);
        // A leader cut off from its quorum could never commit it: say so now, having done
        // nothing, rather than time out with the outcome in doubt.
        let gated = !transferring && self.quorum_lost();
        // The term this node leads in now: a proposal outlives it only as `outcome_unknown`.
        // (Server metrics change with the role and vote only, not with every applied entry.)
        let mut role = self.inner.raft.server_metrics();
        let led_term = {
            let m = role.borrow();
            (m.state == ServerState::Leader).then_some(m.vote.leader_id().term)
        };
        let (tx, rx) = oneshot::channel();
        let sent = !gated && !transferring && self.inner.proposals.send((cmd, tx)).is_ok();
        let t = self.inner.timeouts.request;
        async move {
            if let Some(leaving) = leaving.as_mut() {
                let _ = tokio::time::timeout(t, transfer::until_settled(leaving)).await;
                return Err(ConsensusError::NotLeader);
            }
            if gated {
                return Err(ConsensusError::NoQuorum);
            }
            if !sent {
                return Err(ConsensusError::ShuttingDown);
            }
            // openraft keeps the proposal of a leader that stepped down (for lost quorum, or a
            // higher term) waiting: a later leader may commit the entry, or truncate it, or
            // nothing may happen for a long while. Waiting out the request timeout would tell
            // the client the same thing, later.
            let deposed = async move {
                match led_term {
                    Some(term) => {
                        let stopped = role
                            .wait_for(|m| {
                                m.state != ServerState::Leader || m.vote.leader_id().term != term
                            })
                            .await
                            .is_err();
                        if stopped {
                            // The core stopped: the reply channel says so.
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                reply = rx => match reply {
                    Ok(result) => result,
                    Err(_) => Err(ConsensusError::ShuttingDown),
                },
                _ = deposed => Err(ConsensusError::OutcomeUnknown {
                    detail: "this node stopped leading with the write in flight: a new leader \
                             may still apply it"
                        .into(),
                }),
                _ = tokio::time::sleep(t) => Err(ConsensusError::Timeout {
                    ms: t.as_millis() as u64,
                }),
            }
        }
    }

    /// Propose a command from any node and return its applied response.
    pub async fn propose(&self, cmd: Command) -> Result<Response, ConsensusError> {
        let t = self.inner.timeouts.request;
        match tokio::time::timeout(t, self.propose_anywhere(cmd)).await {
            Ok(result) => result,
            Err(_) => Err(ConsensusError::Timeout {
                ms: t.as_millis() as u64,
            }),
        }
    }

    async fn propose_anywhere(&self, cmd: Command) -> Result<Response, ConsensusError> {
        if self.transferring() {
            // This leader hands over: propose to whichever node leads once it has.
            transfer::until_settled(&mut self.inner.intake.subscribe()).await;
        }
        // The common case moves the command straight into the log, without a copy.
        if matches!(leader_ref(&self.inner.raft, self.inner.id), LeaderRef::Me) {
            return self.propose_here(cmd).await.map_err(no_leader_for_clients);
        }
        self.forward(cmd).await
    }

    /// Propose on this node only (the target of forwarded proposals): `NotLeader` if it is not
    /// the leader, so that a forwarded request is never forwarded again.
    pub async fn propose_here(&self, mut cmd: Command) -> Result<Response, ConsensusError> {
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        if matches!(
            cmd.inner_mut(),
            Command::RegisterLease { .. } | Command::RegisterMember { .. }
        ) {
            self.until_lease_tracking().await?;
        }
        // The leader's own use decides for the cluster: every write goes through here.
        let storage = &self.inner.storage;
        storage
            .quota
            .admit(&cmd, self.storage_used())
            .map_err(|e| ConsensusError::QuotaExceeded {
                used_bytes: e.used_bytes,
                quota_bytes: e.quota_bytes,
            })?;
        self.submit(cmd).await
    }
}
