//! Peer trust: which peer messages a node accepts, decided before anything reaches Raft or an
//! acceptor. Pure.
//!
//! Every peer message names its sender (the `x-leasecore-node` header, see
//! [`SENDER_HEADER`]). The rules:
//! - **Membership** ([`admit_sender`]): a message is accepted only from a member of the current
//!   membership (voters and learners, every configuration of a joint one). A node that knows no
//!   membership yet (fresh, waiting to be added with `--join`) accepts any well-formed sender:
//!   the leader adding it is in no membership it could know. It stops doing so as soon as the
//!   first append carrying a membership reaches it.
//! - **Consistency** ([`check_claim`]): a message that claims an identity in its body (an
//!   append's or a snapshot's leader, a vote's candidate, a Flease message's `from`) must claim
//!   the sender's.
//! - **No disruptive votes** ([`disruptive_vote`]): a node that heard from a live leader within
//!   the minimum election timeout, or a leader that heard from a quorum within it, neither
//!   grants a vote nor adopts a higher term from a vote request (Raft thesis section 4.2.3; the
//!   effect of etcd's CheckQuorum + PreVote). A real election is not delayed by it: a candidate's
//!   election timer fires no sooner than the minimum timeout after it last heard from the
//!   leader, and by then the other followers' last contact is as old.
//!
//! # What this protects against, and what it does not
//! Without TLS the sender header is a claim, not a proof: these rules stop blind forgeries
//! (unknown ids, an append that claims another leader than its sender, a vote flood from a
//! member id while the leader lives), not an attacker who can reach the peer port and names a
//! real member consistently. With peer mTLS the channel itself is authenticated. The peer port
//! must stay private unless peer TLS is on.
//!
//! # What it must not do
//! Read a clock or touch I/O: ages come in as arguments.

use std::collections::BTreeSet;

use super::types::NodeId;

/// The HTTP header that names the sending node of a peer message.
pub const SENDER_HEADER: &str = "x-leasecore-node";

/// Why a peer message was refused; also the `reason` label of `leasecore_peer_refused_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, thiserror::Error)]
pub enum Refusal {
    /// No sender header, or one that is not a node id.
    #[error("the message names no sender node (header {SENDER_HEADER})")]
    NoSender,
    /// The sender is not a member of this node's current membership.
    #[error("the sender is not a member of this node's cluster")]
    NotMember,
    /// The body claims another node than the sender.
    #[error("the message claims another node than its sender")]
    Inconsistent,
    /// A vote request while a leader is alive (answered "not granted", not with 403).
    #[error("a leader is alive: the vote is not granted")]
    DisruptiveVote,
    /// A vote request to a node that started empty to join and is not yet listed as a
    /// non-voter (`raft::vote_hold`): answered "not granted".
    #[error("this node joined with an empty data dir and does not vote yet")]
    VoteWithheld,
    /// A forwarded command or request a client could not have sent.
    #[error("the forwarded request is not one a client could send")]
    InvalidRequest,
    /// A Flease or PaxosLease message with impossible values.
    #[error("the lease message has impossible values")]
    InvalidLeaseMessage,
}

impl Refusal {
    /// Every refusal, for rendering counters.
    pub const ALL: [Refusal; 7] = [
        Refusal::NoSender,
        Refusal::NotMember,
        Refusal::Inconsistent,
        Refusal::DisruptiveVote,
        Refusal::VoteWithheld,
        Refusal::InvalidRequest,
        Refusal::InvalidLeaseMessage,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::NoSender => "no_sender",
            Refusal::NotMember => "not_member",
            Refusal::Inconsistent => "inconsistent",
            Refusal::DisruptiveVote => "disruptive_vote",
            Refusal::VoteWithheld => "vote_withheld",
            Refusal::InvalidRequest => "invalid_request",
            Refusal::InvalidLeaseMessage => "invalid_lease_message",
        }
    }
}

/// Admit a message whose sender header reads `header` (None: absent) to a node whose current
/// membership is `members` (voters and learners; empty: none known yet). Returns the sender.
pub fn admit_sender(header: Option<&str>, members: &BTreeSet<NodeId>) -> Result<NodeId, Refusal> {
    let sender: NodeId = header
        .and_then(|h| h.trim().parse().ok())
        .ok_or(Refusal::NoSender)?;
    is_member(sender, members).map(|()| sender)
}

/// The membership rule alone, for a sender already named (a peer stream's, at each frame):
/// a member, or any node while this one knows no membership yet.
pub fn is_member(sender: NodeId, members: &BTreeSet<NodeId>) -> Result<(), Refusal> {
    if members.is_empty() || members.contains(&sender) {
        Ok(())
    } else {
        Err(Refusal::NotMember)
    }
}

/// A body that claims to come from `claimed` was sent by `sender`.
pub fn check_claim(sender: NodeId, claimed: NodeId) -> Result<(), Refusal> {
    if sender == claimed {
        Ok(())
    } else {
        Err(Refusal::Inconsistent)
    }
}

/// What a node knows when a vote request arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VoteContext {
    /// If this node leads: milliseconds since a quorum last acknowledged it (None: not yet).
    /// None if it does not lead.
    pub quorum_ack_age_ms: Option<u64>,
    /// Milliseconds since this node last accepted an append or snapshot from a leader (None:
    /// never, since it started).
    pub leader_contact_age_ms: Option<u64>,
    /// The minimum election timeout.
    pub election_min_ms: u64,
}

/// Whether a vote request must be answered "not granted" without reaching Raft: a leader is
/// alive (this node heard from it, or leads and heard from a quorum, within the minimum election
/// timeout).
pub fn disruptive_vote(ctx: &VoteContext) -> bool {
    let fresh = |age: Option<u64>| age.is_some_and(|a| a < ctx.election_min_ms);
    fresh(ctx.quorum_ack_age_ms) || fresh(ctx.leader_contact_age_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    #[test]
    fn members_are_admitted_and_others_refused() {
        let m = set(&[1, 2, 3]);
        assert_eq!(admit_sender(Some("2"), &m), Ok(2));
        assert_eq!(admit_sender(Some(" 3 "), &m), Ok(3));
        assert_eq!(admit_sender(Some("99"), &m), Err(Refusal::NotMember));
        assert_eq!(admit_sender(None, &m), Err(Refusal::NoSender));
        assert_eq!(admit_sender(Some("two"), &m), Err(Refusal::NoSender));
        assert_eq!(admit_sender(Some("-1"), &m), Err(Refusal::NoSender));
        assert_eq!(admit_sender(Some(""), &m), Err(Refusal::NoSender));
    }

    #[test]
    fn a_node_without_membership_admits_any_named_sender_only() {
        let none = BTreeSet::new();
        assert_eq!(admit_sender(Some("99"), &none), Ok(99));
        assert_eq!(admit_sender(None, &none), Err(Refusal::NoSender));
    }

    #[test]
    fn claims_must_match_the_sender() {
        assert_eq!(check_claim(1, 1), Ok(()));
        assert_eq!(check_claim(1, 99), Err(Refusal::Inconsistent));
    }

    #[test]
    fn votes_are_refused_while_a_leader_is_alive() {
        let ctx = |q, l| VoteContext {
            quorum_ack_age_ms: q,
            leader_contact_age_ms: l,
            election_min_ms: 400,
        };
        // A follower that just heard from its leader.
        assert!(disruptive_vote(&ctx(None, Some(100))));
        // A leader that just heard from a quorum.
        assert!(disruptive_vote(&ctx(Some(0), None)));
        // Silence for the minimum election timeout: a real election may proceed.
        assert!(!disruptive_vote(&ctx(None, Some(400))));
        assert!(!disruptive_vote(&ctx(Some(400), None)));
        // Never heard from a leader (a fresh cluster electing its first one).
        assert!(!disruptive_vote(&ctx(None, None)));
    }

    proptest! {
        #[test]
        fn a_vote_is_refused_iff_some_contact_is_fresh(
            q in proptest::option::of(0u64..2000),
            l in proptest::option::of(0u64..2000),
            min in 1u64..1500,
        ) {
            let ctx = VoteContext { quorum_ack_age_ms: q, leader_contact_age_ms: l, election_min_ms: min };
            let fresh = q.is_some_and(|a| a < min) || l.is_some_and(|a| a < min);
            prop_assert_eq!(disruptive_vote(&ctx), fresh);
            // Older contact never makes a vote more refusable.
            let older = VoteContext {
                quorum_ack_age_ms: q.map(|a| a + min),
                leader_contact_age_ms: l.map(|a| a + min),
                ..ctx
            };
            prop_assert!(!disruptive_vote(&older));
        }

        #[test]
        fn membership_decides_admission(ids in proptest::collection::btree_set(0u64..20, 0..6), s in 0u64..20) {
            let got = admit_sender(Some(&s.to_string()), &ids);
            prop_assert_eq!(got.is_ok(), ids.is_empty() || ids.contains(&s));
        }
    }
}
