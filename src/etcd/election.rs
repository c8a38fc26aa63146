//! The `Election` service (etcd's v3election), on leasecore's election recipe with etcd's
//! layout (`Recipe::EtcdElection`): `Campaign` queues the caller's key (`<name>/<lease id in
//! hex>`, holding its value) and waits until it leads; `Proclaim` changes the leader's value
//! (only the leader's); `Leader` reads the leader; `Resign` leaves.
//!
//! `Observe` streams the leader as etcd's does: the current one at once (if there is one),
//! then one answer per change, a new leader or the leader's new value (`Proclaim`). Nothing is
//! sent while there is no leader. It is built on the watch hub: it waits for any event under
//! the election's prefix, then reads the leader again (a linearizable read, with the caller's
//! read permission checked again), and sends it if it differs from the last one sent (by key
//! and mod revision). So it never misses a change (the wait starts right after the read's
//! revision), and it may skip a leader that came and went between two reads (as etcd's may).
//!
//! `etcdctl elect` and `elect -l` do not call this service: they are etcd's client-side
//! recipe over KV and Watch, on the prefix `<name>/`. The layout is theirs, so that a
//! campaign here and one of theirs on the same name compete for one leadership, as in etcd.
//! (Under leasecore's `elections/<name>/`, until 2026-11-29, each side had a leader.)
//!
//! # Invariants
//! - A `Campaign` that ends before it leads (the client cancelled) leaves the queue.
//! - `LeaderKey.rev` is the leader key's create revision: the term, a fencing token.
//! - An `Observe` stream holds one task, a queue of [`OBSERVE_QUEUE`] answers and one parked
//!   watch; it ends when the client goes, when the node shuts down, or on an error that is not
//!   transient (a revoked read permission), which it sends first.
//!
//! # What it must not do
//! Order anyone or judge leadership: the recipe (`http::recipes`) does.

use std::time::Duration;

use axum::Json;
use leasecore_etcd_api::mvccpb;
use leasecore_etcd_api::v3electionpb::election_server::Election;
use leasecore_etcd_api::v3electionpb::{
    CampaignRequest, CampaignResponse, LeaderKey, LeaderRequest, LeaderResponse, ProclaimRequest,
    ProclaimResponse, ResignRequest, ResignResponse,
};
use tonic::{Request, Response, Status};

use super::{Etcd, EtcdError, lease_id, lease_name, text};
use crate::domain::history::{KeyFilter, Resume};
use crate::domain::recipes::Recipe;
use crate::domain::types::Revision;
use crate::domain::value_bytes;
use crate::domain::watch_batch::BatchLimit;
use crate::http::recipes::{self, leave};
use crate::runtime::auth::Caller;
use crate::wire::Leadership;

/// Answers an `Observe` stream holds for a client that is slow to read them.
const OBSERVE_QUEUE: usize = 4;
/// How long one wait for a change lasts before it is renewed.
const OBSERVE_ROUND: Duration = Duration::from_secs(60);
/// The pause before reading again after a transient failure (no leader, no quorum).
const OBSERVE_RETRY: Duration = Duration::from_millis(250);

type ObserveStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<LeaderResponse, Status>> + Send + 'static>>;

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
        let value = value_bytes::store(r.value);
        let lease = self.session_lease(&caller, r.lease).await?;
        let standing = self
            .hold(
                &caller,
                Recipe::EtcdElection,
                &name,
                &lease_name(lease),
                &value,
            )
            .await?;
        Ok(Response::new(CampaignResponse {
            header: self.header(),
            leader: Some(LeaderKey {
                name: name.into_bytes(),
                key: standing.key.into_bytes(),
                rev: standing.revision.0 as i64,
                lease,
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
        let value = value_bytes::store(r.value);
        let done = recipes::proclaim_value(
            &self.state,
            &caller,
            Recipe::EtcdElection,
            name,
            leasecore_client::api::ProclaimRequest { lease, value },
        )
        .await
        .map_err(EtcdError::from)?;
        Ok(Response::new(ProclaimResponse {
            header: self.header_at(done.revision),
        }))
    }

    async fn leader(
        &self,
        req: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        let caller = self.caller(&req)?;
        let name = text("election name", req.into_inner().name)?;
        match self.current_leader(&caller, &name).await? {
            (Some(l), _) => Ok(Response::new(self.leader_response(l))),
            (None, _) => Err(Status::unknown("election: no leader")),
        }
    }

    type ObserveStream = ObserveStream;

    async fn observe(
        &self,
        req: Request<LeaderRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        let caller = self.caller(&req)?;
        let name = text("election name", req.into_inner().name)?;
        // The first read answers the call itself: a bad name or a missing permission is the
        // call's error, not a stream's.
        let (leader, revision) = self.current_leader(&caller, &name).await?;
        let (out, rx) = tokio::sync::mpsc::channel(OBSERVE_QUEUE);
        let observer = Observer {
            etcd: self.clone(),
            caller,
            name,
            out,
        };
        tokio::spawn(observer.run(leader, revision));
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|resp| (resp, rx))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn resign(
        &self,
        req: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        let caller = self.caller(&req)?;
        let (name, lease) = leader_key(req.into_inner().leader)?;
        let Json(released) = leave(&self.state, &caller, Recipe::EtcdElection, &name, &lease)
            .await
            .map_err(EtcdError::from)?;
        Ok(Response::new(ResignResponse {
            header: self.header_at(released.revision),
        }))
    }
}

impl Etcd {
    /// The leader of election `name` (if any), read linearizably with `caller`'s permission,
    /// and the store revision it was read at.
    async fn current_leader(
        &self,
        caller: &Caller,
        name: &str,
    ) -> Result<(Option<Leadership>, Revision), Status> {
        let read =
            recipes::leadership(&self.state, caller, Recipe::EtcdElection, name.to_string()).await;
        match read {
            Ok(l) => {
                let revision = l.store_revision;
                Ok((Some(l), revision))
            }
            Err(e) if e.code == "no_leader_elected" => {
                let revision = e
                    .details
                    .get("revision")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0);
                Ok((None, Revision(revision)))
            }
            Err(e) => Err(EtcdError::from(e).into()),
        }
    }

    fn leader_response(&self, l: Leadership) -> LeaderResponse {
        // The key's version, as etcd's answer carries it (clients read a proclamation's
        // count from it): from this node's state, where the key is still the one read.
        let version = match self.state.consensus.view().get(&l.key).1 {
            Some(v) if v.create_revision == l.revision && v.mod_revision == l.mod_revision => {
                v.version as i64
            }
            _ => 0,
        };
        LeaderResponse {
            header: self.header_at(l.store_revision),
            kv: Some(mvccpb::KeyValue {
                key: l.key.into_bytes(),
                create_revision: l.revision.0 as i64,
                mod_revision: l.mod_revision.0 as i64,
                version,
                value: value_bytes::bytes(&l.value).into_owned(),
                lease: lease_id(&l.lease),
            }),
        }
    }
}

/// One `Observe` stream's task.
struct Observer {
    etcd: Etcd,
    caller: Caller,
    name: String,
    out: tokio::sync::mpsc::Sender<Result<LeaderResponse, Status>>,
}

impl Observer {
    async fn run(self, first: Option<Leadership>, read_at: Revision) {
        let hub = self.etcd.state.watch.clone();
        let filter = KeyFilter::Prefix(Recipe::EtcdElection.queue(&self.name));
        // The leader last sent, by key and mod revision.
        let mut sent: Option<(String, Revision)> = None;
        let mut leader = first;
        let mut from = read_at.next();
        loop {
            if let Some(l) = leader.take() {
                let this = (l.key.clone(), l.mod_revision);
                if sent.as_ref() != Some(&this) {
                    if self
                        .out
                        .send(Ok(self.etcd.leader_response(l)))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    sent = Some(this);
                }
            }
            // Wait for anything under the prefix after the read (or the client to go).
            loop {
                let batch = tokio::select! {
                    _ = self.out.closed() => return,
                    b = hub.watch(&filter, Some(from), OBSERVE_ROUND, BatchLimit::events(64), Resume::AtMark) => b,
                };
                if hub.is_closed() {
                    return;
                }
                match batch {
                    Ok(b) if b.events.is_empty() => from = b.through.next(),
                    // A change, or the history moved past `from`: read again.
                    Ok(_) | Err(_) => break,
                }
            }
            // Read again; a transient failure (no leader, no quorum) is retried.
            loop {
                match self.etcd.current_leader(&self.caller, &self.name).await {
                    Ok((l, at)) => {
                        if l.is_none() {
                            sent = None;
                        }
                        leader = l;
                        from = at.next();
                        break;
                    }
                    Err(s) if s.code() == tonic::Code::Unavailable => {
                        tokio::select! {
                            _ = self.out.closed() => return,
                            _ = hub.closed() => return,
                            _ = tokio::time::sleep(OBSERVE_RETRY) => {}
                        }
                    }
                    Err(s) => {
                        let _ = self.out.send(Err(s)).await;
                        return;
                    }
                }
            }
        }
    }
}
