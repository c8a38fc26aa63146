//! The async runtime's pulse: a task asks to wake every `every` and measures how late it woke.
//! A late wake means that no worker polled a ready task for that long: a worker was blocked (a
//! synchronous lock, a long computation or a sync I/O call on an async worker) or the
//! machine's cores were taken. Either starves the Raft core and the peer streams, so heartbeats
//! go unanswered and a leader may step down; the stall is logged and counted
//! (`leasecore_runtime_stalls_total`, `leasecore_runtime_stall_max_ms`) so that an operator
//! sees it beside the election it causes.
//!
//! Why it exists: a borrow of openraft's metrics held across a wait for the state's lock (the
//! log compactor's, during a 3 s apply) stopped the Raft core on its worker, and every node's
//! runtime with it, for 2.5-3.7 s. Nothing in the logs said so; a probe of this kind did.
//!
//! # What it must not do
//! Decide anything for the cluster (it only reports; the rule is `domain::health::
//! runtime_stalled`), log more than once per [`LOG_EVERY`], or read a clock other than the one
//! it is given.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::health::{WarnThrottle, runtime_stalled, tick_lateness};
use crate::metrics::StallStats;

/// At most one warning in this long (stalls meanwhile are counted in the next one).
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// Measures how late the runtime runs a task that asked to wake.
pub struct StallMonitor {
    pub clock: Arc<dyn Clock>,
    /// How often to tick.
    pub every: Duration,
    /// The shortest election timeout: a stall is judged against it.
    pub election_min: Duration,
    pub stats: Arc<StallStats>,
}

impl StallMonitor {
    pub async fn run(self, cancel: CancellationToken) {
        let every_ms = self.every.as_millis() as u64;
        let election_min_ms = self.election_min.as_millis() as u64;
        let mut warnings = WarnThrottle::new(LOG_EVERY.as_millis() as u64);
        loop {
            let asked = self.clock.mono();
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.every) => {}
            }
            let woke = self.clock.mono();
            let late = tick_lateness(asked, woke, every_ms);
            self.stats.ticks.fetch_add(1, Ordering::Relaxed);
            self.stats.max_late_ms.fetch_max(late, Ordering::Relaxed);
            if !runtime_stalled(late, election_min_ms) {
                continue;
            }
            self.stats.stalls.fetch_add(1, Ordering::Relaxed);
            let Some(stalls) = warnings.occurred(woke) else {
                continue;
            };
            tracing::warn!(
                late_ms = late,
                stalls,
                "the async runtime ran a ready task late: a worker was blocked or the cores \
                 were taken (heartbeats wait as long; see leasecore_runtime_stalls_total)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both workers blocked for longer than half an election timeout: counted as a stall, and
    /// its lateness kept.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blocked_worker_is_counted_as_a_stall() {
        let stats = Arc::new(StallStats::default());
        let cancel = CancellationToken::new();
        let monitor = StallMonitor {
            clock: Arc::new(crate::clock::SystemClock::new()),
            every: Duration::from_millis(5),
            election_min: Duration::from_millis(100),
            stats: stats.clone(),
        };
        let task = tokio::spawn(monitor.run(cancel.clone()));
        // Blocked only once the pulse runs: its first wait must start before the block.
        for _ in 0..500 {
            if stats.ticks.load(Ordering::Relaxed) >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Both workers blocked at once (each waits, boundedly, for the other to start): nothing
        // polls the monitor's timer for 200 ms.
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let block = |started: Arc<std::sync::atomic::AtomicUsize>| async move {
            started.fetch_add(1, Ordering::SeqCst);
            for _ in 0..2_000 {
                if started.load(Ordering::SeqCst) >= 2 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        let (a, b) = tokio::join!(
            tokio::spawn(block(started.clone())),
            tokio::spawn(block(started.clone())),
        );
        a.unwrap();
        b.unwrap();
        // The monitor wakes as soon as a worker is free again; wait for it, within a bound.
        for _ in 0..500 {
            if stats.stalls.load(Ordering::Relaxed) >= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            stats.stalls.load(Ordering::Relaxed) >= 1,
            "the block counted as a stall"
        );
        assert!(stats.max_late_ms.load(Ordering::Relaxed) >= 50);
        cancel.cancel();
        task.await.unwrap();
    }
}
