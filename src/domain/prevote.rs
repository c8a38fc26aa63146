//! Pre-vote (Raft thesis section 9.6): a voter campaigns only once a majority would vote for
//! it, so a node that was cut off (or stalled) does not raise its term on its own and, once
//! back, depose a leader that never stopped serving.
//!
//! openraft 0.9 has no pre-vote: a follower whose timer fires campaigns, raises its term with
//! each try, and its first answer to the leader's append after the partition heals carries the
//! higher term, which makes the leader step down. This project turns openraft's election
//! timer off and campaigns from its own watchdog (`runtime::election`), which asks first.
//!
//! # Invariants
//! - A pre-vote changes nothing on the node asked: no term adopted, no vote recorded.
//! - Granted only as the real vote would be granted by this project's rules: no live leader
//!   heard within the minimum election timeout ([`super::peer_trust::disruptive_vote`]), the
//!   node's vote not withheld (`raft::vote_hold`), and the candidate's log at least as
//!   up-to-date as the node's.
//! - Won only with a majority of every configuration of a joint membership, counting the
//!   candidate itself (as an election is).
//!
//! # What it must not do
//! Campaign or decide timing: the watchdog does, with this answer.

use std::collections::BTreeSet;

use super::peer_trust::{VoteContext, disruptive_vote};
use super::types::NodeId;

/// Whether a node answers a pre-vote "granted": `held` is its vote hold, `candidate_last` and
/// `mine` the last log ids (ordered as Raft compares logs: term, then index).
pub fn grants<L: Ord>(ctx: &VoteContext, held: bool, candidate_last: &L, mine: &L) -> bool {
    !held && !disruptive_vote(ctx) && candidate_last >= mine
}

/// Whether the pre-vote is won: `granted` (the candidate included) holds a majority of every
/// configuration in `configs` (one, or two while a membership change is joint).
pub fn won(configs: &[BTreeSet<NodeId>], granted: &BTreeSet<NodeId>) -> bool {
    !configs.is_empty()
        && configs
            .iter()
            .all(|c| c.intersection(granted).count() * 2 > c.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    fn ctx(leader_contact: Option<u64>, quorum_ack: Option<u64>) -> VoteContext {
        VoteContext {
            quorum_ack_age_ms: quorum_ack,
            leader_contact_age_ms: leader_contact,
            election_min_ms: 400,
        }
    }

    #[test]
    fn granted_only_without_a_live_leader_to_an_up_to_date_log_when_not_held() {
        assert!(grants(&ctx(Some(500), None), false, &(3, 10), &(3, 10)));
        assert!(grants(&ctx(None, None), false, &(4, 1), &(3, 10)));
        assert!(
            !grants(&ctx(Some(100), None), false, &(3, 10), &(3, 10)),
            "a live leader"
        );
        assert!(
            !grants(&ctx(None, Some(100)), false, &(3, 10), &(3, 10)),
            "it leads"
        );
        assert!(
            !grants(&ctx(None, None), false, &(3, 9), &(3, 10)),
            "a shorter log"
        );
        assert!(
            !grants(&ctx(None, None), false, &(2, 20), &(3, 10)),
            "an older term"
        );
        assert!(
            !grants(&ctx(None, None), true, &(3, 10), &(3, 10)),
            "vote withheld"
        );
    }

    #[test]
    fn won_with_a_majority_of_every_configuration() {
        assert!(won(&[set(&[1])], &set(&[1])));
        assert!(won(&[set(&[1, 2, 3])], &set(&[1, 3])));
        assert!(!won(&[set(&[1, 2, 3])], &set(&[1])));
        assert!(
            !won(&[set(&[1, 2, 3, 4])], &set(&[1, 2])),
            "half is not a majority"
        );
        // Joint: {1,2,3} -> {3,4,5}.
        assert!(!won(&[set(&[1, 2, 3]), set(&[3, 4, 5])], &set(&[1, 2, 3])));
        assert!(won(&[set(&[1, 2, 3]), set(&[3, 4, 5])], &set(&[2, 3, 4])));
        assert!(!won(&[], &set(&[1])));
    }

    proptest! {
        /// Won iff more than half of each configuration granted.
        #[test]
        fn won_is_a_majority_in_each(
            a in proptest::collection::btree_set(1u64..8, 1..6),
            b in proptest::collection::btree_set(1u64..8, 1..6),
            g in proptest::collection::btree_set(1u64..8, 0..8),
        ) {
            let maj = |c: &BTreeSet<NodeId>| c.iter().filter(|v| g.contains(v)).count() > c.len() / 2;
            prop_assert_eq!(won(std::slice::from_ref(&a), &g), maj(&a));
            prop_assert_eq!(won(&[a.clone(), b.clone()], &g), maj(&a) && maj(&b));
        }
    }
}
