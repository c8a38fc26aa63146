//! The `Lock` service (etcd's v3lock), on leasecore's lock recipe with etcd's mutex layout
//! (`Recipe::EtcdLock`): `Lock` queues the caller's key (`<name>/<lease id in hex>`, attached
//! to the lease) and waits, as long as the client does, until it holds; `Unlock` deletes the
//! key. The layout is etcd's own mutex's (`concurrency.Mutex`, what `etcdctl lock` and Go's
//! clients run client-side), so that a lock taken here and one taken by such a client on the
//! same name exclude each other, as in etcd. (They did not, under `locks/<name>/`, until
//! 2026-11-29: both holders held at once.)
//!
//! # Invariants
//! - A `Lock` call that ends before it holds (the client cancelled, or went away) leaves the
//!   queue: its key is deleted, as etcd's mutex does, so it blocks no one.
//! - The returned key is the fencing token's key: its create revision orders the queue.
//!
//! # What it must not do
//! Order anyone: the recipe (`http::recipes`, `domain::recipes`) does.

use leasecore_etcd_api::v3lockpb::lock_server::Lock;
use leasecore_etcd_api::v3lockpb::{LockRequest, LockResponse, UnlockRequest, UnlockResponse};
use tonic::{Request, Response, Status};

use super::{Etcd, EtcdError, lease_name, text};
use crate::domain::command::{Command, Response as Applied};
use crate::domain::recipes::Recipe;
use crate::http::kv::unexpected;
use crate::http::recipes::{contend, leave};
use crate::runtime::auth::Caller;
use leasecore_client::api::{ContendRequest, Standing};

/// How long one round of waiting lasts before the wait is renewed (the recipe's longest).
const ROUND_MS: u64 = 300_000;

/// Leaves the queue if the call waiting in it ends before it holds.
struct Abandon {
    etcd: Etcd,
    caller: Caller,
    recipe: Recipe,
    name: String,
    lease: String,
    armed: bool,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (etcd, caller, recipe) = (self.etcd.clone(), self.caller.clone(), self.recipe);
        let (name, lease) = (
            std::mem::take(&mut self.name),
            std::mem::take(&mut self.lease),
        );
        tokio::spawn(async move {
            let _ = leave(&etcd.state, &caller, recipe, &name, &lease).await;
        });
    }
}

impl Etcd {
    /// Queue `lease` in `recipe`'s queue `name` with `value`, and wait as long as the client
    /// does until it holds (etcd's Lock and Campaign); a wait that ends first leaves.
    pub(super) async fn hold(
        &self,
        caller: &Caller,
        recipe: Recipe,
        name: &str,
        lease: &str,
        value: &str,
    ) -> Result<Standing, EtcdError> {
        let mut abandon = Abandon {
            etcd: self.clone(),
            caller: caller.clone(),
            recipe,
            name: name.to_string(),
            lease: lease.to_string(),
            armed: true,
        };
        loop {
            let req = ContendRequest {
                lease: lease.to_string(),
                value: value.to_string(),
                timeout_ms: Some(ROUND_MS),
            };
            let standing = contend(&self.state, caller, recipe, name, req)
                .await
                .map_err(|e| {
                    // The contender's key is gone (its lease expired) or was never written.
                    abandon.armed = false;
                    EtcdError::from(e)
                })?;
            if standing.held {
                abandon.armed = false;
                return Ok(standing);
            }
        }
    }
}

#[tonic::async_trait]
impl Lock for Etcd {
    async fn lock(&self, req: Request<LockRequest>) -> Result<Response<LockResponse>, Status> {
        let caller = self.caller(&req)?;
        let r = req.into_inner();
        let name = text("lock name", r.name)?;
        let lease = self.session_lease(&caller, r.lease).await?;
        let standing = self
            .hold(&caller, Recipe::EtcdLock, &name, &lease_name(lease), "")
            .await?;
        Ok(Response::new(LockResponse {
            header: self.header(),
            key: standing.key.into_bytes(),
        }))
    }

    async fn unlock(
        &self,
        req: Request<UnlockRequest>,
    ) -> Result<Response<UnlockResponse>, Status> {
        let caller = self.caller(&req)?;
        let key = text("key", req.into_inner().key)?;
        let cmd = Command::Delete {
            key,
            prev_revision: None,
        };
        match self.submit(&caller, cmd).await? {
            Applied::Delete { revision, .. } => Ok(Response::new(UnlockResponse {
                header: self.header_at(revision),
            })),
            other => Err(EtcdError::from(unexpected(other)).into()),
        }
    }
}
