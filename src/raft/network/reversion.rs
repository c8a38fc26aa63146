//! The leader's guard against followers whose log went back (`domain::log_reversion`): the
//! shared tracker the network connections feed with answers, and the channel on which they
//! report a follower that lost its data to the consensus layer, which replaces it.
//!
//! # Invariants
//! - A conflict that the tracker calls a reversion never reaches openraft: the connection
//!   answers "unreachable" instead (openraft backs off and tries again), until the node is
//!   removed, and forgotten when it is added back as a learner.
//! - Reports are bounded: a full channel drops the report (the next conflict reports again).
//!
//! # What it must not do
//! Hold its lock across an await, or decide what to do about a reversion.

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use crate::domain::log_reversion::{Conflict, LeaderKey, MatchTracker};
use crate::raft::NodeId;

/// How many reports may wait for the consensus layer.
const REPORTS: usize = 16;

/// Shared by every connection of one node, and by its consensus layer.
#[derive(Clone)]
pub struct ReversionGuard {
    tracker: Arc<Mutex<MatchTracker>>,
    report: mpsc::Sender<NodeId>,
}

impl ReversionGuard {
    /// A guard, and the receiving end of its reports.
    pub fn new() -> (ReversionGuard, mpsc::Receiver<NodeId>) {
        let (report, reports) = mpsc::channel(REPORTS);
        let guard = ReversionGuard {
            tracker: Arc::default(),
            report,
        };
        (guard, reports)
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, MatchTracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `target` acknowledged `leader`'s entries up to `index`.
    pub fn acknowledged(&self, target: NodeId, leader: LeaderKey, index: u64) {
        self.tracker().acknowledged(target, leader, index);
    }

    /// `target` answered "conflict" to an append of `leader` after `prev_index`: whether its
    /// log went back (then it is reported, and logged the first time).
    pub fn reverted(&self, target: NodeId, leader: LeaderKey, prev_index: u64) -> bool {
        let verdict = self.tracker().conflict(target, leader, prev_index);
        match verdict {
            Conflict::Ordinary => false,
            Conflict::Reverted { matched, first } => {
                if first {
                    tracing::error!(
                        node = target,
                        matched,
                        prev_index,
                        "node {target} acknowledged entries up to {matched} and now lacks \
                         entry {prev_index}: it lost its data (started again with an empty data \
                         dir?). It is not trusted as the member it was; the leader replaces it \
                         (removes it, adds it back to catch up)"
                    );
                }
                // Reported again on later conflicts: a dropped report is not lost for good.
                let _ = self.report.try_send(target);
                true
            }
        }
    }

    /// `target` is added as a learner: its progress starts from nothing.
    pub fn forget(&self, target: NodeId) {
        self.tracker().forget(target);
    }
}
