//! The election watchdog: a defence against openraft 0.9's election stall.
//!
//! openraft 0.9 draws a node's election timeout once per process. Two surviving voters whose
//! draws land on the same tick can split their votes in every term, forever (fixed upstream only
//! in 0.10). The configuration makes the election window wide relative to the tick, which makes
//! the tie rare; this watchdog makes it harmless: when a voter has seen no leader for
//! `stall_after`, it waits a fresh random delay and then campaigns itself. Fresh randomness at
//! every stall breaks the symmetry that the fixed draw created.
//!
//! # What it must not do
//! Campaign while a leader is known, or count time with a clock reading: it counts its own
//! check intervals, so a paused or slow runtime only delays it.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

/// What the watchdog needs from the consensus layer.
pub trait ElectionPort: Send + Sync + 'static {
    /// Whether a leader is currently known to this node.
    fn leader_known(&self) -> bool;
    /// Whether this node is a voter (learners never campaign).
    fn is_voter(&self) -> bool;
    /// Start an election now.
    fn elect(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// Watches for a leaderless cluster and breaks election ties.
pub struct ElectionWatchdog<P> {
    pub port: P,
    /// How often to look.
    pub check_every: Duration,
    /// How long without a leader counts as a stall.
    pub stall_after: Duration,
    /// The random delay before campaigning is drawn from `[0, jitter_max)`.
    pub jitter_max: Duration,
}

impl<P: ElectionPort> ElectionWatchdog<P> {
    pub async fn run(self, cancel: CancellationToken) {
        let stall_checks =
            (self.stall_after.as_millis() / self.check_every.as_millis().max(1)).max(1) as u64;
        let mut leaderless_checks = 0u64;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.check_every) => {}
            }
            if self.port.leader_known() || !self.port.is_voter() {
                leaderless_checks = 0;
                continue;
            }
            leaderless_checks += 1;
            if leaderless_checks < stall_checks {
                continue;
            }
            leaderless_checks = 0;
            let jitter_ms = rand::rng().random_range(0..self.jitter_max.as_millis().max(1) as u64);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(jitter_ms)) => {}
            }
            if !self.port.leader_known() {
                tracing::warn!(
                    "no leader for a while; campaigning to break a possible election tie"
                );
                self.port.elect().await;
            }
        }
    }
}
