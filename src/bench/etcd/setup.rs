//! Around the measured interval: the endpoints' URLs and the channels of setup and checks;
//! before the clock starts, the preload of the keys range reads (and the wait until every
//! endpoint applied it) and the pre-granted leases of the keepalive workload; after it, what a
//! write workload left in the store ([`stored`], which `run` checks against its tallies).
//!
//! # Invariants
//! - Nothing here is measured: it all runs before the clock starts or after it stops.
//! - Setup keeps at most [`SETUP_CONCURRENCY`] requests in flight, and any failure fails the
//!   run.
//! - The stored count reads linearizably, and only what the run itself wrote (its run-unique
//!   prefix, its acknowledged leases): other activity on the cluster does not move it.
//! - Only plain HTTP/2 endpoints are taken; a bare `host:port` means `http://`.
//!
//! # What it must not do
//! Write anything but the benchmark's own keys (`bench-etcd/`) and leases.

use std::time::Duration;

use leasecore_etcd_api::etcdserverpb::{
    LeaseGrantRequest, LeaseLeasesRequest, PutRequest, RangeRequest,
};
use tonic::transport::{Channel, Endpoint};

use super::{
    EtcdWorkload, LEASE_TTL_S, TIMEOUT, header_revision, key_name, kv_client, lease_client,
    prefix_end, unavailable,
};
use crate::bench::value_for;
use crate::client::ClientError;

/// Concurrent requests while preloading keys or pre-granting leases.
const SETUP_CONCURRENCY: usize = 16;

/// The URL of an etcd endpoint: a bare `host:port` means plain HTTP, as in etcdctl.
pub(super) fn grpc_url(endpoint: &str) -> Result<String, ClientError> {
    let e = endpoint.trim().trim_end_matches('/');
    if e.is_empty() {
        return Err(ClientError::Usage("an empty --etcd endpoint".into()));
    }
    if e.starts_with("https://") {
        return Err(ClientError::Usage(format!(
            "bench --etcd speaks plain HTTP/2 only (a loopback benchmark), not {e}"
        )));
    }
    Ok(if e.starts_with("http://") {
        e.to_string()
    } else {
        format!("http://{e}")
    })
}

/// One HTTP/2 connection to `url`, opened now.
pub(super) async fn channel(url: &str) -> Result<Channel, ClientError> {
    Endpoint::from_shared(url.to_string())
        .map_err(|e| ClientError::Usage(format!("{url}: {e}")))?
        .tcp_nodelay(true)
        .connect_timeout(TIMEOUT)
        .timeout(TIMEOUT)
        .connect()
        .await
        .map_err(|e| ClientError::Unavailable(format!("{url}: {e}")))
}

/// Run `n` items of `one` with [`SETUP_CONCURRENCY`] in flight; the results in order.
async fn setup<T, F, Fut>(n: usize, one: F) -> Result<Vec<T>, ClientError>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    use futures::StreamExt;
    futures::stream::iter((0..n).map(one))
        .buffered(SETUP_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// Write every key once so that ranges find them; the highest revision written.
pub(super) async fn preload(
    admin: &Channel,
    keys: usize,
    value_size: usize,
) -> Result<i64, ClientError> {
    let revisions = setup(keys, |i| {
        let mut kv = kv_client(admin.clone());
        async move {
            let r = kv
                .put(PutRequest {
                    key: key_name(i),
                    value: value_for(i, value_size).into_bytes(),
                    ..PutRequest::default()
                })
                .await
                .map_err(|s| unavailable("preload put", &s))?;
            Ok(header_revision(r.get_ref().header.as_ref()))
        }
    })
    .await?;
    Ok(revisions.into_iter().max().unwrap_or(0))
}

/// Wait (bounded) until every endpoint has applied `revision`, so that a serializable range
/// on a follower finds every preloaded key.
pub(super) async fn caught_up(urls: &[String], revision: i64) -> Result<(), ClientError> {
    for url in urls {
        let mut kv = kv_client(channel(url).await?);
        let mut seen = 0;
        for _ in 0..500 {
            let r = kv
                .range(RangeRequest {
                    key: key_name(0),
                    serializable: true,
                    ..RangeRequest::default()
                })
                .await
                .map_err(|s| unavailable(url, &s))?;
            seen = header_revision(r.get_ref().header.as_ref());
            if seen >= revision {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if seen < revision {
            return Err(ClientError::Unavailable(format!(
                "{url} did not apply the preload (revision {revision}; at {seen})"
            )));
        }
    }
    Ok(())
}

/// One lease per connection for the keepalive workload.
pub(super) async fn pre_grant(admin: &Channel, n: usize) -> Result<Vec<i64>, ClientError> {
    setup(n, |_| {
        let mut lease = lease_client(admin.clone());
        async move {
            let g = lease
                .lease_grant(LeaseGrantRequest {
                    ttl: LEASE_TTL_S,
                    id: 0,
                })
                .await
                .map_err(|s| unavailable("pre-grant", &s))?
                .into_inner();
            if g.id <= 0 || !g.error.is_empty() {
                return Err(ClientError::Unavailable(format!(
                    "pre-grant: id {} ({})",
                    g.id, g.error
                )));
            }
            Ok(g.id)
        }
    })
    .await
}

/// What a write workload left in the store (linearizable reads): put, the keys under the
/// run's `prefix`; txn, the versions of its keys there added up (one per successful
/// compare-and-set); lease-grant, how many of the acknowledged leases (`granted`) the lease
/// list holds. `None` for the other workloads.
pub(super) async fn stored(
    admin: &Channel,
    w: EtcdWorkload,
    prefix: &[u8],
    granted: &[i64],
) -> Result<Option<u64>, ClientError> {
    let under_prefix = |count_only| RangeRequest {
        key: prefix.to_vec(),
        range_end: prefix_end(prefix),
        count_only,
        ..RangeRequest::default()
    };
    Ok(match w {
        EtcdWorkload::Put => {
            let r = kv_client(admin.clone())
                .range(under_prefix(true))
                .await
                .map_err(|s| unavailable("counting the keys put", &s))?;
            Some(r.get_ref().count.max(0) as u64)
        }
        EtcdWorkload::Txn => {
            let r = kv_client(admin.clone())
                .range(under_prefix(false))
                .await
                .map_err(|s| unavailable("reading the txn keys", &s))?;
            Some(
                r.get_ref()
                    .kvs
                    .iter()
                    .map(|kv| kv.version.max(0) as u64)
                    .sum(),
            )
        }
        EtcdWorkload::LeaseGrant => {
            let r = lease_client(admin.clone())
                .lease_leases(LeaseLeasesRequest {})
                .await
                .map_err(|s| unavailable("listing the leases", &s))?;
            let listed: std::collections::HashSet<i64> =
                r.get_ref().leases.iter().map(|l| l.id).collect();
            Some(granted.iter().filter(|id| listed.contains(id)).count() as u64)
        }
        EtcdWorkload::Range | EtcdWorkload::RangeSerializable | EtcdWorkload::LeaseKeepalive => {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_default_to_plain_http() {
        assert_eq!(grpc_url("127.0.0.1:2379").unwrap(), "http://127.0.0.1:2379");
        assert_eq!(
            grpc_url("http://127.0.0.1:2379/").unwrap(),
            "http://127.0.0.1:2379"
        );
        assert!(grpc_url("https://127.0.0.1:2379").is_err());
        assert!(grpc_url(" ").is_err());
    }
}
