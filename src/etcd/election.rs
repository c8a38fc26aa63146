//! The `Election` service (etcd's v3election), mapped onto leasecore's election recipe:
//! `Campaign` queues the caller's key (`elections/<name>/etcd-<lease>`, holding its value)
//! and waits until it leads; `Proclaim` changes the leader's value (only the leader's);
//! `Leader` reads the leader; `Resign` leaves.
//!
//! # Invariants
//! - A `Campaign` that ends before it leads (the client cancelled) leaves the queue.
//! - `LeaderKey.rev` is the leader key's create revision: the term, a fencing token.
//!
//! # What is not here yet
//! `Observe` (a stream of leader changes) answers `Unimplemented`: watch the election's
//! prefix (`elections/<name>/`) instead.
//!
//! # What it must not do
//! Order anyone or judge leadership: the recipe (`http::recipes`) does.

use axum::Json;
use axum::extract::State;
use leasecore_etcd_api::mvccpb;
use leasecore_etcd_api::v3electionpb::election_server::Election;
use leasecore_etcd_api::v3electionpb::{
    CampaignRequest, CampaignResponse, LeaderKey, LeaderRequest, LeaderResponse, ProclaimRequest,
    ProclaimResponse, ResignRequest, ResignResponse,
};
use tonic::{Request, Response, Status};

use super::{Etcd, EtcdError, lease_id, lease_name, text};
use crate::domain::recipes::Recipe;
use crate::http::extract::{ApiJson, ApiPath};
use crate::http::recipes::{self, leave};

/// The election name and lease of a `LeaderKey`.
fn leader_key(k: Option<LeaderKey>) -> Result<(String, String), EtcdError> {
    let k = k.ok_or_else(|| EtcdError::invalid("leader key is not provided"))?;
    Ok((text("election name", k.name)?, lease_name(k.lease)))
}

#[tonic::async_trait]
impl Election for Etcd {
    async fn campaign(
        &self,
        req: Request<CampaignRequest>,
    ) -> Result<Response<CampaignResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let name = text("election name", r.name)?;
        let value = text("value", r.value)?;
        let standing = self
            .hold(
                &caller,
                Recipe::Election,
                &name,
                &lease_name(r.lease),
                &value,
            )
            .await?;
        Ok(Response::new(CampaignResponse {
            header: self.header(),
            leader: Some(LeaderKey {
                name: name.into_bytes(),
                key: standing.key.into_bytes(),
                rev: standing.revision.0 as i64,
                lease: r.lease,
            }),
        }))
    }

    async fn proclaim(
        &self,
        req: Request<ProclaimRequest>,
    ) -> Result<Response<ProclaimResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let (name, lease) = leader_key(r.leader)?;
        let value = text("value", r.value)?;
        let done = recipes::proclaim(
            State(self.state.clone()),
            caller,
            ApiPath(name),
            ApiJson(leasecore_client::api::ProclaimRequest { lease, value }),
        )
        .await
        .map_err(EtcdError::from)?;
        Ok(Response::new(ProclaimResponse {
            header: self.header_at(done.0.revision),
        }))
    }

    async fn leader(
        &self,
        req: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        let caller = self.caller(&req)?;
        let name = text("election name", req.into_inner().name)?;
        let Json(l) = recipes::leader(State(self.state.clone()), caller, ApiPath(name))
            .await
            .map_err(|e| {
                if e.code == "no_leader_elected" {
                    EtcdError::Status(Status::unknown("election: no leader"))
                } else {
                    EtcdError::from(e)
                }
            })?;
        Ok(Response::new(LeaderResponse {
            header: self.header_at(l.store_revision),
            kv: Some(mvccpb::KeyValue {
                key: l.key.into_bytes(),
                create_revision: l.revision.0 as i64,
                mod_revision: l.mod_revision.0 as i64,
                version: 0,
                value: l.value.into_bytes(),
                lease: lease_id(&l.lease),
            }),
        }))
    }

    type ObserveStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<LeaderResponse, Status>> + Send + 'static>,
    >;

    async fn observe(
        &self,
        _req: Request<LeaderRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        Err(Status::unimplemented(
            "leasecore: Observe is not implemented yet; watch the prefix elections/<name>/",
        ))
    }

    async fn resign(
        &self,
        req: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        let caller = self.caller(&req)?;
        let (name, lease) = leader_key(req.into_inner().leader)?;
        let Json(released) = leave(&self.state, &caller, Recipe::Election, &name, &lease)
            .await
            .map_err(EtcdError::from)?;
        Ok(Response::new(ResignResponse {
            header: self.header_at(released.revision),
        }))
    }
}
