//! Newtypes shared by every layer.
//!
//! Two kinds of time exist in leasecore and must never mix: [`MonoMillis`] is a reading of one
//! node's monotonic clock (lease deadlines on the leader, client-side validity) and means nothing
//! on another node; [`WallMillis`] is synchronized wall-clock time (Flease), comparable across
//! nodes only up to the skew bound epsilon. Keeping them distinct types makes mixing them a
//! compile error. Neither is ever stored in the replicated state.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A Raft node id, stable for the life of a node's data directory.
pub type NodeId = u64;

/// The store revision: one counter for the whole store, advanced by every applied mutation.
/// Identical on every replica because it is derived from applied entries only.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Revision(pub u64);

impl Revision {
    /// The revision after this one.
    pub fn next(self) -> Revision {
        Revision(self.0 + 1)
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Milliseconds on one node's monotonic clock (arbitrary origin, never goes back).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct MonoMillis(pub u64);

impl MonoMillis {
    /// `self + ms`, saturating.
    pub fn plus(self, ms: u64) -> MonoMillis {
        MonoMillis(self.0.saturating_add(ms))
    }

    /// Milliseconds from `self` until `later`, zero if `later` is not later.
    pub fn until(self, later: MonoMillis) -> u64 {
        later.0.saturating_sub(self.0)
    }
}

/// Milliseconds since the Unix epoch on a skew-bounded wall clock.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct WallMillis(pub u64);
