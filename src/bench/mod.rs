//! `leasecore bench`: a closed-loop load generator against a running cluster.
//!
//! Each connection is one worker with its own single-connection HTTP client that sends one
//! request at a time, so `connections` is the concurrency. Every response is checked (status
//! and body); only checked successes count toward throughput and latency. Workers are spread
//! over the endpoints round-robin.
//!
//! Figures are only comparable within one run on one machine: report ratios against a baseline
//! measured in the same run (scripts/bench.sh does this).

// A load generator measures wall-clock latency: the clock reads are the point.
#![allow(clippy::disallowed_methods)]

pub mod apply;
pub mod churn;
pub mod etcd;
pub mod experiments;
pub mod grpc_conn;
pub mod handover;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::client::{Client, ClientError, encode_path};
use crate::wire::{GetResponse, PutResponse};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// `PUT /v1/kv/{key}` over a key space.
    Put,
    /// Linearizable `GET /v1/kv/{key}`.
    Get,
    /// `GET /v1/kv/{key}?consistency=local`.
    GetLocal,
    /// `POST /v1/leases` with fresh names.
    LeaseGrant,
    /// `POST /v1/leases/{name}/refresh` over `keys` pre-registered leases.
    LeaseRefresh,
    /// Uncontended Flease acquisitions, each of a fresh resource.
    FleaseAcquire,
    /// Every connection's owner contends for one resource: acquire, and release at once when
    /// granted. Counts handovers; `fairness` compares owners.
    FleaseContended,
    /// Uncontended PaxosLease acquisitions, each of a fresh resource.
    PaxosleaseAcquire,
    /// The contended workload with PaxosLease.
    PaxosleaseContended,
}

impl Workload {
    /// The per-resource lease protocol of a Flease or PaxosLease workload.
    fn protocol(self) -> Option<crate::domain::flease::Protocol> {
        use crate::domain::flease::Protocol;
        match self {
            Workload::FleaseAcquire | Workload::FleaseContended => Some(Protocol::Flease),
            Workload::PaxosleaseAcquire | Workload::PaxosleaseContended => {
                Some(Protocol::PaxosLease)
            }
            _ => None,
        }
    }
}

impl FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "put" => Ok(Workload::Put),
            "get" => Ok(Workload::Get),
            "get-local" => Ok(Workload::GetLocal),
            "lease-grant" => Ok(Workload::LeaseGrant),
            "lease-refresh" => Ok(Workload::LeaseRefresh),
            "flease-acquire" => Ok(Workload::FleaseAcquire),
            "flease-contended" => Ok(Workload::FleaseContended),
            "paxoslease-acquire" => Ok(Workload::PaxosleaseAcquire),
            "paxoslease-contended" => Ok(Workload::PaxosleaseContended),
            other => Err(format!(
                "unknown workload {other:?}: put, get, get-local, lease-grant, lease-refresh, flease-acquire, flease-contended, paxoslease-acquire or paxoslease-contended"
            )),
        }
    }
}

/// How to run.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub workload: Workload,
    pub endpoints: Vec<String>,
    pub connections: usize,
    pub duration: Duration,
    pub keys: usize,
    pub value_size: usize,
    /// A bearer token sent with every request (auth on); never printed.
    pub token: Option<crate::domain::auth::Secret>,
}

/// What was measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    pub workload: Workload,
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
}

impl fmt::Display for BenchResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} c={} {:.1}s: {:.0} ops/s, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} ok, {} errors)",
            self.workload,
            self.connections,
            self.seconds,
            self.throughput,
            self.p50_ms,
            self.p99_ms,
            self.max_ms,
            self.ok,
            self.errors
        )
    }
}

fn key_name(i: usize) -> String {
    format!("bench/{i:08}")
}

fn value_for(i: usize, size: usize) -> String {
    let mut v = format!("{i:08}");
    // One copy of the filler, not a push per character: this runs once per call.
    v.push_str(&"x".repeat(size.saturating_sub(v.len())));
    v.truncate(size.max(1));
    v
}

/// Run one workload and return its figures.
pub async fn run(opts: &BenchOptions) -> Result<BenchResult, ClientError> {
    match opts.workload {
        Workload::Get | Workload::GetLocal => preload(opts).await?,
        Workload::LeaseRefresh => preload_leases(opts).await?,
        Workload::Put
        | Workload::LeaseGrant
        | Workload::FleaseAcquire
        | Workload::FleaseContended
        | Workload::PaxosleaseAcquire
        | Workload::PaxosleaseContended => {}
    }
    let endpoints: Vec<String> = Client::new(&opts.endpoints)?.endpoints().to_vec();
    let deadline = Instant::now() + opts.duration;
    let opts = Arc::new(opts.clone());
    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..opts.connections {
        let endpoint = endpoints[w % endpoints.len()].clone();
        let opts = opts.clone();
        workers.push(tokio::spawn(async move {
            worker(w, &endpoint, &opts, deadline).await
        }));
    }
    let mut latencies_us: Vec<u32> = Vec::new();
    let mut errors = 0;
    let mut per_worker = Vec::new();
    for w in workers {
        let (lat, err) = w.await.map_err(|e| ClientError::Usage(e.to_string()))?;
        per_worker.push(lat.len() as f64);
        latencies_us.extend(lat);
        errors += err;
    }
    let most = per_worker.iter().cloned().fold(0.0, f64::max);
    let fewest = per_worker.iter().cloned().fold(f64::MAX, f64::min);
    let fairness = if most > 0.0 { fewest / most } else { 0.0 };
    let seconds = started.elapsed().as_secs_f64();
    latencies_us.sort_unstable();
    let pct = |p: f64| percentile_ms(&latencies_us, p);
    Ok(BenchResult {
        workload: opts.workload,
        connections: opts.connections,
        seconds,
        ok: latencies_us.len() as u64,
        errors,
        throughput: latencies_us.len() as f64 / seconds,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        fairness,
        max_ms: latencies_us
            .last()
            .map(|l| *l as f64 / 1000.0)
            .unwrap_or(0.0),
    })
}

/// The `p` quantile of sorted microsecond samples, in milliseconds (nearest rank).
pub fn percentile_ms(sorted_us: &[u32], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let i = ((sorted_us.len() as f64 * p).ceil() as usize).clamp(1, sorted_us.len()) - 1;
    sorted_us[i] as f64 / 1000.0
}

/// A run-unique prefix, so that repeated runs against one cluster do not collide.
pub fn run_tag() -> String {
    format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros()
    )
}

fn lease_name(tag: &str, i: usize) -> String {
    format!("bench-{tag}-{i:08}")
}

/// `client` with the run's token, if any.
fn authed(client: Client, opts: &BenchOptions) -> Client {
    match &opts.token {
        Some(t) => client.with_token(t.0.clone()),
        None => client,
    }
}

/// Register `keys` leases (long-lived) for the refresh workload.
async fn preload_leases(opts: &BenchOptions) -> Result<(), ClientError> {
    let client = Arc::new(authed(Client::new(&opts.endpoints)?, opts));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (client, next) = (client.clone(), next.clone());
        let keys = opts.keys;
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= keys {
                    return Ok::<(), ClientError>(());
                }
                match client.grant(&lease_name("refresh", i), 3_600_000).await {
                    Ok(_) => {}
                    Err(e) if e.code() == Some("lease_exists") => {}
                    Err(e) => return Err(e),
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| ClientError::Usage(e.to_string()))??;
    }
    Ok(())
}

/// Write every key once so that reads find them.
async fn preload(opts: &BenchOptions) -> Result<(), ClientError> {
    let client = Arc::new(authed(Client::new(&opts.endpoints)?, opts));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (client, next) = (client.clone(), next.clone());
        let (keys, size) = (opts.keys, opts.value_size);
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= keys {
                    return Ok::<(), ClientError>(());
                }
                client
                    .put(&key_name(i), &value_for(i, size), None, None)
                    .await?;
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| ClientError::Usage(e.to_string()))??;
    }
    Ok(())
}

async fn worker(
    w: usize,
    endpoint: &str,
    opts: &BenchOptions,
    deadline: Instant,
) -> (Vec<u32>, u64) {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(value) = opts
        .token
        .as_ref()
        .and_then(|t| reqwest::header::HeaderValue::from_str(&format!("Bearer {}", t.0)).ok())
    {
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let http = crate::client::http_builder()
        .pool_max_idle_per_host(1)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(10))
        .default_headers(headers)
        .build()
        .expect("an HTTP client with a built TLS config always builds");
    let mut latencies = Vec::new();
    let mut errors = 0u64;
    // Workers start at different keys so that they do not write the same key in lockstep.
    let mut i = w.wrapping_mul(7919) % opts.keys;
    let tag = run_tag();
    let mut granted = 0usize;
    while Instant::now() < deadline {
        let key = key_name(i);
        let url = format!("{endpoint}/v1/kv/{}", encode_path(&key));
        let sent = Instant::now();
        let ok = match opts.workload {
            Workload::Put => {
                let body = serde_json::json!({ "value": value_for(i, opts.value_size) });
                match http.put(&url).json(&body).send().await {
                    Ok(r) if r.status().is_success() => r
                        .json::<PutResponse>()
                        .await
                        .is_ok_and(|p| p.revision.0 > 0),
                    _ => false,
                }
            }
            Workload::LeaseGrant => {
                granted += 1;
                let body = serde_json::json!({
                    "name": lease_name(&format!("{tag}-{w}"), granted),
                    "ttl_ms": 60_000,
                });
                let url = format!("{endpoint}/v1/leases");
                match http.post(&url).json(&body).send().await {
                    Ok(r) if r.status() == reqwest::StatusCode::CREATED => r
                        .json::<crate::wire::LeaseGranted>()
                        .await
                        .is_ok_and(|g| g.revision.0 > 0),
                    _ => false,
                }
            }
            Workload::FleaseAcquire | Workload::PaxosleaseAcquire => {
                granted += 1;
                let res = crate::client::encode_query(&format!("bench-fl-{tag}-{w}-{granted}"));
                let proto = opts.workload.protocol().unwrap_or_default().name();
                let url = format!("{endpoint}/v1/{proto}/{res}/acquire");
                let body = serde_json::json!({ "owner": format!("w{w}") });
                match http.post(&url).json(&body).send().await {
                    Ok(r) if r.status().is_success() => r
                        .json::<crate::runtime::flease::LeaseView>()
                        .await
                        .is_ok_and(|v| v.granted == Some(true)),
                    _ => false,
                }
            }
            Workload::FleaseContended | Workload::PaxosleaseContended => {
                let res = format!("bench-contended-{tag}");
                let proto = opts.workload.protocol().unwrap_or_default().name();
                let owner = serde_json::json!({ "owner": format!("w{w}") });
                let url = format!("{endpoint}/v1/{proto}/{res}/acquire");
                let got = match http.post(&url).json(&owner).send().await {
                    Ok(r) if r.status().is_success() => r
                        .json::<crate::runtime::flease::LeaseView>()
                        .await
                        .is_ok_and(|v| v.granted == Some(true)),
                    _ => false,
                };
                if !got {
                    // Busy is no error here, only not an acquisition. Back off a little, as a
                    // real contender would: probing rounds pre-empt the holder's release round.
                    let pause = 1 + (w as u64 * 7 + latencies.len() as u64) % 10;
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    continue;
                }
                // Hand it over at once: a release, then count the acquisition.
                let url = format!("{endpoint}/v1/{proto}/{res}/release");
                let _ = http.post(&url).json(&owner).send().await;
                true
            }
            Workload::LeaseRefresh => {
                let name = crate::client::encode_query(&lease_name("refresh", i));
                let url = format!("{endpoint}/v1/leases/{name}/refresh");
                match http.post(&url).send().await {
                    Ok(r) if r.status().is_success() => r
                        .json::<crate::runtime::lease::RefreshAck>()
                        .await
                        .is_ok_and(|a| a.ttl_ms == 3_600_000),
                    _ => false,
                }
            }
            Workload::Get | Workload::GetLocal => {
                let url = if opts.workload == Workload::GetLocal {
                    format!("{url}?consistency=local")
                } else {
                    url
                };
                match http.get(&url).send().await {
                    Ok(r) if r.status().is_success() => r
                        .json::<GetResponse>()
                        .await
                        .is_ok_and(|g| g.kv.value.len() == opts.value_size.max(1)),
                    _ => false,
                }
            }
        };
        if ok {
            latencies.push(sent.elapsed().as_micros().min(u32::MAX as u128) as u32);
        } else {
            errors += 1;
        }
        i = (i + 1) % opts.keys;
    }
    (latencies, errors)
}
