//! What this node knows of its link to each peer: when it last heard from it ([`Contacts`],
//! a fact for the health rules of `domain::health`), and whether the link is down
//! ([`LinkLog`], which logs each outage once, with reminders, by the rule of
//! `domain::peer_link`).
//!
//! # Invariants
//! - Bounded by the membership: one entry per node id ever heard from or called.
//! - Times are on this process's monotonic clock, read through `crate::clock`.
//! - A lock is held for a few lines, never across an await.
//!
//! # What it must not do
//! Act on what it records. It keeps facts and prints the rule's verdicts; the health rules
//! judge them, and no call to a peer is held back because of them.

use super::PeerError;
use crate::domain::peer_link::{LinkPolicy, LinkReport, PeerLink};
use crate::raft::NodeId;

/// When this node last heard from each peer, on this process's monotonic clock.
///
/// Bounded by the membership: one entry per node id ever heard from (ids are few).
#[derive(Default)]
pub struct Contacts {
    clock: crate::clock::SystemClock,
    last: std::sync::Mutex<std::collections::BTreeMap<NodeId, crate::domain::types::MonoMillis>>,
    /// When this node last accepted an append or a snapshot from a leader (not an answer to
    /// its own RPCs): the "leader alive" fact of the vote rule (`domain::peer_trust`).
    led: std::sync::Mutex<Option<crate::domain::types::MonoMillis>>,
}

impl Contacts {
    /// Record that `id` was heard from just now.
    pub fn heard_from(&self, id: NodeId) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        self.last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, now);
    }

    /// Record that a leader's append or snapshot was accepted just now.
    pub fn led_now(&self) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        *self.led.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
    }

    /// Milliseconds since a leader's append or snapshot was last accepted (None: never).
    pub fn led_age(&self) -> Option<u64> {
        use crate::clock::Clock;
        let now = self.clock.mono();
        let led = *self.led.lock().unwrap_or_else(|p| p.into_inner());
        led.map(|t| t.until(now))
    }

    /// Milliseconds since each peer was last heard from.
    pub fn ages(&self) -> std::collections::BTreeMap<NodeId, u64> {
        use crate::clock::Clock;
        let now = self.clock.mono();
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.iter().map(|(id, t)| (*id, t.until(now))).collect()
    }
}

/// Logs each peer's outages once, with reminders, instead of every failed RPC (the rule is
/// `domain::peer_link`; this only keeps its state per peer and prints its verdicts).
#[derive(Default)]
pub struct LinkLog {
    clock: crate::clock::SystemClock,
    links: std::sync::Mutex<std::collections::BTreeMap<NodeId, PeerLink>>,
}

impl LinkLog {
    fn with_link<T>(&self, id: NodeId, f: impl FnOnce(&mut PeerLink) -> T) -> T {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        f(links.entry(id).or_default())
    }

    /// An RPC to `id` (at `addr`) failed with `e`.
    pub fn failed(&self, id: NodeId, addr: &str, e: &PeerError) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        let report = self.with_link(id, |l| l.failed(now, LinkPolicy::default()));
        match report {
            Some(LinkReport::WentDown { for_ms, failures }) => tracing::warn!(
                peer = id,
                addr,
                error = %e.cause(),
                failing_for_ms = for_ms,
                failures,
                "peer unreachable"
            ),
            Some(LinkReport::StillDown { for_ms, failures }) => tracing::warn!(
                peer = id,
                addr,
                error = %e.cause(),
                failing_for_ms = for_ms,
                failures,
                "peer still unreachable"
            ),
            _ => {}
        }
    }

    /// An RPC to `id` got an answer.
    pub fn answered(&self, id: NodeId, addr: &str) {
        use crate::clock::Clock;
        let now = self.clock.mono();
        if let Some(LinkReport::CameBack { after_ms, failures }) =
            self.with_link(id, |l| l.answered(now))
        {
            tracing::info!(
                peer = id,
                addr,
                down_for_ms = after_ms,
                failures,
                "peer reachable again"
            );
        }
    }
}
