//! May a node start as the member it claims to be? The rule for a node with an empty data dir.
//!
//! A node that lost its data dir also lost its vote and its log. Raft's safety rests on both
//! being durable: started again as the same member, it could vote twice in one term, and the
//! leader (whose replication progress still says the follower holds the log up to some index)
//! would treat the empty follower as caught up. openraft 0.9 assumes a follower's log never goes
//! backwards: the follower then accepts the log tail on a commit index it does not have, and
//! applying that tail panics (`handle_apply_result`, unwrap on `None`) after serving partial
//! data. So, as etcd does with member ids and `--initial-cluster-state`:
//!
//! - a node with data restarts from it (nothing to decide);
//! - a node with an empty data dir first asks its peers whether a cluster already runs. If
//!   that cluster lists it as a member, the node has it **replaced** ([`Start::Replace`])
//!   before it takes part in anything: the leader removes it (only if the other voters can
//!   commit that alone, and not while it still hears from a node of that id at the recorded
//!   address) and adds it back as a learner, with replication progress started afresh; the
//!   node then starts and, if it was a voter, asks to be promoted once caught up. That is the
//!   documented manual procedure, done by the cluster, and safe whether the node lost its data
//!   or merely started late: until the removal commits the node answers nothing, so no commit
//!   can rest on its empty state; after it, the node's vote decides nothing (any candidate
//!   still holding the old configuration needs a majority of it, which meets the voters that
//!   committed the removal). With a leader named that cannot be asked (this node itself, which
//!   led before it lost its data), or a replacement begun whose learner add has not landed
//!   yet, it asks again ([`Start::AskAgain`]); with no leader named at all (a new cluster's
//!   first election) it starts as configured.
//!   With replacement turned off (`--no-auto-replace`) the old rules hold:
//! - a node asked to form a cluster (`--peers`, no `--join`) refuses to start if a cluster
//!   already runs: the operator removes the member and adds it back with `--join`;
//! - a node started with `--join` refuses while a peer still lists it as a member (the leader
//!   would keep its stale progress): remove it first.
//!
//! And who campaigns first in a brand-new cluster ([`first_campaign_delay`]): openraft's
//! `initialize` starts an election at once, and it orders two votes of one term by node id,
//! so a listed node that campaigned for the first term after another had won it deposed that
//! leader at its first append; the survivors, having just heard from a leader, refused every
//! vote until their leader lease ran out (about two seconds without a leader). So only the
//! lowest listed id initializes at once; each other waits its rank's turn, and by then has
//! usually been reached by the first leader (its `initialize` is then refused, harmlessly).
//!
//! # Invariants
//! - Pure: the caller gathers the reports (bounded wait) and acts on the decision.
//! - An unreachable peer proves nothing: with no report of a running cluster, the node proceeds
//!   (a brand-new cluster forms while its nodes come up one by one).

use std::collections::BTreeMap;

use super::types::NodeId;

/// What one peer said about the cluster it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerReport {
    /// The peer's own id.
    pub peer: NodeId,
    /// The leader it knows, if any.
    pub leader_id: Option<NodeId>,
    /// Its current term.
    pub term: u64,
    /// The ids in its membership (voters and learners).
    pub members: Vec<NodeId>,
    /// The voters among them.
    pub voters: Vec<NodeId>,
    /// The address of the leader it knows, as its membership records it.
    pub leader_address: Option<String>,
}

/// How a node that may start starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Start {
    /// As configured: restart from its data, form a new cluster, or wait to be added.
    AsConfigured,
    /// A running cluster lists this node, whose data dir is empty: have its leader remove it
    /// first (the node answers nothing meanwhile), then start as a joiner and ask to be
    /// added back.
    Replace {
        /// The peer that reported the leader.
        peer: NodeId,
        leader: NodeId,
        leader_address: String,
        /// Whether a peer lists this node as a voter: only then is it promoted again once
        /// caught up (a node kept a learner on purpose stays one).
        was_voter: bool,
    },
    /// Ask the peers again shortly, for the reason given.
    AskAgain(Waiting),
}

/// What a node asking its peers again waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// The running cluster lists this node, but no peer names a leader to ask (other than
    /// this node itself, which led before it lost its data).
    ForLeader,
    /// This node's replacement began (it noted that it is to be promoted again) and the
    /// cluster, led by `leader`, does not list it: the leader removed it and is adding it back.
    ToBeAddedBack { leader: NodeId },
}

/// What the data dir holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataDir {
    /// No vote, no log entry, no applied state: never started, or wiped.
    Empty,
    /// Holds Raft state: the node restarts from it.
    Existing,
}

/// Why a node must not start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A cluster is running and this node, with an empty data dir, was asked to form one.
    ClusterExists { peer: NodeId, leader: NodeId },
    /// This node joins with an empty data dir but a peer still lists it as a member.
    StillMember { peer: NodeId },
    /// The cluster still lists this node, whose data dir is empty, and its leader did not
    /// replace it ([`Start::Replace`]).
    NotReplaced { leader: NodeId, why: NotReplaced },
    /// The cluster still lists this node, whose data dir is empty, and no peer named a leader
    /// to ask for its replacement in time.
    NoLeaderToAsk,
}

/// Why a replacement ([`Start::Replace`]) did not happen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotReplaced {
    /// The leader refused (it cannot commit the removal without this node, or still hears
    /// from a node of this id): nothing was changed.
    Refused { reason: String },
    /// The cluster no longer lists this node: it was removed but not added back (the leader
    /// changed or failed in between).
    RemovedNotAdded,
    /// No answer in time; the last one is given.
    NoAnswer { secs: u64, last: String },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::ClusterExists { peer, leader } => write!(
                f,
                "the data dir is empty but a cluster already runs (node {peer} reports leader \
                 {leader}): this node may have lost its data and must not rejoin as the member it \
                 was. Remove it (`leasecore cluster remove ID`), then start it with --join and add \
                 it (`leasecore cluster add ID HOST:PORT`); it catches up from a snapshot before it \
                 votes"
            ),
            Refusal::StillMember { peer } => write!(
                f,
                "the data dir is empty but node {peer} still lists this node as a member: remove \
                 it first (`leasecore cluster remove ID`), then add it again \
                 (`leasecore cluster add ID HOST:PORT`)"
            ),
            Refusal::NotReplaced { leader, why } => {
                write!(
                    f,
                    "the data dir is empty and the cluster listed this node, but its leader \
                     (node {leader}) did not replace it: "
                )?;
                match why {
                    NotReplaced::Refused { reason } => write!(
                        f,
                        "{reason}. Nothing was changed: start this node again once that is \
                         mended, or replace it by hand (`leasecore cluster remove ID`, then \
                         start it with --join and `leasecore cluster add ID HOST:PORT`)"
                    ),
                    NotReplaced::RemovedNotAdded => write!(
                        f,
                        "it was removed from the cluster but not added back (the leader \
                         changed or failed in between). Start it with --join and add it \
                         (`leasecore cluster add ID HOST:PORT`)"
                    ),
                    NotReplaced::NoAnswer { secs, last } => write!(
                        f,
                        "no answer within {secs} s (the last: {last}). Check whether the \
                         cluster still lists it (`leasecore cluster status`), then start it \
                         again, or replace it by hand"
                    ),
                }
            }
            Refusal::NoLeaderToAsk => write!(
                f,
                "the data dir is empty and the running cluster lists this node, but no peer \
                 named a leader to ask for its replacement: start it again once the cluster \
                 has a leader"
            ),
        }
    }
}

/// Decide whether and how node `me` may start; `auto_replace` allows [`Start::Replace`];
/// `replacing` says that a replacement of this node began (a start before this one noted that
/// it is to be promoted again).
pub fn may_start(
    me: NodeId,
    data: DataDir,
    join: bool,
    auto_replace: bool,
    replacing: bool,
    reports: &[PeerReport],
) -> Result<Start, Refusal> {
    if data == DataDir::Existing {
        return Ok(Start::AsConfigured);
    }
    let others: Vec<&PeerReport> = reports.iter().filter(|r| r.peer != me).collect();
    let listed = others.iter().any(|r| r.members.contains(&me));
    if auto_replace && replacing && !listed {
        // Removed by the leader, whose learner add may still land (it runs to its end even
        // when the asking node is gone): wait for it rather than refuse.
        if let Some((_, leader, _)) = leader_to_ask(me, reports) {
            return Ok(Start::AskAgain(Waiting::ToBeAddedBack { leader }));
        }
    }
    if auto_replace && listed {
        let was_voter = others.iter().any(|r| r.voters.contains(&me));
        if let Some((peer, leader, leader_address)) = leader_to_ask(me, reports) {
            return Ok(Start::Replace {
                peer,
                leader,
                leader_address,
                was_voter,
            });
        }
        // A leader is named, but none to ask (this node, which led before it lost its data,
        // or one without an address): one will be. With no leader named at all, a cluster
        // still forming (its first election) is joined as below.
        if others.iter().any(|r| r.leader_id.is_some()) {
            return Ok(Start::AskAgain(Waiting::ForLeader));
        }
    }
    if join {
        return match others.into_iter().find(|r| r.members.contains(&me)) {
            Some(r) => Err(Refusal::StillMember { peer: r.peer }),
            None => Ok(Start::AsConfigured),
        };
    }
    for r in others {
        if let Some(leader) = r.leader_id {
            return Err(Refusal::ClusterExists {
                peer: r.peer,
                leader,
            });
        }
    }
    Ok(Start::AsConfigured)
}

/// The leader to ask, from peers' reports: the one named in the highest term, never `me` (which
/// may have led before it lost its data: its own port does not answer yet), and only with an
/// address to reach it at. As (reporting peer, leader, address).
pub fn leader_to_ask(me: NodeId, reports: &[PeerReport]) -> Option<(NodeId, NodeId, String)> {
    reports
        .iter()
        .filter(|r| r.peer != me)
        .filter_map(|r| {
            let leader = r.leader_id.filter(|l| *l != me)?;
            Some((r.term, r.peer, leader, r.leader_address.clone()?))
        })
        .max_by_key(|(term, peer, ..)| (*term, std::cmp::Reverse(*peer)))
        .map(|(_, peer, leader, address)| (peer, leader, address))
}

/// Whether removing `removed`, which answers nothing, can commit: the voters that answered the
/// leader recently (`answering`, the leader included), without it, must be a majority of
/// `voters` (the configuration being left; they are then a majority of the one entered too).
/// If not, the removal would sit uncommitted in the leader's log, and the cluster with it.
pub fn removal_commits_without(
    voters: &std::collections::BTreeSet<NodeId>,
    removed: NodeId,
    answering: &std::collections::BTreeSet<NodeId>,
) -> bool {
    let others = voters
        .iter()
        .filter(|v| **v != removed && answering.contains(v))
        .count();
    others > voters.len() / 2
}

/// How long listed node `me` waits before it initializes a new cluster of `voters` (and so
/// campaigns): zero for the lowest id, one `step` more for each id below it. A node the
/// first leader reached meanwhile holds a vote or a log by then, and openraft refuses its
/// `initialize`; one that was not (the lower ids are down) forms the cluster itself, later.
pub fn first_campaign_delay(
    me: NodeId,
    voters: impl IntoIterator<Item = NodeId>,
    step: std::time::Duration,
) -> std::time::Duration {
    let rank = voters.into_iter().filter(|id| *id < me).count();
    step.saturating_mul(u32::try_from(rank).unwrap_or(u32::MAX))
}

/// How long a listed node waits before it forms a new cluster: for every other listed node to
/// be up (at most `listed_wait`), then its turn ([`first_campaign_delay`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FormingWaits {
    pub listed: std::time::Duration,
    pub turn: std::time::Duration,
}

impl FormingWaits {
    /// Nothing to wait for: form (or find formed) at once.
    pub fn none(&self) -> bool {
        self.listed.is_zero() && self.turn.is_zero()
    }
}

/// The waits of listed node `me` of `voters`. A node with data was initialized long ago
/// (openraft refuses the call at once): no wait. Only a new one waits its turn, and only a new
/// one that asked its peers at start (`probes`, so that it may have refused to start) waits for
/// the others to have asked theirs, up to `listed_wait`.
pub fn forming_waits(
    me: NodeId,
    voters: impl IntoIterator<Item = NodeId>,
    data: DataDir,
    probes: bool,
    step: std::time::Duration,
    listed_wait: std::time::Duration,
) -> FormingWaits {
    match data {
        DataDir::Existing => FormingWaits {
            listed: std::time::Duration::ZERO,
            turn: std::time::Duration::ZERO,
        },
        DataDir::Empty => FormingWaits {
            listed: if probes {
                listed_wait
            } else {
                std::time::Duration::ZERO
            },
            turn: first_campaign_delay(me, voters, step),
        },
    }
}

/// What a listed node of a new cluster does when its turn to form it comes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AtTurn {
    /// Nobody reached it: it forms the cluster with its own list.
    Initialize,
    /// A leader reached it with the membership this node lists: nothing to do.
    Joined,
    /// A leader reached it with other voters than it lists: an operator's mistake to report.
    JoinedOtherVoters,
}

/// Decide [`AtTurn`] from this node's `--peers` list and the voters of the membership it holds
/// (`None` while it holds none), both as id -> address.
pub fn at_turn(
    listed: &BTreeMap<NodeId, String>,
    formed: Option<&BTreeMap<NodeId, String>>,
) -> AtTurn {
    match formed {
        None => AtTurn::Initialize,
        Some(formed) if formed == listed => AtTurn::Joined,
        Some(_) => AtTurn::JoinedOtherVoters,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn at_its_turn_a_node_forms_the_cluster_only_if_nobody_reached_it() {
        let listed: BTreeMap<NodeId, String> =
            [(1, "a:1".to_string()), (2, "b:1".to_string())].into();
        assert_eq!(at_turn(&listed, None), AtTurn::Initialize);
        assert_eq!(at_turn(&listed, Some(&listed)), AtTurn::Joined);
        let mut moved = listed.clone();
        moved.insert(2, "b:2".to_string());
        assert_eq!(at_turn(&listed, Some(&moved)), AtTurn::JoinedOtherVoters);
        let mut more = listed.clone();
        more.insert(3, "c:1".to_string());
        assert_eq!(at_turn(&listed, Some(&more)), AtTurn::JoinedOtherVoters);
    }

    #[test]
    fn only_the_lowest_listed_id_campaigns_at_once() {
        let step = Duration::from_millis(500);
        assert_eq!(first_campaign_delay(1, [1, 2, 3], step), Duration::ZERO);
        assert_eq!(first_campaign_delay(2, [1, 2, 3], step), step);
        assert_eq!(first_campaign_delay(3, [3, 1, 2], step), step * 2);
        // Ids need not be dense; a lone node campaigns at once.
        assert_eq!(first_campaign_delay(7, [4, 7, 9], step), step);
        assert_eq!(first_campaign_delay(5, [5], step), Duration::ZERO);
    }

    fn report(peer: NodeId, leader: Option<NodeId>, members: &[NodeId]) -> PeerReport {
        PeerReport {
            peer,
            leader_id: leader,
            term: leader.map_or(0, |_| 3),
            members: members.to_vec(),
            voters: members.to_vec(),
            leader_address: leader.map(|l| format!("127.0.0.1:{}", 7000 + l)),
        }
    }

    const AS: Result<Start, Refusal> = Ok(Start::AsConfigured);

    #[test]
    fn a_node_with_data_always_restarts() {
        let r = [report(1, Some(1), &[1, 2, 3])];
        for (join, replace) in [(false, false), (true, false), (false, true), (true, true)] {
            assert_eq!(
                may_start(2, DataDir::Existing, join, replace, false, &r),
                AS
            );
        }
    }

    #[test]
    fn an_empty_node_forms_a_new_cluster_when_no_peer_knows_a_leader() {
        // Peers unreachable, or up but still electing their first leader.
        assert_eq!(may_start(2, DataDir::Empty, false, true, false, &[]), AS);
        let r = [report(1, None, &[1, 2, 3]), report(3, None, &[])];
        assert_eq!(may_start(2, DataDir::Empty, false, true, false, &r), AS);
    }

    #[test]
    fn an_empty_member_of_a_running_cluster_is_replaced_or_refused() {
        let r = [report(1, None, &[]), report(3, Some(1), &[1, 2, 3])];
        let replace = Ok(Start::Replace {
            peer: 3,
            leader: 1,
            leader_address: "127.0.0.1:7001".into(),
            was_voter: true,
        });
        assert_eq!(
            may_start(2, DataDir::Empty, false, true, false, &r),
            replace
        );
        assert_eq!(may_start(2, DataDir::Empty, true, true, false, &r), replace);
        assert_eq!(
            may_start(2, DataDir::Empty, false, false, false, &r),
            Err(Refusal::ClusterExists { peer: 3, leader: 1 })
        );
        // A leader whose address nobody gave: ask again (later).
        let mut unknown = r.clone();
        unknown[1].leader_address = None;
        assert_eq!(
            may_start(2, DataDir::Empty, false, true, false, &unknown),
            Ok(Start::AskAgain(Waiting::ForLeader))
        );
        // No leader at all: a new cluster's first election; joined as ever.
        let electing = [report(1, None, &[1, 2, 3])];
        assert_eq!(
            may_start(2, DataDir::Empty, false, true, false, &electing),
            AS
        );
        // A learner is replaced as a learner.
        let mut learner = r.clone();
        learner[1].voters = vec![1, 3];
        assert!(matches!(
            may_start(2, DataDir::Empty, false, true, false, &learner),
            Ok(Start::Replace {
                was_voter: false,
                ..
            })
        ));
    }

    #[test]
    fn the_leader_to_ask_is_the_one_of_the_highest_term_and_never_the_node_itself() {
        let mut stale = report(1, Some(1), &[1, 2, 3]);
        stale.term = 3;
        let mut current = report(3, Some(3), &[1, 2, 3]);
        current.term = 5;
        assert_eq!(
            leader_to_ask(2, &[stale.clone(), current.clone()]),
            Some((3, 3, "127.0.0.1:7003".into()))
        );
        // This node led before it lost its data: not asked; nobody else: ask again later.
        let mut me_leading = report(1, Some(2), &[1, 2, 3]);
        me_leading.term = 7;
        assert_eq!(leader_to_ask(2, &[me_leading.clone()]), None);
        assert_eq!(
            may_start(2, DataDir::Empty, false, true, false, &[me_leading.clone()]),
            Ok(Start::AskAgain(Waiting::ForLeader))
        );
        assert_eq!(
            leader_to_ask(2, &[me_leading, stale]),
            Some((1, 1, "127.0.0.1:7001".into()))
        );
    }

    #[test]
    fn a_node_whose_replacement_began_waits_to_be_added_back() {
        let removed = [report(1, Some(1), &[1, 3])];
        assert_eq!(
            may_start(2, DataDir::Empty, false, true, true, &removed),
            Ok(Start::AskAgain(Waiting::ToBeAddedBack { leader: 1 }))
        );
        // Added back (a learner): replaced again, as a learner; its note promotes it.
        let mut back = report(1, Some(1), &[1, 2, 3]);
        back.voters = vec![1, 3];
        assert!(matches!(
            may_start(2, DataDir::Empty, false, true, true, &[back]),
            Ok(Start::Replace {
                was_voter: false,
                ..
            })
        ));
        // Without replacement, the old refusal.
        assert_eq!(
            may_start(2, DataDir::Empty, false, false, true, &removed),
            Err(Refusal::ClusterExists { peer: 1, leader: 1 })
        );
    }

    #[test]
    fn a_running_cluster_without_the_node_is_not_joined_uninvited() {
        // Removed on purpose (or never added): with --peers it refuses, with --join it waits.
        let r = [report(1, Some(1), &[1, 3])];
        assert_eq!(
            may_start(2, DataDir::Empty, false, true, false, &r),
            Err(Refusal::ClusterExists { peer: 1, leader: 1 })
        );
        assert_eq!(may_start(2, DataDir::Empty, true, true, false, &r), AS);
    }

    #[test]
    fn a_removal_must_commit_without_the_removed_node() {
        let set = |ids: &[NodeId]| {
            ids.iter()
                .copied()
                .collect::<std::collections::BTreeSet<_>>()
        };
        let three = set(&[1, 2, 3]);
        assert!(removal_commits_without(&three, 2, &set(&[1, 3])));
        assert!(removal_commits_without(&three, 2, &set(&[1, 2, 3])));
        assert!(
            !removal_commits_without(&three, 2, &set(&[1, 2])),
            "3 is down"
        );
        assert!(!removal_commits_without(&set(&[1, 2]), 2, &set(&[1, 2])));
        let five = set(&[1, 2, 3, 4, 5]);
        assert!(removal_commits_without(&five, 5, &set(&[1, 2, 3])));
        assert!(!removal_commits_without(&five, 5, &set(&[1, 2, 5])));
        assert!(
            !removal_commits_without(&five, 9, &set(&[1, 9])),
            "a stranger counts for nothing"
        );
    }

    #[test]
    fn its_own_report_does_not_count() {
        let r = [report(2, Some(2), &[2])];
        assert_eq!(may_start(2, DataDir::Empty, false, true, false, &r), AS);
    }

    #[test]
    fn an_empty_joiner_waits_to_be_added_unless_still_a_member() {
        let removed = [report(1, Some(1), &[1, 3])];
        assert_eq!(
            may_start(2, DataDir::Empty, true, false, false, &removed),
            AS
        );
        let listed = [report(1, Some(1), &[1, 2, 3])];
        assert_eq!(
            may_start(2, DataDir::Empty, true, false, false, &listed),
            Err(Refusal::StillMember { peer: 1 })
        );
        // A member while no leader is named: refused, with or without replacement.
        let leaderless = [report(1, None, &[1, 2, 3])];
        for replace in [false, true] {
            assert_eq!(
                may_start(2, DataDir::Empty, true, replace, false, &leaderless),
                Err(Refusal::StillMember { peer: 1 })
            );
        }
    }

    #[test]
    fn only_a_new_node_waits_and_only_one_that_probed_waits_for_the_others() {
        use std::time::Duration;
        let (step, wait) = (Duration::from_millis(300), Duration::from_secs(5));
        let w = forming_waits(2, [1, 2, 3], DataDir::Empty, true, step, wait);
        assert_eq!((w.listed, w.turn), (wait, step));
        let w = forming_waits(1, [1, 2, 3], DataDir::Empty, false, step, wait);
        assert!(w.none(), "the lowest id of an unprobed start forms at once");
        let w = forming_waits(3, [1, 2, 3], DataDir::Existing, true, step, wait);
        assert!(w.none(), "a node with data was initialized long ago");
    }
}
