//! Ask the peers, once, whether a cluster already runs: the I/O half of
//! [`crate::domain::bootstrap`].
//!
//! Runs only when a node starts with an empty data dir. Every peer is asked concurrently, on
//! its peer port with the node's peer client (`/raft/status`: the same document as
//! `GET /v1/cluster`, reached with peer TLS when that is on, whatever the client port
//! demands), each answer bounded by one timeout, so a start waits at most that long.
//! A peer that does not answer (not up yet, unreachable) contributes no report.
//!
//! # What it must not do
//! Decide: it gathers reports; `domain::bootstrap::may_start` rules.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::domain::bootstrap::PeerReport;
use crate::domain::types::NodeId;
use crate::raft::consensus::ClusterView;
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
