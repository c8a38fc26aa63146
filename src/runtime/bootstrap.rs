//! Ask the peers, once, whether a cluster already runs, and form a new cluster in turn: the
//! I/O half of [`crate::domain::bootstrap`].
//!
//! Runs only when a node starts with an empty data dir. Every peer is asked concurrently, on
//! its peer port with the node's peer client (`/raft/status`: the same document as
//! `GET /v1/cluster`, reached with peer TLS when that is on, whatever the client port
//! demands), each answer bounded by one timeout, so a start waits at most that long.
//! A peer that does not answer (not up yet, unreachable) contributes no report.
//!
//! A listed node of a new cluster that asked its peers at start initializes only once every
//! other listed node answers on its peer port, or [`LISTED_WAIT`] has passed
//! ([`wait_for_listed`]: so that none of them is refused for starting a little late), and then
//! only after its turn ([`initialize_later`], the delay from
//! `domain::bootstrap::first_campaign_delay`), unless a leader reached it meanwhile; reached,
//! it compares the formed membership with its own `--peers` list and warns if they differ.
//!
//! A node with an empty data dir that a running cluster still lists is replaced
//! (`domain::bootstrap::Start::Replace`): [`remove_for_replacement`] has the leader remove it
//! and add it back as a learner before the node answers anything, and once it serves,
//! [`ask_to_be_added`] has it promoted when caught up.
//!
//! # What it must not do
//! Decide: it gathers reports, waits turns and acts; `domain::bootstrap` rules (`may_start`,
//! `first_campaign_delay`, `at_turn`).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::bootstrap::{
    AtTurn, DataDir, FormingWaits, PeerReport, Refusal, Start, at_turn, may_start,
};
use crate::domain::types::NodeId;
use crate::raft::consensus::{AdminOutcome, AdminRequest, ClusterView, Consensus, ConsensusError};
use crate::raft::network::{PeerClient, routes};

/// Reports from every peer but `me` that answered within `timeout`.
pub async fn probe_peers(
    me: NodeId,
    peers: &BTreeMap<NodeId, String>,
    client: &PeerClient,
    timeout: Duration,
) -> Vec<PeerReport> {
    let asks = peers
        .iter()
        .filter(|(id, _)| **id != me)
        .map(|(id, addr)| {
            let id = *id;
            async move {
                let view = client
                    .status(addr, timeout)
                    .await
                    .map_err(|e| tracing::debug!(peer = id, error = %e, "peer did not report"))
                    .ok()?;
                tracing::info!(peer = id, leader = ?view.leader_id, term = view.term, "peer reports its cluster");
                Some(report_of(&view))
            }
        });
    let all = futures::future::join_all(asks);
    // Belt and braces: the client timeout bounds each ask; this bounds the whole.
    tokio::time::timeout(timeout + Duration::from_millis(500), all)
        .await
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .collect()
}

/// A peer's cluster view as the start-up rules read it.
fn report_of(view: &ClusterView) -> PeerReport {
    PeerReport {
        peer: view.node_id,
        leader_id: view.leader_id,
        term: view.term,
        members: view.nodes.iter().map(|n| n.id).collect(),
        leader_address: view
            .leader_id
            .and_then(|l| view.nodes.iter().find(|n| n.id == l))
            .map(|n| n.address.clone()),
    }
}

/// What a node with an empty data dir needs to decide how it starts.
pub struct StartCheck<'a> {
    pub me: NodeId,
    /// Its `--peers` list.
    pub listed: &'a BTreeMap<NodeId, String>,
    /// Where peers reach it.
    pub advertise: &'a str,
    pub join: bool,
    pub auto_replace: bool,
    /// How long to wait for the peers' answers (and for each ask to the leader).
    pub probe: Duration,
    /// The largest election timeout.
    pub election_max: Duration,
}

/// Ask the peers whether a cluster runs and act on `domain::bootstrap::may_start`:
/// `Ok(None)` to start as configured, `Ok(Some(leader address))` once the leader replaced this
/// node (it then starts as a learner and asks to be promoted: [`ask_to_be_added`]), `Err` to
/// refuse to start.
pub async fn check_empty_start(
    client: &PeerClient,
    c: StartCheck<'_>,
) -> Result<Option<String>, Refusal> {
    let reports = probe_peers(c.me, c.listed, client, c.probe).await;
    let start = may_start(c.me, DataDir::Empty, c.join, c.auto_replace, &reports)?;
    let Start::Replace {
        peer,
        leader,
        leader_address,
    } = start
    else {
        return Ok(None);
    };
    tracing::warn!(
        peer,
        leader,
        "the data dir is empty but the running cluster still lists this node: asking the \
         leader to replace it (remove it, then add it back to catch up before it votes)"
    );
    let addresses: Vec<String> = c.listed.values().cloned().collect();
    let replacement = Replacement {
        me: c.me,
        advertise: c.advertise,
        leader_address: leader_address.clone(),
        addresses: &addresses,
    };
    let waits = ReplaceWaits {
        ask: c.probe,
        still_answering: c.election_max * 5,
        total: REPLACE_WITHIN,
    };
    remove_for_replacement(client, replacement, waits)
        .await
        .map_err(|reason| Refusal::NotReplaced { leader, reason })?;
    tracing::info!(
        leader,
        "removed by the leader and added back as a learner; starting as a new member"
    );
    Ok(Some(leader_address))
}

/// How long a listed node of a new cluster waits for every other listed node to be up before
/// the cluster may form without the silent ones (see [`wait_for_listed`]).
pub const LISTED_WAIT: Duration = Duration::from_secs(5);

/// Initialize the new cluster of `voters` after every listed node is up (or `waits.listed` has
/// passed) and then its turn (`waits.turn`), unless shut down first or reached by a leader
/// meanwhile. (Reached between the check and the call, `initialize` is refused harmlessly: the
/// node holds a vote or a log by then.)
pub async fn initialize_later(
    consensus: Consensus,
    voters: BTreeMap<NodeId, String>,
    waits: FormingWaits,
    cancel: CancellationToken,
) {
    tokio::select! {
        _ = cancel.cancelled() => return,
        _ = wait_for_listed(&consensus, &voters, waits.listed) => {}
    }
    tokio::select! {
        _ = cancel.cancelled() => return,
        _ = tokio::time::sleep(waits.turn) => {}
    }
    let view = consensus.cluster_view();
    let formed: Option<BTreeMap<NodeId, String>> = (!view.nodes.is_empty()).then(|| {
        view.nodes
            .iter()
            .filter(|n| n.voter)
            .map(|n| (n.id, n.address.clone()))
            .collect()
    });
    match at_turn(&voters, formed.as_ref()) {
        AtTurn::Initialize => {
            if let Err(e) = consensus.initialize(voters).await {
                tracing::error!(error = %e, "could not form the new cluster");
            }
        }
        AtTurn::Joined => {}
        // An operator who gave the nodes different `--peers` lists learns it here rather
        // than from a cluster of unexpected members.
        AtTurn::JoinedOtherVoters => tracing::warn!(
            listed = ?voters,
            formed = ?formed,
            "the cluster formed with other voters than this node's --peers lists: give every \
             node the same list"
        ),
    }
}

/// Wait until every listed node but this one answers on its peer port, this node is reached by
/// a leader, or `within` passes.
///
/// Why: a listed node with an empty data dir asks its peers at start whether a cluster runs
/// (`domain::bootstrap::may_start`), and refuses to start if one does (it cannot tell that it
/// never started from that it lost its data). A node answers on its peer port only after that
/// check, so a cluster formed once every listed node answers can refuse none of them: nodes
/// started together, one of them a little late (a slow machine, a container scheduled later),
/// all join, where the first two used to form the cluster and the third was refused. A listed
/// node still silent after `within` is taken to be down; the cluster forms without it (and it
/// is refused if it starts later with an empty data dir, as before).
async fn wait_for_listed(
    consensus: &Consensus,
    voters: &BTreeMap<NodeId, String>,
    within: Duration,
) {
    const ASK_WITHIN: Duration = Duration::from_millis(300);
    const BETWEEN_ROUNDS: Duration = Duration::from_millis(100);
    let me = consensus.cluster_view().node_id;
    let mut silent: BTreeMap<NodeId, String> = voters
        .iter()
        .filter(|(id, _)| **id != me)
        .map(|(id, addr)| (*id, addr.clone()))
        .collect();
    let rounds = async {
        while !silent.is_empty() && consensus.cluster_view().nodes.is_empty() {
            let client = consensus.peers();
            let asks = silent.iter().map(|(id, addr)| async move {
                client.status(addr, ASK_WITHIN).await.is_ok().then_some(*id)
            });
            for up in futures::future::join_all(asks).await.into_iter().flatten() {
                silent.remove(&up);
            }
            if !silent.is_empty() {
                tokio::time::sleep(BETWEEN_ROUNDS).await;
            }
        }
    };
    if tokio::time::timeout(within, rounds).await.is_err() {
        tracing::warn!(
            silent = ?silent.keys().collect::<Vec<_>>(),
            waited_ms = within.as_millis() as u64,
            "listed nodes did not answer: the new cluster forms without them (started later \
             with an empty data dir, such a node refuses to start: add it with `leasecore \
             cluster add` after removing it)"
        );
    }
}

/// How long a starting node keeps asking the leader to remove it for replacement (the leader
/// refuses while it still hears from the node, up to an election timeout after a crash).
pub const REPLACE_WITHIN: Duration = Duration::from_secs(30);

/// Pause between two asks to the leader (remove, add back).
const ASK_AGAIN_AFTER: Duration = Duration::from_millis(250);

/// The leader's address as the reachable `addresses` report it, if one knows a leader.
async fn find_leader(
    client: &PeerClient,
    addresses: &[String],
    timeout: Duration,
) -> Option<(NodeId, String)> {
    let asks = addresses.iter().map(|a| client.status(a, timeout));
    futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .map(|view| report_of(&view))
        .find_map(|r| Some((r.leader_id?, r.leader_address?)))
}

/// Who asks to be replaced, and where.
pub struct Replacement<'a> {
    /// The node asking (which has not answered anything yet).
    pub me: NodeId,
    /// Where it is to be added back.
    pub advertise: &'a str,
    /// The leader to ask first.
    pub leader_address: String,
    /// Where to find the leader anew when it moved.
    pub addresses: &'a [String],
}

/// How long [`remove_for_replacement`] waits.
#[derive(Clone, Copy, Debug)]
pub struct ReplaceWaits {
    /// One ask (and one status question).
    pub ask: Duration,
    /// At most, while the leader keeps hearing from a node of this id: a node restarted after
    /// a crash falls silent within an election timeout; one that does not is another process
    /// with this id.
    pub still_answering: Duration,
    /// At most, in all.
    pub total: Duration,
}

/// Have the leader remove node `r.me` and add it back as a learner at `r.advertise`, asking
/// again while the refusal says to (and finding the leader anew when it moved), within
/// `waits`. `Ok` once it is a learner again; `Err` with the reason otherwise (the node then
/// refuses to start: nothing it did needs undoing).
pub async fn remove_for_replacement(
    client: &PeerClient,
    r: Replacement<'_>,
    waits: ReplaceWaits,
) -> Result<(), String> {
    let req = AdminRequest::RemoveForReplacement {
        id: r.me,
        address: r.advertise.to_string(),
    };
    let mut leader_address = r.leader_address;
    let mut last = String::from("no answer");
    let asking = async {
        let mut answering_asks = 0u32;
        let answering_budget = waits.still_answering.as_millis() / ASK_AGAIN_AFTER.as_millis();
        loop {
            let answer: Result<Result<AdminOutcome, ConsensusError>, _> = client
                .post_json(&leader_address, routes::ADMIN, &req, waits.ask)
                .await;
            match answer {
                Ok(Ok(_)) => return Ok(()),
                // Permanent: the cluster cannot commit the removal without this node, or no
                // longer lists it (removed meanwhile: joining is then the operator's call).
                Ok(Err(
                    e @ (ConsensusError::InvalidMembership { .. }
                    | ConsensusError::NodeNotFound { .. }),
                )) => return Err(e.to_string()),
                Ok(Err(e @ ConsensusError::StillAnswering { .. })) => {
                    answering_asks += 1;
                    if u128::from(answering_asks) > answering_budget {
                        return Err(e.to_string());
                    }
                    last = e.to_string();
                }
                Ok(Err(e)) => last = e.to_string(),
                Err(e) => last = e.to_string(),
            }
            tracing::info!(leader = %leader_address, reason = %last, "asking again to be replaced");
            tokio::time::sleep(ASK_AGAIN_AFTER).await;
            if let Some((_, address)) = find_leader(client, r.addresses, waits.ask).await {
                leader_address = address;
            }
        }
    };
    let outcome = tokio::time::timeout(waits.total, asking).await;
    outcome.unwrap_or_else(|_| {
        Err(format!(
            "the leader did not replace it within {} s (last answer: {last})",
            waits.total.as_secs()
        ))
    })
}

/// Once node `me` (replaced: a learner again) serves, have the leader promote it once it has
/// caught up (`AddNode` at `advertise`, which for a learner waits for that). Asks again,
/// finding the leader among `addresses`, until it is a voter, another call removed it, or
/// shutdown.
pub async fn ask_to_be_added(
    consensus: Consensus,
    advertise: String,
    mut addresses: Vec<String>,
    ask_within: Duration,
    cancel: CancellationToken,
) {
    addresses.retain(|a| *a != advertise);
    addresses.sort();
    addresses.dedup();
    const MAX_PAUSE: Duration = Duration::from_secs(5);
    let me = consensus.cluster_view().node_id;
    let client = consensus.peers().clone();
    let req = AdminRequest::AddNode {
        id: me,
        address: advertise,
    };
    let mut pause = ASK_AGAIN_AFTER;
    let asking = async {
        loop {
            let reason = match find_leader(&client, &addresses, Duration::from_secs(1)).await {
                None => "no leader found".to_string(),
                Some((leader, address)) => {
                    let answer: Result<Result<AdminOutcome, ConsensusError>, _> = client
                        .post_json(&address, routes::ADMIN, &req, ask_within)
                        .await;
                    match answer {
                        Ok(Ok(AdminOutcome::Done)) => {
                            tracing::info!(leader, "a voter again: replaced");
                            return;
                        }
                        Ok(Ok(AdminOutcome::Removed { message })) => {
                            tracing::warn!(leader, %message, "removed again while catching up; not asking any more");
                            return;
                        }
                        Ok(Ok(AdminOutcome::Learner { message })) => message,
                        Ok(Err(e)) => e.to_string(),
                        Err(e) => e.to_string(),
                    }
                }
            };
            tracing::warn!(%reason, retry_in_ms = pause.as_millis() as u64, "not added back yet");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    };
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = asking => {}
    }
}
