//! Has a follower lost log entries it acknowledged? The leader's rule, for members that came
//! back with an empty data dir and nothing to stop them (a node added with `--join` and no
//! `--peers` is started again with that same command line after losing its data). Pure.
//!
//! Within one leader's term a follower never drops entries it acknowledged to that leader:
//! they are durable before it answers, and only a leader of a higher term makes it truncate.
//! So when, in the same term, a follower answers "conflict" for an append whose previous entry
//! it acknowledged as matching before, its log went back: it lost its data. openraft 0.9
//! treats that as impossible (a debug assertion stops the leader's core; in a release build its
//! replication state goes inconsistent), and the node, with its vote lost too, must not count
//! as the voter it was. The network adapter asks [`MatchTracker::conflict`] before it hands
//! such an answer to openraft, and the leader replaces the node (removes it, adds it back).
//!
//! # Invariants
//! - A match is recorded per target and per leader (term and node): a new leader starts with
//!   nothing recorded, as openraft's replication progress does.
//! - The recorded match only grows within a term; [`MatchTracker::forget`] drops it when the
//!   node is added (again) as a learner, so that its fresh progress starts from nothing, as
//!   openraft's does.
//!
//! # What it must not do
//! Decide what to do about a reversion (the consensus layer replaces the node), or read any
//! clock.

use std::collections::BTreeMap;

use crate::domain::types::NodeId;

/// A leader's identity: its term and node id.
pub type LeaderKey = (u64, NodeId);

/// What a conflict answer means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conflict {
    /// The follower's log lacks the previous entry: ordinary catch-up, for openraft.
    Ordinary,
    /// The follower acknowledged the previous entry (and up to `matched`) to this leader
    /// before: its log went back. `first` is true the first time it is seen for this
    /// target under this leader (worth a log line and a replacement).
    Reverted { matched: u64, first: bool },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Matched {
    leader: LeaderKey,
    index: u64,
    reported: bool,
}

/// The highest index each follower acknowledged as matching, under the current leader.
#[derive(Debug, Default)]
pub struct MatchTracker {
    matched: BTreeMap<NodeId, Matched>,
}

impl MatchTracker {
    /// `target` answered an append (or snapshot) of `leader` with success up to `index`.
    pub fn acknowledged(&mut self, target: NodeId, leader: LeaderKey, index: u64) {
        let entry = self.matched.entry(target).or_insert(Matched {
            leader,
            index,
            reported: false,
        });
        if entry.leader == leader {
            entry.index = entry.index.max(index);
        } else if entry.leader < leader {
            *entry = Matched {
                leader,
                index,
                reported: false,
            };
        }
        // An answer to an older leader's append changes nothing.
    }

    /// `target` answered "conflict" to an append of `leader` whose previous entry is at
    /// `prev_index`.
    pub fn conflict(&mut self, target: NodeId, leader: LeaderKey, prev_index: u64) -> Conflict {
        match self.matched.get_mut(&target) {
            Some(m) if m.leader == leader && prev_index <= m.index => {
                let first = !m.reported;
                m.reported = true;
                Conflict::Reverted {
                    matched: m.index,
                    first,
                }
            }
            _ => Conflict::Ordinary,
        }
    }

    /// Whether `target`'s reversion was reported under `leader` and not yet forgotten.
    pub fn is_reverted(&self, target: NodeId, leader: LeaderKey) -> bool {
        self.matched
            .get(&target)
            .is_some_and(|m| m.leader == leader && m.reported)
    }

    /// Forget `target` (it is added as a learner: its progress starts from nothing).
    pub fn forget(&mut self, target: NodeId) {
        self.matched.remove(&target);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_conflict_below_an_acknowledged_match_is_a_reversion() {
        let mut t = MatchTracker::default();
        let leader = (3, 1);
        assert_eq!(t.conflict(4, leader, 10), Conflict::Ordinary);
        t.acknowledged(4, leader, 50);
        // Ahead of what it acknowledged: ordinary catch-up (a new learner's first append).
        assert_eq!(t.conflict(4, leader, 51), Conflict::Ordinary);
        assert_eq!(
            t.conflict(4, leader, 50),
            Conflict::Reverted {
                matched: 50,
                first: true
            }
        );
        assert_eq!(
            t.conflict(4, leader, 12),
            Conflict::Reverted {
                matched: 50,
                first: false
            }
        );
        assert!(t.is_reverted(4, leader));
        // Another follower is unaffected.
        assert_eq!(t.conflict(2, leader, 1), Conflict::Ordinary);
        // Once removed, its fresh progress starts from nothing.
        t.forget(4);
        assert_eq!(t.conflict(4, leader, 12), Conflict::Ordinary);
        assert!(!t.is_reverted(4, leader));
    }

    #[test]
    fn a_new_leader_starts_with_nothing_recorded() {
        let mut t = MatchTracker::default();
        t.acknowledged(4, (3, 1), 50);
        assert_eq!(t.conflict(4, (4, 2), 10), Conflict::Ordinary);
        t.acknowledged(4, (4, 2), 7);
        assert_eq!(
            t.conflict(4, (4, 2), 7),
            Conflict::Reverted {
                matched: 7,
                first: true
            }
        );
        // A late answer to the old leader changes nothing.
        t.acknowledged(4, (3, 1), 90);
        assert_eq!(t.conflict(4, (4, 2), 8), Conflict::Ordinary);
    }

    proptest! {
        /// Whatever order answers come in, a conflict is a reversion exactly when the same
        /// leader saw that follower acknowledge the previous entry or a later one.
        #[test]
        fn reversion_iff_acknowledged_at_or_after_prev_under_the_same_leader(
            acks in proptest::collection::vec((0u64..3, 1u64..4, 0u64..100), 0..40),
            probe in (0u64..3, 1u64..4, 0u64..100),
        ) {
            let mut t = MatchTracker::default();
            let target = 7;
            for (term, leader, index) in &acks {
                t.acknowledged(target, (*term, *leader), *index);
            }
            let (term, leader, prev) = probe;
            // The tracker follows the newest leader it heard an answer for.
            let newest = acks.iter().map(|(t, l, _)| (*t, *l)).max();
            let expected = newest == Some((term, leader))
                && acks
                    .iter()
                    .any(|(t, l, i)| (*t, *l) == (term, leader) && *i >= prev);
            let got = matches!(
                t.conflict(target, (term, leader), prev),
                Conflict::Reverted { .. }
            );
            prop_assert_eq!(got, expected);
        }
    }
}
