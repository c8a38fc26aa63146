//! Experiments that are not closed-loop throughput: watch wake-up latency at N watchers, lease
//! expiry lateness, and memory per lease and per idle watcher.
//!
//! Memory is read from the serving node's `/metrics` (`leasecore_process_resident_memory_bytes`),
//! so these run against a cluster on this machine or anywhere `/metrics` is reachable.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{percentile_ms, run_tag};
use crate::client::{Client, ClientError, encode_query};
use crate::domain::command::EventKind;
use crate::wire::WatchResponse;

/// Read one gauge from a node's /metrics.
pub async fn gauge(http: &reqwest::Client, endpoint: &str, name: &str) -> Result<f64, ClientError> {
    let text = http
        .get(format!("{endpoint}/metrics"))
        .send()
        .await
        .map_err(|e| ClientError::Unavailable(e.to_string()))?
        .text()
        .await
        .map_err(|e| ClientError::Unavailable(e.to_string()))?;
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| ClientError::Unavailable(format!("no gauge {name} at {endpoint}")))
}

fn http_client() -> reqwest::Client {
    crate::client::http_builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(usize::MAX)
        .build()
        .expect("an HTTP client with a built TLS config always builds")
}

/// Wake-up latency at N watchers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WatchResult {
    pub watchers: usize,
    /// "long-poll", "sse" (one stream per watcher) or "streams-N" (the watchers spread over N
    /// multi-watch streams, `POST /v1/watches`).
    pub mode: String,
    pub events: usize,
    pub deliveries: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Resident memory of the serving node per parked watcher.
    pub bytes_per_idle_watcher: f64,
}

/// N watchers follow one prefix on the first endpoint, by long polls or by one SSE stream each
/// (`sse`); a writer puts `events` keys under it, one every `interval`; each delivery's latency
/// is measured from the put's acknowledgement (0 when the event arrived before the
/// acknowledgement did).
pub async fn watch_latency(
    endpoints: &[String],
    watchers: usize,
    events: usize,
    interval: Duration,
    sse: bool,
    streams: usize,
) -> Result<WatchResult, ClientError> {
    if streams > 0 {
        return watch_streams_latency(endpoints, watchers, events, interval, streams).await;
    }
    let WatchSetup {
        client,
        endpoint,
        http,
        prefix,
        start,
        rss_before,
    } = WatchSetup::new(endpoints).await?;
    let waiting_before = gauge(&http, &endpoint, "leasecore_watch_waiting").await?;

    let received: Arc<Mutex<Vec<(u64, Instant)>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..watchers {
        let (http, endpoint, prefix, received) = (
            http.clone(),
            endpoint.clone(),
            prefix.clone(),
            received.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut next = start;
            let mut seen = 0;
            let mut local = Vec::with_capacity(events);
            if sse {
                local = follow_sse(&http, &endpoint, &prefix, start, events).await;
                seen = events;
            }
            while seen < events {
                let url = format!(
                    "{endpoint}/v1/watch?prefix={}&from_revision={next}&timeout_ms=60000",
                    encode_query(&prefix)
                );
                let Ok(resp) = http.get(&url).send().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let Ok(batch) = resp.json::<WatchResponse>().await else {
                    continue;
                };
                let now = Instant::now();
                for e in &batch.events {
                    local.push((e.revision.0, now));
                    seen += 1;
                }
                next = next.max(batch.revision.0 + 1);
            }
            received
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(local);
        }));
    }
    // Wait until every watcher is parked on the node.
    let parked = Instant::now();
    loop {
        let waiting = gauge(&http, &endpoint, "leasecore_watch_waiting").await?;
        if waiting - waiting_before >= watchers as f64 {
            break;
        }
        if parked.elapsed() > Duration::from_secs(120) {
            return Err(ClientError::Unavailable(format!(
                "only {waiting} watchers parked after 120 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_parked = gauge(&http, &endpoint, "leasecore_process_resident_memory_bytes").await?;

    let acked = put_events(&client, &prefix, events, interval).await?;
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(120), t).await;
    }
    let received = received.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let lat_us: Vec<u32> = received
        .iter()
        .filter_map(|(rev, at)| {
            let ack = acked.get(rev)?;
            Some(
                at.saturating_duration_since(*ack)
                    .as_micros()
                    .min(u32::MAX as u128) as u32,
            )
        })
        .collect();
    let mode = if sse { "sse" } else { "long-poll" };
    let per_watcher = (rss_parked - rss_before) / watchers.max(1) as f64;
    Ok(WatchResult::of(watchers, mode, events, lat_us, per_watcher))
}

impl WatchResult {
    fn of(watchers: usize, mode: &str, events: usize, mut lat_us: Vec<u32>, per: f64) -> Self {
        lat_us.sort_unstable();
        WatchResult {
            watchers,
            mode: mode.to_string(),
            events,
            deliveries: lat_us.len(),
            p50_ms: percentile_ms(&lat_us, 0.50),
            p99_ms: percentile_ms(&lat_us, 0.99),
            max_ms: lat_us.last().map_or(0.0, |l| *l as f64 / 1000.0),
            bytes_per_idle_watcher: per,
        }
    }
}

/// Put `events` keys under `prefix`, one every `interval`: the acknowledgement time of each
/// revision.
async fn put_events(
    client: &Client,
    prefix: &str,
    events: usize,
    interval: Duration,
) -> Result<HashMap<u64, Instant>, ClientError> {
    let mut acked = HashMap::new();
    for i in 0..events {
        let r = client
            .put(&format!("{prefix}k{i}"), "v", None, None)
            .await?;
        acked.insert(r.revision.0, Instant::now());
        tokio::time::sleep(interval).await;
    }
    Ok(acked)
}

/// What both watch experiments start from: a fresh prefix with a first key, the revision after
/// it, and the serving node's resident memory before any watcher.
struct WatchSetup {
    client: Client,
    endpoint: String,
    http: reqwest::Client,
    prefix: String,
    start: u64,
    rss_before: f64,
}

impl WatchSetup {
    async fn new(endpoints: &[String]) -> Result<Self, ClientError> {
        let client = Client::new(endpoints)?;
        let endpoint = client.endpoints()[0].clone();
        let http = http_client();
        let prefix = format!("bench-watch-{}/", run_tag());
        let start = client
            .put(&format!("{prefix}start"), "x", None, None)
            .await?
            .revision
            .0
            + 1;
        let rss_before = gauge(&http, &endpoint, "leasecore_process_resident_memory_bytes").await?;
        Ok(WatchSetup {
            client,
            endpoint,
            http,
            prefix,
            start,
            rss_before,
        })
    }
}

/// The watchers spread over `streams` multi-watch SSE streams (`POST /v1/watches`), all on one
/// prefix; each message names the watches it is for, and counts as a delivery to each.
async fn watch_streams_latency(
    endpoints: &[String],
    watchers: usize,
    events: usize,
    interval: Duration,
    streams: usize,
) -> Result<WatchResult, ClientError> {
    let WatchSetup {
        client,
        endpoint,
        http,
        prefix,
        start,
        rss_before,
    } = WatchSetup::new(endpoints).await?;
    let streams = streams.min(watchers.max(1));
    let mut tasks = Vec::new();
    let mut opened = Vec::new();
    for s in 0..streams {
        let share = watchers / streams + usize::from(s < watchers % streams);
        let watches: Vec<serde_json::Value> = (0..share)
            .map(|j| serde_json::json!({"id": format!("s{s}w{j}"), "prefix": prefix}))
            .collect();
        let body = serde_json::json!({"from_revision": start, "watches": watches});
        let (tx, rx) = tokio::sync::oneshot::channel();
        opened.push(rx);
        let (http, url) = (http.clone(), format!("{endpoint}/v1/watches"));
        tasks.push(tokio::spawn(async move {
            let mut got: Vec<(u64, Instant, usize)> = Vec::new();
            let resp = http
                .post(&url)
                .header(reqwest::header::ACCEPT, "text/event-stream")
                .json(&body)
                .send()
                .await;
            let Ok(mut resp) = resp else {
                let _ = tx.send(false);
                return got;
            };
            let _ = tx.send(resp.status().is_success());
            let mut pending = String::new();
            while got.len() < events {
                let Ok(Some(chunk)) = resp.chunk().await else {
                    break;
                };
                let now = Instant::now();
                pending.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = pending.find("\n\n") {
                    let message: String = pending.drain(..end + 2).collect();
                    let id = message.lines().find_map(|l| l.strip_prefix("id:"));
                    let data = message.lines().find_map(|l| l.strip_prefix("data:"));
                    if let (Some(Ok(rev)), Some(data)) = (id.map(|i| i.trim().parse::<u64>()), data)
                    {
                        let n = serde_json::from_str::<serde_json::Value>(data.trim())
                            .ok()
                            .and_then(|v| v["watches"].as_array().map(Vec::len))
                            .unwrap_or(0);
                        got.push((rev, now, n));
                    }
                }
            }
            got
        }));
    }
    for rx in opened {
        if rx.await != Ok(true) {
            return Err(ClientError::Unavailable(
                "a watch stream did not open".into(),
            ));
        }
    }
    let rss_parked = gauge(&http, &endpoint, "leasecore_process_resident_memory_bytes").await?;
    let acked = put_events(&client, &prefix, events, interval).await?;
    let mut lat_us: Vec<u32> = Vec::new();
    for t in tasks {
        if let Ok(Ok(got)) = tokio::time::timeout(Duration::from_secs(120), t).await {
            for (rev, at, n) in got {
                if let Some(ack) = acked.get(&rev) {
                    let us = at
                        .saturating_duration_since(*ack)
                        .as_micros()
                        .min(u32::MAX as u128) as u32;
                    lat_us.extend(std::iter::repeat_n(us, n));
                }
            }
        }
    }
    let per_watcher = (rss_parked - rss_before) / watchers.max(1) as f64;
    let mode = format!("streams-{streams}");
    Ok(WatchResult::of(
        watchers,
        &mode,
        events,
        lat_us,
        per_watcher,
    ))
}

/// Follow `prefix` from `start` over one SSE stream until `events` events arrived (or the
/// stream ends); (revision, arrival) of each.
async fn follow_sse(
    http: &reqwest::Client,
    endpoint: &str,
    prefix: &str,
    start: u64,
    events: usize,
) -> Vec<(u64, Instant)> {
    let mut got = Vec::with_capacity(events);
    let url = format!(
        "{endpoint}/v1/watch?prefix={}&from_revision={start}",
        encode_query(prefix)
    );
    let Ok(mut resp) = http
        .get(&url)
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .send()
        .await
    else {
        return got;
    };
    let mut pending = String::new();
    while got.len() < events {
        let Ok(Some(chunk)) = resp.chunk().await else {
            break;
        };
        let now = Instant::now();
        pending.push_str(&String::from_utf8_lossy(&chunk));
        // Whole lines only; an `id:` line carries the event's revision.
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            if let Some(Ok(rev)) = line.strip_prefix("id:").map(|id| id.trim().parse::<u64>()) {
                got.push((rev, now));
            }
        }
    }
    got
}

/// Expiry lateness of never-refreshed leases.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExpiryResult {
    pub leases: usize,
    pub ttl_ms: u64,
    pub grant_connections: usize,
    pub observed: usize,
    /// Deletions seen before `grant send time + ttl`, the client's view (must be 0).
    pub early: usize,
    /// Lateness after `grant reply time + ttl` (etcd's measure; negative counts as 0).
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Register `leases` leases (from `conns` concurrent clients) with one key each, never refresh
/// them, and measure (key deletion seen by a watcher) - (grant reply time + ttl); a deletion
/// before (grant send time + ttl) counts as early.
pub async fn expiry_lateness(
    endpoints: &[String],
    leases: usize,
    ttl_ms: u64,
    conns: usize,
) -> Result<ExpiryResult, ClientError> {
    let client = Arc::new(Client::new(endpoints)?);
    let prefix = format!("bench-exp-{}/", run_tag());
    let start = client
        .put(&format!("{prefix}start"), "x", None, None)
        .await?
        .revision
        .0
        + 1;
    let deleted: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let watcher = {
        let (client, prefix, deleted) = (client.clone(), prefix.clone(), deleted.clone());
        tokio::spawn(async move {
            let filter = crate::client::WatchFilter::Prefix(prefix);
            let mut next = start;
            loop {
                let n = deleted.lock().unwrap_or_else(|p| p.into_inner()).len();
                if n >= leases {
                    return;
                }
                let Ok(batch) = client.watch_once(&filter, Some(next), 10_000).await else {
                    continue;
                };
                let now = Instant::now();
                let mut d = deleted.lock().unwrap_or_else(|p| p.into_inner());
                for e in &batch.events {
                    if e.kind == EventKind::Delete {
                        d.insert(e.key.clone(), now);
                    }
                }
                next = next.max(batch.revision.0 + 1);
            }
        })
    };
    // name -> (send + ttl, reply + ttl)
    let nominal: Arc<Mutex<HashMap<String, (Instant, Instant)>>> = Arc::default();
    let counter = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conns.max(1) {
        let (client, prefix, nominal, counter) = (
            client.clone(),
            prefix.clone(),
            nominal.clone(),
            counter.clone(),
        );
        tasks.push(tokio::spawn(async move {
            loop {
                let i = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= leases {
                    return Ok::<(), ClientError>(());
                }
                let name = format!("{prefix}{i:06}");
                let sent = Instant::now();
                client.grant(&name, ttl_ms).await?;
                let replied = Instant::now();
                let ttl = Duration::from_millis(ttl_ms);
                nominal
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(name.clone(), (sent + ttl, replied + ttl));
                client.put(&name, "v", Some(&name), None).await?;
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| ClientError::Usage(e.to_string()))??;
    }
    let _ = tokio::time::timeout(Duration::from_millis(ttl_ms + 60_000), watcher).await;
    let nominal = nominal.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let deleted = deleted.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut early = 0;
    let mut late_us: Vec<u32> = Vec::new();
    for (key, at) in &deleted {
        let Some((earliest, due)) = nominal.get(key) else {
            continue;
        };
        if at < earliest {
            early += 1;
        }
        late_us.push(
            at.saturating_duration_since(*due)
                .as_micros()
                .min(u32::MAX as u128) as u32,
        );
    }
    late_us.sort_unstable();
    Ok(ExpiryResult {
        leases,
        ttl_ms,
        grant_connections: conns.max(1),
        observed: deleted.len(),
        early,
        p50_ms: percentile_ms(&late_us, 0.50),
        p99_ms: percentile_ms(&late_us, 0.99),
        max_ms: late_us.last().map_or(0.0, |l| *l as f64 / 1000.0),
    })
}

/// Memory per idle lease with one key.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeaseMemoryResult {
    pub leases: usize,
    pub rss_before: f64,
    pub rss_after: f64,
    pub bytes_per_lease: f64,
}

/// Register `leases` long leases with one key each and read the first endpoint's resident
/// memory before and after.
pub async fn lease_memory(
    endpoints: &[String],
    leases: usize,
) -> Result<LeaseMemoryResult, ClientError> {
    let client = Arc::new(Client::new(endpoints)?);
    let endpoint = client.endpoints()[0].clone();
    let http = http_client();
    let prefix = format!("bench-mem-{}/", run_tag());
    let rss_before = gauge(&http, &endpoint, "leasecore_process_resident_memory_bytes").await?;
    let counter = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (client, prefix, counter) = (client.clone(), prefix.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= leases {
                    return Ok::<(), ClientError>(());
                }
                let name = format!("{prefix}{i:07}");
                client.grant(&name, 3_600_000).await?;
                client
                    .put(&name, "member-value-of-modest-size", Some(&name), None)
                    .await?;
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| ClientError::Usage(e.to_string()))??;
    }
    let rss_after = gauge(&http, &endpoint, "leasecore_process_resident_memory_bytes").await?;
    Ok(LeaseMemoryResult {
        leases,
        rss_before,
        rss_after,
        bytes_per_lease: (rss_after - rss_before) / leases.max(1) as f64,
    })
}

/// Resident memory per idle per-resource lease (Flease or PaxosLease).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FleaseMemoryResult {
    pub protocol: String,
    pub resources: usize,
    /// Acceptor cells on the measured node at the end (cells collected meanwhile are not
    /// counted: run the cluster with a lease time longer than the experiment).
    pub cells: f64,
    pub rss_before: f64,
    pub rss_after: f64,
    pub bytes_per_resource: f64,
}

/// Acquire `resources` fresh resources once each (64 at a time) through the first endpoint,
/// then read its resident memory and acceptor cells.
pub async fn flease_memory(
    endpoints: &[String],
    proto: crate::domain::flease::Protocol,
    resources: usize,
) -> Result<FleaseMemoryResult, ClientError> {
    let client = Arc::new(Client::new(&endpoints[..1])?);
    let endpoint = client.endpoints()[0].clone();
    let http = http_client();
    let prefix = format!("mem-{}/", run_tag());
    let cells_gauge = format!("leasecore_flease_cells{{protocol=\"{}\"}}", proto.name());
    let rss_before = gauge(&http, &endpoint, "leasecore_process_resident_memory_bytes").await?;
    let cells_before = gauge(&http, &endpoint, &cells_gauge).await?;
    let counter = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..64 {
        let (client, prefix, counter) = (client.clone(), prefix.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= resources {
                    return Ok::<(), ClientError>(());
                }
                let v = client
                    .resource_acquire(proto, &format!("{prefix}{i:08}"), &format!("owner-{w}"))
                    .await?;
                if v.granted != Some(true) {
                    return Err(ClientError::Unavailable(format!(
                        "resource {i} not granted: {v:?}"
                    )));
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| ClientError::Usage(e.to_string()))??;
    }
    let rss_after = gauge(&http, &endpoint, "leasecore_process_resident_memory_bytes").await?;
    let cells = gauge(&http, &endpoint, &cells_gauge).await? - cells_before;
    Ok(FleaseMemoryResult {
        protocol: proto.name().to_string(),
        resources,
        cells,
        rss_before,
        rss_after,
        bytes_per_resource: (rss_after - rss_before) / cells.max(1.0),
    })
}

/// What MVCC history costs: resident memory and disk per stored version.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MvccFootprintResult {
    pub keys: usize,
    pub versions: usize,
    pub value_size: usize,
    /// Versions written per second (puts, 128 to a transaction).
    pub versions_per_sec: f64,
    /// Per endpoint, in the order given.
    pub nodes: Vec<MvccNodeFootprint>,
}

/// One node's resident memory and data directory, before and after.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MvccNodeFootprint {
    pub endpoint: String,
    pub rss_before: f64,
    pub rss_after: f64,
    pub disk_before: f64,
    pub disk_after: f64,
    /// (after − before) / (keys × versions).
    pub rss_bytes_per_version: f64,
    pub disk_bytes_per_version: f64,
}

/// Puts per transaction in [`mvcc_footprint`]: etcd's and leasecore's default `--max-txn-ops`.
const FOOTPRINT_TXN_OPS: usize = 128;

/// Write `versions` versions of each of `keys` keys (values of `value_size` bytes, 128 puts to a
/// `/v1/txn`, `connections` transactions at a time, through the first endpoint), wait until
/// every endpoint has applied the last one, and read each endpoint's resident memory and data
/// directory size (`/metrics`) before and after. Run it with auto-compaction off (or a
/// retention longer than the run), or compaction sweeps what is being measured.
pub async fn mvcc_footprint(
    endpoints: &[String],
    keys: usize,
    versions: usize,
    value_size: usize,
    connections: usize,
) -> Result<MvccFootprintResult, ClientError> {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let client = Arc::new(Client::new(endpoints)?);
    let http = http_client();
    let nodes: Vec<String> = client.endpoints().to_vec();
    let read = |name: &'static str| {
        let (http, nodes) = (http.clone(), nodes.clone());
        async move {
            let mut out = Vec::new();
            for n in &nodes {
                out.push(gauge(&http, n, name).await?);
            }
            Ok::<Vec<f64>, ClientError>(out)
        }
    };
    let rss_before = read("leasecore_process_resident_memory_bytes").await?;
    let disk_before = read("leasecore_data_dir_bytes").await?;
    let prefix = format!("mvcc-{}/", run_tag());
    let value = "v".repeat(value_size);
    let chunks = keys.div_ceil(FOOTPRINT_TXN_OPS);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections.max(1) {
        let (client, prefix, value, next) =
            (client.clone(), prefix.clone(), value.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                // Every key's version v before any key's version v + 1 (but for the last few).
                let i = next.fetch_add(1, Relaxed);
                if i >= chunks * versions {
                    return Ok::<(), ClientError>(());
                }
                let chunk = i % chunks;
                let first = chunk * FOOTPRINT_TXN_OPS;
                let puts: Vec<serde_json::Value> = (first..keys.min(first + FOOTPRINT_TXN_OPS))
                    .map(|k| serde_json::json!({"put": {"key": format!("{prefix}{k:08}"), "value": value}}))
                    .collect();
                client
                    .txn(&serde_json::json!({ "success": puts }))
                    .await?;
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| ClientError::Usage(e.to_string()))??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    // Every node has applied the last write once its local read of the last key shows its
    // final version.
    let last_key = format!("{prefix}{:08}", keys.saturating_sub(1));
    for n in &nodes {
        let one = Client::new(std::slice::from_ref(n))?;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let done = one
                .get(&last_key, true)
                .await?
                .is_some_and(|r| r.kv.version as usize >= versions);
            if done {
                break;
            }
            if Instant::now() > deadline {
                return Err(ClientError::Unavailable(format!(
                    "{n} did not apply the last write within 120 s"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let rss_after = read("leasecore_process_resident_memory_bytes").await?;
    let disk_after = read("leasecore_data_dir_bytes").await?;
    let total = (keys * versions).max(1) as f64;
    Ok(MvccFootprintResult {
        keys,
        versions,
        value_size,
        versions_per_sec: total / elapsed.max(1e-9),
        nodes: nodes
            .iter()
            .enumerate()
            .map(|(i, n)| MvccNodeFootprint {
                endpoint: n.clone(),
                rss_before: rss_before[i],
                rss_after: rss_after[i],
                disk_before: disk_before[i],
                disk_after: disk_after[i],
                rss_bytes_per_version: (rss_after[i] - rss_before[i]) / total,
                disk_bytes_per_version: (disk_after[i] - disk_before[i]) / total,
            })
            .collect(),
    })
}
