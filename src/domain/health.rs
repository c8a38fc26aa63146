//! Health rules: is this node ready to serve, has a leader lost its quorum, is a peer reachable,
//! has a learner caught up enough to become a voter, has a `hasleader` watch stream's member
//! been without a leader long enough to end it.
//!
//! Everything here is a pure function of a snapshot of what the node knows and of `now`
//! (through ages in milliseconds, computed by the shell from its one clock). The shells
//! (`raft::consensus`, `runtime::quorum`, `http::cluster`) read openraft's metrics and the peer
//! contact record, call these rules, and act on the verdict; they decide nothing themselves.
//!
//! # Invariants
//! - A leader that has not heard from a quorum within one election timeout is treated as having
//!   lost it: by then the rest of the cluster may have elected another leader, so this node must
//!   not accept writes, confirm reads, or call itself ready.
//! - A node is ready only if it knows a leader it heard from within one election timeout (itself
//!   with a fresh quorum acknowledgement, when it leads) and has applied everything it knows to be
//!   committed. This is what `/readyz` and the compose healthcheck report.
//! - A learner is promoted to voter only after it has acknowledged the membership entry that
//!   added it (it answered) and is within `max_lag` entries of the leader's log: a node that
//!   never answered can never count toward a quorum.
//!
//! # What it must not do
//! Read a clock, or know about openraft: inputs are plain numbers.

use super::types::{MonoMillis, NodeId};

pub use leasecore_client::api::NotReady;

/// What a node knows about itself, as of one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeHealth {
    pub node_id: NodeId,
    /// The leader this node knows, if any.
    pub leader_id: Option<NodeId>,
    /// Whether this node is that leader (and in the leader state).
    pub is_leader: bool,
    /// For a leader: ms since a quorum last acknowledged it (`None`: not yet since its election).
    pub quorum_ack_age_ms: Option<u64>,
    /// For a follower: ms since it last heard from its leader (`None`: unknown).
    pub leader_contact_age_ms: Option<u64>,
    pub applied_index: u64,
    pub commit_index: u64,
}

/// Whether a leader has lost its quorum: no acknowledgement from a quorum for more than
/// `election_timeout_ms`. `leading_for_ms` covers a leader that has never been acknowledged
/// since it was elected (`quorum_ack_age_ms` is `None`): it gets one election timeout.
pub fn leader_lost_quorum(
    quorum_ack_age_ms: Option<u64>,
    leading_for_ms: u64,
    election_timeout_ms: u64,
) -> bool {
    match quorum_ack_age_ms {
        Some(age) => age > election_timeout_ms,
        None => leading_for_ms > election_timeout_ms,
    }
}

/// How late a tick woke: the time from its request to sleep `every_ms` until it ran, beyond
/// `every_ms` (`runtime::stall`).
pub fn tick_lateness(asked: MonoMillis, woke: MonoMillis, every_ms: u64) -> u64 {
    woke.0.saturating_sub(asked.0).saturating_sub(every_ms)
}

/// Warnings of a recurring condition (a runtime stall, a slow disk sync), at most one per
/// `every_ms`: the occurrences between two warnings are counted into the next one.
#[derive(Clone, Debug)]
pub struct WarnThrottle {
    every_ms: u64,
    unlogged: u64,
    logged_at: Option<MonoMillis>,
}

impl WarnThrottle {
    pub fn new(every_ms: u64) -> Self {
        WarnThrottle {
            every_ms,
            unlogged: 0,
            logged_at: None,
        }
    }

    /// One more occurrence at `now`: if a warning is due, how many it reports (this one and
    /// those held back since the last).
    pub fn occurred(&mut self, now: MonoMillis) -> Option<u64> {
        self.unlogged += 1;
        if self
            .logged_at
            .is_some_and(|at| now.0.saturating_sub(at.0) < self.every_ms)
        {
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// Whether a runtime that ran a ready task `late_ms` late stalled: by half the shortest
/// election timeout, a heartbeat held as long leaves a follower little margin before it
/// campaigns, and a leader's quorum acknowledgement grows as old.
pub fn runtime_stalled(late_ms: u64, election_min_ms: u64) -> bool {
    late_ms >= election_min_ms / 2
}

/// Whether a leader should hold back its own housekeeping proposals (lease expiries and
/// checkpoints): no quorum acknowledgement for over a third of the election timeout means the
/// followers are not keeping up (their append answers time out while they apply and flush), and
/// more work from the leader would push it towards [`leader_lost_quorum`] and a needless
/// election. Holding back only delays expiries (never makes one early) and checkpoints (a late
/// checkpoint leaves a lease longer, never shorter).
pub fn replication_strained(quorum_ack_age_ms: Option<u64>, election_timeout_ms: u64) -> bool {
    quorum_ack_age_ms.is_some_and(|age| age > election_timeout_ms / 3)
}

/// Whether a follower should campaign now because its leader went silent: it has not accepted
/// an append from it for longer than `lease_ms`. openraft 0.9 lets every voter refuse votes for
/// the leader lease (its largest election timeout) after the leader's last append, and then
/// waits one more election timeout of its own before it campaigns: a dead leader cost 1.4 to
/// 2 s with default timings. Once the lease has run out everywhere, a vote can be granted at
/// once, so waiting longer only extends the leaderless gap: every lease due meanwhile expires
/// that much late. `lease_ms` must include a margin for the other voters, which accepted the
/// same last append a little later.
pub fn leader_silent(silence_ms: Option<u64>, lease_ms: u64) -> bool {
    silence_ms.is_some_and(|age| age > lease_ms)
}

/// Whether a node that knows `h` is ready to serve.
pub fn readiness(h: &NodeHealth, election_timeout_ms: u64) -> Result<(), NotReady> {
    let Some(leader_id) = h.leader_id else {
        return Err(NotReady::NoLeader);
    };
    if h.is_leader {
        // A fresh leader that no quorum has acknowledged yet is not ready either: it cannot
        // commit or confirm a read until one does (a heartbeat later).
        match h.quorum_ack_age_ms {
            Some(age) if age <= election_timeout_ms => {}
            other => {
                return Err(NotReady::NoQuorum {
                    quorum_ack_age_ms: other,
                });
            }
        }
    } else if leader_id == h.node_id {
        // It names itself leader but is not in the leader state: it is stepping down.
        return Err(NotReady::NoQuorum {
            quorum_ack_age_ms: None,
        });
    } else {
        match h.leader_contact_age_ms {
            Some(age) if age <= election_timeout_ms => {}
            other => {
                return Err(NotReady::LeaderSilent {
                    leader_id,
                    contact_age_ms: other,
                });
            }
        }
    }
    if h.applied_index < h.commit_index {
        return Err(NotReady::Applying {
            applied_index: h.applied_index,
            commit_index: h.commit_index,
        });
    }
    Ok(())
}

/// Whether a peer last heard from `contact_age_ms` ago counts as reachable.
pub fn reachable(contact_age_ms: Option<u64>, election_timeout_ms: u64) -> bool {
    contact_age_ms.is_some_and(|age| age <= election_timeout_ms)
}

/// How many voters this node has heard from within one election timeout (itself included,
/// when it is a voter), out of how many, and how many a leader needs: the evidence behind
/// telling a client "the quorum is lost" rather than "a leader is being elected".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VoterContact {
    pub heard: usize,
    pub voters: usize,
    pub needed: usize,
}

impl VoterContact {
    /// Fewer voters are within reach than a leader needs: no election can succeed until
    /// enough of them are back.
    pub fn quorum_lost(&self) -> bool {
        self.voters > 0 && self.heard < self.needed
    }
}

/// Count the `voters` heard from within an election timeout (`ages`: ms since each peer was
/// last heard from; `me` counts as heard).
pub fn voter_contact(
    voters: &[NodeId],
    me: NodeId,
    ages: &std::collections::BTreeMap<NodeId, u64>,
    election_timeout_ms: u64,
) -> VoterContact {
    let heard = voters
        .iter()
        .filter(|id| **id == me || reachable(ages.get(id).copied(), election_timeout_ms))
        .count();
    VoterContact {
        heard,
        voters: voters.len(),
        needed: voters.len() / 2 + 1,
    }
}

/// Whether a learner may be promoted to voter: it acknowledged the membership entry that added
/// it (at `membership_index`), and its acknowledged log (`matched`) is within `max_lag` entries
/// of the leader's `last_log_index`.
pub fn learner_caught_up(
    matched: Option<u64>,
    membership_index: u64,
    last_log_index: u64,
    max_lag: u64,
) -> bool {
    matched.is_some_and(|m| m >= membership_index && last_log_index.saturating_sub(m) <= max_lag)
}

/// Whether a learner is in sync enough to be promoted, as a leader's view shows it (etcd's
/// MemberPromote refuses at once otherwise): not known unreachable, and at most `max_lag`
/// entries behind (`None`: it never acknowledged anything).
pub fn learner_in_sync(reachable: Option<bool>, lag: Option<u64>, max_lag: u64) -> bool {
    reachable != Some(false) && lag.is_some_and(|l| l <= max_lag)
}

/// Whether a member has started, as etcd's `MemberList` tells it: etcd names a member and
/// lists its client URLs once the member itself has published them, and etcdctl shows one
/// without a name as `unstarted`. A voter has started (an initial member, or a node promoted
/// once it had caught up); a learner once it has been `heard` from (it acknowledged the
/// leader's log, or answered a node that asked it). One that started and later stopped has
/// still started.
pub fn member_started(voter: bool, heard: bool) -> bool {
    voter || heard
}

/// How long this node has led in its current term: the shell feeds it every observation and
/// it remembers when the current tenure began.
#[derive(Clone, Debug, Default)]
pub struct Tenure {
    /// The term this node leads in and when it was first seen leading in it.
    current: Option<(u64, MonoMillis)>,
}

impl Tenure {
    /// Record an observation (`leading_term`: the term if this node leads now) and return for
    /// how long it has led (0 when it does not lead).
    pub fn observe(&mut self, leading_term: Option<u64>, now: MonoMillis) -> u64 {
        match (leading_term, self.current) {
            (None, _) => {
                self.current = None;
                0
            }
            (Some(term), Some((t, since))) if t == term => since.until(now),
            (Some(term), _) => {
                self.current = Some((term, now));
                0
            }
        }
    }
}

/// etcd's `hasleader` rule for a watch stream: the stream ends once `needed` checks in a row
/// (an election timeout apart, the shell's interval) found its member without a leader. A
/// check that finds a leader starts the count again, so a member that keeps finding leaders
/// between short gaps never ends its streams (etcd's `maxNoLeaderCnt`).
#[derive(Clone, Debug)]
pub struct LeaderlessStreak {
    needed: u32,
    in_a_row: u32,
}

impl LeaderlessStreak {
    pub fn new(needed: u32) -> Self {
        LeaderlessStreak {
            needed: needed.max(1),
            in_a_row: 0,
        }
    }

    /// One check: whether the stream must end now.
    pub fn check(&mut self, leaderless: bool) -> bool {
        self.in_a_row = if leaderless { self.in_a_row + 1 } else { 0 };
        self.in_a_row >= self.needed
    }
}

/// Whether the transferee of a leadership transfer may campaign: its leader (whose heartbeats
/// stopped for the transfer) has been silent, as this node saw it, for longer than openraft's
/// leader lease (`lease_ms`, the largest election timeout) plus `margin_ms` (the other voters
/// accepted the last append a little later). Before that every voter refuses the vote; a node
/// that never heard a leader (`None`) holds no lease against it.
pub fn transferee_may_campaign(led_age_ms: Option<u64>, lease_ms: u64, margin_ms: u64) -> bool {
    led_age_ms.is_none_or(|age| age >= lease_ms.saturating_add(margin_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttled_warning_comes_once_per_interval_and_counts_what_it_held_back() {
        let mut w = WarnThrottle::new(10_000);
        assert_eq!(
            w.occurred(MonoMillis(5)),
            Some(1),
            "the first is reported at once"
        );
        assert_eq!(w.occurred(MonoMillis(1_000)), None);
        assert_eq!(
            w.occurred(MonoMillis(10_004)),
            None,
            "still within the interval"
        );
        assert_eq!(w.occurred(MonoMillis(10_005)), Some(3));
        assert_eq!(w.occurred(MonoMillis(10_006)), None);
        assert_eq!(w.occurred(MonoMillis(30_000)), Some(2));
    }

    #[test]
    fn a_transferee_campaigns_only_once_the_lease_and_margin_have_passed() {
        assert!(!transferee_may_campaign(Some(0), 1000, 100));
        assert!(!transferee_may_campaign(Some(1099), 1000, 100));
        assert!(transferee_may_campaign(Some(1100), 1000, 100));
        assert!(transferee_may_campaign(None, 1000, 100));
        assert!(!transferee_may_campaign(Some(u64::MAX - 1), u64::MAX, 100));
    }

    #[test]
    fn a_hasleader_stream_ends_only_after_enough_leaderless_checks_in_a_row() {
        let mut s = LeaderlessStreak::new(3);
        assert!(!s.check(true));
        assert!(!s.check(true));
        // A leader found in between starts the count again.
        assert!(!s.check(false));
        assert!(!s.check(true));
        assert!(!s.check(true));
        assert!(s.check(true), "the third in a row ends it");
        // Thousands of random histories: it ends exactly at a third leaderless check in a row.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2_000 {
            let mut s = LeaderlessStreak::new(3);
            let mut run = 0;
            for _ in 0..50 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let leaderless = !x.is_multiple_of(3);
                run = if leaderless { run + 1 } else { 0 };
                assert_eq!(s.check(leaderless), run >= 3);
            }
        }
        // At least one check is needed, whatever it is told.
        assert!(LeaderlessStreak::new(0).check(true));
        assert!(!LeaderlessStreak::new(0).check(false));
    }

    #[test]
    fn a_tick_is_late_by_what_it_waited_beyond_its_interval_and_stalls_at_half_an_election() {
        assert_eq!(tick_lateness(MonoMillis(100), MonoMillis(110), 10), 0);
        assert_eq!(
            tick_lateness(MonoMillis(100), MonoMillis(105), 10),
            0,
            "early: not late"
        );
        assert_eq!(tick_lateness(MonoMillis(100), MonoMillis(2_710), 10), 2_600);
        assert_eq!(
            tick_lateness(MonoMillis(200), MonoMillis(100), 10),
            0,
            "never negative"
        );
        assert!(!runtime_stalled(199, 400));
        assert!(runtime_stalled(200, 400));
        assert!(runtime_stalled(2_600, 400));
    }

    #[test]
    fn a_learner_is_in_sync_only_when_reached_and_close_behind() {
        assert!(learner_in_sync(Some(true), Some(0), 64));
        assert!(learner_in_sync(Some(true), Some(64), 64));
        assert!(!learner_in_sync(Some(true), Some(65), 64));
        assert!(!learner_in_sync(Some(false), Some(0), 64), "unreachable");
        assert!(!learner_in_sync(Some(true), None, 64), "never acknowledged");
    }

    #[test]
    fn a_learner_has_started_once_heard_from_and_a_voter_always() {
        assert!(!member_started(false, false), "added, never heard from");
        assert!(member_started(false, true));
        assert!(
            member_started(true, false),
            "an initial member not heard from yet"
        );
    }

    const ET: u64 = 1000;

    fn follower(contact: Option<u64>) -> NodeHealth {
        NodeHealth {
            node_id: 2,
            leader_id: Some(1),
            is_leader: false,
            quorum_ack_age_ms: None,
            leader_contact_age_ms: contact,
            applied_index: 10,
            commit_index: 10,
        }
    }

    fn leader(ack: Option<u64>) -> NodeHealth {
        NodeHealth {
            node_id: 1,
            leader_id: Some(1),
            is_leader: true,
            quorum_ack_age_ms: ack,
            leader_contact_age_ms: None,
            applied_index: 10,
            commit_index: 10,
        }
    }

    #[test]
    fn the_quorum_is_lost_when_fewer_voters_than_a_majority_were_heard_recently() {
        let ages: std::collections::BTreeMap<NodeId, u64> =
            [(2, ET), (3, ET + 1), (4, 10)].into_iter().collect();
        // Three voters: me, 2 (just within), 3 (too long ago).
        let c = voter_contact(&[1, 2, 3], 1, &ages, ET);
        assert_eq!((c.heard, c.voters, c.needed), (2, 3, 2));
        assert!(!c.quorum_lost());
        // Me alone out of three, and a learner (4) does not count.
        let c = voter_contact(&[1, 3, 5], 1, &ages, ET);
        assert_eq!((c.heard, c.needed), (1, 2));
        assert!(c.quorum_lost());
        // A node that is not a voter does not count itself.
        let c = voter_contact(&[2, 3], 4, &ages, ET);
        assert_eq!((c.heard, c.needed), (1, 2));
        assert!(c.quorum_lost());
        // No membership known yet: nothing to say.
        assert!(!voter_contact(&[], 1, &ages, ET).quorum_lost());
    }

    #[test]
    fn a_leader_loses_its_quorum_after_one_election_timeout_without_acknowledgement() {
        assert!(!leader_lost_quorum(Some(0), 5000, ET));
        assert!(!leader_lost_quorum(Some(ET), 5000, ET));
        assert!(leader_lost_quorum(Some(ET + 1), 5000, ET));
        // Never acknowledged since its election: one election timeout of grace.
        assert!(!leader_lost_quorum(None, ET, ET));
        assert!(leader_lost_quorum(None, ET + 1, ET));
    }

    #[test]
    fn a_leader_is_ready_only_with_a_fresh_quorum_acknowledgement() {
        assert_eq!(readiness(&leader(Some(50)), ET), Ok(()));
        assert_eq!(
            readiness(&leader(Some(ET + 1)), ET),
            Err(NotReady::NoQuorum {
                quorum_ack_age_ms: Some(ET + 1)
            })
        );
        assert_eq!(
            readiness(&leader(None), ET),
            Err(NotReady::NoQuorum {
                quorum_ack_age_ms: None
            })
        );
    }

    #[test]
    fn a_follower_is_ready_only_if_it_heard_from_its_leader_recently() {
        assert_eq!(readiness(&follower(Some(100)), ET), Ok(()));
        assert_eq!(
            readiness(&follower(Some(ET + 1)), ET),
            Err(NotReady::LeaderSilent {
                leader_id: 1,
                contact_age_ms: Some(ET + 1)
            })
        );
        assert!(readiness(&follower(None), ET).is_err());
        let mut no_leader = follower(Some(1));
        no_leader.leader_id = None;
        assert_eq!(readiness(&no_leader, ET), Err(NotReady::NoLeader));
    }

    #[test]
    fn a_node_that_names_itself_leader_but_does_not_lead_is_not_ready() {
        let mut h = leader(Some(1));
        h.is_leader = false;
        assert!(readiness(&h, ET).is_err());
    }

    #[test]
    fn a_node_behind_its_known_commit_is_not_ready() {
        let mut h = follower(Some(1));
        h.applied_index = 9;
        assert_eq!(
            readiness(&h, ET),
            Err(NotReady::Applying {
                applied_index: 9,
                commit_index: 10
            })
        );
    }

    #[test]
    fn housekeeping_holds_back_well_before_the_leader_would_step_down() {
        let et = 1000;
        assert!(!replication_strained(None, et));
        assert!(!replication_strained(Some(0), et));
        assert!(!replication_strained(Some(333), et));
        assert!(replication_strained(Some(334), et));
        // Strain comes first: there is room to recover before the quorum counts as lost.
        for age in 0..=2 * et {
            if leader_lost_quorum(Some(age), 0, et) {
                assert!(replication_strained(Some(age), et), "age {age}");
            }
        }
    }

    #[test]
    fn reachability_is_contact_within_an_election_timeout() {
        assert!(reachable(Some(0), ET));
        assert!(reachable(Some(ET), ET));
        assert!(!reachable(Some(ET + 1), ET));
        assert!(!reachable(None, ET));
    }

    #[test]
    fn a_learner_that_never_answered_is_never_caught_up() {
        // The log is short: a lag threshold alone would call it caught up.
        assert!(!learner_caught_up(None, 5, 6, 100));
        // It acknowledged entries, but not yet the one that added it.
        assert!(!learner_caught_up(Some(4), 5, 6, 100));
        assert!(learner_caught_up(Some(5), 5, 6, 100));
        assert!(!learner_caught_up(Some(5), 5, 500, 100));
        assert!(learner_caught_up(Some(400), 5, 500, 100));
    }

    #[test]
    fn tenure_counts_from_the_first_observation_of_a_term() {
        let mut t = Tenure::default();
        assert_eq!(t.observe(None, MonoMillis(0)), 0);
        assert_eq!(t.observe(Some(3), MonoMillis(100)), 0);
        assert_eq!(t.observe(Some(3), MonoMillis(350)), 250);
        // A new term starts a new tenure.
        assert_eq!(t.observe(Some(4), MonoMillis(400)), 0);
        assert_eq!(t.observe(Some(4), MonoMillis(500)), 100);
        assert_eq!(t.observe(None, MonoMillis(600)), 0);
        assert_eq!(t.observe(Some(4), MonoMillis(700)), 0);
    }
}
