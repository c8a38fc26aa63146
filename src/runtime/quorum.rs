//! The quorum watchdog: a leader that has not heard from a quorum within an election timeout
//! steps down.
//!
//! openraft 0.9 keeps a cut-off leader in the leader state for ever: it never hears the higher
//! term the rest of the cluster moved to. Meanwhile it would accept writes that can never
//! commit and call itself healthy. This driver watches the leader's "last acknowledged by a
//! quorum" age (openraft's `millis_since_quorum_ack`), asks the pure rule
//! (`domain::health::leader_lost_quorum`) whether the quorum is lost, and if so asks the
//! consensus layer to step down ([`QuorumPort::step_down`]). Until it has stepped down, the
//! consensus layer already refuses proposals with `no_quorum` (same rule), so stepping down
//! late only delays the role change, never a client's answer.
//!
//! # What it must not do
//! Judge anything itself (the rule is in `domain::health`), or read a clock other than the one
//! it is given.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::health::{Tenure, leader_lost_quorum};

/// What the watchdog needs from the consensus layer.
pub trait QuorumPort: Send + Sync + 'static {
    /// If this node leads: its term, and ms since a quorum last acknowledged it (if ever).
    fn leader_status(&self) -> Option<(u64, Option<u64>)>;
    /// Stop leading; whether this node no longer leads.
    fn step_down(&self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>>;
    /// Once a leader is known again, stop failing fast for lack of a quorum.
    fn clear_cut_off_if_led(&self);
}

/// Steps a leader down when it has lost its quorum.
pub struct QuorumWatchdog<P> {
    pub port: P,
    pub clock: Arc<dyn Clock>,
    /// How often to look (a heartbeat interval).
    pub check_every: Duration,
    /// The longest election timeout.
    pub election_timeout: Duration,
}

impl<P: QuorumPort> QuorumWatchdog<P> {
    pub async fn run(self, cancel: CancellationToken) {
        let timeout_ms = self.election_timeout.as_millis() as u64;
        let mut tenure = Tenure::default();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.check_every) => {}
            }
            self.port.clear_cut_off_if_led();
            let status = self.port.leader_status();
            let leading_for = tenure.observe(status.map(|(term, _)| term), self.clock.mono());
            let Some((_, ack_age)) = status else {
                continue;
            };
            if leader_lost_quorum(ack_age, leading_for, timeout_ms) {
                self.port.step_down().await;
            }
        }
    }
}
