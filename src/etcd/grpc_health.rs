//! gRPC's standard health service (`grpc.health.v1.Health`) on the etcd port, as etcd serves
//! it: what `grpc_health_probe`, Kubernetes' `grpc` probes, Envoy and gRPC's client-side
//! health checking ask.
//!
//! The verdict is `http::cluster::ready`'s, the same as etcd's `GET /health` and the client
//! port's `/readyz`: `SERVING` when this node knows a leader it heard from within an election
//! timeout and has applied what it knows to be committed, `NOT_SERVING` otherwise (etcd 3.4
//! answers `SERVING` from start to shutdown whatever its leader; a probe that routes traffic
//! wants to know more than that the process is up).
//!
//! The service names answered are `""` (the server as a whole) and each etcd service this
//! port serves; any other name is `NOT_FOUND` to `Check` and `SERVICE_UNKNOWN` to `Watch`, as
//! the protocol asks. The service is open, with auth on too, like etcd's.
//!
//! # Invariants
//! - A `Watch` stream sends the current status first, then only changes; it looks at most
//!   every [`WATCH_EVERY`], and ends with its connection (the listener bounds how many
//!   connections and streams there are, and drains them at shutdown).
//!
//! # What it must not do
//! Judge readiness itself, or keep any state between calls.

use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::http::AppState;
use crate::http::cluster::ready;

/// How often a `Watch` stream looks at readiness again.
pub const WATCH_EVERY: Duration = Duration::from_millis(500);

/// The service names this port serves, besides `""`.
pub const SERVICES: [&str; 8] = [
    "etcdserverpb.KV",
    "etcdserverpb.Watch",
    "etcdserverpb.Lease",
    "etcdserverpb.Cluster",
    "etcdserverpb.Maintenance",
    "etcdserverpb.Auth",
    "v3lockpb.Lock",
    "v3electionpb.Election",
];

fn known(service: &str) -> bool {
    service.is_empty() || SERVICES.contains(&service)
}

/// The health service of one node.
#[derive(Clone)]
pub struct HealthService {
    state: AppState,
}

/// The gRPC server for [`HealthService`], to add to the etcd port's routes.
pub fn server(state: AppState) -> HealthServer<HealthService> {
    HealthServer::new(HealthService { state })
}

async fn status(state: &AppState) -> ServingStatus {
    match ready(state).await {
        Ok(()) => ServingStatus::Serving,
        Err(_) => ServingStatus::NotServing,
    }
}

fn answer(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status as i32,
    }
}

type HealthStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = &request.get_ref().service;
        if !known(service) {
            return Err(Status::not_found(format!("unknown service {service:?}")));
        }
        Ok(Response::new(answer(status(&self.state).await)))
    }

    type WatchStream = HealthStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        if !known(&request.get_ref().service) {
            // The protocol: an unknown service is reported, and the stream stays open for it
            // to appear (it never will here, so one message is all there is to say).
            let unknown =
                futures::stream::once(async { Ok(answer(ServingStatus::ServiceUnknown)) })
                    .chain(futures::stream::pending());
            return Ok(Response::new(Box::pin(unknown)));
        }
        let state = self.state.clone();
        let changes =
            futures::stream::unfold((state, None::<ServingStatus>), |(state, last)| async move {
                loop {
                    if last.is_some() {
                        tokio::time::sleep(WATCH_EVERY).await;
                    }
                    let now = status(&state).await;
                    if Some(now) != last {
                        return Some((Ok(answer(now)), (state, Some(now))));
                    }
                }
            });
        Ok(Response::new(Box::pin(changes)))
    }
}
