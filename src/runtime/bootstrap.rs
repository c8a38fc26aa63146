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
//! What a node with an empty data dir that a running cluster still lists does about it is in
//! `runtime::replace`.
//!
//! # What it must not do
//! Decide: it gathers reports, waits turns and acts; `domain::bootstrap` rules (`may_start`,
//! `first_campaign_delay`, `at_turn`).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::bootstrap::{AtTurn, FormingWaits, PeerReport, at_turn};
use crate::domain::types::NodeId;
use crate::raft::consensus::{ClusterView, Consensus};
use crate::raft::network::PeerClient;

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
pub(crate) fn report_of(view: &ClusterView) -> PeerReport {
    PeerReport {
        peer: view.node_id,
        leader_id: view.leader_id,
        term: view.term,
        members: view.nodes.iter().map(|n| n.id).collect(),
        voters: view
            .nodes
            .iter()
            .filter(|n| n.voter)
            .map(|n| n.id)
            .collect(),
        leader_address: view
            .leader_id
            .and_then(|l| view.nodes.iter().find(|n| n.id == l))
            .map(|n| n.address.clone()),
    }
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
            "listed nodes did not answer: the new cluster forms without them (started later, \
             such a node has itself replaced into it: removed, added back as a learner, \
             promoted once caught up)"
        );
    }
}
