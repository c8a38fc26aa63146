//! What this node knows of the cluster's health, for the pure rules of `domain::health`: quorum
//! loss, readiness, the cluster view with each member's reachability and lag; the leader's way
//! out when it lost its quorum ([`Consensus::step_down`]); and the ports the quorum and election
//! watchdogs drive. Reads openraft's metrics and the peer contacts; decides nothing itself.

use super::*;

impl Consensus {
    /// Whether this node leads but has not heard from a quorum within an election timeout.
    /// (A leader not yet acknowledged since its election is judged by the quorum watchdog,
    /// which knows how long it has led.)
    pub fn quorum_lost(&self) -> bool {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        m.state == ServerState::Leader
            && m.millis_since_quorum_ack.is_some()
            && health::leader_lost_quorum(
                m.millis_since_quorum_ack,
                0,
                self.inner.timeouts.election_timeout.as_millis() as u64,
            )
    }

    /// Whether this node leads while its followers are not keeping up (see
    /// [`health::replication_strained`]).
    pub fn replication_strained(&self) -> bool {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        m.state == ServerState::Leader
            && health::replication_strained(m.millis_since_quorum_ack, self.election_timeout_ms())
    }

    /// The term this node leads in and how long ago a quorum acknowledged it, if it leads.
    pub fn leader_status(&self) -> Option<(u64, Option<u64>)> {
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        (m.state == ServerState::Leader).then_some((m.current_term, m.millis_since_quorum_ack))
    }

    /// Step down as leader: make this node a follower without a leader, so that it stops
    /// serving writes and reads and the rest of the cluster (if it can reach a quorum) elects
    /// another leader. Returns whether this node no longer leads.
    ///
    /// openraft 0.9 has no step-down call (a leader leaves only when a higher vote reaches it,
    /// or when it is removed from the membership), and triggering an election would only make
    /// it a candidate that keeps the old term's followers waiting. So the node hands its own
    /// Raft core the vote request a peer would send: term + 1, for the smallest other voter,
    /// with this node's own last log id. The core grants it (the log is as long, the term
    /// higher), which persists the vote and turns this node into a follower. Why that voter:
    /// a vote `(term + 1, v)` compares below any leader `(term + 1, w)` with `w >= v`, so this
    /// node still accepts whichever real leader the others elect in that term; and granting it
    /// promises nothing else (a real vote request from `v` is still checked against the log).
    /// The cost: while cut off, the node campaigns in ever higher terms (openraft 0.9 has no
    /// pre-vote), so healing the partition makes the majority's leader step down once.
    pub async fn step_down(&self) -> bool {
        let raft = &self.inner.raft;
        let (term, vote, last_log_index, other_voter) = {
            let m = raft.metrics();
            let m = m.borrow();
            if m.state != ServerState::Leader {
                return true;
            }
            let other = m
                .membership_config
                .membership()
                .voter_ids()
                .filter(|v| *v != self.inner.id)
                .min();
            (m.current_term, m.vote, m.last_log_index, other)
        };
        let Some(other_voter) = other_voter else {
            // The only voter is its own quorum: it cannot lose it.
            return false;
        };
        // Every entry of this leader's log tail carries its own (committed) leader id.
        let last_log_id = last_log_index.map(|i| LogId::new(vote.leader_id, i));
        let req = VoteRequest::new(Vote::new(term + 1, other_voter), last_log_id);
        match raft.vote(req).await {
            Ok(resp) if resp.vote_granted => {
                self.inner.cut_off.store(true, Ordering::Relaxed);
                tracing::warn!(
                    term,
                    "no quorum acknowledged this leader within an election timeout; stepped down"
                );
                true
            }
            // A log entry appended meanwhile, or the leader lease: try again at the next check.
            Ok(_) => false,
            Err(e) => {
                tracing::warn!(error = %e, "stepping down failed");
                false
            }
        }
    }

    /// Forget that this node stepped down for lack of a quorum once it knows a leader again
    /// (the quorum watchdog calls this at every check).
    pub fn clear_cut_off_if_led(&self) {
        if self.inner.cut_off.load(Ordering::Relaxed)
            && self.inner.raft.metrics().borrow().current_leader.is_some()
        {
            self.inner.cut_off.store(false, Ordering::Relaxed);
        }
    }

    /// The peer client (its contact record).
    pub fn peers(&self) -> &PeerClient {
        &self.inner.peers
    }

    /// What this node knows of its own health, now.
    pub fn health(&self) -> NodeHealth {
        // Read before the metrics are borrowed (see the module's invariants on that borrow).
        let ages = self.inner.peers.contacts().ages();
        let applied = self.inner.view.applied().log_index;
        let m = self.inner.raft.metrics();
        let m = m.borrow();
        self.health_of(&m, &ages, applied)
    }

    /// [`Consensus::health`] from readings already taken.
    fn health_of(
        &self,
        m: &openraft::RaftMetrics<NodeId, BasicNode>,
        ages: &BTreeMap<NodeId, u64>,
        applied: u64,
    ) -> NodeHealth {
        let is_leader = m.state == ServerState::Leader && m.current_leader == Some(self.inner.id);
        NodeHealth {
            node_id: self.inner.id,
            leader_id: m.current_leader,
            is_leader,
            quorum_ack_age_ms: if is_leader {
                m.millis_since_quorum_ack
            } else {
                None
            },
            leader_contact_age_ms: m.current_leader.and_then(|l| ages.get(&l).copied()),
            applied_index: applied,
            commit_index: self.inner.committed.load(Ordering::Relaxed).max(applied),
        }
    }

    /// Whether this node is ready (`domain::health::readiness`), now.
    pub fn readiness(&self) -> Result<(), health::NotReady> {
        health::readiness(&self.health(), self.election_timeout_ms())
    }

    /// The longest election timeout.
    pub fn election_timeout(&self) -> std::time::Duration {
        self.inner.timeouts.election_timeout
    }

    pub(super) fn election_timeout_ms(&self) -> u64 {
        self.inner.timeouts.election_timeout.as_millis() as u64
    }

    /// This node's view of the cluster once it satisfies `settled` (a change committed on the
    /// leader reaches a forwarding node a moment later), or as it is after the request timeout.
    pub async fn view_once(&self, settled: impl Fn(&ClusterView) -> bool) -> ClusterView {
        let mut changes = self.inner.raft.metrics();
        let settle = async {
            loop {
                if settled(&self.cluster_view()) || changes.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(self.inner.timeouts.request, settle).await;
        self.cluster_view()
    }

    /// This node's view of the cluster.
    pub fn cluster_view(&self) -> ClusterView {
        let m = self.inner.raft.metrics().borrow().clone();
        let applied = self.inner.view.applied();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let ages = self.inner.peers.contacts().ages();
        let et = self.election_timeout_ms();
        let is_leader = m.state == ServerState::Leader;
        let last_log_index = m.last_log_index.unwrap_or(0);
        let nodes = membership
            .nodes()
            .map(|(id, node)| {
                let me = *id == self.inner.id;
                let age = if me { Some(0) } else { ages.get(id).copied() };
                // Only the leader talks to every member; elsewhere silence proves nothing
                // about members other than the leader.
                let knows = me || is_leader || m.current_leader == Some(*id);
                let matched = if is_leader {
                    if me {
                        Some(last_log_index)
                    } else {
                        replicated_index(&m, *id)
                    }
                } else {
                    None
                };
                MemberNode {
                    id: *id,
                    address: node.addr.clone(),
                    voter: voters.contains(id),
                    status: MemberStatus {
                        reachable: knows.then(|| health::reachable(age, et)),
                        last_contact_ms: age,
                        lag: is_leader.then(|| last_log_index.saturating_sub(matched.unwrap_or(0))),
                        matched_index: matched,
                    },
                }
            })
            .collect();
        let readiness = health::readiness(
            &self.health_of(&m, &ages, applied.log_index),
            self.election_timeout_ms(),
        );
        let state = match m.state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        };
        ClusterView {
            node_id: self.inner.id,
            state: state.to_string(),
            leader_id: m.current_leader,
            term: m.current_term,
            commit_index: self
                .inner
                .committed
                .load(Ordering::Relaxed)
                .max(applied.log_index),
            applied_index: applied.log_index,
            last_log_index: m.last_log_index.unwrap_or(0),
            revision: applied.revision,
            nodes,
            ready: readiness.is_ok(),
            not_ready: readiness.err(),
            quorum_ack_ms: if is_leader {
                m.millis_since_quorum_ack
            } else {
                None
            },
            // Not Raft's to know: the HTTP layer adds it (`http::AppState::cluster_view`).
            etcd_url: None,
        }
    }
}

impl crate::runtime::quorum::QuorumPort for Consensus {
    fn leader_status(&self) -> Option<(u64, Option<u64>)> {
        Consensus::leader_status(self)
    }

    fn step_down(&self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        // A leader handing its leadership over goes quiet on purpose (its transfer is
        // bounded, and stepping down would vote for a node other than the transferee).
        if self.transferring() {
            return Box::pin(std::future::ready(false));
        }
        Box::pin(Consensus::step_down(self))
    }

    fn clear_cut_off_if_led(&self) {
        Consensus::clear_cut_off_if_led(self)
    }
}

impl ElectionPort for Consensus {
    fn leader_known(&self) -> bool {
        self.inner.raft.metrics().borrow().current_leader.is_some()
    }

    fn leader_silence_ms(&self) -> Option<u64> {
        let following = {
            let m = self.inner.raft.metrics();
            let m = m.borrow();
            m.state == ServerState::Follower && m.current_leader.is_some_and(|l| l != self.inner.id)
        };
        following
            .then(|| self.inner.peers.contacts().led_age())
            .flatten()
    }

    fn may_campaign(&self) -> bool {
        let voter = {
            let m = self.inner.raft.metrics();
            let m = m.borrow();
            m.membership_config
                .membership()
                .voter_ids()
                .any(|id| id == self.inner.id)
        };
        voter && !self.elections_held()
    }

    fn elect(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            // A leadership transfer is under way: the transferee campaigns, nobody else.
            if self.elections_held() {
                return;
            }
            let _ = self.inner.raft.trigger().elect().await;
        })
    }

    fn prevote(&self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        Box::pin(self.prevote_round())
    }
}

impl Consensus {
    /// Ask every other voter whether it would vote for this node now (`domain::prevote`),
    /// each within a minimum election timeout; won with a majority of every configuration.
    /// A voter on an older build (no such route) counts as granting: its real vote decides.
    async fn prevote_round(&self) -> bool {
        let me = self.inner.id;
        let (configs, addresses) = {
            let m = self.inner.raft.metrics();
            let m = m.borrow();
            let membership = m.membership_config.membership();
            let configs: Vec<BTreeSet<NodeId>> = membership.get_joint_config().clone();
            let addresses: Vec<(NodeId, String)> = membership
                .voter_ids()
                .filter(|id| *id != me)
                .filter_map(|id| membership.get_node(&id).map(|n| (id, n.addr.clone())))
                .collect();
            (configs, addresses)
        };
        let req = PreVoteRequest {
            candidate: me,
            last_log_id: self.inner.raft.data_metrics().borrow().last_log,
        };
        let within = Duration::from_millis(self.inner.raft.config().election_timeout_min);
        let peers = &self.inner.peers;
        let mut asks: futures::stream::FuturesUnordered<_> = addresses
            .iter()
            .map(|(id, addr)| {
                let req = &req;
                async move {
                    let answer: Result<PreVoteAnswer, PeerError> =
                        peers.post_json(addr, routes::PREVOTE, req, within).await;
                    match answer {
                        Ok(a) => a.granted.then_some(*id),
                        Err(PeerError::NoRoute { .. }) => Some(*id),
                        Err(_) => None,
                    }
                }
            })
            .collect();
        let mut granted = BTreeSet::from([me]);
        // Done as soon as a majority granted: a voter that is down would otherwise hold the
        // answer for the whole timeout, long enough for another candidate to win meanwhile
        // (then this node's campaign would depose it).
        let mut won = crate::domain::prevote::won(&configs, &granted);
        while !won && let Some(answer) = futures::StreamExt::next(&mut asks).await {
            granted.extend(answer);
            won = crate::domain::prevote::won(&configs, &granted);
        }
        tracing::debug!(?granted, won, "pre-vote");
        won
    }
}
