//! The election watchdog: a defence against openraft 0.9's election stall.
//!
//! openraft 0.9 draws a node's election timeout once per process. Two surviving voters whose
//! draws land on the same tick can split their votes in every term, forever (fixed upstream only
//! in 0.10). The configuration makes the election window wide relative to the tick, which makes
//! the tie rare; this watchdog makes it harmless: when a voter has seen no leader for
//! `stall_after`, it waits a fresh random delay and then campaigns itself. Fresh randomness at
//! every stall breaks the symmetry that the fixed draw created.
//!
//!
//! It also shortens failover after a leader dies: a follower whose leader has been silent for
//! longer than the leader lease ([`crate::domain::health::leader_silent`]) campaigns after a
//! short random delay, instead of waiting for openraft's own timer (a lease plus a whole
//! election timeout).
//!
//! # What it must not do
//! Campaign while a leader is known, or count time with a clock reading: it counts its own
//! check intervals, so a paused or slow runtime only delays it.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::domain::health::leader_silent;

/// What the watchdog needs from the consensus layer.
pub trait ElectionPort: Send + Sync + 'static {
    /// Whether a leader is currently known to this node.
    fn leader_known(&self) -> bool;
    /// Milliseconds since this node, a follower of another known leader, last accepted that
    /// leader's append (`None` when it leads, knows no leader, or was never led).
    fn leader_silence_ms(&self) -> Option<u64>;
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
    /// How long a silent leader is waited for (the leader lease plus a margin).
    pub silence_after: Duration,
    /// The random delay before campaigning against a silent leader: `[0, silence_jitter_max)`.
    pub silence_jitter_max: Duration,
}

impl<P: ElectionPort> ElectionWatchdog<P> {
    pub async fn run(self, cancel: CancellationToken) {
        let stall_checks =
            (self.stall_after.as_millis() / self.check_every.as_millis().max(1)).max(1) as u64;
        let mut leaderless_checks = 0u64;
        // Campaigns in the current leaderless stretch: the first is worth a warning, the
        // repeats (a lost quorum can last hours) are not.
        let mut stall_campaigns = 0u64;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.check_every) => {}
            }
            if !self.port.is_voter() {
                leaderless_checks = 0;
                continue;
            }
            let silent = |port: &P| {
                leader_silent(
                    port.leader_silence_ms(),
                    self.silence_after.as_millis() as u64,
                )
            };
            if silent(&self.port) {
                leaderless_checks = 0;
                if !self.pause(self.silence_jitter_max, &cancel).await {
                    return;
                }
                if silent(&self.port) {
                    tracing::info!("leader silent past its lease; campaigning");
                    self.port.elect().await;
                }
                continue;
            }
            if self.port.leader_known() {
                if stall_campaigns > 0 {
                    tracing::info!(campaigns = stall_campaigns, "a leader is known again");
                    stall_campaigns = 0;
                }
                leaderless_checks = 0;
                continue;
            }
            leaderless_checks += 1;
            if leaderless_checks < stall_checks {
                continue;
            }
            leaderless_checks = 0;
            if !self.pause(self.jitter_max, &cancel).await {
                return;
            }
            if !self.port.leader_known() {
                if stall_campaigns == 0 {
                    tracing::warn!(
                        "no leader for a while; campaigning to break a possible election tie \
                         (repeated quietly until a leader is known)"
                    );
                } else {
                    tracing::debug!(stall_campaigns, "still no leader; campaigning again");
                }
                stall_campaigns += 1;
                self.port.elect().await;
            }
        }
    }

    /// Sleep a random `[0, max)`; false if cancelled meanwhile.
    async fn pause(&self, max: Duration, cancel: &CancellationToken) -> bool {
        let ms = rand::rng().random_range(0..max.as_millis().max(1) as u64);
        tokio::select! {
            _ = cancel.cancelled() => false,
            _ = tokio::time::sleep(Duration::from_millis(ms)) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    use super::*;

    /// A follower whose leader went silent `silence` ms ago (u64::MAX: it leads, no silence).
    struct FakePort {
        silence: AtomicU64,
        elections: Arc<AtomicUsize>,
    }

    impl ElectionPort for FakePort {
        fn leader_known(&self) -> bool {
            true
        }
        fn leader_silence_ms(&self) -> Option<u64> {
            let s = self.silence.load(Ordering::Relaxed);
            (s != u64::MAX).then_some(s)
        }
        fn is_voter(&self) -> bool {
            true
        }
        fn elect(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
            self.elections.fetch_add(1, Ordering::Relaxed);
            // A candidate no longer follows: no silence to act on.
            self.silence.store(u64::MAX, Ordering::Relaxed);
            Box::pin(async {})
        }
    }

    async fn elections_after(silence_ms: u64) -> usize {
        let elections = Arc::new(AtomicUsize::new(0));
        let dog = ElectionWatchdog {
            port: FakePort {
                silence: AtomicU64::new(silence_ms),
                elections: elections.clone(),
            },
            check_every: Duration::from_millis(100),
            stall_after: Duration::from_millis(4000),
            jitter_max: Duration::from_millis(1000),
            silence_after: Duration::from_millis(1100),
            silence_jitter_max: Duration::from_millis(200),
        };
        let cancel = CancellationToken::new();
        let run = tokio::spawn(dog.run(cancel.clone()));
        tokio::time::sleep(Duration::from_millis(2000)).await;
        cancel.cancel();
        run.await.unwrap();
        elections.load(Ordering::Relaxed)
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_campaigns_once_its_leader_is_silent_past_the_lease() {
        assert_eq!(elections_after(1101).await, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_of_a_live_leader_or_a_leader_never_campaigns() {
        assert_eq!(elections_after(1100).await, 0);
        assert_eq!(elections_after(50).await, 0);
        assert_eq!(elections_after(u64::MAX).await, 0);
    }
}
