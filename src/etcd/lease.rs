//! The `Lease` service: Grant, Revoke, KeepAlive (a stream), TimeToLive and Leases, over
//! leasecore's leases (named `etcd-<id>`, see [`super::lease_name`]).
//!
//! leasecore's guarantees hold unchanged: the leader times every lease on its own clock, a
//! failover never shortens one (checkpoints), and expiry is proposed within milliseconds of
//! the deadline. A TTL below the cluster's minimum is raised to it, as etcd raises a TTL to
//! its `minTTL`; one above the maximum, etcd's own (9,000,000,000 s,
//! [`crate::runtime::lease::MAX_TTL_MS`]), is refused with etcd's `too large lease TTL`.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use leasecore_etcd_api::etcdserverpb::lease_server::Lease;
use leasecore_etcd_api::etcdserverpb::{
    LeaseGrantRequest, LeaseGrantResponse, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseLeasesRequest, LeaseLeasesResponse, LeaseRevokeRequest, LeaseRevokeResponse, LeaseStatus,
    LeaseTimeToLiveRequest, LeaseTimeToLiveResponse,
};
use tonic::{Request, Response, Status, Streaming};

use super::{Etcd, EtcdError, lease_id, lease_name};
use crate::domain::auth::Access;
use crate::domain::command::{Command, KvError, Response as Applied};
use crate::domain::key_bytes;
use crate::http::auth::{check_lease, lease_allowed};
use crate::http::kv::unexpected;
use crate::runtime::auth::Caller;
use crate::runtime::lease::LeaseError;

/// Whole seconds, rounded up: a granted TTL never reads shorter than it is.
fn seconds_up(ms: u64) -> i64 {
    ms.div_ceil(1000) as i64
}

pub(super) type KeepAliveStream =
    Pin<Box<dyn Stream<Item = Result<LeaseKeepAliveResponse, Status>> + Send + 'static>>;

/// The TTL of the lease a `Lock` or `Campaign` without one is held under: etcd's session
/// default (`concurrency.NewSession`, 60 s).
const SESSION_TTL_MS: u64 = 60_000;

/// A lease list of at most this many is built where it is asked (about a millisecond): only
/// a longer one takes a large read's turn.
const LEASES_LISTED_IN_PLACE: usize = 10_000;

impl Etcd {
    /// One answer per request of `inbound`, in order; the stream ends with the client's, or
    /// at the first failure (the client then reconnects, as it does when a node goes).
    pub(super) fn keep_alive_stream(
        &self,
        caller: Caller,
        inbound: impl Stream<Item = Result<LeaseKeepAliveRequest, Status>> + Unpin + Send + 'static,
    ) -> KeepAliveStream {
        let etcd = self.clone();
        let out = futures::stream::unfold(Some((etcd, caller, inbound)), |s| async move {
            let (etcd, caller, mut inbound) = s?;
            match inbound.next().await {
                Some(Ok(m)) => match etcd.keep_alive_once(&caller, m.id).await {
                    Ok(resp) => Some((Ok(resp), Some((etcd, caller, inbound)))),
                    Err(status) => Some((Err(status), None)),
                },
                None => None,
                Some(Err(status)) => Some((Err(status), None)),
            }
        });
        Box::pin(out)
    }

    /// Register lease `id` with `ttl_ms`; `Ok(false)` if the id is taken.
    async fn grant(&self, caller: &Caller, id: i64, ttl_ms: u64) -> Result<bool, EtcdError> {
        let cmd = Command::RegisterLease {
            name: lease_name(id),
            ttl_ms,
            clock_ms: None,
        };
        match self.submit(caller, cmd).await? {
            Applied::LeaseRegistered { .. } => Ok(true),
            Applied::Rejected {
                error: KvError::LeaseExists { .. },
            } => Ok(false),
            other => Err(unexpected(other).into()),
        }
    }

    /// Grant a lease of `ttl_ms` whose id the server picks: a random positive one, again on
    /// the (unlikely) collision.
    async fn grant_any(&self, caller: &Caller, ttl_ms: u64) -> Result<i64, EtcdError> {
        for _ in 0..4 {
            let id = (rand::random::<u64>() >> 2).max(1) as i64;
            if self.grant(caller, id, ttl_ms).await? {
                return Ok(id);
            }
        }
        Err(EtcdError::Status(Status::internal(
            "etcdserver: no free lease id",
        )))
    }

    /// The lease a `Lock` or `Campaign` holds under: `lease`, or for 0 a new lease of
    /// [`SESSION_TTL_MS`], as etcd's v3lock and v3election servers open a session of their
    /// own (and orphan it: nothing keeps it alive, so the lock or leadership lapses with it
    /// unless the caller refreshes the lease, whose id the answer's key carries).
    pub(super) async fn session_lease(
        &self,
        caller: &Caller,
        lease: i64,
    ) -> Result<i64, EtcdError> {
        if lease != 0 {
            return Ok(lease);
        }
        self.grant_any(caller, SESSION_TTL_MS).await
    }

    /// One keepalive: the lease's TTL in seconds, 0 if it is gone (as etcd answers).
    async fn keep_alive_once(
        &self,
        caller: &Caller,
        id: i64,
    ) -> Result<LeaseKeepAliveResponse, Status> {
        let name = lease_name(id);
        check_lease(&self.state, caller, &name, Access::Write).map_err(EtcdError::from)?;
        let ttl = match self.state.leases.refresh(&name).await {
            Ok(ack) => seconds_up(ack.ttl_ms),
            Err(LeaseError::NotFound { .. }) => 0,
            Err(e) => return Err(EtcdError::from(e).into()),
        };
        Ok(LeaseKeepAliveResponse {
            header: self.header(),
            id,
            ttl,
        })
    }
}

#[tonic::async_trait]
impl Lease for Etcd {
    async fn lease_grant(
        &self,
        req: Request<LeaseGrantRequest>,
    ) -> Result<Response<LeaseGrantResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        if r.id < 0 {
            return Err(EtcdError::invalid("lease ID must be positive").into());
        }
        let bounds = self.state.leases.hub().config().ttl_bounds();
        let asked_ms = u64::try_from(r.ttl).unwrap_or(0).saturating_mul(1000);
        if asked_ms > bounds.max_ms {
            return Err(Status::out_of_range("etcdserver: too large lease TTL"));
        }
        let ttl_ms = asked_ms.max(bounds.min_ms);
        let id = if r.id != 0 {
            if !self.grant(&caller, r.id, ttl_ms).await? {
                return Err(Status::failed_precondition(
                    "etcdserver: lease already exists",
                ));
            }
            r.id
        } else {
            self.grant_any(&caller, ttl_ms).await?
        };
        Ok(Response::new(LeaseGrantResponse {
            header: self.header(),
            id,
            ttl: seconds_up(ttl_ms),
            error: String::new(),
        }))
    }

    async fn lease_revoke(
        &self,
        req: Request<LeaseRevokeRequest>,
    ) -> Result<Response<LeaseRevokeResponse>, Status> {
        let caller = self.caller(&req)?;
        let cmd = Command::RevokeLease {
            name: lease_name(req.get_ref().id),
        };
        match self.submit(&caller, cmd).await? {
            Applied::LeaseRevoked { revision, .. } => Ok(Response::new(LeaseRevokeResponse {
                header: self.header_at(revision),
            })),
            Applied::Rejected {
                error: KvError::LeaseNotFound { .. },
            } => Err(EtcdError::lease_not_found().into()),
            other => Err(EtcdError::from(unexpected(other)).into()),
        }
    }

    type LeaseKeepAliveStream = KeepAliveStream;

    async fn lease_keep_alive(
        &self,
        req: Request<Streaming<LeaseKeepAliveRequest>>,
    ) -> Result<Response<Self::LeaseKeepAliveStream>, Status> {
        let caller = self.caller(&req)?;
        Ok(Response::new(
            self.keep_alive_stream(caller, req.into_inner()),
        ))
    }

    async fn lease_time_to_live(
        &self,
        req: Request<LeaseTimeToLiveRequest>,
    ) -> Result<Response<LeaseTimeToLiveResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let name = lease_name(r.id);
        self.state
            .consensus
            .read_barrier()
            .await
            .map_err(EtcdError::from)?;
        let (revision, lease) = self.state.consensus.view().lease(&name);
        let not_found = LeaseTimeToLiveResponse {
            header: self.header_at(revision),
            id: r.id,
            ttl: -1,
            granted_ttl: 0,
            keys: Vec::new(),
        };
        let Some(lease) = lease else {
            return Ok(Response::new(not_found));
        };
        if r.keys {
            check_lease(&self.state, &caller, &name, Access::Read).map_err(EtcdError::from)?;
        }
        let remaining = self
            .state
            .leases
            .remaining(std::slice::from_ref(&name))
            .await
            .map_err(EtcdError::from)?;
        let Some(remaining_ms) = remaining.into_iter().next().flatten() else {
            return Ok(Response::new(not_found));
        };
        Ok(Response::new(LeaseTimeToLiveResponse {
            header: self.header_at(revision),
            id: r.id,
            // As etcd: whole seconds left, rounded down.
            ttl: (remaining_ms / 1000) as i64,
            granted_ttl: seconds_up(lease.ttl_ms),
            keys: if r.keys {
                lease
                    .keys
                    .into_iter()
                    .map(|k| key_bytes::bytes(&k).into_owned())
                    .collect()
            } else {
                Vec::new()
            },
        }))
    }

    async fn lease_leases(
        &self,
        req: Request<LeaseLeasesRequest>,
    ) -> Result<Response<LeaseLeasesResponse>, Status> {
        let caller = self.caller(&req)?;
        self.state
            .consensus
            .read_barrier()
            .await
            .map_err(EtcdError::from)?;
        // Names only: a lease's record carries its attached keys, which the list does not show.
        let list = || {
            let (revision, names) = self.state.consensus.view().lease_names();
            let leases = names
                .iter()
                .map(|name| (lease_id(name), name))
                .filter(|(id, name)| {
                    *id != 0 && lease_allowed(&self.state, &caller, name, Access::Read)
                })
                .map(|(id, _)| LeaseStatus { id })
                .collect::<Vec<_>>();
            (revision, leases)
        };
        // Up to `--max-leases` (two million) of them: a long list is walked as work over the
        // whole store, which waits its turn; a short one is not made to wait behind large reads.
        let (revision, leases) =
            if self.state.consensus.view().lease_count() <= LEASES_LISTED_IN_PLACE {
                list()
            } else {
                self.whole_store_work(list).await?
            };
        Ok(Response::new(LeaseLeasesResponse {
            header: self.header_at(revision),
            leases,
        }))
    }
}
