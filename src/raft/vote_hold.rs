//! A node that starts with an empty data dir to join a running cluster does not vote until its
//! log shows that the cluster no longer counts it as a voter it may have been (the rule and
//! why: [`crate::domain::vote_release`]).
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
//! This is the adapter: the log store, the append handler and the snapshot handler tell it
//! what was stored and what the leader had committed; [`VoteRelease`] decides.
//!
//! # Invariants
//! - The hold is noted in the data dir ([`HOLD_FILE`]) before the node answers anything, and
//!   the note removed only on release: a restart before the release (with a vote saved by
//!   then, so the data dir no longer looks empty) holds again. The note also keeps the first
//!   commit point once known (a restart learning a later one would only wait longer).
//! - Once released, the hold stays released.
//! - Released only by what this node holds durably: memberships it appended, counted once the
//!   sync thread has synced them ([`VoteHold::follow_durable`]), or installed with a snapshot;
//!   a cut of the log (a conflicting suffix) forgets the memberships it removed.
//! - While held the node does not campaign either (`Consensus::elections_held` keeps the
//!   election watchdog, the only one that campaigns, quiet): a vote for itself is a vote.
//!
//! # What it must not do
//! Hold anything for a node that started from existing data, or for the nodes of a new
//! cluster (they must vote for its first leader).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use openraft::{BasicNode, LogId, Membership};

use super::NodeId;
use crate::domain::vote_release::VoteRelease;

/// The file in the data dir that says this node withholds its vote.
pub const HOLD_FILE: &str = "vote-held";

/// The note's line that keeps the first commit point.
const FIRST_COMMIT: &str = "first-commit ";

/// Whether this node withholds its vote (shared by the log store, the append and snapshot
/// handlers and the vote handler).
#[derive(Debug)]
pub struct VoteHold {
    me: NodeId,
    held: AtomicBool,
    /// What decides the release; only consulted while held.
    release: Mutex<VoteRelease>,
    /// The note in the data dir (none in unit tests).
    note: Option<PathBuf>,
}

impl VoteHold {
    /// The hold of node `me` with data in `data_dir`: held if `start_held` (it starts empty to
    /// join a running cluster) or if a start before this one held it and was not released.
    pub fn open(me: NodeId, data_dir: &Path, start_held: bool) -> std::io::Result<Arc<VoteHold>> {
        let note = data_dir.join(HOLD_FILE);
        let noted = match std::fs::read_to_string(&note) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        let held = start_held || noted.is_some();
        // A note from an older build is empty: the first commit point is learnt again.
        let first_commit = noted.as_deref().and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix(FIRST_COMMIT))
                .and_then(|n| n.trim().parse().ok())
        });
        let hold = VoteHold {
            me,
            held: AtomicBool::new(held),
            release: Mutex::new(VoteRelease::new(first_commit)),
            note: Some(note),
        };
        if held {
            hold.write_note(first_commit)?;
            tracing::warn!(
                "this node joins with an empty data dir: it does not vote until the cluster \
                 lists it as a learner (a new node) or has replaced it (a member that lost its \
                 data)"
            );
        }
        Ok(Arc::new(hold))
    }

    /// A hold that is never noted on disk (tests).
    pub fn in_memory(me: NodeId, held: bool) -> Arc<VoteHold> {
        Arc::new(VoteHold {
            me,
            held: AtomicBool::new(held),
            release: Mutex::new(VoteRelease::new(None)),
            note: None,
        })
    }

    /// What the log held at start: entries up to `last_index`, the latest membership.
    pub fn opened_with(
        &self,
        last_index: Option<u64>,
        membership: Option<(u64, &Membership<NodeId, BasicNode>)>,
    ) {
        self.update(|r| {
            if let Some((index, m)) = membership {
                r.membership(index, self.lists_me(m));
            }
            if let Some(last) = last_index {
                r.durable_up_to(last);
            }
            None
        });
    }

    /// An append from the leader of `leader_term`, accepted, with the leader's commit point.
    pub fn leader_append(&self, leader_term: u64, leader_commit: Option<&LogId<NodeId>>) {
        let commit = leader_commit.map(|c| (c.leader_id.term, c.index));
        self.update(|r| r.append_from_leader(leader_term, commit));
    }

    /// A membership this node stored at `index` (an appended entry, or an installed
    /// snapshot's).
    pub fn stored(&self, index: u64, membership: &Membership<NodeId, BasicNode>) {
        self.update(|r| {
            r.membership(index, self.lists_me(membership));
            None
        });
    }

    /// The log is durable up to `index` (synced, or covered by an installed snapshot).
    pub fn durable_up_to(&self, index: u64) {
        self.update(|r| {
            r.durable_up_to(index);
            None
        });
    }

    /// The log's entries from `from` on were removed.
    pub fn truncated(&self, from: u64) {
        self.update(|r| {
            r.truncated(from);
            None
        });
    }

    /// Follows the log's durable mark until the hold is released (or the node stops): the
    /// release counts only synced entries, and the sync thread moves the mark.
    pub async fn follow_durable(
        self: std::sync::Arc<Self>,
        mut durable: super::durability::DurableView,
        stop: tokio_util::sync::CancellationToken,
    ) {
        while self.is_held() {
            let mark = durable.current();
            if mark.failed {
                return;
            }
            if let Some(last) = mark.last {
                self.durable_up_to(last.index);
            }
            tokio::select! {
                changed = durable.changed() => if changed.is_err() { return },
                _ = stop.cancelled() => return,
            }
        }
    }

    /// Whether votes are withheld.
    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// Whether the node is held although its log reached the first commit point, and still
    /// counted as a voter there: it lost its data and nobody replaced it (the leader that saw
    /// its acknowledgements changed before it came back). It may ask to be replaced.
    pub fn still_counted_as_voter(&self) -> bool {
        self.is_held()
            && self
                .release
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .still_counted_as_voter()
    }

    fn lists_me(&self, membership: &Membership<NodeId, BasicNode>) -> bool {
        membership.voter_ids().any(|v| v == self.me)
    }

    /// Apply `change` while held (it returns the first commit point if it learnt it), and
    /// release if the rule now says so. The note is written and removed under the same lock,
    /// so a release is never followed by a note written again.
    fn update(&self, change: impl FnOnce(&mut VoteRelease) -> Option<u64>) {
        if !self.is_held() {
            return;
        }
        let mut r = self.release.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c0) = change(&mut r) {
            tracing::info!(
                first_commit = c0,
                "vote hold: the first commit point (a leader's commit of its own term)"
            );
            if let Err(e) = self.write_note(Some(c0)) {
                // Learnt again after a restart (a later one): the hold only lasts longer.
                tracing::warn!(error = %e, "could not note the first commit point in {HOLD_FILE}");
            }
        }
        if r.releases() && self.held.swap(false, Ordering::AcqRel) {
            if let Some(note) = &self.note
                && let Err(e) = std::fs::remove_file(note)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                // Held again after a restart, until the membership is seen again: safe.
                tracing::warn!(error = %e, "could not remove {HOLD_FILE}");
            }
            tracing::info!(
                "the cluster lists this node as a non-voter and its log holds what was \
                 committed: it votes once it is a voter"
            );
        }
    }

    /// Write the note (with the first commit point, if known), durably.
    fn write_note(&self, first_commit: Option<u64>) -> std::io::Result<()> {
        let Some(note) = &self.note else {
            return Ok(());
        };
        let text = first_commit.map_or(String::new(), |c| format!("{FIRST_COMMIT}{c}\n"));
        let tmp = note.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, note)?;
        if let Some(dir) = note.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
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
        hold.leader_append(
            1,
            Some(&LogId::new(openraft::CommittedLeaderId::new(1, 1), 20)),
        );
        // The old configurations of a log replayed from the start: its learner entry, then
        // its promotion, both below the leader's commit point.
        hold.stored(3, &membership(&[1, 2, 3], &[4]));
        hold.stored(5, &membership(&[1, 2, 3, 4], &[]));
        hold.durable_up_to(30);
        assert!(hold.is_held());
        // Removed, then added back as a learner: released.
        hold.stored(31, &membership(&[1, 2, 3], &[4]));
        assert!(hold.is_held(), "appended, not yet synced");
        hold.durable_up_to(31);
        assert!(!hold.is_held());
        // For good.
        hold.stored(32, &membership(&[1, 2, 3, 4], &[]));
        assert!(!hold.is_held());
        assert!(!VoteHold::in_memory(1, false).is_held());
    }

    #[test]
    fn the_note_keeps_the_first_commit_point_across_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let hold = VoteHold::open(4, dir.path(), true).unwrap();
        hold.leader_append(
            2,
            Some(&LogId::new(openraft::CommittedLeaderId::new(2, 1), 40)),
        );
        drop(hold);
        // Started again (the data dir no longer empty): held, with the point it had learnt.
        let hold = VoteHold::open(4, dir.path(), false).unwrap();
        assert!(hold.is_held());
        hold.leader_append(
            3,
            Some(&LogId::new(openraft::CommittedLeaderId::new(3, 2), 90)),
        );
        // A leader of a later term (the term of the one before is not noted) raised it to 90.
        let noted = std::fs::read_to_string(dir.path().join(HOLD_FILE)).unwrap();
        assert_eq!(noted.trim(), "first-commit 90");
        hold.opened_with(Some(40), Some((10, &membership(&[1, 2, 3], &[4]))));
        assert!(hold.is_held(), "held until 90");
        hold.durable_up_to(90);
        assert!(!hold.is_held());
        assert!(!dir.path().join(HOLD_FILE).exists());
        assert!(!VoteHold::open(4, dir.path(), false).unwrap().is_held());
    }
}
