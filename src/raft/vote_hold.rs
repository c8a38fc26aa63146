//! A node that starts with an empty data dir to join a running cluster does not vote until the
//! cluster has made it a non-voter since: until its log (or a snapshot it installed) holds a
//! membership in which it is not a voter.
//!
//! Why: a member that lost its data and is started again with `--join` (the command line of a
//! node added later, which names no peers to ask first) would otherwise vote with an empty
//! log and a forgotten vote: it could elect a leader that lacks writes it had acknowledged, or
//! vote twice in one term. The leader replaces such a node when it notices
//! (`raft::network::reversion`: removed, added back as a learner, promoted once caught up), and
//! a genuinely new node is a learner until then as well; so every node that joins honestly
//! passes through a membership that lists it as a non-voter, and holding its vote until then
//! costs nothing.
//!
//! # Invariants
//! - The hold is noted in the data dir ([`HOLD_FILE`]) before the node answers anything, and
//!   the note removed only on release: a restart before the release (with a vote saved by
//!   then, so the data dir no longer looks empty) holds again.
//! - Once released, the hold stays released.
//! - Released only by a membership this node stored (appended, or installed with a snapshot).
//!
//! # What it must not do
//! Hold anything for a node that started from existing data, or for the nodes of a new
//! cluster (they must vote for its first leader).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use openraft::{BasicNode, Membership};

use super::NodeId;

/// The file in the data dir that says this node withholds its vote.
pub const HOLD_FILE: &str = "vote-held";

/// Whether this node withholds its vote (shared by the log store, the snapshot handler and
/// the vote handler).
#[derive(Debug)]
pub struct VoteHold {
    me: NodeId,
    held: AtomicBool,
    /// The note in the data dir (none in unit tests).
    note: Option<PathBuf>,
}

impl VoteHold {
    /// The hold of node `me` with data in `data_dir`: held if `start_held` (it starts empty to
    /// join a running cluster) or if a start before this one held it and was not released.
    pub fn open(me: NodeId, data_dir: &Path, start_held: bool) -> std::io::Result<Arc<VoteHold>> {
        let note = data_dir.join(HOLD_FILE);
        let held = start_held || note.exists();
        if held {
            let file = std::fs::File::create(&note)?;
            file.sync_all()?;
            std::fs::File::open(data_dir)?.sync_all()?;
            tracing::warn!(
                "this node joins with an empty data dir: it does not vote until the cluster \
                 lists it as a learner (a new node) or has replaced it (a member that lost its \
                 data)"
            );
        }
        Ok(Arc::new(VoteHold {
            me,
            held: AtomicBool::new(held),
            note: Some(note),
        }))
    }

    /// A hold that is never noted on disk (tests).
    pub fn in_memory(me: NodeId, held: bool) -> Arc<VoteHold> {
        Arc::new(VoteHold {
            me,
            held: AtomicBool::new(held),
            note: None,
        })
    }

    /// A membership this node stored: a configuration without it as a voter releases the hold.
    pub fn stored(&self, membership: &Membership<NodeId, BasicNode>) {
        if !self.held.load(Ordering::Acquire) || membership.voter_ids().any(|v| v == self.me) {
            return;
        }
        self.held.store(false, Ordering::Release);
        if let Some(note) = &self.note
            && let Err(e) = std::fs::remove_file(note)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            // Held again after a restart, until the membership is seen again: safe.
            tracing::warn!(error = %e, "could not remove {HOLD_FILE}");
        }
        tracing::info!("the cluster lists this node as a non-voter: it votes once it is a voter");
    }

    /// Whether votes are withheld.
    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn membership(voters: &[NodeId], learners: &[NodeId]) -> Membership<NodeId, BasicNode> {
        let nodes: BTreeMap<NodeId, BasicNode> = voters
            .iter()
            .chain(learners)
            .map(|id| (*id, BasicNode::new(format!("n{id}"))))
            .collect();
        let voters: BTreeSet<NodeId> = voters.iter().copied().collect();
        Membership::new(vec![voters], nodes)
    }

    #[test]
    fn a_voter_configuration_keeps_the_hold_and_a_non_voter_one_releases_it() {
        let hold = VoteHold::in_memory(4, true);
        // The old configurations of a log replayed from the start list it as a voter.
        hold.stored(&membership(&[1, 2, 3, 4], &[]));
        assert!(hold.is_held());
        // Removed, then added back as a learner: released.
        hold.stored(&membership(&[1, 2, 3], &[4]));
        assert!(!hold.is_held());
        // For good.
        hold.stored(&membership(&[1, 2, 3, 4], &[]));
        assert!(!hold.is_held());
        assert!(!VoteHold::in_memory(1, false).is_held());
    }
}
