//! The `Cluster` and `Maintenance` services: membership as etcd shows it, and the node's
//! status.
//!
//! Members are the Raft membership: `id` is the node id, `name` is `node-<id>`, the peer URL
//! is the node's peer listener, and the client URL its etcd listener where this node knows it
//! (its own). `MemberRemove` is the `/v1` node removal (root only, as there).
//!
//! `Snapshot` streams leasecore's backup (root only, after a quorum read, as `GET
//! /v1/snapshot`): `etcdctl snapshot save` stores it, `leasecore snapshot restore` seeds a
//! cluster from it. It is not a bbolt file: `etcdctl snapshot status|restore` cannot read it.
//!
//! # What is not here yet
//! `MemberAdd`, `MemberPromote`, `MemberUpdate` and `MoveLeader` answer `Unimplemented` (use
//! `leasecore cluster add`): at once, never a hang.

use std::pin::Pin;

use futures::Stream;
use leasecore_etcd_api::etcdserverpb::cluster_server::Cluster;
use leasecore_etcd_api::etcdserverpb::maintenance_server::Maintenance;
use leasecore_etcd_api::etcdserverpb::{
    AlarmRequest, AlarmResponse, DefragmentRequest, DefragmentResponse, HashKvRequest,
    HashKvResponse, HashRequest, HashResponse, Member, MemberAddRequest, MemberAddResponse,
    MemberListRequest, MemberListResponse, MemberPromoteRequest, MemberPromoteResponse,
    MemberRemoveRequest, MemberRemoveResponse, MemberUpdateRequest, MemberUpdateResponse,
    MoveLeaderRequest, MoveLeaderResponse, SnapshotRequest, SnapshotResponse, StatusRequest,
    StatusResponse,
};
use tonic::{Request, Response, Status};

use super::{ETCD_VERSION, Etcd, EtcdError};
use crate::domain::resources::peer_address;
use crate::http::auth::require_root;
use crate::raft::consensus::{AdminRequest, ClusterView};

type SnapshotStream = Pin<Box<dyn Stream<Item = Result<SnapshotResponse, Status>> + Send>>;

impl Etcd {
    fn members(&self, view: &ClusterView) -> Vec<Member> {
        view.nodes
            .iter()
            .map(|n| Member {
                id: n.id,
                name: format!("node-{}", n.id),
                peer_ur_ls: peer_address(&n.address)
                    .map(|a| vec![format!("http://{a}")])
                    .unwrap_or_default(),
                client_ur_ls: if n.id == view.node_id {
                    self.etcd_url.iter().cloned().collect()
                } else {
                    Vec::new()
                },
                is_learner: !n.voter,
            })
            .collect()
    }
}

fn unimplemented(what: &str, instead: &str) -> Status {
    Status::unimplemented(format!(
        "leasecore does not implement {what} on the etcd API yet; use {instead}"
    ))
}

#[tonic::async_trait]
impl Cluster for Etcd {
    async fn member_add(
        &self,
        _req: Request<MemberAddRequest>,
    ) -> Result<Response<MemberAddResponse>, Status> {
        Err(unimplemented("MemberAdd", "`leasecore cluster add`"))
    }

    async fn member_remove(
        &self,
        req: Request<MemberRemoveRequest>,
    ) -> Result<Response<MemberRemoveResponse>, Status> {
        let caller = self.caller(&req)?;
        require_root(&self.state, &caller).map_err(EtcdError::from)?;
        let id = req.get_ref().id;
        if !self
            .state
            .consensus
            .cluster_view()
            .nodes
            .iter()
            .any(|n| n.id == id)
        {
            return Err(Status::not_found("etcdserver: member not found"));
        }
        self.state
            .consensus
            .admin(AdminRequest::RemoveNode { id })
            .await
            .map_err(EtcdError::from)?;
        let view = self
            .state
            .consensus
            .view_once(|v| v.nodes.iter().all(|n| n.id != id))
            .await;
        Ok(Response::new(MemberRemoveResponse {
            header: self.header(),
            members: self.members(&view),
        }))
    }

    async fn member_update(
        &self,
        _req: Request<MemberUpdateRequest>,
    ) -> Result<Response<MemberUpdateResponse>, Status> {
        Err(unimplemented(
            "MemberUpdate",
            "`leasecore cluster remove` and `add`",
        ))
    }

    async fn member_list(
        &self,
        req: Request<MemberListRequest>,
    ) -> Result<Response<MemberListResponse>, Status> {
        self.caller(&req)?;
        let view = self.state.consensus.cluster_view();
        Ok(Response::new(MemberListResponse {
            header: self.header(),
            members: self.members(&view),
        }))
    }

    async fn member_promote(
        &self,
        _req: Request<MemberPromoteRequest>,
    ) -> Result<Response<MemberPromoteResponse>, Status> {
        Err(unimplemented(
            "MemberPromote",
            "`leasecore cluster add` (it promotes)",
        ))
    }
}

#[tonic::async_trait]
impl Maintenance for Etcd {
    async fn alarm(&self, req: Request<AlarmRequest>) -> Result<Response<AlarmResponse>, Status> {
        self.caller(&req)?;
        // leasecore raises no alarms: a full quota refuses writes with their own error.
        Ok(Response::new(AlarmResponse {
            header: self.header(),
            alarms: Vec::new(),
        }))
    }

    async fn status(
        &self,
        req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        self.caller(&req)?;
        let view = self.state.consensus.cluster_view();
        let mut errors = Vec::new();
        if let Some(why) = &view.not_ready {
            errors.push(format!("not ready: {why:?}"));
        }
        let is_learner = view.nodes.iter().any(|n| n.id == view.node_id && !n.voter);
        Ok(Response::new(StatusResponse {
            header: self.header_at(view.revision),
            version: ETCD_VERSION.to_string(),
            db_size: self.state.consensus.storage_used() as i64,
            leader: view.leader_id.unwrap_or(0),
            raft_index: view.commit_index,
            raft_term: view.term,
            raft_applied_index: view.applied_index,
            errors,
            db_size_in_use: self.state.consensus.view().data_bytes() as i64,
            is_learner,
        }))
    }

    async fn defragment(
        &self,
        req: Request<DefragmentRequest>,
    ) -> Result<Response<DefragmentResponse>, Status> {
        self.caller(&req)?;
        tracing::info!(
            "etcd Defragment: nothing to do, leasecore's store reclaims space as it goes"
        );
        Ok(Response::new(DefragmentResponse {
            header: self.header(),
        }))
    }

    async fn hash(&self, req: Request<HashRequest>) -> Result<Response<HashResponse>, Status> {
        self.caller(&req)?;
        let (revision, hash) = self.state_hash();
        Ok(Response::new(HashResponse {
            header: self.header_at(revision),
            hash,
        }))
    }

    async fn hash_kv(
        &self,
        req: Request<HashKvRequest>,
    ) -> Result<Response<HashKvResponse>, Status> {
        self.caller(&req)?;
        let (revision, hash) = self.state_hash();
        let asked = req.get_ref().revision;
        if asked > 0 && asked as u64 != revision.0 {
            return Err(EtcdError::compacted(crate::domain::history::Compacted {
                compacted: revision,
            })
            .into());
        }
        Ok(Response::new(HashKvResponse {
            header: self.header_at(revision),
            hash,
            compact_revision: 0,
        }))
    }

    type SnapshotStream = SnapshotStream;

    async fn snapshot(
        &self,
        req: Request<SnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        /// Bytes per message (etcd sends 32 KiB).
        const CHUNK: usize = 32 << 10;
        let caller = self.caller(&req)?;
        require_root(&self.state, &caller).map_err(EtcdError::from)?;
        self.state
            .consensus
            .read_barrier()
            .await
            .map_err(EtcdError::from)?;
        let view = self.state.consensus.view().clone();
        let node_id = self.state.consensus.cluster_view().node_id;
        let (taken, file) =
            tokio::task::spawn_blocking(move || crate::raft::backup::take(&view, node_id))
                .await
                .map_err(|_| Status::unavailable("etcdserver: server stopped"))?;
        tracing::info!(
            revision = taken.revision,
            bytes = file.len(),
            "snapshot sent over the etcd API"
        );
        let file = crate::storage::backup::with_etcd_hash(file);
        let header = self.header_at(crate::domain::types::Revision(taken.revision));
        let total = file.len();
        let chunks: Vec<Result<SnapshotResponse, Status>> = file
            .chunks(CHUNK)
            .enumerate()
            .map(|(i, blob)| {
                Ok(SnapshotResponse {
                    header,
                    remaining_bytes: (total - (i * CHUNK + blob.len())) as u64,
                    blob: blob.to_vec(),
                })
            })
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn move_leader(
        &self,
        _req: Request<MoveLeaderRequest>,
    ) -> Result<Response<MoveLeaderResponse>, Status> {
        Err(unimplemented(
            "MoveLeader",
            "a restart of the leader (a new one is elected within the election timeout)",
        ))
    }
}

impl Etcd {
    /// A CRC-32 of the applied state's canonical encoding: equal on every replica at the same
    /// revision.
    fn state_hash(&self) -> (crate::domain::types::Revision, u32) {
        self.state
            .consensus
            .view()
            .with_state(|kv| (kv.revision(), crc32fast::hash(&kv.encode())))
    }
}
