//! A node with an empty data dir that the running cluster still lists has itself replaced
//! (`domain::bootstrap::Start::Replace`): the I/O half.
//!
//! 1. [`check_empty_start`] asks the peers (`runtime::bootstrap::probe_peers`) and applies
//!    `domain::bootstrap::may_start`, asking again while the cluster names no leader to ask.
//! 2. If the node was a voter, it notes in its data dir that it is to be promoted
//!    ([`PROMOTION_PENDING`]), before anything else: a restart from that data dir, before the
//!    promotion, resumes asking for it.
//! 3. [`remove_for_replacement`]: before the node answers anything on its ports, the leader
//!    removes it and adds it back as a learner (`AdminRequest::RemoveForReplacement`; the
//!    leader's work runs to its end even if this ask is cut). Refusals that say "retry" are
//!    retried, the leader found anew when it moved, all within [`REPLACE_WITHIN`].
//! 4. The node starts; [`ask_to_be_added`] asks (`AddNode`) to be promoted once caught up,
//!    until it is a voter, and then removes the note.
//!
//! # What it must not do
//! Decide who leads, whether to replace, or whether a removal can commit: `domain::bootstrap`
//! and the leader decide. Ask without a bound: every ask has a timeout, the replacement a
//! total budget, the promotion loop a backoff and the node's cancellation.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::bootstrap::{probe_peers, report_of};
use crate::domain::bootstrap::{
    DataDir, NotReplaced, Refusal, Start, Waiting, leader_to_ask, may_start,
};
use crate::domain::types::NodeId;
use crate::raft::consensus::{AdminOutcome, AdminRequest, Consensus, ConsensusError};
use crate::raft::network::{PeerClient, routes};

/// How long a starting node keeps at its replacement: asking for a leader to ask, and asking
/// the leader (which refuses while it still hears from the node, up to an election timeout
/// after a crash).
pub const REPLACE_WITHIN: Duration = Duration::from_secs(30);

/// The file in the data dir that says this node was replaced as a voter and is to be
/// promoted again once caught up.
pub const PROMOTION_PENDING: &str = "promotion-pending";

/// Pause between two asks (for a leader, to the leader).
const ASK_AGAIN_AFTER: Duration = Duration::from_millis(250);

/// What a node with an empty data dir needs to decide how it starts.
pub struct StartCheck<'a> {
    pub me: NodeId,
    /// Its `--peers` list.
    pub listed: &'a BTreeMap<NodeId, String>,
    /// Where peers reach it.
    pub advertise: &'a str,
    /// Its data dir (for [`PROMOTION_PENDING`]).
    pub data_dir: &'a Path,
    pub join: bool,
    pub auto_replace: bool,
    /// How long to wait for the peers' status answers.
    pub probe: Duration,
    /// How long one ask to the leader may take (its removal and learner add, each bounded by
    /// its request timeout).
    pub ask: Duration,
    /// The largest election timeout.
    pub election_max: Duration,
}

/// Ask the peers whether a cluster runs and act on `domain::bootstrap::may_start`:
/// `Ok(None)` to start as configured, `Ok(Some(leader address))` once the leader replaced this
/// node (it then starts as a learner), `Err` to refuse to start.
pub async fn check_empty_start(
    client: &PeerClient,
    c: StartCheck<'_>,
) -> Result<Option<String>, Refusal> {
    let replacing = promotion_pending(c.data_dir);
    let mut waiting: Option<Waiting> = None;
    let deciding = async {
        loop {
            let reports = probe_peers(c.me, c.listed, client, c.probe).await;
            let start = may_start(
                c.me,
                DataDir::Empty,
                c.join,
                c.auto_replace,
                replacing,
                &reports,
            )?;
            match start {
                Start::AskAgain(why) => {
                    if waiting.as_ref() != Some(&why) {
                        tracing::info!(waiting = ?why, "asking the peers again until it changes");
                    }
                    waiting = Some(why);
                    tokio::time::sleep(ASK_AGAIN_AFTER).await;
                }
                other => return Ok(other),
            }
        }
    };
    let decided = tokio::time::timeout(REPLACE_WITHIN, deciding).await;
    let start = match decided {
        Ok(start) => start?,
        Err(_) => {
            return Err(match waiting {
                Some(Waiting::ToBeAddedBack { leader }) => Refusal::NotReplaced {
                    leader,
                    why: NotReplaced::RemovedNotAdded,
                },
                _ => Refusal::NoLeaderToAsk,
            });
        }
    };
    let Start::Replace {
        peer,
        leader,
        leader_address,
        was_voter,
    } = start
    else {
        return Ok(None);
    };
    tracing::warn!(
        peer,
        leader,
        was_voter,
        "the data dir is empty but the running cluster still lists this node: asking the \
         leader to replace it (remove it, then add it back to catch up before it votes)"
    );
    if was_voter {
        note_promotion_pending(c.data_dir).map_err(|e| Refusal::NotReplaced {
            leader,
            why: NotReplaced::Refused {
                reason: format!("could not write {PROMOTION_PENDING} in the data dir: {e}"),
            },
        })?;
    }
    let addresses: Vec<String> = c.listed.values().cloned().collect();
    let replacement = Replacement {
        me: c.me,
        advertise: c.advertise,
        leader_address: leader_address.clone(),
        addresses: &addresses,
    };
    let waits = ReplaceWaits {
        ask: c.ask,
        probe: c.probe,
        still_answering: c.election_max * 5,
        total: REPLACE_WITHIN,
    };
    if let Err(why) = remove_for_replacement(client, replacement, waits).await {
        // Nothing to promote if nothing changed since this start wrote the note; otherwise
        // it stays for a later start.
        if matches!(why, NotReplaced::Refused { .. }) && !replacing {
            clear_promotion_pending(c.data_dir);
        }
        return Err(Refusal::NotReplaced { leader, why });
    }
    tracing::info!(
        leader,
        "removed by the leader and added back as a learner; starting as a new member"
    );
    Ok(Some(leader_address))
}

/// Who asks to be replaced, and where.
pub struct Replacement<'a> {
    /// The node asking (which has not answered anything yet).
    pub me: NodeId,
    /// Where it is to be added back: the address the cluster records for it.
    pub advertise: &'a str,
    /// The leader to ask first.
    pub leader_address: String,
    /// Where to find the leader anew when it moved.
    pub addresses: &'a [String],
}

/// How long [`remove_for_replacement`] waits.
#[derive(Clone, Copy, Debug)]
pub struct ReplaceWaits {
    /// One ask to the leader.
    pub ask: Duration,
    /// One status question to a peer.
    pub probe: Duration,
    /// At most, while the leader keeps hearing from a node of this id: a node restarted after
    /// a crash falls silent within an election timeout; one that does not is another process
    /// with this id.
    pub still_answering: Duration,
    /// At most, in all.
    pub total: Duration,
}

/// The leader (as reported by the peers at `addresses`), and whether any of them still lists
/// `me` as a member.
async fn ask_peers(
    client: &PeerClient,
    me: NodeId,
    addresses: &[String],
    timeout: Duration,
) -> (Option<String>, bool) {
    let asks = addresses.iter().map(|a| client.status(a, timeout));
    let reports: Vec<_> = futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .map(|view| report_of(&view))
        .collect();
    let listed = reports.iter().any(|r| r.members.contains(&me));
    (leader_to_ask(me, &reports).map(|(_, _, a)| a), listed)
}

/// Have the leader remove node `r.me` and add it back as a learner at `r.advertise`, asking
/// again while the refusal says to (and finding the leader anew when it moved), within
/// `waits`. `Ok` once it is a learner again.
pub async fn remove_for_replacement(
    client: &PeerClient,
    r: Replacement<'_>,
    waits: ReplaceWaits,
) -> Result<(), NotReplaced> {
    let req = AdminRequest::RemoveForReplacement {
        id: r.me,
        address: r.advertise.to_string(),
    };
    let mut leader_address = r.leader_address;
    let mut last = String::from("no answer");
    let mut listed = true;
    let asking = async {
        let mut answering_asks = 0u32;
        let answering_budget = waits.still_answering.as_millis() / ASK_AGAIN_AFTER.as_millis();
        loop {
            let answer: Result<Result<AdminOutcome, ConsensusError>, _> = client
                .post_json(&leader_address, routes::ADMIN, &req, waits.ask)
                .await;
            match answer {
                Ok(Ok(_)) => return Ok(()),
                // Permanent: the leader cannot commit the removal without this node, or
                // records it at another address.
                Ok(Err(e @ ConsensusError::InvalidMembership { .. })) => {
                    return Err(NotReplaced::Refused {
                        reason: e.to_string(),
                    });
                }
                Ok(Err(e @ ConsensusError::StillAnswering { .. })) => {
                    answering_asks += 1;
                    if u128::from(answering_asks) > answering_budget {
                        return Err(NotReplaced::Refused {
                            reason: e.to_string(),
                        });
                    }
                    last = e.to_string();
                }
                // Not a member (any more): an earlier ask's removal took effect and its
                // learner add may still land; a leader that changed in between never adds it.
                Ok(Err(e)) => last = e.to_string(),
                Err(e) => last = e.to_string(),
            }
            tracing::info!(leader = %leader_address, reason = %last, "asking again to be replaced");
            tokio::time::sleep(ASK_AGAIN_AFTER).await;
            let (leader, still_listed) = ask_peers(client, r.me, r.addresses, waits.probe).await;
            listed = still_listed;
            if let Some(address) = leader {
                leader_address = address;
            }
        }
    };
    match tokio::time::timeout(waits.total, asking).await {
        Ok(result) => result,
        Err(_) if listed => Err(NotReplaced::NoAnswer {
            secs: waits.total.as_secs(),
            last,
        }),
        Err(_) => Err(NotReplaced::RemovedNotAdded),
    }
}

/// Note in `data_dir` that this node is to be promoted once caught up (synced: a restart
/// right after must still find it).
fn note_promotion_pending(data_dir: &Path) -> std::io::Result<()> {
    let file = std::fs::File::create(data_dir.join(PROMOTION_PENDING))?;
    file.sync_all()?;
    std::fs::File::open(data_dir)?.sync_all()
}

/// The addresses of the other members this node's log names.
fn member_addresses(consensus: &Consensus, me: NodeId, advertise: &str) -> Vec<String> {
    let m = consensus
        .raft()
        .metrics()
        .borrow()
        .membership_config
        .clone();
    m.membership()
        .nodes()
        .filter(|(id, node)| **id != me && node.addr != advertise)
        .map(|(_, node)| node.addr.clone())
        .collect()
}

/// Whether `data_dir` says this node is to be promoted.
pub fn promotion_pending(data_dir: &Path) -> bool {
    data_dir.join(PROMOTION_PENDING).exists()
}

fn clear_promotion_pending(data_dir: &Path) {
    if let Err(e) = std::fs::remove_file(data_dir.join(PROMOTION_PENDING))
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(error = %e, "could not remove {PROMOTION_PENDING}");
    }
}

/// Once this node (replaced as a voter: a learner again) serves, ask the leader to promote it
/// once it has caught up (`AddNode` at `advertise`, which for a learner waits for that), the
/// leader found among `addresses`; again and again (with a backoff) until it is a voter, the
/// cluster no longer lists it, or shutdown. Then it removes the note in `data_dir`.
pub async fn ask_to_be_added(
    consensus: Consensus,
    advertise: String,
    mut addresses: Vec<String>,
    data_dir: std::path::PathBuf,
    ask_within: Duration,
    cancel: CancellationToken,
) {
    const MAX_PAUSE: Duration = Duration::from_secs(5);
    const STATUS_WITHIN: Duration = Duration::from_secs(1);
    addresses.retain(|a| *a != advertise);
    addresses.sort();
    addresses.dedup();
    let me = consensus.cluster_view().node_id;
    let client = consensus.peers().clone();
    let req = AdminRequest::AddNode {
        id: me,
        address: advertise.clone(),
    };
    let mut pause = ASK_AGAIN_AFTER;
    let asking = async {
        loop {
            // A node started with `--join` lists no peers: the members its log names.
            let mut addresses = addresses.clone();
            addresses.extend(member_addresses(&consensus, me, &advertise));
            addresses.sort();
            addresses.dedup();
            let (leader, listed) = ask_peers(&client, me, &addresses, STATUS_WITHIN).await;
            let reason = match leader {
                None => "no leader found".to_string(),
                Some(_) if !listed => {
                    tracing::warn!(
                        "the cluster no longer lists this node: not asking to be promoted"
                    );
                    return;
                }
                Some(address) => {
                    let answer: Result<Result<AdminOutcome, ConsensusError>, _> = client
                        .post_json(&address, routes::ADMIN, &req, ask_within)
                        .await;
                    match answer {
                        Ok(Ok(AdminOutcome::Done)) => {
                            tracing::info!("a voter again: replaced");
                            return;
                        }
                        Ok(Ok(AdminOutcome::Removed { message })) => {
                            tracing::warn!(%message, "removed while catching up; not asking any more");
                            return;
                        }
                        Ok(Ok(AdminOutcome::Learner { message })) => message,
                        Ok(Err(e)) => e.to_string(),
                        Err(e) => e.to_string(),
                    }
                }
            };
            tracing::warn!(%reason, retry_in_ms = pause.as_millis() as u64, "not promoted yet");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    };
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = asking => clear_promotion_pending(&data_dir),
    }
}

/// How long the leader waits before it tries again to replace a node whose log went back,
/// after a try that could not (its removal would not commit, or the leadership moved).
const REVERTED_RETRY: Duration = Duration::from_secs(2);

/// On the leader: replace each node that the network reports as having lost entries it had
/// acknowledged (`raft::network::reversion`), one at a time, until shutdown. Reports of a node
/// already replaced (its record forgotten) or repeated while one is handled are dropped.
pub async fn replace_reverted_nodes(
    consensus: Consensus,
    mut reports: tokio::sync::mpsc::Receiver<NodeId>,
    cancel: CancellationToken,
) {
    loop {
        let id = tokio::select! {
            _ = cancel.cancelled() => return,
            id = reports.recv() => match id {
                Some(id) => id,
                None => return,
            },
        };
        let outcome = tokio::select! {
            _ = cancel.cancelled() => return,
            outcome = consensus.replace_reverted(id) => outcome,
        };
        match outcome {
            Ok(AdminOutcome::Done) => tracing::warn!(
                node = id,
                "node {id} lost its data and was replaced: removed, added back, caught up"
            ),
            Ok(AdminOutcome::Learner { message } | AdminOutcome::Removed { message }) => {
                tracing::warn!(node = id, %message, "node {id} lost its data and was replaced")
            }
            Err(ConsensusError::NotLeader | ConsensusError::NodeNotFound { .. }) => {}
            Err(e) => {
                tracing::error!(
                    node = id,
                    error = %e,
                    retry_in_ms = REVERTED_RETRY.as_millis() as u64,
                    "node {id} lost its data and could not be replaced yet"
                );
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(REVERTED_RETRY) => {}
                }
            }
        }
        // What arrived meanwhile is about the node just handled, or will be reported again.
        while reports.try_recv().is_ok() {}
    }
}

/// A node that withholds its vote (`raft::vote_hold`): where it is recorded, whether it may
/// ask to be replaced (`--no-auto-replace` says no: the operator removes and adds it), and
/// what its promotion afterwards needs ([`ask_to_be_added`]).
pub struct HeldNode {
    pub address: String,
    pub ask_replacement: bool,
    pub data_dir: std::path::PathBuf,
    pub ask_within: Duration,
}

/// How often a held node looks at its hold.
const HELD_CHECK_EVERY: Duration = Duration::from_millis(500);

/// After a refused or failed ask to be replaced, wait this long before asking again.
const HELD_ASK_AGAIN_AFTER: Duration = Duration::from_secs(5);

/// While this node withholds its vote: if its log shows it lost its data as a voter nobody
/// replaced ([`VoteHold::still_counted_as_voter`](crate::raft::vote_hold::VoteHold)), note
/// that it is to be promoted, ask the leader to replace it
/// (`AdminRequest::ReplaceHeldVoter`), and then to promote it once caught up
/// ([`ask_to_be_added`]). Ends once released without that, or at shutdown.
pub async fn replace_if_held_as_voter(
    consensus: Consensus,
    hold: std::sync::Arc<crate::raft::vote_hold::VoteHold>,
    node: HeldNode,
    cancel: CancellationToken,
) {
    let asking = async {
        let mut told = false;
        let mut asked = false;
        loop {
            tokio::time::sleep(HELD_CHECK_EVERY).await;
            if !hold.is_held() {
                // Released after an ask whose answer was lost (it may still have replaced
                // this node): ask to be promoted as after an answered one. A replacement at
                // start has its own asker (`node`).
                return asked && promotion_pending(&node.data_dir);
            }
            if !hold.still_counted_as_voter() {
                continue;
            }
            if !node.ask_replacement {
                if !told {
                    tracing::warn!(
                        "this node lost its data but the cluster still counts it as a voter; it \
                         does not vote until removed and added again (auto-replace is off): \
                         `leasecore cluster remove`, then `cluster add`"
                    );
                    told = true;
                }
                continue;
            }
            if let Err(e) = note_promotion_pending(&node.data_dir) {
                tracing::error!(error = %e, "could not write {PROMOTION_PENDING}; not asking to be replaced");
                tokio::time::sleep(HELD_ASK_AGAIN_AFTER).await;
                continue;
            }
            asked = true;
            let req = AdminRequest::ReplaceHeldVoter {
                id: consensus.cluster_view().node_id,
                address: node.address.clone(),
            };
            tracing::warn!(
                "this node lost its data and the cluster still counts it as a voter: asking \
                 the leader to replace it (removed, added back, promoted once caught up)"
            );
            match consensus.admin(req).await {
                Ok(_) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, "not replaced yet; asking again");
                    tokio::time::sleep(HELD_ASK_AGAIN_AFTER).await;
                }
            }
        }
    };
    let replaced = tokio::select! {
        _ = cancel.cancelled() => return,
        replaced = asking => replaced,
    };
    if replaced {
        tracing::info!("removed by the leader and added back as a learner; asking to be promoted");
        ask_to_be_added(
            consensus,
            node.address,
            Vec::new(),
            node.data_dir,
            node.ask_within,
            cancel,
        )
        .await;
    }
}
