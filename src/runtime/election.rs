//! The election timer: when a voter campaigns. openraft's own timer is off
//! (`NodeConfig::raft_config`); this watchdog decides, and asks first.
//!
//! - **Pre-vote** ([`crate::domain::prevote`]): before each campaign the node asks the other
//!   voters whether they would vote for it, and campaigns only with a majority. A node cut
//!   off from the others (or stalled) therefore does not raise its term by itself, and, once
//!   back, does not depose a leader that never stopped serving (openraft 0.9 has no
//!   pre-vote: its candidate's higher term, carried by its first answer to the leader's
//!   append, made the leader step down).
//! - **A silent leader**: a follower whose leader has been silent for longer than the leader
//!   lease ([`crate::domain::health::leader_silent`]) tries after a short random delay.
//! - **No leader known** (a failed campaign, a cluster restarted whole): it tries after a fresh
//!   random wait within the election timeout range, drawn again after every try. Fresh
//!   randomness each time keeps two voters from splitting their votes in every term (openraft
//!   0.9 drew its timeout once per process, and two voters could tie forever).
//!
//! # What it must not do
//! Campaign while a leader is known, without a won pre-vote, or count time with a clock
//! reading: it counts its own check intervals, so a paused or slow runtime only delays it.

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
    /// Whether this node may campaign: a voter (learners never do) whose elections are not
    /// held (a leadership transfer under way, or a vote withheld: `raft::vote_hold`).
    fn may_campaign(&self) -> bool;
    /// Ask the other voters whether they would vote for this node now; `true` if a majority
    /// would.
    fn prevote(&self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>>;
    /// Start an election now.
    fn elect(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// Campaigns when a leader is needed, once a pre-vote is won.
pub struct ElectionWatchdog<P> {
    pub port: P,
    /// How often to look.
    pub check_every: Duration,
    /// With no leader known, a try comes after a random wait drawn from
    /// `[election_min, election_max]`.
    pub election_min: Duration,
    pub election_max: Duration,
    /// How long a silent leader is waited for (the leader lease plus a margin).
    pub silence_after: Duration,
    /// The random delay before trying against a silent leader: `[0, silence_jitter_max)`.
    pub silence_jitter_max: Duration,
}

impl<P: ElectionPort> ElectionWatchdog<P> {
    pub async fn run(self, cancel: CancellationToken) {
        let mut leaderless = Duration::ZERO;
        let mut wait = self.draw();
        // Tries in the current leaderless stretch: the first is worth a line, the repeats (a
        // lost quorum can last hours) are not.
        let mut tries = 0u64;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.check_every) => {}
            }
            if !self.port.may_campaign() {
                leaderless = Duration::ZERO;
                continue;
            }
            let silent = |port: &P| {
                leader_silent(
                    port.leader_silence_ms(),
                    self.silence_after.as_millis() as u64,
                )
            };
            if silent(&self.port) {
                leaderless = Duration::ZERO;
                if !self.pause(self.silence_jitter_max, &cancel).await {
                    return;
                }
                if silent(&self.port) {
                    tracing::info!("leader silent past its lease; asking the voters");
                    self.try_campaign(&mut tries, |p| silent(p)).await;
                }
                continue;
            }
            if self.port.leader_known() {
                if tries > 0 {
                    tracing::info!(tries, "a leader is known again");
                    tries = 0;
                }
                leaderless = Duration::ZERO;
                continue;
            }
            leaderless += self.check_every;
            if leaderless < wait {
                continue;
            }
            leaderless = Duration::ZERO;
            wait = self.draw();
            if !self.port.leader_known() {
                if tries == 0 {
                    tracing::info!("no leader known; asking the voters, then campaigning");
                }
                self.try_campaign(&mut tries, |p| !p.leader_known()).await;
            }
        }
    }

    /// A pre-vote, then, if won and `still_needed` (no leader appeared meanwhile: a campaign
    /// would depose it), a campaign.
    async fn try_campaign(&self, tries: &mut u64, still_needed: impl Fn(&P) -> bool) {
        *tries += 1;
        if !self.port.prevote().await {
            tracing::debug!(tries = *tries, "pre-vote lost; not campaigning");
        } else if still_needed(&self.port) {
            tracing::debug!(tries = *tries, "pre-vote won; campaigning");
            self.port.elect().await;
        } else {
            tracing::debug!(
                tries = *tries,
                "pre-vote won, but a leader appeared meanwhile"
            );
        }
    }

    /// A fresh wait within the election timeout range.
    fn draw(&self) -> Duration {
        let (min, max) = (
            self.election_min.as_millis() as u64,
            self.election_max.as_millis() as u64,
        );
        Duration::from_millis(rand::rng().random_range(min..=max.max(min)))
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
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    use super::*;

    /// A follower whose leader went silent `silence` ms ago (u64::MAX: it leads, no silence;
    /// u64::MAX - 1: no leader known).
    struct FakePort {
        silence: AtomicU64,
        prevote_wins: AtomicBool,
        /// A leader is heard from while the pre-vote is out.
        leader_meanwhile: AtomicBool,
        prevotes: Arc<AtomicUsize>,
        elections: Arc<AtomicUsize>,
    }

    const NO_LEADER: u64 = u64::MAX - 1;

    impl ElectionPort for FakePort {
        fn leader_known(&self) -> bool {
            self.silence.load(Ordering::Relaxed) != NO_LEADER
        }
        fn leader_silence_ms(&self) -> Option<u64> {
            let s = self.silence.load(Ordering::Relaxed);
            (s < NO_LEADER).then_some(s)
        }
        fn may_campaign(&self) -> bool {
            true
        }
        fn prevote(&self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
            self.prevotes.fetch_add(1, Ordering::Relaxed);
            if self.leader_meanwhile.load(Ordering::Relaxed) {
                self.silence.store(50, Ordering::Relaxed);
            }
            Box::pin(std::future::ready(
                self.prevote_wins.load(Ordering::Relaxed),
            ))
        }
        fn elect(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
            self.elections.fetch_add(1, Ordering::Relaxed);
            // It leads now: no silence to act on.
            self.silence.store(u64::MAX, Ordering::Relaxed);
            Box::pin(async {})
        }
    }

    /// (pre-votes asked, elections started) in 2 s of a watchdog over `silence_ms`.
    async fn run_for_2s(silence_ms: u64, prevote_wins: bool) -> (usize, usize) {
        run_with(silence_ms, prevote_wins, false).await
    }

    async fn run_with(silence_ms: u64, prevote_wins: bool, meanwhile: bool) -> (usize, usize) {
        let elections = Arc::new(AtomicUsize::new(0));
        let prevotes = Arc::new(AtomicUsize::new(0));
        let dog = ElectionWatchdog {
            port: FakePort {
                silence: AtomicU64::new(silence_ms),
                prevote_wins: AtomicBool::new(prevote_wins),
                leader_meanwhile: AtomicBool::new(meanwhile),
                prevotes: prevotes.clone(),
                elections: elections.clone(),
            },
            check_every: Duration::from_millis(100),
            election_min: Duration::from_millis(400),
            election_max: Duration::from_millis(1000),
            silence_after: Duration::from_millis(1100),
            silence_jitter_max: Duration::from_millis(200),
        };
        let cancel = CancellationToken::new();
        let run = tokio::spawn(dog.run(cancel.clone()));
        tokio::time::sleep(Duration::from_millis(2000)).await;
        cancel.cancel();
        run.await.unwrap();
        (
            prevotes.load(Ordering::Relaxed),
            elections.load(Ordering::Relaxed),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_campaigns_once_its_leader_is_silent_past_the_lease() {
        assert_eq!(run_for_2s(1101, true).await, (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_of_a_live_leader_or_a_leader_never_campaigns() {
        assert_eq!(run_for_2s(1100, true).await, (0, 0));
        assert_eq!(run_for_2s(50, true).await, (0, 0));
        assert_eq!(run_for_2s(u64::MAX, true).await, (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_won_prevote_nobody_campaigns() {
        let (prevotes, elections) = run_for_2s(1101, false).await;
        assert!(prevotes >= 1);
        assert_eq!(elections, 0);
        let (prevotes, elections) = run_for_2s(NO_LEADER, false).await;
        assert!(prevotes >= 1);
        assert_eq!(elections, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn with_no_leader_known_it_campaigns_within_the_election_timeout() {
        assert_eq!(run_for_2s(NO_LEADER, true).await, (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_heard_from_during_the_prevote_is_not_deposed() {
        assert_eq!(run_with(1101, true, true).await, (1, 0));
        assert_eq!(run_with(NO_LEADER, true, true).await, (1, 0));
    }
}
