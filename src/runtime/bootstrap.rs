//! Ask the peers, once, whether a cluster already runs, and form a new cluster in turn: the
//! I/O half of [`crate::domain::bootstrap`].
//!
//! Runs only when a node starts with an empty data dir. Every peer is asked concurrently, on
//! its peer port with the node's peer client (`/raft/status`: the same document as
//! `GET /v1/cluster`, reached with peer TLS when that is on, whatever the client port
//! demands), each answer bounded by one timeout, so a start waits at most that long.
//! A peer that does not answer (not up yet, unreachable) contributes no report.
//!
//! A listed node of a new cluster that is not the lowest id initializes only after its turn
//! ([`initialize_later`], the delay from `domain::bootstrap::first_campaign_delay`), unless a
//! leader reached it meanwhile; reached, it compares the formed membership with its own
//! `--peers` list and warns if they differ.
//!
//! # What it must not do
//! Decide: it gathers reports, waits turns and acts; `domain::bootstrap` rules (`may_start`,
//! `first_campaign_delay`, `at_turn`).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::bootstrap::{AtTurn, PeerReport, at_turn};
use crate::domain::types::NodeId;
use crate::raft::consensus::{ClusterView, Consensus};
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
                let view: ClusterView = client
                    .post_json(addr, routes::STATUS, &(), timeout)
                    .await
                    .map_err(|e| tracing::debug!(peer = id, error = %e, "peer did not report"))
                    .ok()?;
                tracing::info!(peer = id, leader = ?view.leader_id, term = view.term, "peer reports its cluster");
                Some(PeerReport {
                    peer: view.node_id,
                    leader_id: view.leader_id,
                    term: view.term,
                    members: view.nodes.iter().map(|n| n.id).collect(),
                })
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

/// Initialize the new cluster of `voters` after `delay`, unless shut down first or reached by
/// a leader meanwhile. (Reached between the check and the call, `initialize` is refused
/// harmlessly: the node holds a vote or a log by then.)
pub async fn initialize_later(
    consensus: Consensus,
    voters: BTreeMap<NodeId, String>,
    delay: Duration,
    cancel: CancellationToken,
) {
    tokio::select! {
        _ = cancel.cancelled() => return,
        _ = tokio::time::sleep(delay) => {}
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
