//! The `Cluster` and `Maintenance` services: membership as etcd shows it and changes it, and
//! the node's status.
//!
//! Members are the Raft membership: `id` is the node id (etcdctl prints it in hex), `name` is
//! `node-<id>`, the peer URL is the node's peer listener (its client address's port + 1000),
//! and the client URL its etcd listener: this node's own, the others' as they gave it in their
//! status documents (`client_urls`; `MemberList` asks the members whose answer is old, for
//! about a second at most, the other calls show what is known). A member that serves no etcd
//! API, or never answered, has none. Changes are root only, as `/v1/cluster/nodes`.
//!
//! A member that has not started (`domain::health::member_started`: a learner no one has heard
//! from, such as one `MemberAdd` added before it runs) is listed as etcd lists a member that
//! has not published itself: no name and no client URLs, which etcdctl shows as `unstarted`.
//! Who has been heard from is known, not replicated: the leader's view (who acknowledged its
//! log; `MemberList` on a follower asks the leader when a learner may not have started), and
//! each node's own contacts and status asks since it started. So a learner that stopped before
//! the present leader and this node ever heard from it shows as not started again (etcd keeps
//! the name it published).
//!
//! - `MemberAdd` takes one peer URL, `http(s)://host:port`, and names the node by its client
//!   address, `host:(port - 1000)`. The new node's id is the next after the highest in the
//!   membership; start it with that `--id`, `--listen host:(port - 1000)` and `--join`. The
//!   node joins as a learner at once (the answer shows it so). With `is_learner` it stays one
//!   until `MemberPromote`; without, leasecore's add path promotes it as soon as it has caught
//!   up, waiting for it in the background for up to [`PROMOTE_FOR`] (etcd makes it a voter at
//!   once, counted in the quorum before it even started; leasecore never counts a node that
//!   has not caught up). Past that it stays a learner: `MemberPromote` it.
//! - `MemberPromote` is leasecore's add path again for a learner: it promotes the node once it
//!   has caught up, waiting up to the catch-up wait (`NodeConfig::catch_up_ms`, 10 s) for
//!   that, and answers etcd's "can only promote a learner member which is in sync with
//!   leader" if it did not.
//! - `MemberUpdate` succeeds only when the peer URL is the member's own: leasecore cannot move
//!   a member to another address (remove it and add it again).
//! - `MemberRemove` is the `/v1` node removal.
//!
//! `Snapshot` streams leasecore's backup (root only, after a quorum read, as `GET
//! /v1/snapshot`): `etcdctl snapshot save` stores it, `leasecore snapshot restore` seeds a
//! cluster from it. It is not a bbolt file: `etcdctl snapshot status|restore` cannot read it.
//!
//! `HashKV` hashes the keys live at any revision still held (`domain::range::keys_hash`): the
//! same on every member for the same revision, whatever was written or compacted since.
//!
//! `MoveLeader` hands the leadership over (`raft::consensus::transfer`), root only as in
//! etcd; unlike etcd, any node serves it (a follower forwards it to the leader).

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use leasecore_etcd_api::etcdserverpb::cluster_server::Cluster;
use leasecore_etcd_api::etcdserverpb::maintenance_server::Maintenance;
use leasecore_etcd_api::etcdserverpb::{
    AlarmRequest, AlarmResponse, DefragmentRequest, DefragmentResponse, HashKvRequest,
    HashKvResponse, HashRequest, HashResponse, Member, MemberAddRequest, MemberAddResponse,
    MemberListRequest, MemberListResponse, MemberPromoteRequest, MemberPromoteResponse,
    MemberRemoveRequest, MemberRemoveResponse, MemberUpdateRequest, MemberUpdateResponse,
    MoveLeaderRequest, MoveLeaderResponse, SnapshotRequest, SnapshotResponse, StatusRequest,
    StatusResponse, alarm_request,
};
use tonic::{Request, Response, Status};

use super::{ETCD_VERSION, Etcd, EtcdError, learner};
use crate::clock::{Clock, SystemClock};
use crate::domain::auth::KeyRange;
use crate::domain::health;
use crate::domain::range::keys_hash;
use crate::domain::resources::{PEER_PORT_OFFSET, peer_address};
use crate::domain::types::Revision;
use crate::http::AppState;
use crate::http::auth::require_root;
use crate::raft::NodeId;
use crate::raft::consensus::{AdminOutcome, AdminRequest, ClusterView, ConsensusError};
use leasecore_client::api::NotReady;

/// How long a voter added by `MemberAdd` is waited for (to start and catch up) before it is
/// left a learner.
pub const PROMOTE_FOR: Duration = Duration::from_secs(600);

type SnapshotStream = Pin<Box<dyn Stream<Item = Result<SnapshotResponse, Status>> + Send>>;

impl Etcd {
    /// The members of `view`, with the other members' client URLs this node knows (`others`)
    /// and those heard from (`heard`). A member that has not started (`health::member_started`)
    /// is listed as etcd lists one: without a name or client URLs (etcdctl: `unstarted`).
    fn members_with(
        &self,
        view: &ClusterView,
        others: &BTreeMap<NodeId, String>,
        heard: &BTreeSet<NodeId>,
    ) -> Vec<Member> {
        view.nodes
            .iter()
            .map(|n| {
                let me = n.id == view.node_id;
                let urls = if me {
                    self.state.etcd_url.iter().cloned().collect()
                } else {
                    others.get(&n.id).cloned().into_iter().collect()
                };
                let started = me || health::member_started(n.voter, heard.contains(&n.id));
                let (name, client_ur_ls) = if started {
                    (format!("node-{}", n.id), urls)
                } else {
                    (String::new(), Vec::new())
                };
                Member {
                    id: n.id,
                    name,
                    peer_ur_ls: peer_address(&n.address)
                        .map(|a| vec![format!("http://{a}")])
                        .unwrap_or_default(),
                    client_ur_ls,
                    is_learner: !n.voter,
                }
            })
            .collect()
    }

    /// The members this node has heard from: acknowledged its log (on the leader), answered
    /// its RPCs, or answered its status asks.
    fn heard(&self, view: &ClusterView) -> BTreeSet<NodeId> {
        let mut heard = heard_in(view);
        heard.extend(self.client_urls.answered(view));
        heard
    }

    /// The members of `view`, with what is known (no member is asked).
    fn members(&self, view: &ClusterView) -> Vec<Member> {
        self.members_with(view, &self.client_urls.known(view), &self.heard(view))
    }

    /// The leader's view: this node's when it leads, else asked of the leader (bounded);
    /// `None` when no leader is known or it did not answer as the leader.
    async fn leader_view(&self, view: &ClusterView) -> Option<ClusterView> {
        const ASK_WITHIN: Duration = Duration::from_secs(1);
        if view.leader_id == Some(view.node_id) {
            return Some(view.clone());
        }
        let address = view
            .leader_id
            .and_then(|l| view.nodes.iter().find(|n| n.id == l))
            .map(|n| n.address.clone())?;
        match self
            .state
            .consensus
            .peers()
            .status(&address, ASK_WITHIN)
            .await
        {
            Ok(v) if v.leader_id == Some(v.node_id) => Some(v),
            _ => None,
        }
    }
}

/// The members a view shows heard from: the leader knows who acknowledged its log, and every
/// node whom it heard from since it started.
fn heard_in(view: &ClusterView) -> BTreeSet<NodeId> {
    view.nodes
        .iter()
        .filter(|n| n.status.matched_index.is_some() || n.status.last_contact_ms.is_some())
        .map(|n| n.id)
        .collect()
}

/// etcd's answers about members.
fn member_not_found() -> Status {
    Status::not_found("etcdserver: member not found")
}

/// A peer URL list etcd itself would refuse: etcd's exact text (Go's clientv3 maps it to
/// `rpctypes.ErrMemberBadURLs` by that text, so nothing may follow it); the reason goes to
/// the log. Refusals of URLs etcd would take (leasecore's own limits) keep their reasons.
fn bad_urls(why: impl std::fmt::Display) -> Status {
    tracing::info!(%why, "member add or update refused: bad peer URLs");
    Status::invalid_argument("etcdserver: given member URLs are invalid")
}

/// A refusal of URLs etcd would accept but leasecore cannot serve: said in full.
fn unservable_urls(why: impl std::fmt::Display) -> Status {
    EtcdError::invalid(why.to_string()).into()
}

/// Whether `url` is a bare `http(s)://host[:port][/]`: no user, path, query or fragment.
pub(super) fn is_bare(url: &reqwest::Url) -> bool {
    matches!(url.scheme(), "http" | "https")
        && url.username().is_empty()
        && url.password().is_none()
        && matches!(url.path(), "" | "/")
        && url.query().is_none()
        && url.fragment().is_none()
}

/// The client address (`host:port`, what leasecore's membership holds) of the node whose peer
/// URLs are `urls`: exactly one `http(s)://host:port`, the port being the client port + 1000.
pub fn client_address(urls: &[String]) -> Result<String, Status> {
    let [url] = urls else {
        if urls.is_empty() {
            return Err(bad_urls("no peer URL"));
        }
        return Err(unservable_urls(format!(
            "a leasecore node has exactly one peer URL, not {}",
            urls.len()
        )));
    };
    let parsed = reqwest::Url::parse(url).map_err(|e| bad_urls(format!("{url:?}: {e}")))?;
    let (Some(host), Some(port), true) = (parsed.host_str(), parsed.port(), is_bare(&parsed))
    else {
        return Err(bad_urls(format!(
            "{url:?} must be http(s)://host:port, with the port"
        )));
    };
    let client_port = port
        .checked_sub(PEER_PORT_OFFSET)
        .filter(|p| *p > 0)
        .ok_or_else(|| {
            unservable_urls(format!(
                "{url:?}: a leasecore node serves its peers on its client port + \
                 {PEER_PORT_OFFSET}, so a peer port must be above {PEER_PORT_OFFSET}"
            ))
        })?;
    let address = format!("{host}:{client_port}");
    crate::http::cluster::check_address(&address).map_err(EtcdError::from)?;
    Ok(address)
}

/// etcd's refusal to promote a learner that has not caught up.
fn not_in_sync() -> Status {
    Status::failed_precondition(
        "etcdserver: can only promote a learner member which is in sync with leader",
    )
}

impl Etcd {
    /// Whether the leader's view (this node's, or asked of the leader, bounded) shows learner
    /// `id` unreachable or more than `PROMOTE_MAX_LAG` entries behind. `false` when the leader
    /// cannot be asked: the add path then judges, within its own wait.
    async fn leader_sees_lagging(&self, view: &ClusterView, id: NodeId) -> bool {
        let Some(leader_view) = self.leader_view(view).await else {
            return false;
        };
        let Some(status) = leader_view
            .nodes
            .iter()
            .find(|n| n.id == id)
            .map(|n| n.status.clone())
        else {
            return false;
        };
        !crate::domain::health::learner_in_sync(
            status.reachable,
            status.lag,
            crate::raft::consensus::PROMOTE_MAX_LAG,
        )
    }

    /// Root only: membership changes (as `/v1/cluster/nodes`) and maintenance calls (as
    /// etcd's: Defragment, Hash, HashKV, Snapshot, MoveLeader).
    fn admin_caller<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let caller = self.caller(req)?;
        require_root(&self.state, &caller).map_err(EtcdError::from)?;
        Ok(())
    }

    /// The view once it shows node `id` as `settled` says (bounded), and etcd's list of it.
    async fn members_once(
        &self,
        id: NodeId,
        settled: impl Fn(Option<&crate::raft::consensus::MemberNode>) -> bool,
    ) -> Vec<Member> {
        let view = self
            .state
            .consensus
            .view_once(|v| settled(v.nodes.iter().find(|n| n.id == id)))
            .await;
        self.members(&view)
    }
}

/// Keep promoting node `id` (leasecore's add path: a learner becomes a voter once it has
/// caught up), for up to [`PROMOTE_FOR`]: it may not have been started yet. Stops once it is a
/// voter, is removed or moved, or this node stops.
fn promote_in_background(state: AppState, id: NodeId, address: String) {
    tokio::spawn(async move {
        let clock = SystemClock::new();
        let deadline = clock.mono().plus(PROMOTE_FOR.as_millis() as u64);
        let mut first = true;
        while clock.mono() < deadline {
            if !first {
                // Between catch-up rounds (each one already waited the catch-up wait).
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            first = false;
            let stopped = state
                .consensus
                .raft()
                .metrics()
                .borrow()
                .running_state
                .is_err();
            let view = state.consensus.cluster_view();
            let learner_here = view
                .nodes
                .iter()
                .any(|n| n.id == id && n.address == address && !n.voter);
            if stopped || !learner_here {
                return;
            }
            let add = AdminRequest::AddNode {
                id,
                address: address.clone(),
            };
            match state.consensus.admin(add).await {
                Ok(AdminOutcome::Done | AdminOutcome::Removed { .. }) => return,
                Ok(AdminOutcome::Learner { .. }) => {}
                Err(
                    ConsensusError::NodeNotFound { .. }
                    | ConsensusError::InvalidMembership { .. }
                    | ConsensusError::ShuttingDown,
                ) => return,
                Err(e) => tracing::debug!(node = id, "promoting an added member: {e}"),
            }
        }
        tracing::warn!(
            node = id,
            "member added through the etcd API did not catch up within {} s: it stays a \
             learner (promote it with `etcdctl member promote`, or remove it)",
            PROMOTE_FOR.as_secs()
        );
    });
}

#[tonic::async_trait]
impl Cluster for Etcd {
    async fn member_add(
        &self,
        req: Request<MemberAddRequest>,
    ) -> Result<Response<MemberAddResponse>, Status> {
        self.admin_caller(&req)?;
        let r = req.into_inner();
        let address = client_address(&r.peer_ur_ls)?;
        let view = self.state.consensus.cluster_view();
        let peer = peer_address(&address).map_err(EtcdError::invalid)?;
        if view
            .nodes
            .iter()
            .any(|n| peer_address(&n.address).is_ok_and(|p| p == peer))
        {
            return Err(Status::failed_precondition(
                "etcdserver: Peer URLs already exists",
            ));
        }
        let id = view.nodes.iter().map(|n| n.id).max().unwrap_or(0) + 1;
        let add = learner::AddLearner {
            id,
            address: address.clone(),
        };
        learner::add(&self.state, add)
            .await
            .map_err(EtcdError::from)?;
        let members = self.members_once(id, |n| n.is_some()).await;
        if !r.is_learner {
            // Once this node's view shows the learner (the promoter stops when it does not).
            promote_in_background(self.state.clone(), id, address);
        }
        let member = members.iter().find(|m| m.id == id).cloned();
        Ok(Response::new(MemberAddResponse {
            header: self.header(),
            member,
            members,
        }))
    }

    async fn member_remove(
        &self,
        req: Request<MemberRemoveRequest>,
    ) -> Result<Response<MemberRemoveResponse>, Status> {
        self.admin_caller(&req)?;
        let id = req.get_ref().id;
        if !self
            .state
            .consensus
            .cluster_view()
            .nodes
            .iter()
            .any(|n| n.id == id)
        {
            return Err(member_not_found());
        }
        self.state
            .consensus
            .admin(AdminRequest::RemoveNode { id })
            .await
            .map_err(|e| match e {
                ConsensusError::NodeNotFound { .. } => member_not_found(),
                other => EtcdError::from(other).into(),
            })?;
        let members = self.members_once(id, |n| n.is_none()).await;
        Ok(Response::new(MemberRemoveResponse {
            header: self.header(),
            members,
        }))
    }

    async fn member_update(
        &self,
        req: Request<MemberUpdateRequest>,
    ) -> Result<Response<MemberUpdateResponse>, Status> {
        self.admin_caller(&req)?;
        let r = req.into_inner();
        let view = self.state.consensus.cluster_view();
        let node = view
            .nodes
            .iter()
            .find(|n| n.id == r.id)
            .ok_or_else(member_not_found)?;
        let address = client_address(&r.peer_ur_ls)?;
        if address != node.address {
            return Err(Status::failed_precondition(format!(
                "etcdserver: leasecore cannot move a member to another address: member {:x} \
                 is at {} (peer URL http://{}); remove it and add it again at the new \
                 address, then start it there with an empty data directory",
                r.id,
                node.address,
                peer_address(&node.address).unwrap_or_default(),
            )));
        }
        Ok(Response::new(MemberUpdateResponse {
            header: self.header(),
            members: self.members(&view),
        }))
    }

    async fn member_list(
        &self,
        _req: Request<MemberListRequest>,
    ) -> Result<Response<MemberListResponse>, Status> {
        // Public, as etcd's (and `GET /v1/cluster`): monitoring lists members without a user.
        let view = self.state.consensus.cluster_view();
        let mut heard = self.heard(&view);
        // Only the leader knows who acknowledged its log: asked (meanwhile) when a learner
        // here may not have started.
        let unsure = view
            .nodes
            .iter()
            .any(|n| !health::member_started(n.voter, heard.contains(&n.id)));
        let leader = async {
            if unsure {
                self.leader_view(&view).await
            } else {
                None
            }
        };
        let (others, leader) = tokio::join!(self.client_urls.refreshed(&view), leader);
        heard.extend(self.client_urls.answered(&view));
        heard.extend(leader.iter().flat_map(heard_in));
        Ok(Response::new(MemberListResponse {
            header: self.header(),
            members: self.members_with(&view, &others, &heard),
        }))
    }

    async fn member_promote(
        &self,
        req: Request<MemberPromoteRequest>,
    ) -> Result<Response<MemberPromoteResponse>, Status> {
        self.admin_caller(&req)?;
        let id = req.get_ref().id;
        let view = self.state.consensus.cluster_view();
        let node = view
            .nodes
            .iter()
            .find(|n| n.id == id)
            .ok_or_else(member_not_found)?;
        if node.voter {
            return Err(Status::failed_precondition(
                "etcdserver: can only promote a learner member",
            ));
        }
        // etcd refuses a learner that is not in sync at once; leasecore's add would wait for it
        // (up to --catch-up-ms), past etcdctl's 5 s: judge from the leader's view first.
        if self.leader_sees_lagging(&view, id).await {
            return Err(not_in_sync());
        }
        let add = AdminRequest::AddNode {
            id,
            address: node.address.clone(),
        };
        let outcome = self.state.consensus.admin(add).await.map_err(|e| match e {
            ConsensusError::NodeNotFound { .. } => member_not_found(),
            other => EtcdError::from(other).into(),
        })?;
        match outcome {
            AdminOutcome::Done => {}
            AdminOutcome::Learner { message } => {
                tracing::info!(node = id, "etcd MemberPromote: {message}");
                return Err(not_in_sync());
            }
            AdminOutcome::Removed { .. } => return Err(member_not_found()),
        }
        let members = self.members_once(id, |n| n.is_some_and(|n| n.voter)).await;
        Ok(Response::new(MemberPromoteResponse {
            header: self.header(),
            members,
        }))
    }
}

#[tonic::async_trait]
impl Maintenance for Etcd {
    async fn alarm(&self, req: Request<AlarmRequest>) -> Result<Response<AlarmResponse>, Status> {
        // Public, as etcd's: there is nothing to list or disarm.
        // leasecore raises no alarms: a full quota refuses writes with their own error.
        // Raising one by hand (ACTIVATE: python-etcd3's `create_alarm`) would need a
        // replicated switch that refuses writes, which leasecore does not have; answering as
        // if raised (as it did) let a caller believe writes were now refused. So it is refused.
        if req.get_ref().action == alarm_request::AlarmAction::Activate as i32 {
            return Err(Status::unimplemented(
                "leasecore raises no alarms, so none can be activated (a full storage quota \
                 refuses writes by itself, and lifts when space is freed)",
            ));
        }
        Ok(Response::new(AlarmResponse {
            header: self.header(),
            alarms: Vec::new(),
        }))
    }

    async fn status(
        &self,
        _req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        // Public, as etcd's (and `GET /v1/cluster`): `etcdctl endpoint status` in monitoring.
        let view = self.state.consensus.cluster_view();
        let mut errors = Vec::new();
        match &view.not_ready {
            // etcd's own words for a member without a leader, which monitoring matches on.
            Some(NotReady::NoLeader | NotReady::NoQuorum { .. }) => {
                errors.push("etcdserver: no leader".to_string())
            }
            Some(why) => errors.push(format!("not ready: {why:?}")),
            None => {}
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
            // All of it: leasecore has nothing for a defragmentation to reclaim (the Raft
            // log's part goes with log compaction, on its own). etcd's monitoring reads
            // `1 - in_use / size` as fragmentation and defragments past a threshold; live
            // data alone here read as 99% fragmented, and Defragment (a no-op) never helped.
            db_size_in_use: self.state.consensus.storage_used() as i64,
            is_learner,
        }))
    }

    async fn defragment(
        &self,
        req: Request<DefragmentRequest>,
    ) -> Result<Response<DefragmentResponse>, Status> {
        // Root only, as etcd's maintenance calls.
        self.admin_caller(&req)?;
        tracing::info!(
            "etcd Defragment: nothing to do, leasecore's store reclaims space as it goes"
        );
        Ok(Response::new(DefragmentResponse {
            header: self.header(),
        }))
    }

    async fn hash(&self, req: Request<HashRequest>) -> Result<Response<HashResponse>, Status> {
        self.admin_caller(&req)?;
        let (revision, hash) = self.whole_store_work(|| self.state_hash()).await?;
        Ok(Response::new(HashResponse {
            header: self.header_at(revision),
            hash,
        }))
    }

    async fn hash_kv(
        &self,
        req: Request<HashKvRequest>,
    ) -> Result<Response<HashKvResponse>, Status> {
        self.admin_caller(&req)?;
        // The keys live at the revision asked (0: the present), read as a range at a past
        // revision is: below the floor `compacted`, after the present `future revision`.
        // (etcd 3.4 refuses the compaction mark itself too; 3.5, which leasecore reports,
        // hashes it, as a range may read it.)
        let at = u64::try_from(req.get_ref().revision)
            .ok()
            .filter(|r| *r > 0)
            .map(Revision);
        let view = self.state.consensus.view();
        let everything = KeyRange {
            start: Vec::new(),
            end: None,
        };
        let hashed = self.whole_store_work(|| {
            // The present is hashed in place; a past revision's keys are read first.
            let present = view.with_state(|kv| {
                let current = kv.revision();
                at.is_none_or(|r| r == current)
                    .then(|| (current, keys_hash(kv.range(&everything))))
            });
            match present {
                Some(hashed) => Ok(hashed),
                None => view
                    .range_at(&everything, at)
                    .map(|(revision, kvs)| {
                        let hash = keys_hash(kvs.iter().map(|(k, v)| (k.as_str(), v)));
                        (revision, hash)
                    })
                    .map_err(super::kv::history_error),
            }
        });
        let (revision, hash) = hashed.await??;
        // etcd's -1 before any compaction.
        let compact_revision = match view.with_state(|kv| kv.compact_revision()) {
            Revision(0) => -1,
            Revision(r) => r as i64,
        };
        Ok(Response::new(HashKvResponse {
            header: self.header_at(revision),
            hash,
            compact_revision,
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
        req: Request<MoveLeaderRequest>,
    ) -> Result<Response<MoveLeaderResponse>, Status> {
        // etcd asks for the root user, as for every maintenance call that changes the cluster.
        let caller = self.caller(&req)?;
        require_root(&self.state, &caller).map_err(EtcdError::from)?;
        let target = req.into_inner().target_id;
        // Any node serves it (etcd's only the leader): followers forward to the leader.
        self.state
            .consensus
            .move_leader(target)
            .await
            .map_err(EtcdError::from)?;
        Ok(Response::new(MoveLeaderResponse {
            header: self.header(),
        }))
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

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn address(urls: &[&str]) -> Result<String, (Code, String)> {
        let urls: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
        client_address(&urls).map_err(|s| (s.code(), s.message().to_string()))
    }

    #[test]
    fn a_peer_url_names_the_node_by_its_client_address() {
        assert_eq!(
            address(&["http://127.0.0.1:8001"]).unwrap(),
            "127.0.0.1:7001"
        );
        assert_eq!(address(&["https://node-4:9379/"]).unwrap(), "node-4:8379");
        assert_eq!(address(&["http://[::1]:8001"]).unwrap(), "[::1]:7001");
    }

    #[test]
    fn peer_urls_leasecore_cannot_use_are_refused_clearly() {
        for (urls, why) in [
            (
                &["http://a:8001", "http://b:8001"][..],
                "exactly one peer URL",
            ),
            (&["http://a:999"][..], "above 1000"),
            (&["http://a:1000"][..], "above 1000"),
        ] {
            let (code, message) = address(urls).unwrap_err();
            assert_eq!(code, Code::InvalidArgument, "{urls:?}");
            assert!(message.contains(why), "{urls:?}: {message}");
            assert!(message.starts_with("etcdserver: "), "{message}");
        }
        // What etcd refuses too gets etcd's exact text, which clientv3 matches on.
        for urls in [
            &[][..],
            &["not a url"][..],
            &["http://a"][..],
            &["ftp://a:8001"][..],
            &["http://a:8001/path"][..],
            &["http://user@a:8001"][..],
        ] {
            assert_eq!(
                address(urls).unwrap_err(),
                (
                    Code::InvalidArgument,
                    "etcdserver: given member URLs are invalid".to_string()
                ),
                "{urls:?}"
            );
        }
    }
}
