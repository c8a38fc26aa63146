//! The lease shell: the leader's tracker driven by real time and wired to Raft.
//!
//! - [`LeaseHub`] owns the [`LeaseTracker`] (one `std` mutex, held for a few lines, never
//!   across an await). It observes the apply path, so the tracker learns of registrations and
//!   removals before their proposers are answered.
//! - [`LeaseService`] is what the HTTP layer calls (refresh, remaining time) and what runs the
//!   driver loop: it promotes and demotes the tracker as leadership changes, sleeps until the
//!   next deadline (no fixed polling), and proposes expiries and checkpoints in batches.
//!
//! Every rule (deadlines, the promote condition, refusal of expiring leases, the checkpoint
//! clearing argument) lives in [`crate::domain::lease`]; read it there. This file only
//! sequences: the places where order matters are commented.
//!
//! # Ordering
//! Expiry and checkpoint proposals, and the checkpoint clears of refreshes, are *enqueued while
//! the tracker lock is held* into the consensus layer's proposal queue, which keeps their order. The log therefore
//! receives them in the order the tracker decided them, which is what makes a refresh's clear
//! land after every checkpoint decided before it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock::Clock;
use crate::domain::command::{Cause, Command, LeaseChange, Response};
use crate::domain::lease::{
    ClockReading, ClockWitness, LeaseTracker, RefreshError, TrackerConfig, checkpoint_command,
    clear_command, expire_command, should_track,
};
use crate::domain::limits::{InvalidInput, TtlBounds};
use crate::metrics::Histogram;
use crate::raft::consensus::{Consensus, ConsensusError, Delivery, Forwardable};
use crate::raft::log_store::LogReceipts;
use crate::raft::network::routes;
use crate::raft::state_machine::{AppliedBatch, ApplyObserver};

/// The longest lease: etcd's (`MaxLeaseTTL`, 9,000,000,000 s, about 285 years), so that every
/// TTL an etcd client may ask for is granted. Nothing needs a shorter bound: every deadline
/// sum saturates (`MonoMillis::plus`), the driver's sleep is tokio's (which caps a far
/// deadline), and in JSON the largest value stays below 2^53, exact for JavaScript clients.
pub const MAX_TTL_MS: u64 = 9_000_000_000 * 1000;
/// The default shortest lease.
pub const DEFAULT_MIN_TTL_MS: u64 = 1000;
/// Leases per `ExpireLeases` or `CheckpointLeases` entry.
pub const BATCH: usize = 1000;
/// Expiry and checkpoint entries proposed but not yet applied, at most. A mass expiry (100,000
/// leases at once) is paced through the log a few batches at a time instead of being queued
/// whole: heartbeats and client writes keep their place, and no follower receives one
/// enormous burst to apply.
pub const MAX_IN_FLIGHT: usize = 2;
/// How soon the driver looks again while replication is strained.
const STRAIN_RECHECK: Duration = Duration::from_millis(50);

/// Lease settings of a node.
#[derive(Clone, Copy, Debug)]
pub struct LeaseConfig {
    /// The shortest TTL accepted (never below 1.5 x the election timeout).
    pub min_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub tracker: TrackerConfig,
}

impl LeaseConfig {
    /// Defaults for a cluster whose largest election timeout is `election_max_ms`.
    pub fn new(min_ttl_ms: u64, election_max_ms: u64) -> Self {
        LeaseConfig {
            // A lease shorter than an election would expire during every failover.
            min_ttl_ms: min_ttl_ms.max(election_max_ms.saturating_mul(3) / 2),
            max_ttl_ms: MAX_TTL_MS,
            tracker: TrackerConfig {
                // A margin only (the promote argument needs none): see domain::lease.
                promote_extension_ms: election_max_ms / 10,
                retry_ms: election_max_ms.saturating_mul(2),
                checkpoints: true,
                // With it, a leader that restarted just before it was elected runs at most
                // half an election behind (domain::lease::clock).
                clock_tick_ms: election_max_ms / 2,
            },
        }
    }

    pub fn check_ttl(&self, ttl_ms: u64) -> Result<(), InvalidInput> {
        self.ttl_bounds().check(ttl_ms)
    }

    /// The TTLs a registration may ask for.
    pub fn ttl_bounds(&self) -> TtlBounds {
        TtlBounds {
            min_ms: self.min_ttl_ms,
            max_ms: self.max_ttl_ms,
        }
    }
}

pub use leasecore_client::api::RefreshAck;

/// Why a lease call failed (also the peer-wire error of forwarded lease calls).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LeaseError {
    #[error("lease {name:?} does not exist (or has expired)")]
    NotFound { name: String },
    #[error(transparent)]
    Consensus(#[from] ConsensusError),
}

impl Forwardable for LeaseError {
    fn is_not_leader(&self) -> bool {
        matches!(self, LeaseError::Consensus(ConsensusError::NotLeader))
    }
}

/// Lease counters (every node counts what it applies).
#[derive(Default)]
pub struct LeaseMetrics {
    pub granted: AtomicU64,
    pub refreshed: AtomicU64,
    pub expired: AtomicU64,
    pub revoked: AtomicU64,
    /// Driver rounds that held back expiries and checkpoints for strained replication.
    pub housekeeping_held: AtomicU64,
    /// Expiry lateness on the leader: applied expiry minus deadline, in seconds.
    pub lateness: Mutex<Histogram>,
}

/// The tracker and what feeds it; the apply-path observer.
pub struct LeaseHub {
    time: Arc<dyn Clock>,
    cfg: LeaseConfig,
    tracker: Mutex<LeaseTracker>,
    /// This node's evidence about the lease clock: fed by the log store (receipts) and the
    /// apply path (the highest stamp applied).
    clock: Mutex<ClockWitness>,
    /// Woken when something may have moved the next wake-up earlier.
    wake: Notify,
    pub metrics: LeaseMetrics,
}

impl LeaseHub {
    pub fn new(clock: Arc<dyn Clock>, cfg: LeaseConfig) -> Self {
        LeaseHub {
            time: clock,
            cfg,
            tracker: Mutex::new(LeaseTracker::new(cfg.tracker)),
            clock: Mutex::new(ClockWitness::new()),
            wake: Notify::new(),
            metrics: LeaseMetrics::default(),
        }
    }

    pub fn config(&self) -> LeaseConfig {
        self.cfg
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, LeaseTracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lease clock now, if this node tracks leases (the stamp of a registration it
    /// proposes as leader).
    pub fn clock_now(&self) -> Option<u64> {
        let mut t = self.tracker();
        t.is_primary().then(|| t.stamp(self.time.mono()))
    }

    /// The number of leases this node tracks (0 on followers).
    pub fn tracked(&self) -> usize {
        self.tracker().len()
    }

    fn witness(&self) -> std::sync::MutexGuard<'_, ClockWitness> {
        self.clock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This node's reading of the lease clock, given the state's current value (see
    /// domain::lease::clock).
    fn clock_reading(&self, value: u64, now: crate::domain::types::MonoMillis) -> ClockReading {
        self.witness().reading(value, now)
    }
}

impl LogReceipts for LeaseHub {
    fn received(&self, first: u64, last: u64, stamps: &[(u64, u64)]) {
        let now = self.time.mono();
        self.witness()
            .received(first, last, stamps.iter().copied(), now);
    }

    fn truncated(&self, index: u64) {
        self.witness().truncated(index);
    }
}

impl ApplyObserver for LeaseHub {
    fn on_applied(&self, batch: &AppliedBatch) {
        let now = self.time.mono();
        self.witness()
            .applied(batch.mark.log_index, batch.lease_clock_ms, batch.reset, now);
        if batch.lease_changes.is_empty() {
            return;
        }
        let m = &self.metrics;
        {
            let mut t = self.tracker();
            for change in &batch.lease_changes {
                match change {
                    LeaseChange::Registered {
                        name,
                        revision,
                        ttl_ms,
                        checkpointed,
                    } => {
                        t.on_registered(name, *revision, *ttl_ms, now, *checkpointed);
                        m.granted.fetch_add(1, Ordering::Relaxed);
                    }
                    LeaseChange::Removed { name, cause } => {
                        t.on_removed(name);
                        let counter = match cause {
                            Cause::LeaseExpired => &m.expired,
                            _ => &m.revoked,
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        // A registration may bring the next deadline earlier than the driver's sleep.
        self.wake.notify_one();
    }
}

/// A proposal slot: freed (and the driver woken) when the proposal's task ends.
struct ProposalSlot {
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    hub: Arc<LeaseHub>,
}

impl Drop for ProposalSlot {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.hub.wake.notify_one();
    }
}

/// Lease calls and the driver loop.
pub struct LeaseService {
    hub: Arc<LeaseHub>,
    consensus: Consensus,
    tasks: TaskTracker,
    /// The term this node tracks leases in; 0 when it does not.
    tracking: watch::Sender<u64>,
    /// Expiry and checkpoint proposals not yet applied (see [`MAX_IN_FLIGHT`]).
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
}

impl LeaseService {
    pub fn new(hub: Arc<LeaseHub>, consensus: Consensus, tasks: TaskTracker) -> Self {
        LeaseService {
            hub,
            consensus,
            tasks,
            tracking: watch::channel(0).0,
            in_flight: Arc::default(),
        }
    }

    pub fn hub(&self) -> &LeaseHub {
        &self.hub
    }

    /// The term this node tracks leases in (0: none), as it changes.
    pub fn tracking(&self) -> watch::Receiver<u64> {
        self.tracking.subscribe()
    }

    /// A shared handle to the hub.
    pub fn hub_handle(&self) -> Arc<LeaseHub> {
        self.hub.clone()
    }

    /// Refresh a lease from any node (forwarded to the leader).
    pub async fn refresh(&self, name: &str) -> Result<RefreshAck, LeaseError> {
        self.consensus
            .on_leader(routes::LEASE_REFRESH, name, Delivery::Retryable, || {
                self.refresh_here(name)
            })
            .await
    }

    /// Remaining time of leases from any node (forwarded to the leader): `None` for a lease
    /// the leader does not track.
    pub async fn remaining(&self, names: &[String]) -> Result<Vec<Option<u64>>, LeaseError> {
        self.consensus
            .on_leader(routes::LEASE_REMAINING, names, Delivery::Retryable, || {
                self.remaining_here(names)
            })
            .await
    }

    /// Wait (briefly) until this node tracks leases in its current term (see
    /// [`Consensus::until_lease_tracking`]); otherwise it is not the leader to ask.
    async fn until_tracking(&self) -> Result<(), LeaseError> {
        self.consensus
            .until_lease_tracking()
            .await
            .map_err(|_| ConsensusError::NotLeader.into())
    }

    /// Refresh on this node as leader.
    pub async fn refresh_here(&self, name: &str) -> Result<RefreshAck, LeaseError> {
        self.until_tracking().await?;
        let now = self.hub.time.mono();
        let decided = {
            let mut t = self.hub.tracker();
            match t.refresh(name, now) {
                Err(e) => Err(e),
                Ok(refreshed) => {
                    // Enqueued under the lock: ordered after every checkpoint decided before it.
                    let clear = refreshed.clear.clone().map(|ticket| {
                        let cmd = clear_command(&ticket);
                        (ticket, self.consensus.submit(cmd))
                    });
                    Ok((refreshed, clear))
                }
            }
        };
        let (refreshed, clear) = match decided {
            Ok(d) => d,
            Err(RefreshError::NotPrimary) => return Err(ConsensusError::NotLeader.into()),
            Err(RefreshError::NotFound) => return Err(self.not_found(name).await),
        };
        if let Some((ticket, committed)) = clear {
            committed.await?;
            self.hub.tracker().on_cleared(&ticket);
        }
        // Acknowledge only once a quorum confirmed this node still leads, in a round that
        // started after the refresh arrived (shared with concurrent refreshes and reads).
        self.consensus.confirm_leadership().await?;
        self.hub.metrics.refreshed.fetch_add(1, Ordering::Relaxed);
        let remaining = self
            .hub
            .tracker()
            .remaining(name, self.hub.time.mono())
            .unwrap_or(0);
        Ok(RefreshAck {
            name: name.to_string(),
            ttl_ms: refreshed.ttl_ms,
            remaining_ms: remaining,
        })
    }

    /// "No such lease", said only by a leader that has just confirmed with a quorum that it
    /// still leads: a deposed or isolated leader that still believes it leads does not know the
    /// leases its successor registered, and must not deny them (it answers `NoQuorum`, or
    /// `NotLeader` so that the caller forwards).
    async fn not_found(&self, name: &str) -> LeaseError {
        match self.consensus.confirm_leadership().await {
            Ok(()) => LeaseError::NotFound {
                name: name.to_string(),
            },
            Err(e) => e.into(),
        }
    }

    /// Remaining times on this node as leader. `None` (untracked) is an answer only once a
    /// quorum confirmed this node still leads, for the reason given at `not_found`.
    pub async fn remaining_here(&self, names: &[String]) -> Result<Vec<Option<u64>>, LeaseError> {
        self.until_tracking().await?;
        let now = self.hub.time.mono();
        let remaining: Vec<Option<u64>> = {
            let t = self.hub.tracker();
            names.iter().map(|n| t.remaining(n, now)).collect()
        };
        if remaining.iter().any(Option::is_none) {
            self.consensus.confirm_leadership().await?;
        }
        Ok(remaining)
    }

    /// Promote or demote the tracker to match this node's leadership (`leader_term`), as the
    /// server metrics the driver wakes on report it. Not `Consensus::leader_term`: openraft sends the server
    /// metrics before the full metrics that one reads, so a driver woken by the first could
    /// read the second still stale, decide "not leader", and sleep through the promotion (a
    /// fresh single-node cluster then refused every lease until some other write applied).
    fn reconcile(&self, leader_term: Option<u64>) {
        let applied_term = self.consensus.view().applied().term;
        let term = leader_term.unwrap_or(0);
        let want = should_track(leader_term.is_some(), term, applied_term);
        let current = *self.tracking.borrow();
        if want && current != term {
            let now = self.hub.time.mono();
            let mut t = self.hub.tracker();
            // Read the leases and promote under the tracker lock: the apply path reports each
            // change only after it is visible in the state, and waits for this lock to do so,
            // so no registration or removal falls between the read and the promote.
            let (facts, clock) = self
                .consensus
                .view()
                .with_state(|kv| (kv.lease_facts(), kv.lease_clock_ms()));
            let n = facts.len();
            let reading = self.hub.clock_reading(clock, now);
            t.promote(now, reading, facts);
            drop(t);
            self.tracking.send_replace(term);
            tracing::info!(
                term,
                leases = n,
                lease_clock_ms = reading.value,
                lease_clock_seen_ms_ago = reading.seen_at.until(now),
                "tracking leases as leader"
            );
        } else if !want && current != 0 {
            self.hub.tracker().demote();
            self.tracking.send_replace(0);
            tracing::info!("no longer leader: stopped tracking leases");
        }
    }

    /// Whether a proposal slot is free (see [`MAX_IN_FLIGHT`]). Only the driver takes slots,
    /// so a free slot stays free until it takes it.
    fn slot_free(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) < MAX_IN_FLIGHT
    }

    /// Take a proposal slot for a proposal about to be submitted.
    fn take_slot(&self) -> ProposalSlot {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        ProposalSlot {
            in_flight: self.in_flight.clone(),
            hub: self.hub.clone(),
        }
    }

    /// Propose what is due, as far as free slots allow; returns the time until the next
    /// wake-up (`None` while everything due waits for a slot: a freed slot wakes the loop).
    fn fire_due(self: &Arc<Self>) -> Option<Duration> {
        if self.consensus.replication_strained() {
            // Followers are behind (see domain::health::replication_strained): give them room
            // and look again shortly; client writes keep flowing meanwhile.
            self.hub
                .metrics
                .housekeeping_held
                .fetch_add(1, Ordering::Relaxed);
            return Some(STRAIN_RECHECK);
        }
        let now = self.hub.time.mono();
        let mut t = self.hub.tracker();
        loop {
            if !self.slot_free() {
                return None;
            }
            let expired = t.expired(now, BATCH);
            if expired.is_empty() {
                break;
            }
            let slot = self.take_slot();
            let applied = self.consensus.submit(expire_command(&expired));
            let this = self.clone();
            self.tasks.spawn(async move {
                let _slot = slot;
                match applied.await {
                    Ok(Response::LeasesExpired { expired: gone, .. }) => {
                        let done = this.hub.time.mono();
                        let mut latest = 0;
                        {
                            let mut h = this.hub.metrics.lateness.lock().unwrap_or_else(|p| p.into_inner());
                            for e in expired.iter().filter(|e| gone.contains(&e.name)) {
                                let late = e.deadline.until(done);
                                latest = latest.max(late);
                                h.observe(late as f64 / 1000.0);
                            }
                        }
                        tracing::debug!(
                            n = gone.len(),
                            max_late_ms = latest,
                            names = ?gone.iter().take(8).collect::<Vec<_>>(),
                            "leases expired"
                        );
                    }
                    Ok(other) => tracing::warn!(?other, "unexpected expiry result"),
                    // The tracker re-arms each lease; a leader retries, a deposed one demotes.
                    Err(e) => tracing::warn!(error = %e, n = expired.len(), "expiry not applied; will retry"),
                }
            });
        }
        loop {
            if !self.slot_free() {
                return None;
            }
            let due = t.checkpoints_due(now, BATCH);
            if due.is_empty() {
                break;
            }
            let slot = self.take_slot();
            let applied = self.consensus.submit(checkpoint_command(due));
            self.tasks.spawn(async move {
                let _slot = slot;
                if let Err(e) = applied.await {
                    tracing::warn!(error = %e, "lease checkpoint not applied");
                }
            });
        }
        if !self.slot_free() {
            return None;
        }
        if let Some(clock_ms) = t.clock_tick_due(now) {
            let slot = self.take_slot();
            let applied = self.consensus.submit(Command::LeaseClock { clock_ms });
            self.tasks.spawn(async move {
                let _slot = slot;
                if let Err(e) = applied.await {
                    tracing::debug!(error = %e, "lease clock tick not applied");
                }
            });
        }
        t.next_wakeup()
            .map(|at| Duration::from_millis(now.until(at)))
    }

    /// The driver loop: runs on every node, tracks only on the caught-up leader.
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        // Only leadership changes, not every append.
        let mut metrics = self.consensus.raft().server_metrics();
        let mut applied = self.consensus.view().subscribe();
        loop {
            let leader_term = leader_term_of(&metrics.borrow_and_update());
            self.reconcile(leader_term);
            let tracking = *self.tracking.borrow() != 0;
            let sleep = if tracking { self.fire_due() } else { None };
            let sleep = sleep.unwrap_or(Duration::from_secs(3600));
            tokio::select! {
                _ = cancel.cancelled() => break,
                changed = metrics.changed() => if changed.is_err() { break },
                // Until promoted, every applied batch may complete the promote condition.
                changed = applied.changed(), if !tracking => if changed.is_err() { break },
                _ = self.hub.wake.notified() => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
        self.hub.tracker().demote();
        self.tracking.send_replace(0);
    }
}

/// This node's term if the server metrics say it leads.
fn leader_term_of(server: &crate::raft::ServerMetrics) -> Option<u64> {
    (server.state == openraft::ServerState::Leader && server.current_leader == Some(server.id))
        .then(|| server.vote.leader_id().term)
}
