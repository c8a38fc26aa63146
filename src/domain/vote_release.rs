//! When a node that started with an empty data dir to join a running cluster may vote again
//! (the decision behind `raft::vote_hold`).
//!
//! Such a node may be a member that lost its data. It must not vote before its log again holds
//! every entry that may have been committed with its lost acknowledgements, and before the
//! cluster has stopped counting it as the voter it was. Both are read from its own log:
//!
//! - **The first commit point** `c0`: the commit index of the first append whose leader had
//!   committed an entry of its own term. From then on that leader's commit index covers
//!   every entry committed before it, in any term (Raft's leader completeness), so also every
//!   entry committed with this node's acknowledgements before it lost them, unless that
//!   leader was deposed without knowing it and a later one committed more. So while held, an
//!   append from a leader of a later term with a commit of its own raises `c0` to that commit:
//!   a deposed leader that reached this node first can release it only until a current one
//!   does (the narrow case left: released by the deposed one before any current leader's
//!   append arrives).
//! - **Released** once the log reaches `c0` and either the latest membership at or below `c0`
//!   lists this node as a non-voter (then nothing committed up to `c0` counted its vote
//!   since it last became a member, and what it acknowledged before that it holds again), or a
//!   membership above `c0` does (the cluster made it a non-voter after this start: a
//!   replacement, or a new node's learner add after its first contact).
//!
//! Both count only what is durable in the log ([`VoteRelease::durable_up_to`]): a membership
//! appended but not yet synced releases nothing until the sync covers it, and a crash between
//! its append and its sync cannot leave a released node without it (the release is final).
//!
//! Why not simply "any membership without it as a voter": a young cluster's log, never purged,
//! is replayed from index 1, and the node's own first learner entry would release it while it
//! is still listed as the voter it was.
//!
//! # Invariants
//! - `c0` only rises, and only on an append from a leader of a later term than the one that
//!   set it (the same leader's growing commit would delay the release forever).
//! - Released implies: the log reached `c0`, and one of the two rules above held at some
//!   point. Once released, always released (the caller keeps that; this type only answers).
//! - Memberships are remembered by index, at most [`MEMBERSHIPS_KEPT`]; the oldest go first,
//!   which can only withhold a release, never grant one.
//!
//! # What it must not do
//! Release before `c0` is known, or on a membership it has not been told of.

use std::collections::BTreeMap;

/// How many memberships are remembered (a log holds few; a hostile leader could send many).
pub const MEMBERSHIPS_KEPT: usize = 256;

/// What a held node knows of its log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VoteRelease {
    first_commit: Option<u64>,
    /// The term of the leader that set `first_commit` (unknown after a restart: the note keeps
    /// only the index).
    first_commit_term: Option<u64>,
    /// The highest index durable in the log (synced, or covered by an installed snapshot).
    log_end: Option<u64>,
    /// Membership entries by index: whether each lists this node as a voter.
    memberships: BTreeMap<u64, bool>,
}

impl VoteRelease {
    /// A hold that already knows its first commit point (noted before a restart), or not.
    pub fn new(first_commit: Option<u64>) -> Self {
        VoteRelease {
            first_commit,
            ..VoteRelease::default()
        }
    }

    /// An append from a leader of `leader_term` whose commit index is `commit` (an entry of
    /// term `commit_term`). Returns the first commit point if this call set or raised it.
    pub fn append_from_leader(
        &mut self,
        leader_term: u64,
        commit: Option<(u64, u64)>,
    ) -> Option<u64> {
        let (commit_term, index) = commit?;
        let later_leader = self.first_commit_term.is_none_or(|t| leader_term > t);
        if commit_term != leader_term || !later_leader {
            return None;
        }
        self.first_commit_term = Some(leader_term);
        let raised = self.first_commit.max(Some(index));
        (raised != self.first_commit).then(|| {
            self.first_commit = raised;
            index
        })
    }

    /// A membership entry at `index` stored, listing this node as a voter or not.
    pub fn membership(&mut self, index: u64, lists_me_as_voter: bool) {
        self.memberships.insert(index, lists_me_as_voter);
        while self.memberships.len() > MEMBERSHIPS_KEPT {
            self.memberships.pop_first();
        }
    }

    /// The log is durable up to `index` (a sync, an installed snapshot, the log a start
    /// found). Never lowers the mark: only [`VoteRelease::truncated`] does.
    pub fn durable_up_to(&mut self, index: u64) {
        self.log_end = self.log_end.max(Some(index));
    }

    /// The log's entries from `from` on were removed (a conflicting suffix): memberships
    /// among them are forgotten, and the durable mark falls below them.
    pub fn truncated(&mut self, from: u64) {
        drop(self.memberships.split_off(&from));
        self.log_end = match from.checked_sub(1) {
            Some(kept) => self.log_end.map(|end| end.min(kept)),
            None => None,
        };
    }

    /// The first commit point, if known.
    pub fn first_commit(&self) -> Option<u64> {
        self.first_commit
    }

    /// Whether the log reached the first commit point and the latest membership stored still
    /// lists this node as a voter, with nothing that releases it: a member that lost its data
    /// and that no leader replaced (it may ask to be).
    pub fn still_counted_as_voter(&self) -> bool {
        let (Some(c0), Some(end)) = (self.first_commit, self.log_end) else {
            return false;
        };
        let latest_voter = matches!(self.memberships.last_key_value(), Some((_, true)));
        end >= c0 && latest_voter && !self.releases()
    }

    /// Whether the node may vote again.
    pub fn releases(&self) -> bool {
        let (Some(c0), Some(end)) = (self.first_commit, self.log_end) else {
            return false;
        };
        if end < c0 {
            return false;
        }
        let at_c0 = self.memberships.range(..=c0).next_back();
        let non_voter_at_c0 = matches!(at_c0, Some((_, false)));
        // (Empty, not a panic, when the log ends at c0.)
        let non_voter_since = end > c0
            && self
                .memberships
                .range(c0 + 1..=end)
                .any(|(_, voter)| !*voter);
        non_voter_at_c0 || non_voter_since
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A member's young log replayed from index 1: its own learner entry (5) and promotion
    /// (7), then writes; the leader had committed 54 at first contact.
    #[test]
    fn a_wiped_voter_replaying_its_own_learner_entry_stays_held_until_replaced() {
        let mut r = VoteRelease::new(None);
        assert_eq!(r.append_from_leader(1, Some((1, 54))), Some(54));
        r.membership(1, false);
        r.membership(5, false);
        assert!(!r.releases(), "below the first commit point");
        r.membership(7, true);
        r.durable_up_to(53);
        assert!(
            !r.still_counted_as_voter(),
            "not caught up to the first commit point"
        );
        r.durable_up_to(54);
        assert!(!r.releases(), "a voter at the first commit point");
        r.durable_up_to(60);
        assert!(!r.releases());
        assert!(r.still_counted_as_voter(), "it may ask to be replaced");
        // The leader replaces it: removed, then added back as a learner (once synced).
        r.membership(61, false);
        assert!(!r.releases(), "not durable yet");
        r.durable_up_to(61);
        assert!(r.releases());
        assert!(!r.still_counted_as_voter());
    }

    #[test]
    fn a_new_node_is_released_by_its_learner_entry_before_or_after_first_contact() {
        // Added (entry 12) before the leader's first append committed it.
        let mut r = VoteRelease::new(None);
        r.append_from_leader(2, Some((2, 10)));
        r.durable_up_to(11);
        assert!(!r.releases());
        r.membership(12, false);
        assert!(!r.releases(), "appended, not yet synced");
        r.durable_up_to(12);
        assert!(r.releases());
        // Added (entry 12) and committed before its first append.
        let mut r = VoteRelease::new(None);
        r.append_from_leader(2, Some((2, 20)));
        r.membership(12, false);
        r.durable_up_to(19);
        assert!(
            !r.releases(),
            "the log has not reached the first commit point"
        );
        r.durable_up_to(20);
        assert!(r.releases());
    }

    #[test]
    fn a_commit_of_an_earlier_term_is_no_first_commit_point() {
        let mut r = VoteRelease::new(None);
        // A leader just elected, whose commit index may lag the last leader's.
        assert_eq!(r.append_from_leader(3, Some((2, 40))), None);
        assert_eq!(r.append_from_leader(3, None), None);
        r.membership(5, false);
        r.durable_up_to(40);
        assert!(!r.releases());
        assert_eq!(r.append_from_leader(3, Some((3, 60))), Some(60));
        assert_eq!(r.append_from_leader(3, Some((3, 65))), None, "kept");
        r.durable_up_to(60);
        assert!(
            r.releases(),
            "a learner at 60 (entry 5 is the latest below it)"
        );
    }

    #[test]
    fn a_later_leader_raises_the_first_commit_point_of_a_deposed_one() {
        let mut r = VoteRelease::new(None);
        // A leader of term 3, deposed without knowing it, reached this node first.
        assert_eq!(r.append_from_leader(3, Some((3, 40))), Some(40));
        r.membership(5, false);
        // The leader of term 4 had committed up to 70.
        assert_eq!(r.append_from_leader(4, Some((4, 70))), Some(70));
        assert_eq!(
            r.append_from_leader(3, Some((3, 80))),
            None,
            "not a later term"
        );
        r.durable_up_to(60);
        assert!(!r.releases(), "the log has not reached 70");
        r.durable_up_to(70);
        assert!(r.releases());
        // After a restart the noted point is raised by the first leader, never lowered.
        let mut r = VoteRelease::new(Some(50));
        assert_eq!(r.append_from_leader(2, Some((2, 30))), None);
        assert_eq!(r.first_commit(), Some(50));
        assert_eq!(r.append_from_leader(5, Some((5, 90))), Some(90));
    }

    #[test]
    fn forgetting_old_memberships_never_releases() {
        let mut r = VoteRelease::new(Some(10_000));
        r.membership(1, false);
        for i in 0..MEMBERSHIPS_KEPT as u64 {
            r.membership(5_000 + i, true);
        }
        r.membership(10_000 + 1, true);
        r.durable_up_to(10_001);
        assert!(!r.releases());
    }

    #[test]
    fn a_membership_cut_before_its_sync_releases_nothing() {
        let mut r = VoteRelease::new(Some(20));
        r.durable_up_to(20);
        r.membership(21, true);
        r.membership(25, false);
        // The suffix from 22 conflicted with a new leader's log and was cut before any sync;
        // the entry at 25 is now something else.
        r.truncated(22);
        r.durable_up_to(30);
        assert!(!r.releases());
        // A cut below the durable mark lowers it.
        let mut r = VoteRelease::new(Some(20));
        r.membership(5, false);
        r.durable_up_to(40);
        r.truncated(15);
        assert!(!r.releases(), "the log no longer reaches 20");
        r.durable_up_to(20);
        assert!(r.releases());
    }

    proptest! {
        /// Released exactly when the durable log reached the first commit point and the
        /// latest membership at or below it, or any durable one above it, lists the node as a
        /// non-voter; memberships cut from the log count no more.
        #[test]
        fn releases_matches_its_rule(
            c0 in 1u64..60,
            events in proptest::collection::vec((0u8..4, 1u64..80, any::<bool>()), 0..40),
        ) {
            let mut r = VoteRelease::new(None);
            let mut model: Vec<(u64, bool)> = Vec::new();
            let mut end = 0u64;
            let mut known = false;
            for (kind, index, voter) in events {
                match kind {
                    0 => { r.append_from_leader(7, Some((7, c0))); known = true; }
                    1 => { r.durable_up_to(index); end = end.max(index); }
                    2 => {
                        r.truncated(index);
                        model.retain(|(i, _)| *i < index);
                        end = end.min(index - 1);
                    }
                    _ => {
                        r.membership(index, voter);
                        model.retain(|(i, _)| *i != index);
                        model.push((index, voter));
                    }
                }
                let latest_at = model.iter().filter(|(i, _)| *i <= c0).max_by_key(|(i, _)| *i);
                let expect = known && end >= c0
                    && (matches!(latest_at, Some((_, false)))
                        || model.iter().any(|(i, v)| *i > c0 && *i <= end && !*v));
                prop_assert_eq!(r.releases(), expect);
            }
        }
    }
}
