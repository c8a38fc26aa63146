//! `leasecore bench --etcd ENDPOINTS WORKLOAD`: closed-loop load through etcd's v3 gRPC API,
//! with the tonic clients generated in `leasecore-etcd-api`, so that leasecore's etcd API
//! (`serve --etcd-listen`) and etcd itself are driven by the very same client.
//!
//! As etcd's own benchmark tool with `--conns N --clients N`: every connection is an HTTP/2
//! connection of its own with one request in flight (`bench::h2_conn`: no dispatch task
//! between the client and the connection, which left 5-10% more of the machine to the servers
//! measured), and connections are spread over the endpoints round-robin. Channels are opened, keys preloaded and leases granted before the
//! clock starts. Every response is checked; only checked successes count toward throughput and
//! latency. After a write workload the writes are looked for in the store (`stored_check`), in
//! a way other activity on the cluster does not disturb: put writes a new key each under a
//! run-unique prefix, and the keys found there must number between the acknowledged puts and
//! the acknowledged plus the failed ones (a failed write may have been applied); txn's keys are
//! run-unique too, and their versions must add up the same way; every acknowledged lease of
//! lease-grant must be in the lease list.
//!
//! Figures are only comparable within one run on one machine (scripts/bench-etcd-api.sh runs
//! both systems alternately and reports ratios).

// A load generator measures wall-clock latency: the clock reads are the point.
#![allow(clippy::disallowed_methods)]

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use leasecore_etcd_api::etcdserverpb::kv_client::KvClient;
use leasecore_etcd_api::etcdserverpb::lease_client::LeaseClient;
use leasecore_etcd_api::etcdserverpb::maintenance_client::MaintenanceClient;
use leasecore_etcd_api::etcdserverpb::{
    Compare, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseLeasesRequest,
    PutRequest, RangeRequest, RequestOp, StatusRequest, TxnRequest, TxnResponse, compare,
    request_op, response_op,
};
use serde::{Deserialize, Serialize};
use tonic::Streaming;
use tonic::transport::{Channel, Endpoint};

use super::h2_conn::H2Conn;
use super::{percentile_ms, value_for};
use crate::client::ClientError;

/// The TTL of every lease granted (lease-grant and the keepalive workload's leases): long
/// enough that none expires during a run, as scripts/bench.sh's lease workloads.
pub const LEASE_TTL_S: i64 = 60;

/// The longest one request (or one keepalive round trip) may take before it counts as failed.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Concurrent requests while preloading keys or pre-granting leases.
const SETUP_CONCURRENCY: usize = 16;

/// The largest response accepted (a lease list after a long lease-grant run).
const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// What to measure through etcd's API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EtcdWorkload {
    /// `KV.Put` over a key space.
    Put,
    /// Linearizable `KV.Range` of one preloaded key.
    Range,
    /// Serializable `KV.Range` of one preloaded key.
    RangeSerializable,
    /// `KV.Txn`: compare the mod revision of the connection's own key, put it if unchanged
    /// (a compare-and-set that always succeeds, since nobody else writes that key).
    Txn,
    /// `Lease.LeaseGrant` with a server-chosen id.
    LeaseGrant,
    /// `Lease.LeaseKeepAlive`: one stream per connection, one keepalive at a time over the
    /// connection's pre-granted lease.
    LeaseKeepalive,
}

impl EtcdWorkload {
    /// Every workload, in the order scripts report them.
    pub const ALL: [EtcdWorkload; 6] = [
        EtcdWorkload::Put,
        EtcdWorkload::Range,
        EtcdWorkload::RangeSerializable,
        EtcdWorkload::Txn,
        EtcdWorkload::LeaseGrant,
        EtcdWorkload::LeaseKeepalive,
    ];

    /// The workload's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            EtcdWorkload::Put => "put",
            EtcdWorkload::Range => "range",
            EtcdWorkload::RangeSerializable => "range-serializable",
            EtcdWorkload::Txn => "txn",
            EtcdWorkload::LeaseGrant => "lease-grant",
            EtcdWorkload::LeaseKeepalive => "lease-keepalive",
        }
    }
}

impl fmt::Display for EtcdWorkload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EtcdWorkload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EtcdWorkload::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = EtcdWorkload::ALL.iter().map(|w| w.name()).collect();
                format!("unknown workload {s:?} for --etcd: {}", names.join(", "))
            })
    }
}

/// How to run.
#[derive(Clone, Debug)]
pub struct EtcdBenchOptions {
    pub workload: EtcdWorkload,
    /// etcd API endpoints: `host:port` or `http://host:port`.
    pub endpoints: Vec<String>,
    pub connections: usize,
    pub duration: Duration,
    /// Distinct keys preloaded and read (range).
    pub keys: usize,
    pub value_size: usize,
    /// Processes (the servers) whose CPU time during the measured interval is reported per
    /// successful request (read from `/proc`, Linux only).
    pub cpu_pids: Vec<u32>,
}

/// What was measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EtcdBenchResult {
    pub workload: EtcdWorkload,
    /// The version the first endpoint's `Maintenance.Status` reports (which server this was).
    pub server_version: String,
    pub connections: usize,
    pub seconds: f64,
    /// Checked successes.
    pub ok: u64,
    /// Failed or unchecked responses (not counted in throughput).
    pub errors: u64,
    pub throughput: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Fewest successes of one connection divided by the most (1.0: perfectly even).
    pub fairness: f64,
    /// Writes found in the store afterwards (put: keys; txn: versions of its keys;
    /// lease-grant: acknowledged leases in the lease list).
    pub stored: Option<u64>,
    /// `ok`, `failed` (put, txn: stored outside [ok, ok + errors]; lease-grant: an acknowledged
    /// lease missing) or `n/a` (the other workloads).
    pub stored_check: String,
    /// CPU time (user + system) of `cpu_pids` during the measured interval, per checked
    /// success, in microseconds: a figure a shared machine's noise moves far less than
    /// throughput.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cpu_us_per_op: Option<f64>,
    /// The same for this client process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cpu_us_per_op: Option<f64>,
    /// The first failure seen, for diagnosis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
}

impl EtcdBenchResult {
    /// No failed response, at least one success, and the stored count (if any) as it must be.
    pub fn passed(&self) -> bool {
        self.errors == 0 && self.ok > 0 && self.stored_check != "failed"
    }
}

impl fmt::Display for EtcdBenchResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "etcd API {} c={} {:.1}s: {:.0} ops/s, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} ok, {} errors; server {}",
            self.workload,
            self.connections,
            self.seconds,
            self.throughput,
            self.p50_ms,
            self.p99_ms,
            self.max_ms,
            self.ok,
            self.errors,
            self.server_version,
        )?;
        if let Some(stored) = self.stored {
            write!(f, "; stored {stored}: {}", self.stored_check)?;
        }
        if let Some(cpu) = self.server_cpu_us_per_op {
            write!(f, "; server CPU {cpu:.0} us/op")?;
        }
        if let Some(cpu) = self.client_cpu_us_per_op {
            write!(f, "; client CPU {cpu:.0} us/op")?;
        }
        if let Some(e) = &self.first_error {
            write!(f, "; first error: {e}")?;
        }
        f.write_str(")")
    }
}

/// The URL of an etcd endpoint: a bare `host:port` means plain HTTP, as in etcdctl.
fn grpc_url(endpoint: &str) -> Result<String, ClientError> {
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
async fn channel(url: &str) -> Result<Channel, ClientError> {
    Endpoint::from_shared(url.to_string())
        .map_err(|e| ClientError::Usage(format!("{url}: {e}")))?
        .tcp_nodelay(true)
        .connect_timeout(TIMEOUT)
        .timeout(TIMEOUT)
        .connect()
        .await
        .map_err(|e| ClientError::Unavailable(format!("{url}: {e}")))
}

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

    // Every connection is open before the clock starts. The measured requests bypass tonic's
    // channel (see `bench::h2_conn`); setup and checks use it.
    let channels = futures::future::try_join_all(
        (0..connections).map(|w| H2Conn::connect(&urls[w % urls.len()], TIMEOUT)),
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
async fn preload(admin: &Channel, keys: usize, value_size: usize) -> Result<i64, ClientError> {
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
async fn caught_up(urls: &[String], revision: i64) -> Result<(), ClientError> {
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
async fn pre_grant(admin: &Channel, n: usize) -> Result<Vec<i64>, ClientError> {
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
async fn stored(
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

/// One connection's work.
struct Job {
    w: usize,
    /// Where put and txn write (see [`run_prefix`]).
    prefix: String,
    workload: EtcdWorkload,
    keys: usize,
    value_size: usize,
    /// The pre-granted lease of the keepalive workload.
    lease: Option<i64>,
    deadline: Instant,
}

/// One connection's figures.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    errors: u64,
    first_error: Option<String>,
    /// lease-grant: the leases acknowledged.
    granted: Vec<i64>,
}

impl Tally {
    fn record(&mut self, sent: Instant, checked: Result<(), String>) {
        match checked {
            Ok(()) => self
                .latencies_us
                .push(sent.elapsed().as_micros().min(u128::from(u32::MAX)) as u32),
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, e: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

/// A keepalive stream: where requests go, and where answers come from.
type KeepAlive = (
    tokio::sync::mpsc::Sender<LeaseKeepAliveRequest>,
    Streaming<LeaseKeepAliveResponse>,
);

impl Job {
    async fn run(self, ch: H2Conn) -> Tally {
        let mut t = Tally::default();
        // Connections start at different keys so that they do not write one key in lockstep.
        let mut i = self.w.wrapping_mul(7919) % self.keys;
        let mut kv = kv_client(ch.clone());
        let mut lease = lease_client(ch);
        // The revision of this connection's last write: each must be above it.
        let mut last = 0i64;
        // put: this connection's writes so far (each to a new key).
        let mut written = 0usize;
        // txn: this connection's key (new), and its mod revision if known.
        let txn_key = format!("{}{:04}", self.prefix, self.w).into_bytes();
        let mut txn_mod: Option<i64> = Some(0);
        let mut keepalive: Option<KeepAlive> = None;
        while Instant::now() < self.deadline {
            match self.workload {
                EtcdWorkload::Put => {
                    written += 1;
                    let req = PutRequest {
                        key: format!("{}{:04}/{written:08}", self.prefix, self.w).into_bytes(),
                        value: value_for(i, self.value_size).into_bytes(),
                        ..PutRequest::default()
                    };
                    let sent = Instant::now();
                    let checked = match kv.put(req).await {
                        Ok(r) => {
                            let rev = header_revision(r.get_ref().header.as_ref());
                            let checked = if rev > last {
                                Ok(())
                            } else {
                                Err(format!("put: revision {rev} not above {last}"))
                            };
                            last = last.max(rev);
                            checked
                        }
                        Err(s) => Err(format!("put: {}", status_text(&s))),
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::Range | EtcdWorkload::RangeSerializable => {
                    let key = key_name(i);
                    let req = RangeRequest {
                        key: key.clone(),
                        serializable: self.workload == EtcdWorkload::RangeSerializable,
                        ..RangeRequest::default()
                    };
                    let sent = Instant::now();
                    let checked = match kv.range(req).await {
                        Ok(r) => {
                            let r = r.get_ref();
                            let found = r.kvs.first();
                            if r.count == 1
                                && r.kvs.len() == 1
                                && found.is_some_and(|kv| {
                                    kv.key == key
                                        && kv.value == value_for(i, self.value_size).as_bytes()
                                })
                            {
                                Ok(())
                            } else {
                                Err(format!(
                                    "range {}: {} keys, not the preloaded value",
                                    String::from_utf8_lossy(&key),
                                    r.kvs.len()
                                ))
                            }
                        }
                        Err(s) => Err(format!("range: {}", status_text(&s))),
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::Txn => {
                    let key = txn_key.clone();
                    let Some(expected) = txn_mod else {
                        // Learn the key's mod revision (not timed): at the start, and after a
                        // failure whose outcome is unknown.
                        match kv
                            .range(RangeRequest {
                                key,
                                ..RangeRequest::default()
                            })
                            .await
                        {
                            Ok(r) => {
                                txn_mod =
                                    Some(r.get_ref().kvs.first().map_or(0, |kv| kv.mod_revision))
                            }
                            Err(s) => t.fail(format!("txn's key: {}", status_text(&s))),
                        }
                        continue;
                    };
                    let req = cas_put(&key, expected, value_for(i, self.value_size));
                    let sent = Instant::now();
                    let checked = match kv.txn(req).await {
                        Ok(r) => {
                            let (checked, now) = check_cas(r.get_ref(), expected);
                            txn_mod = now;
                            checked
                        }
                        Err(s) => {
                            txn_mod = None;
                            Err(format!("txn: {}", status_text(&s)))
                        }
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::LeaseGrant => {
                    let req = LeaseGrantRequest {
                        ttl: LEASE_TTL_S,
                        id: 0,
                    };
                    let sent = Instant::now();
                    let checked = match lease.lease_grant(req).await {
                        Ok(r) => {
                            let g = r.get_ref();
                            if g.id > 0 && g.ttl >= LEASE_TTL_S && g.error.is_empty() {
                                t.granted.push(g.id);
                                Ok(())
                            } else {
                                Err(format!(
                                    "lease grant: id {}, ttl {} ({})",
                                    g.id, g.ttl, g.error
                                ))
                            }
                        }
                        Err(s) => Err(format!("lease grant: {}", status_text(&s))),
                    };
                    t.record(sent, checked);
                }
                EtcdWorkload::LeaseKeepalive => {
                    let Some(id) = self.lease else {
                        t.fail("no pre-granted lease".into());
                        return t;
                    };
                    let sent = Instant::now();
                    let checked = match tokio::time::timeout(
                        TIMEOUT,
                        keep_alive_once(&mut lease, &mut keepalive, id),
                    )
                    .await
                    {
                        Ok(Ok(r)) if r.id == id && r.ttl == LEASE_TTL_S => Ok(()),
                        Ok(Ok(r)) => Err(format!("keepalive of {id}: id {}, ttl {}", r.id, r.ttl)),
                        Ok(Err(e)) => Err(e),
                        Err(_) => Err(format!("keepalive of {id}: no answer within {TIMEOUT:?}")),
                    };
                    if checked.is_err() {
                        keepalive = None; // open a new stream
                    }
                    t.record(sent, checked);
                }
            }
            i = (i + 1) % self.keys;
        }
        t
    }
}

/// A compare-and-set: put `key` if its mod revision is still `expected` (0: it does not
/// exist), else read it.
fn cas_put(key: &[u8], expected: i64, value: String) -> TxnRequest {
    TxnRequest {
        compare: vec![Compare {
            result: compare::CompareResult::Equal as i32,
            target: compare::CompareTarget::Mod as i32,
            key: key.to_vec(),
            range_end: Vec::new(),
            target_union: Some(compare::TargetUnion::ModRevision(expected)),
        }],
        success: vec![RequestOp {
            request: Some(request_op::Request::RequestPut(PutRequest {
                key: key.to_vec(),
                value: value.into_bytes(),
                ..PutRequest::default()
            })),
        }],
        failure: vec![RequestOp {
            request: Some(request_op::Request::RequestRange(RangeRequest {
                key: key.to_vec(),
                ..RangeRequest::default()
            })),
        }],
    }
}

/// Check a [`cas_put`]'s answer: it must have succeeded with one put at a revision above
/// `expected`. Returns the check and the key's mod revision now, if known.
fn check_cas(r: &TxnResponse, expected: i64) -> (Result<(), String>, Option<i64>) {
    let rev = header_revision(r.header.as_ref());
    let put = matches!(
        r.responses.as_slice(),
        [leasecore_etcd_api::etcdserverpb::ResponseOp {
            response: Some(response_op::Response::ResponsePut(_))
        }]
    );
    if r.succeeded && put && rev > expected {
        return (Ok(()), Some(rev));
    }
    // A failed compare read the key: its mod revision now.
    let now = match r.responses.as_slice() {
        [
            leasecore_etcd_api::etcdserverpb::ResponseOp {
                response: Some(response_op::Response::ResponseRange(range)),
            },
        ] => Some(range.kvs.first().map_or(0, |kv| kv.mod_revision)),
        _ => None,
    };
    (
        Err(format!(
            "txn: succeeded {}, {} responses, revision {rev} after {expected}",
            r.succeeded,
            r.responses.len()
        )),
        now,
    )
}

/// Send one keepalive for `id` on the connection's stream (opened when there is none) and
/// wait for its answer.
async fn keep_alive_once(
    lease: &mut LeaseClient<H2Conn>,
    stream: &mut Option<KeepAlive>,
    id: i64,
) -> Result<LeaseKeepAliveResponse, String> {
    let req = LeaseKeepAliveRequest { id };
    let closed = |_| format!("keepalive of {id}: the stream closed");
    if let Some((tx, inbound)) = stream.as_mut() {
        tx.send(req).await.map_err(closed)?;
        return match inbound.message().await {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(format!("keepalive of {id}: the stream ended")),
            Err(s) => Err(format!("keepalive of {id}: {}", status_text(&s))),
        };
    }
    // The first request is queued before the call: a server may send the stream's headers only
    // with its first answer.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(req).await.map_err(closed)?;
    let outbound =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut inbound = lease
        .lease_keep_alive(outbound)
        .await
        .map_err(|s| format!("keepalive stream: {}", status_text(&s)))?
        .into_inner();
    let first = match inbound.message().await {
        Ok(Some(m)) => m,
        Ok(None) => return Err(format!("keepalive of {id}: the stream ended")),
        Err(s) => return Err(format!("keepalive of {id}: {}", status_text(&s))),
    };
    *stream = Some((tx, inbound));
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_names_round_trip() {
        for w in EtcdWorkload::ALL {
            assert_eq!(w.name().parse::<EtcdWorkload>(), Ok(w));
            assert_eq!(
                serde_json::to_value(w).unwrap(),
                serde_json::Value::String(w.name().into())
            );
        }
        assert!("get".parse::<EtcdWorkload>().is_err());
    }

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

    #[test]
    fn a_cas_answer_is_checked() {
        use leasecore_etcd_api::etcdserverpb::{
            PutResponse, RangeResponse, ResponseHeader, ResponseOp,
        };
        let header = |revision| {
            Some(ResponseHeader {
                revision,
                ..ResponseHeader::default()
            })
        };
        let put = TxnResponse {
            header: header(8),
            succeeded: true,
            responses: vec![ResponseOp {
                response: Some(response_op::Response::ResponsePut(PutResponse::default())),
            }],
        };
        assert_eq!(check_cas(&put, 5), (Ok(()), Some(8)));
        assert!(check_cas(&put, 8).0.is_err());
        let lost = TxnResponse {
            header: header(9),
            succeeded: false,
            responses: vec![ResponseOp {
                response: Some(response_op::Response::ResponseRange(RangeResponse {
                    kvs: vec![leasecore_etcd_api::mvccpb::KeyValue {
                        mod_revision: 7,
                        ..Default::default()
                    }],
                    ..RangeResponse::default()
                })),
            }],
        };
        let (checked, now) = check_cas(&lost, 5);
        assert!(checked.is_err());
        assert_eq!(now, Some(7));
    }
}
