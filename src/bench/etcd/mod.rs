//! `leasecore bench --etcd ENDPOINTS WORKLOAD`: closed-loop load through etcd's v3 gRPC API,
//! with the messages generated in `leasecore-etcd-api`, so that leasecore's etcd API
//! (`serve --etcd-listen`) and etcd itself are driven by the very same client.
//!
//! As etcd's own benchmark tool with `--conns N --clients N`: every connection is an HTTP/2
//! connection of its own with one request in flight, and connections are spread over the
//! endpoints round-robin. The measured calls go through `bench::grpc_conn`, a gRPC client
//! that writes each request in one system call and wakes no other task for it, so that the
//! generator takes less of the cores the servers run on; setup and checks use tonic's
//! clients. Connections are opened, keys preloaded and leases granted before the clock
//! starts. Every response is checked; only checked successes count toward throughput and
//! latency. After a write workload the writes are looked for in the store (`stored_check`), in
//! a way other activity on the cluster does not disturb: put writes a new key each under a
//! run-unique prefix, and the keys found there must number between the acknowledged puts and
//! the acknowledged plus the failed ones (a failed write may have been applied); txn's keys are
//! run-unique too, and their versions must add up the same way; every acknowledged lease of
//! lease-grant must be in the lease list.
//!
//! Figures are only comparable within one run on one machine (scripts/bench-etcd-api.sh runs
//! both systems alternately and reports ratios).
//!
//! # Layout
//! This file holds the run ([`run`]: the connections, the measured interval, the figures),
//! the constants and the helpers every part uses (the gRPC clients, key names and prefixes),
//! and the CPU times read from `/proc`; `workload` the workloads, the options and the result,
//! `setup` the endpoints, the preload and the pre-granted leases before the clock starts and
//! the count of the stored writes after it, `job` one connection's closed loop and its checks.

// A load generator measures wall-clock latency: the clock reads are the point.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use leasecore_etcd_api::etcdserverpb::StatusRequest;
use leasecore_etcd_api::etcdserverpb::kv_client::KvClient;
use leasecore_etcd_api::etcdserverpb::lease_client::LeaseClient;
use leasecore_etcd_api::etcdserverpb::maintenance_client::MaintenanceClient;

use super::grpc_conn::GrpcConn;
use super::percentile_ms;
use crate::client::ClientError;

mod job;
mod setup;
mod workload;

pub use workload::{EtcdBenchOptions, EtcdBenchResult, EtcdWorkload};

use job::Job;
use setup::{caught_up, channel, grpc_url, pre_grant, preload, stored};

/// The TTL of every lease granted (lease-grant and the keepalive workload's leases): long
/// enough that none expires during a run, as scripts/bench.sh's lease workloads.
pub const LEASE_TTL_S: i64 = 60;

/// The longest one request (or one keepalive round trip) may take before it counts as failed.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The largest response accepted (a lease list after a long lease-grant run).
const MAX_RESPONSE_BYTES: usize = 64 << 20;

fn kv_client<T>(ch: T) -> KvClient<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    KvClient::new(ch).max_decoding_message_size(MAX_RESPONSE_BYTES)
}

fn lease_client<T>(ch: T) -> LeaseClient<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    LeaseClient::new(ch).max_decoding_message_size(MAX_RESPONSE_BYTES)
}

/// A gRPC status in a line.
fn status_text(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

fn unavailable(what: &str, s: &tonic::Status) -> ClientError {
    ClientError::Unavailable(format!("{what}: {}", status_text(s)))
}

/// The preloaded keys that range reads.
fn key_name(i: usize) -> Vec<u8> {
    format!("bench-etcd/{i:08}").into_bytes()
}

/// Where a run's put or txn writes: a prefix of its own.
fn run_prefix(workload: EtcdWorkload, tag: &str) -> String {
    format!("bench-etcd/{workload}/{tag}/")
}

/// The end of the range of keys that start with `prefix` (etcd's `--prefix`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn header_revision(h: Option<&leasecore_etcd_api::etcdserverpb::ResponseHeader>) -> i64 {
    h.map_or(0, |h| h.revision)
}

/// Run one workload and return its figures.
pub async fn run(opts: &EtcdBenchOptions) -> Result<EtcdBenchResult, ClientError> {
    let urls: Vec<String> = opts
        .endpoints
        .iter()
        .map(|e| grpc_url(e))
        .collect::<Result<_, _>>()?;
    if urls.is_empty() {
        return Err(ClientError::Usage("--etcd needs an endpoint".into()));
    }
    let connections = opts.connections.max(1);
    let keys = opts.keys.max(1);
    let admin = channel(&urls[0]).await?;
    let server_version = MaintenanceClient::new(admin.clone())
        .status(StatusRequest {})
        .await
        .map_err(|s| unavailable("Maintenance.Status", &s))?
        .into_inner()
        .version;

    let mut leases = Vec::new();
    match opts.workload {
        EtcdWorkload::Range | EtcdWorkload::RangeSerializable => {
            let revision = preload(&admin, keys, opts.value_size).await?;
            caught_up(&urls, revision).await?;
        }
        EtcdWorkload::LeaseKeepalive => leases = pre_grant(&admin, connections).await?,
        EtcdWorkload::Put | EtcdWorkload::Txn | EtcdWorkload::LeaseGrant => {}
    }
    let prefix = run_prefix(opts.workload, &super::run_tag());

    // Every connection is open before the clock starts. The measured requests go through the
    // generator's own gRPC client (`bench::grpc_conn`); setup and checks use tonic's.
    let channels = futures::future::try_join_all(
        (0..connections).map(|w| GrpcConn::connect(&urls[w % urls.len()], TIMEOUT)),
    )
    .await
    .map_err(ClientError::Unavailable)?;
    let cpu_before = (cpu_us(&opts.cpu_pids), proc_cpu_us("/proc/self/stat"));
    let started = Instant::now();
    let deadline = started + opts.duration;
    let mut workers = Vec::new();
    for (w, ch) in channels.into_iter().enumerate() {
        let job = Job {
            w,
            prefix: prefix.clone(),
            workload: opts.workload,
            keys,
            value_size: opts.value_size,
            lease: leases.get(w).copied(),
            deadline,
        };
        workers.push(tokio::spawn(job.run(ch)));
    }
    let mut latencies_us: Vec<u32> = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    let mut granted = Vec::new();
    let mut per_worker = Vec::new();
    for w in workers {
        let t = w.await.map_err(|e| ClientError::Usage(e.to_string()))?;
        per_worker.push(t.latencies_us.len() as f64);
        latencies_us.extend(t.latencies_us);
        errors += t.errors;
        first_error = first_error.or(t.first_error);
        granted.extend(t.granted);
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu_after = (cpu_us(&opts.cpu_pids), proc_cpu_us("/proc/self/stat"));

    let ok = latencies_us.len() as u64;
    let stored = stored(&admin, opts.workload, prefix.as_bytes(), &granted).await?;
    let stored_check = match (opts.workload, stored) {
        (_, None) => "n/a",
        (EtcdWorkload::LeaseGrant, Some(s)) if s == ok => "ok",
        (EtcdWorkload::Put | EtcdWorkload::Txn, Some(s)) if s >= ok && s <= ok + errors => "ok",
        (_, Some(_)) => "failed",
    };
    let most = per_worker.iter().copied().fold(0.0, f64::max);
    let fewest = per_worker.iter().copied().fold(f64::MAX, f64::min);
    latencies_us.sort_unstable();
    let pct = |p: f64| percentile_ms(&latencies_us, p);
    Ok(EtcdBenchResult {
        workload: opts.workload,
        server_version,
        connections,
        seconds,
        ok,
        errors,
        throughput: ok as f64 / seconds,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        max_ms: latencies_us.last().map_or(0.0, |l| f64::from(*l) / 1000.0),
        fairness: if most > 0.0 { fewest / most } else { 0.0 },
        stored,
        stored_check: stored_check.to_string(),
        server_cpu_us_per_op: per_op(cpu_before.0, cpu_after.0, ok),
        client_cpu_us_per_op: per_op(cpu_before.1, cpu_after.1, ok),
        first_error,
    })
}

/// CPU time (user + system) in microseconds of `pids` together, from `/proc/PID/stat` (Linux;
/// `None` for no pids, or where a process cannot be read).
fn cpu_us(pids: &[u32]) -> Option<u64> {
    if pids.is_empty() {
        return None;
    }
    pids.iter()
        .map(|p| proc_cpu_us(&format!("/proc/{p}/stat")))
        .sum()
}

/// CPU time (user + system) in microseconds of one process's `/proc/.../stat`.
fn proc_cpu_us(path: &str) -> Option<u64> {
    // USER_HZ: the unit of /proc's CPU times, 100 on every Linux architecture leasecore runs on.
    const TICK_US: u64 = 10_000;
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14 and
    // stime 15.
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
    Some(ticks * TICK_US)
}

fn per_op(before: Option<u64>, after: Option<u64>, ok: u64) -> Option<f64> {
    let (b, a) = (before?, after?);
    (ok > 0).then(|| a.saturating_sub(b) as f64 / ok as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_where_etcd_says() {
        assert_eq!(prefix_end(b"a/"), b"a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(
            run_prefix(EtcdWorkload::Txn, "1a"),
            "bench-etcd/txn/1a/".to_string()
        );
    }

    #[test]
    fn cpu_time_is_read_from_proc() {
        if cfg!(target_os = "linux") {
            assert!(proc_cpu_us("/proc/self/stat").is_some());
            assert!(cpu_us(&[std::process::id()]).is_some());
        }
        assert_eq!(cpu_us(&[]), None);
        assert_eq!(cpu_us(&[u32::MAX]), None);
        assert_eq!(per_op(Some(1_000), Some(3_000), 4), Some(500.0));
        assert_eq!(per_op(Some(1_000), None, 4), None);
        assert_eq!(per_op(Some(1_000), Some(3_000), 0), None);
    }
}
