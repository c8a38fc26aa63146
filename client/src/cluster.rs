//! The cluster calls of [`Client`]: the cluster view, readiness, adding and removing nodes, and
//! moving the leadership.
//!
//! # Invariants
//! - Only the reads (the view, `readyz`) are retried after a failure that may have reached a
//!   node; a membership change or a leader move is sent again only when it certainly did not
//!   arrive.
//!
//! # What it must not do
//! Decide membership or leadership: the cluster does; these calls only ask.

use reqwest::Method;
use serde_json::Value;

use super::{Client, ClientError};
use crate::api::{AddNodeRequest, ClusterView, MoveLeaderRequest};
use crate::types::NodeId;

impl Client {
    /// The cluster as the first answering node sees it.
    pub async fn cluster_status(&self) -> Result<ClusterView, ClientError> {
        self.call(Method::GET, "/v1/cluster", None::<&()>).await
    }

    /// Hand the leadership to node `id` (a voter); answers once it leads.
    pub async fn move_leader(&self, id: NodeId) -> Result<ClusterView, ClientError> {
        self.call(
            Method::POST,
            "/v1/cluster/leader",
            Some(&MoveLeaderRequest { id }),
        )
        .await
    }

    /// Add a node (as learner, then voter).
    pub async fn add_node(&self, id: NodeId, address: &str) -> Result<ClusterView, ClientError> {
        let body = AddNodeRequest {
            id,
            address: address.to_string(),
        };
        self.call(Method::POST, "/v1/cluster/nodes", Some(&body))
            .await
    }

    /// Add a node; the answer says whether it became a voter, and why not.
    pub async fn add_node_detailed(
        &self,
        id: NodeId,
        address: &str,
    ) -> Result<crate::api::AddNodeResponse, ClientError> {
        let body = AddNodeRequest {
            id,
            address: address.to_string(),
        };
        self.call(Method::POST, "/v1/cluster/nodes", Some(&body))
            .await
    }

    /// `GET /readyz` of the first endpoint that answers: `Ok` with the document if that node
    /// is ready, the `not_ready` error otherwise.
    pub async fn readyz(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, "/readyz", None::<&()>).await
    }

    /// Remove a node from the cluster.
    pub async fn remove_node(&self, id: NodeId) -> Result<ClusterView, ClientError> {
        self.call(
            Method::DELETE,
            &format!("/v1/cluster/nodes/{id}"),
            None::<&()>,
        )
        .await
    }
}
