//! Leadership transfer (etcd's `MoveLeader`, `POST /v1/cluster/leader`) on openraft 0.9,
//! which has no transfer of its own.
//!
//! openraft 0.9 protects a live leader with a lease: a voter that accepted the leader's append
//! within the largest election timeout refuses every vote request, and the leader itself
//! refuses until a quorum has not acknowledged it for that long. So a transferee cannot
//! simply campaign. The leader makes the lease lapse instead, and makes sure that the
//! transferee is the first to campaign once it has:
//! 1. It stops taking new work (`leaving`): proposals and read rounds on it wait until the
//!    transfer ends, then go to whichever node leads (a proposal that waited was never
//!    proposed; a read round never confirmed). It stops its heartbeats.
//! 2. It waits until the transferee holds its whole log (bounded).
//! 3. It calls every other voter ([`routes::TRANSFER`]) for the length of the transfer. The
//!    others hold their elections (openraft's timer and the election watchdog) while the call
//!    lasts; the transferee waits until its leader has been silent for longer than the lease,
//!    then campaigns, again if it must, until it leads or the transfer's time is up.
//!    Its log is as long as anyone's, the leases have lapsed and nobody else campaigns: it
//!    wins, and the old leader, which granted its vote, follows it.
//! 4. Whatever happens, the old leader's heartbeats and intake resume when the call ends
//!    (`Leaving`'s drop), and a follower's hold ends when its call does (`Hold`'s drop): a
//!    leader that dies mid-transfer drops its calls, and the cluster elects as usual.
//!
//! # What it must not do
//! Hold elections on a follower on anyone's word but its current leader's, in its current
//! term, for longer than [`MAX_HOLD`]; or lose a proposal: a proposal either waited and was
//! never proposed, or was proposed before the transfer began and commits as usual (the
//! transferee holds it before it campaigns).

use std::sync::Mutex;

use super::*;

/// The longest a follower holds its elections for a transfer, whatever the leader asks.
pub const MAX_HOLD: Duration = Duration::from_secs(30);

/// The leader's call to a voter during a transfer (see the module docs).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TransferRequest {
    /// The term the leader leads in: a call of another term is refused.
    pub term: u64,
    /// The node that is to lead.
    pub target: NodeId,
    /// How long the transfer may take, in milliseconds.
    pub hold_ms: u64,
}

/// What a voter says when its transfer call ends.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TransferAnswer {
    /// Whether this node leads now.
    pub leads: bool,
}

/// Elections held on this node (several transfers may overlap); the election watchdog (the
/// only one that campaigns: openraft's timer is off) is quiet while any hold lasts.
#[derive(Default)]
pub(super) struct Holds {
    count: Mutex<usize>,
}

impl Holds {
    fn count(&self) -> std::sync::MutexGuard<'_, usize> {
        self.count.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The intake gate of a leader that hands its leadership over.
pub(super) struct Intake {
    leaving: watch::Sender<bool>,
}

impl Default for Intake {
    fn default() -> Self {
        Intake {
            leaving: watch::channel(false).0,
        }
    }
}

impl Intake {
    pub(super) fn subscribe(&self) -> watch::Receiver<bool> {
        self.leaving.subscribe()
    }

    pub(super) fn is_leaving(&self) -> bool {
        *self.leaving.borrow()
    }
}

/// Wait until the transfer that `leaving` reports (if any) has ended.
pub(super) async fn until_settled(leaving: &mut watch::Receiver<bool>) {
    let _ = leaving.wait_for(|l| !*l).await;
}

/// A leader's transfer in progress: heartbeats off and intake closed until dropped.
struct Leaving<'a> {
    consensus: &'a Consensus,
}

impl<'a> Leaving<'a> {
    fn begin(consensus: &'a Consensus) -> Result<Self, ConsensusError> {
        let started = consensus.inner.intake.leaving.send_if_modified(|l| {
            let was = *l;
            *l = true;
            !was
        });
        if !started {
            return Err(ConsensusError::TransferInProgress);
        }
        consensus.inner.raft.runtime_config().heartbeat(false);
        Ok(Leaving { consensus })
    }
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.consensus.inner.raft.runtime_config().heartbeat(true);
        self.consensus.inner.intake.leaving.send_replace(false);
    }
}

/// A follower's hold on its elections: the election watchdog quiet, until dropped.
struct Hold<'a> {
    consensus: &'a Consensus,
}

impl<'a> Hold<'a> {
    fn begin(consensus: &'a Consensus) -> Self {
        *consensus.inner.holds.count() += 1;
        Hold { consensus }
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        let mut count = self.consensus.inner.holds.count();
        *count = count.saturating_sub(1);
    }
}

impl Consensus {
    /// Whether this node holds its elections for a transfer (the election watchdog asks).
    pub fn elections_held(&self) -> bool {
        *self.inner.holds.count() > 0 || self.vote_withheld()
    }

    /// Whether this node withholds its vote (`raft::vote_hold`): it does not campaign either.
    pub fn vote_withheld(&self) -> bool {
        self.vote_hold().is_some_and(|h| h.is_held())
    }

    /// Whether this node, as leader, is handing its leadership over.
    pub fn transferring(&self) -> bool {
        self.inner.intake.is_leaving()
    }

    /// How long a transfer may take: the lease to lapse, then two elections.
    pub fn transfer_timeout(&self) -> Duration {
        let config = self.inner.raft.config();
        Duration::from_millis(3 * config.election_timeout_max + 2 * config.heartbeat_interval + 500)
    }

    /// Make `target` the leader, from any node (forwarded to the leader). Answers the leader
    /// once `target` leads.
    pub async fn move_leader(&self, target: NodeId) -> Result<NodeId, ConsensusError> {
        self.on_leader(routes::MOVE_LEADER, &target, Delivery::AtMostOnce, || {
            self.move_leader_here(target)
        })
        .await
    }

    /// Hand this leader's leadership to `target` (see the module docs).
    pub async fn move_leader_here(&self, target: NodeId) -> Result<NodeId, ConsensusError> {
        let me = self.inner.id;
        let (term, voters) = {
            let m = self.inner.raft.metrics();
            let m = m.borrow();
            if m.state != ServerState::Leader || m.current_leader != Some(me) {
                return Err(ConsensusError::NotLeader);
            }
            let membership = m.membership_config.membership();
            let voters: BTreeMap<NodeId, String> = membership
                .voter_ids()
                .filter_map(|id| membership.get_node(&id).map(|n| (id, n.addr.clone())))
                .collect();
            (m.current_term, voters)
        };
        if target == me {
            return Ok(me);
        }
        if !voters.contains_key(&target) {
            return Err(ConsensusError::BadTransferee { id: target });
        }
        if self.quorum_lost() {
            return Err(ConsensusError::NoQuorum);
        }
        let hold = self.transfer_timeout();
        let leaving = Leaving::begin(self)?;
        tracing::info!(target, term, "transferring leadership");

        // The transferee must hold every entry before it campaigns: the proposals already
        // in the log commit under the next leader.
        let catch_up = self.inner.timeouts.election_timeout * 2;
        let mut rx = self.inner.raft.metrics();
        let caught_up = matches!(
            tokio::time::timeout(
                catch_up,
                rx.wait_for(|m| {
                    m.state == ServerState::Leader
                        && replicated_index(m, target) >= m.last_log_index
                        && m.last_applied.map(|l| l.index) >= m.last_log_index
                }),
            )
            .await,
            Ok(Ok(_))
        );
        if !caught_up {
            tracing::warn!(
                target,
                "transfer abandoned: the transferee did not catch up"
            );
            return Err(ConsensusError::TransferFailed {
                detail: format!(
                    "node {target} did not catch up with the leader's log within {} ms",
                    catch_up.as_millis()
                ),
            });
        }

        let req = TransferRequest {
            term,
            target,
            hold_ms: hold.as_millis() as u64,
        };
        let peers = &self.inner.peers;
        let call = |addr: String| {
            let req = req.clone();
            async move {
                let answer: Result<Result<TransferAnswer, ConsensusError>, PeerError> = peers
                    .post_json(&addr, routes::TRANSFER, &req, hold + Duration::from_secs(1))
                    .await;
                answer
            }
        };
        let others = futures::future::join_all(
            voters
                .iter()
                .filter(|(id, _)| **id != me && **id != target)
                .map(|(_, addr)| call(addr.clone())),
        );
        let campaign = call(voters[&target].clone());
        // The others hold their elections for as long as their calls last: until the
        // transferee's call ends (dropping `others` ends them).
        let answer = tokio::select! {
            answer = campaign => answer,
            _ = others => std::future::pending().await,
        };
        // The transferee leads (or gave up): wait until this node knows, briefly.
        let led_by_target = matches!(
            tokio::time::timeout(
                self.inner.timeouts.election_timeout,
                rx.wait_for(|m| m.current_leader == Some(target) && m.current_term > term),
            )
            .await,
            Ok(Ok(_))
        );
        drop(leaving);
        if led_by_target {
            tracing::info!(target, "leadership transferred");
            return Ok(target);
        }
        let detail = match answer {
            Ok(Ok(TransferAnswer { leads: true })) => {
                format!("node {target} was elected but this node has not heard from it yet")
            }
            Ok(Ok(_)) => format!(
                "node {target} did not win an election within {} ms",
                hold.as_millis()
            ),
            Ok(Err(e)) => format!("node {target} refused: {e}"),
            Err(e) => format!("node {target} could not be reached: {e}"),
        };
        tracing::warn!(target, %detail, "leadership transfer failed");
        Err(ConsensusError::TransferFailed { detail })
    }

    /// A voter's side of a transfer (the leader's call): hold elections, or, as the
    /// transferee, campaign once the leader's lease has lapsed. Answers when done.
    pub async fn transfer_here(
        &self,
        sender: NodeId,
        req: TransferRequest,
    ) -> Result<TransferAnswer, ConsensusError> {
        let me = self.inner.id;
        let (leader, term) = {
            let m = self.inner.raft.metrics();
            let m = m.borrow();
            (m.current_leader, m.current_term)
        };
        // Only the leader this node follows, in its term, may hold its elections.
        if leader != Some(sender) || term != req.term || sender == me {
            return Err(ConsensusError::NotLeader);
        }
        // A node that withholds its vote (it joined empty) takes no leadership either.
        if req.target == me && self.vote_withheld() {
            return Ok(TransferAnswer { leads: false });
        }
        let hold = Duration::from_millis(req.hold_ms).min(MAX_HOLD);
        let _hold = Hold::begin(self);
        let mut rx = self.inner.raft.metrics();
        if req.target != me {
            // Hold until a leader of a later term is known, or the time is up.
            let _ = tokio::time::timeout(
                hold,
                rx.wait_for(|m| m.current_term > term && m.current_leader.is_some()),
            )
            .await;
            return Ok(TransferAnswer { leads: false });
        }
        let config = self.inner.raft.config();
        let lease = Duration::from_millis(config.election_timeout_max);
        let margin = Duration::from_millis(config.heartbeat_interval.max(20));
        let campaign = async {
            loop {
                // Campaign once the leader has been silent for longer than its lease, at
                // every voter: they accepted its last append at about the time this node did.
                let led_age = self.inner.peers.contacts().led_age();
                if crate::domain::health::transferee_may_campaign(
                    led_age,
                    lease.as_millis() as u64,
                    margin.as_millis() as u64,
                ) {
                    tracing::info!(term, "campaigning to take over leadership");
                    let _ = self.inner.raft.trigger().elect().await;
                    let settled = tokio::time::timeout(
                        lease,
                        rx.wait_for(|m| {
                            m.state == ServerState::Leader
                                || (m.current_term > term && m.current_leader.is_some())
                        }),
                    )
                    .await;
                    if matches!(settled, Ok(Ok(_))) {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let _ = tokio::time::timeout(hold, campaign).await;
        Ok(TransferAnswer {
            leads: self.is_leader(),
        })
    }
}
