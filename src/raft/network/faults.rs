//! Fault injection for tests: the peers this node must not reach, a partition as seen from
//! here. The peer client checks it before each send ([`PeerClient`](super::PeerClient)).
//!
//! # Invariants
//! - Empty in production: no peer is blocked unless a test asked for it.
//! - A blocked message is lost, as in a real partition: the client waits a little (never past
//!   the call's deadline) and reports a transport failure, never `Unreachable`.
//!
//! # What it must not do
//! Anything but drop messages: it never delays, reorders or alters one that goes through.

/// Fault injection for tests: peers this node must not reach (a partition seen from here).
/// Empty in production; checked before each send.
#[derive(Default)]
pub struct Faults {
    blocked: std::sync::RwLock<std::collections::HashSet<String>>,
}

impl Faults {
    /// Drop every message to `addr` from now on.
    pub fn block(&self, addr: &str) {
        self.blocked
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr.to_string());
    }

    /// Heal every partition.
    pub fn heal(&self) {
        self.blocked
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    pub(super) fn is_blocked(&self, addr: &str) -> bool {
        let blocked = self.blocked.read().unwrap_or_else(|p| p.into_inner());
        !blocked.is_empty() && blocked.contains(addr)
    }
}
