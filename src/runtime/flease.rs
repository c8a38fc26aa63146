//! The Flease shell: runs rounds for owners over the peer HTTP port, feeds peers' messages to
//! the local acceptor, and keeps the acceptor's restart wait in step with the membership.
//!
//! - No task per resource: a round runs inside the request that asked for it; idle resources
//!   cost one acceptor cell (collected when idle and free).
//! - Messages to a peer are batched: concurrent rounds' messages to one destination travel in
//!   one `POST /flease/msg` (a per-destination outbox), and the answers come back in its reply.
//!   Messages to this node go to the local acceptor as messages, never as direct calls, so the
//!   restart wait applies to it too.
//! - The acceptor set is the current Raft voter set; when it changes, the acceptor forgets its
//!   cells and stays silent for the restart wait again (the cost: Flease is unavailable for
//!   about `restart_wait` after every membership change).
//!
//! - Flease and PaxosLease run side by side: one acceptor per protocol (their resources are
//!   separate namespaces), rounds and messages tagged with their protocol.
//! - A release goes first through the ballot that the local acceptor holds the owner's lease
//!   at (one round trip, no read phase); a full release round only if that finds no quorum.
//!
//! Every rule is in [`crate::domain::flease`]; this file sequences I/O and retries.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rand::Rng;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::flease::proposer::{FastRelease, RoundEvent};
use crate::domain::flease::validate;
use crate::domain::flease::{
    Acceptor, Ballot, BallotGen, Envelope, FleaseConfig, Intent, Now, Protocol, Round,
};
use crate::domain::types::{NodeId, WallMillis};
use crate::raft::consensus::Consensus;
use crate::raft::network::PeerClient;

/// The peer route for batched Flease messages.
pub const MSG_ROUTE: &str = "/flease/msg";
/// Rounds per request before giving up.
const MAX_ATTEMPTS: usize = 8;
/// Messages per peer request at most.
const MAX_BATCH: usize = 512;

pub use leasecore_client::api::LeaseView;

/// Why a round could not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FleaseError {
    #[error(
        "no quorum of acceptors answered (a node restarted or the membership changed recently, or a majority is unreachable)"
    )]
    NoQuorum,
}

/// Counters.
#[derive(Default)]
pub struct FleaseMetrics {
    pub rounds: AtomicU64,
    pub granted: AtomicU64,
    pub renewals: AtomicU64,
    pub busy: AtomicU64,
    pub released: AtomicU64,
    pub retries: AtomicU64,
}

type Outgoing = (Envelope, oneshot::Sender<Option<Envelope>>);

/// Flease on this node.
pub struct FleaseService {
    me: NodeId,
    cfg: FleaseConfig,
    clock: Arc<dyn Clock>,
    flease: Mutex<Acceptor>,
    paxos: Mutex<Acceptor>,
    ballots: Mutex<(BallotGen, Ballot)>,
    consensus: Consensus,
    peers: PeerClient,
    outboxes: Mutex<HashMap<NodeId, mpsc::UnboundedSender<Outgoing>>>,
    /// The voter set the acceptor serves.
    view: Mutex<BTreeSet<NodeId>>,
    flease_metrics: FleaseMetrics,
    paxos_metrics: FleaseMetrics,
}

impl FleaseService {
    pub fn new(
        me: NodeId,
        cfg: FleaseConfig,
        clock: Arc<dyn Clock>,
        consensus: Consensus,
        peers: PeerClient,
    ) -> Self {
        let now = Now {
            wall: clock.wall(),
            mono: clock.mono(),
        };
        FleaseService {
            me,
            cfg,
            flease: Mutex::new(Acceptor::for_protocol(Protocol::Flease, me, cfg, now)),
            paxos: Mutex::new(Acceptor::for_protocol(Protocol::PaxosLease, me, cfg, now)),
            // The boot id: this start's wall clock (it grows across restarts).
            ballots: Mutex::new((
                BallotGen::new(me, now.wall.0, cfg.ballot_era_ms),
                Ballot::default(),
            )),
            clock,
            consensus,
            peers,
            outboxes: Mutex::new(HashMap::new()),
            view: Mutex::new(BTreeSet::new()),
            flease_metrics: FleaseMetrics::default(),
            paxos_metrics: FleaseMetrics::default(),
        }
    }

    pub fn config(&self) -> FleaseConfig {
        self.cfg
    }

    fn now(&self) -> Now {
        Now {
            wall: self.clock.wall(),
            mono: self.clock.mono(),
        }
    }

    /// The counters of one protocol.
    pub fn metrics(&self, proto: Protocol) -> &FleaseMetrics {
        match proto {
            Protocol::Flease => &self.flease_metrics,
            Protocol::PaxosLease => &self.paxos_metrics,
        }
    }

    fn acceptor(&self, proto: Protocol) -> std::sync::MutexGuard<'_, Acceptor> {
        match proto {
            Protocol::Flease => &self.flease,
            Protocol::PaxosLease => &self.paxos,
        }
        .lock()
        .unwrap_or_else(|p| p.into_inner())
    }

    /// (cells, nacks, skew suspicions, recovering) of one protocol's acceptor.
    pub fn stats(&self, proto: Protocol) -> (usize, u64, u64, bool) {
        let now = self.now();
        let a = self.acceptor(proto);
        let s = a.stats();
        (a.len(), s.nacks, s.skew_suspicions, a.is_recovering(now))
    }

    /// The voters and their addresses.
    fn members(&self) -> BTreeMap<NodeId, String> {
        let view = self.consensus.cluster_view();
        view.nodes
            .into_iter()
            .filter(|n| n.voter)
            .map(|n| (n.id, n.address))
            .collect()
    }

    /// Handle a batch of peer messages with the local acceptor, unchecked (tests); one answer
    /// per message.
    pub fn on_peer_batch(&self, batch: &[Envelope]) -> Vec<Option<Envelope>> {
        let now = self.now();
        let mut flease = self.acceptor(Protocol::Flease);
        let mut paxos = self.acceptor(Protocol::PaxosLease);
        batch
            .iter()
            .map(|m| match m.proto {
                Protocol::Flease => flease.on_message(m, now),
                Protocol::PaxosLease => paxos.on_message(m, now),
            })
            .collect()
    }

    /// Handle a batch that node `sender` sent, this node's membership being `members`: a
    /// message that fails the acceptor's admission ([`validate::check_incoming`]: impossible
    /// values, or identities that disagree) gets no answer, and why is returned.
    pub fn on_peer_batch_from(
        &self,
        sender: NodeId,
        members: &BTreeSet<NodeId>,
        batch: &[Envelope],
    ) -> (Vec<Option<Envelope>>, Vec<String>) {
        let now = self.now();
        let mut refusals = Vec::new();
        let mut flease = self.acceptor(Protocol::Flease);
        let mut paxos = self.acceptor(Protocol::PaxosLease);
        let answers = batch
            .iter()
            .map(|m| {
                if let Err(why) =
                    validate::check_incoming(m, sender, self.me, members, &self.cfg, now)
                {
                    refusals.push(why);
                    return None;
                }
                match m.proto {
                    Protocol::Flease => flease.on_message(m, now),
                    Protocol::PaxosLease => paxos.on_message(m, now),
                }
            })
            .collect();
        (answers, refusals)
    }

    /// Deliver one message and wait for its answer (None: lost, refused or timed out).
    async fn deliver(self: &Arc<Self>, env: Envelope, addr: Option<String>) -> Option<Envelope> {
        if env.to == self.me {
            let now = self.now();
            return self.acceptor(env.proto).on_message(&env, now);
        }
        let addr = addr?;
        let (tx, rx) = oneshot::channel();
        let outbox = {
            let mut boxes = self.outboxes.lock().unwrap_or_else(|p| p.into_inner());
            boxes
                .entry(env.to)
                .or_insert_with(|| {
                    // The outbox ends when this service (its only sender) is dropped.
                    let (otx, orx) = mpsc::unbounded_channel();
                    let timeout = Duration::from_millis(self.cfg.round_timeout_ms);
                    tokio::spawn(run_outbox(self.peers.clone(), addr.clone(), timeout, orx));
                    otx
                })
                .clone()
        };
        outbox.send((env, tx)).ok()?;
        rx.await.ok().flatten()
    }

    /// Acquire (or renew) `resource` for `owner`.
    pub async fn acquire(
        self: &Arc<Self>,
        proto: Protocol,
        resource: &str,
        owner: &str,
    ) -> Result<LeaseView, FleaseError> {
        self.run(proto, Intent::Acquire, resource, owner).await
    }

    /// Release `resource` if `owner` holds it (the owner has stopped using it); whether it did.
    pub async fn release(
        self: &Arc<Self>,
        proto: Protocol,
        resource: &str,
        owner: &str,
    ) -> Result<bool, FleaseError> {
        if self.fast_release(proto, resource, owner).await {
            self.metrics(proto).released.fetch_add(1, Ordering::Relaxed);
            return Ok(true);
        }
        let view = self.run(proto, Intent::Release, resource, owner).await?;
        Ok(view.granted == Some(true))
    }

    /// Release through the ballot the local acceptor holds `owner`'s lease at; whether a quorum
    /// released it.
    async fn fast_release(self: &Arc<Self>, proto: Protocol, resource: &str, owner: &str) -> bool {
        let now = self.now();
        let grant_k = match self.acceptor(proto).held_by(resource, now) {
            Some((k, holder)) if holder == owner => k,
            _ => return false,
        };
        let members = self.members();
        let ids: Vec<NodeId> = members.keys().copied().collect();
        let (mut release, msgs) =
            FastRelease::start(proto, self.me, resource, owner, &ids, grant_k, now);
        let mut inflight = FuturesUnordered::new();
        for m in msgs {
            let addr = members.get(&m.to).cloned();
            inflight.push(self.deliver(m, addr));
        }
        let wait = Duration::from_millis(self.cfg.round_timeout_ms);
        let outcome = tokio::time::timeout(wait, async {
            while let Some(reply) = inflight.next().await {
                if let Some(done) = reply.and_then(|r| release.on_reply(&r)) {
                    return done;
                }
            }
            false
        });
        outcome.await.unwrap_or(false)
    }

    /// What this node's acceptor knows of `resource` (local, not a quorum read; for PaxosLease
    /// a hint, as only the holder knows its lease exactly).
    pub fn peek(&self, proto: Protocol, resource: &str) -> LeaseView {
        let now = self.now();
        let (holder, valid_ms, epoch) = self.acceptor(proto).local_view(resource, now);
        LeaseView {
            resource: resource.to_string(),
            granted: None,
            holder,
            valid_ms,
            epoch,
        }
    }

    async fn run(
        self: &Arc<Self>,
        proto: Protocol,
        intent: Intent,
        resource: &str,
        owner: &str,
    ) -> Result<LeaseView, FleaseError> {
        for _ in 0..MAX_ATTEMPTS {
            self.metrics(proto).rounds.fetch_add(1, Ordering::Relaxed);
            let members = self.members();
            let ids: Vec<NodeId> = members.keys().copied().collect();
            let now = self.now();
            let k = {
                let mut b = self.ballots.lock().unwrap_or_else(|p| p.into_inner());
                let (generator, seen) = &mut *b;
                generator.next(now.wall, *seen, rand::rng().random())
            };
            let (mut round, msgs) = Round::start_in(
                proto, intent, self.me, resource, owner, &ids, k, self.cfg, now,
            );
            let mut inflight = FuturesUnordered::new();
            for m in msgs {
                let addr = members.get(&m.to).cloned();
                inflight.push(self.deliver(m, addr));
            }
            let outcome = loop {
                let wait = Duration::from_millis(self.now().mono.until(round.deadline()));
                tokio::select! {
                    Some(reply) = inflight.next(), if !inflight.is_empty() => {
                        let Some(reply) = reply else { continue };
                        match round.on_reply(&reply, self.now()) {
                            RoundEvent::Pending => {}
                            RoundEvent::Send(more) => {
                                for m in more {
                                    let addr = members.get(&m.to).cloned();
                                    inflight.push(self.deliver(m, addr));
                                }
                            }
                            done => break done,
                        }
                    }
                    _ = tokio::time::sleep(wait) => {
                        match round.on_timeout(self.now()) {
                            RoundEvent::Pending => {}
                            done => break done,
                        }
                    }
                }
            };
            match outcome {
                RoundEvent::Granted(g) => {
                    self.metrics(proto).granted.fetch_add(1, Ordering::Relaxed);
                    if g.renewal {
                        self.metrics(proto).renewals.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(LeaseView {
                        resource: resource.to_string(),
                        granted: Some(true),
                        holder: Some(g.owner),
                        valid_ms: self.now().mono.until(g.valid_until),
                        epoch: g.epoch,
                    });
                }
                RoundEvent::Busy {
                    owner: holder,
                    expires,
                    epoch,
                } => {
                    self.metrics(proto).busy.fetch_add(1, Ordering::Relaxed);
                    let now = self.now();
                    return Ok(LeaseView {
                        resource: resource.to_string(),
                        granted: Some(false),
                        holder: Some(holder),
                        valid_ms: expires.0.saturating_sub(now.wall.0 + self.cfg.eps_ms),
                        epoch,
                    });
                }
                RoundEvent::Released { epoch } => {
                    self.metrics(proto).released.fetch_add(1, Ordering::Relaxed);
                    return Ok(LeaseView {
                        resource: resource.to_string(),
                        granted: Some(true),
                        holder: None,
                        valid_ms: 0,
                        epoch,
                    });
                }
                RoundEvent::NotHeld => {
                    return Ok(LeaseView {
                        resource: resource.to_string(),
                        granted: Some(false),
                        holder: None,
                        valid_ms: 0,
                        epoch: 0,
                    });
                }
                RoundEvent::Retry {
                    seen, not_before, ..
                } => {
                    self.metrics(proto).retries.fetch_add(1, Ordering::Relaxed);
                    {
                        let mut b = self.ballots.lock().unwrap_or_else(|p| p.into_inner());
                        b.1 = b.1.max(seen);
                    }
                    let backoff = rand::rng().random_range(20..120);
                    let until =
                        not_before.map_or(0, |w: WallMillis| w.0.saturating_sub(self.now().wall.0));
                    tokio::time::sleep(Duration::from_millis(backoff.max(until))).await;
                }
                RoundEvent::Pending | RoundEvent::Send(_) => {}
            }
        }
        Err(FleaseError::NoQuorum)
    }

    /// Keep the acceptor's view in step with the voter set; collect idle cells.
    pub async fn run_maintenance(self: Arc<Self>, cancel: CancellationToken) {
        let mut membership = self.consensus.raft().server_metrics();
        let gc_every = Duration::from_millis(self.cfg.t_max_ms.max(100));
        loop {
            let voters: BTreeSet<NodeId> = self.members().keys().copied().collect();
            {
                let mut view = self.view.lock().unwrap_or_else(|p| p.into_inner());
                if !voters.is_empty() && *view != voters {
                    if !view.is_empty() {
                        // A new acceptor set: forget and wait, as after a restart.
                        let now = self.now();
                        self.acceptor(Protocol::Flease).rearm(now);
                        self.acceptor(Protocol::PaxosLease).rearm(now);
                        tracing::info!(
                            ?voters,
                            "flease: membership changed; acceptor silent for the restart wait"
                        );
                    }
                    *view = voters;
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                changed = membership.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(gc_every) => {
                    let now = self.now();
                    self.acceptor(Protocol::Flease).collect_idle(now);
                    self.acceptor(Protocol::PaxosLease).collect_idle(now);
                }
            }
        }
    }
}

/// One destination's outbox: everything queued by the time a request leaves goes in it.
async fn run_outbox(
    peers: PeerClient,
    addr: String,
    timeout: Duration,
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
) {
    while let Some(first) = queue.recv().await {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let (msgs, replies): (Vec<Envelope>, Vec<_>) = batch.into_iter().unzip();
        let answers: Vec<Option<Envelope>> = peers
            .post_msgpack(&addr, MSG_ROUTE, &msgs, timeout)
            .await
            .unwrap_or_default();
        let mut answers = answers.into_iter();
        for reply in replies {
            let _ = reply.send(answers.next().flatten());
        }
    }
}
