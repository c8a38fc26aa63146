//! Lease experiments under stress: expiry lateness while leaders are being killed
//! (`expiry-churn`, with `scripts/lease-churn.sh` doing the killing), and a mass expiry
//! (`mass-expiry`: many leases expiring at once, with a writer measuring the longest stall and
//! every node's view polled for leader changes and apply lag).
//!
//! Both observe deletions in the nodes' *applied* state (`consistency=local` reads on every
//! node), which keeps answering while the cluster has no leader: a deletion is seen as soon as
//! one node applied it, not once a new leader can serve a linearizable read.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{percentile_ms, run_tag};
use crate::client::{Client, ClientError};

/// Expiry lateness of leases never refreshed after their grant, while leaders change.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChurnExpiryResult {
    pub leases: usize,
    pub ttl_ms: u64,
    /// Leases whose deletion was observed (the others' grant or key write was uncertain).
    pub observed: usize,
    /// Deletions before grant send + ttl (must be 0).
    pub early: usize,
    /// Deletion seen minus (grant reply + ttl).
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Leader terms seen during the run (first and last).
    pub first_term: u64,
    pub last_term: u64,
    /// The five latest deletions, with wall-clock times to line up with the nodes' logs.
    pub latest: Vec<LateLease>,
}

/// One late deletion: the key, when its lease was due (grant reply + ttl) and when it was seen
/// gone, in Unix milliseconds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LateLease {
    pub key: String,
    pub due_unix_ms: u64,
    pub gone_unix_ms: u64,
}

/// One lease of the experiment: when it was asked for, acknowledged, and seen gone.
struct Tracked {
    key: String,
    sent: Instant,
    replied: Instant,
    gone: Option<Instant>,
}

/// The highest term any reachable node reports.
async fn term(nodes: &[Client]) -> u64 {
    let mut best = 0;
    for n in nodes {
        if let Ok(v) = n.cluster_status().await {
            best = best.max(v.term);
        }
    }
    best
}

/// Grant a lease and attach a key, retrying through failovers. `None` when the outcome of a
/// step is uncertain (the lease may exist with an unknown reply time): such a lease is left out.
async fn grant_with_key(client: &Client, name: &str, ttl_ms: u64) -> Option<Tracked> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let (sent, replied) = loop {
        let sent = Instant::now();
        match client.grant(name, ttl_ms).await {
            Ok(_) => break (sent, Instant::now()),
            Err(e) if e.status() == Some(503) && e.code() != Some("outcome_unknown") => {}
            Err(_) => return None,
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let key = format!("{name}/k");
    // The key must be written while the lease lives; a failed attempt is retried only while it
    // certainly did nothing.
    loop {
        match client.put(&key, "v", Some(name), None).await {
            Ok(_) => break,
            Err(e) if e.status() == Some(503) && e.code() != Some("outcome_unknown") => {}
            Err(_) => return None,
        }
        if replied.elapsed() > Duration::from_millis(ttl_ms / 2) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(Tracked {
        key,
        sent,
        replied,
        gone: None,
    })
}

/// Poll every node's applied state (one local listing each, concurrently, every 20 ms) and
/// note when each key under `prefix` is first seen gone. A node that does not answer within
/// [`LISTING_WAIT`] is skipped for the round (a dying or restarting node must not delay what
/// the others show). A key counts as gone on a node whose
/// store revision is past the key's revision when it was seen present (a restarted node that
/// has not caught up yet proves nothing). Runs until `stop`, publishing key -> when seen gone.
const LISTING_WAIT: Duration = Duration::from_millis(200);

async fn observe_deletions(
    nodes: Arc<Vec<Client>>,
    prefix: String,
    stop: tokio_util::sync::CancellationToken,
    gone_shared: Arc<std::sync::Mutex<HashMap<String, Instant>>>,
) {
    let mut present_at: HashMap<String, u64> = HashMap::new();
    let mut gone: HashMap<String, Instant> = HashMap::new();
    while !stop.is_cancelled() {
        let listings = futures::future::join_all(
            nodes
                .iter()
                .map(|n| tokio::time::timeout(LISTING_WAIT, n.list(&prefix, Some(100_000), true))),
        )
        .await;
        let now = Instant::now();
        for listing in listings.into_iter().flatten().flatten() {
            let mut here: HashMap<&str, u64> = HashMap::new();
            for kv in &listing.items {
                here.insert(kv.key.as_str(), kv.mod_revision.0);
            }
            for (key, rev) in &here {
                if !gone.contains_key(*key) {
                    let known = present_at.entry((*key).to_string()).or_insert(*rev);
                    *known = (*known).max(*rev);
                }
            }
            for (key, rev) in &present_at {
                if listing.revision.0 >= *rev && !here.contains_key(key.as_str()) {
                    gone.entry(key.clone()).or_insert(now);
                }
            }
        }
        present_at.retain(|k, _| !gone.contains_key(k));
        gone_shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone_from(&gone);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Register `leases` leases (one key each) spread evenly over `spread`, never refresh them,
/// and measure when each is deleted. Run it while something kills leaders
/// (`scripts/lease-churn.sh`).
pub async fn expiry_under_churn(
    endpoints: &[String],
    leases: usize,
    ttl_ms: u64,
    spread: Duration,
) -> Result<ChurnExpiryResult, ClientError> {
    let client = Arc::new(Client::with_timeout(endpoints, Duration::from_secs(3))?);
    let nodes = Arc::new(
        endpoints
            .iter()
            .map(|e| Client::with_timeout(std::slice::from_ref(e), Duration::from_millis(300)))
            .collect::<Result<Vec<_>, _>>()?,
    );
    let first_term = term(&nodes).await;
    let prefix = format!("bench-churn-{}/", run_tag());
    let ttl = Duration::from_millis(ttl_ms);
    let stop = tokio_util::sync::CancellationToken::new();
    let gone: Arc<std::sync::Mutex<HashMap<String, Instant>>> = Arc::default();
    let observer = {
        let (nodes, prefix, stop, gone) =
            (nodes.clone(), prefix.clone(), stop.clone(), gone.clone());
        tokio::spawn(observe_deletions(nodes, prefix, stop, gone))
    };
    let gap = spread / leases.max(1) as u32;
    // Grants run in their own tasks so that a slow one (a failover) does not delay the next.
    let mut grants = Vec::new();
    let started = Instant::now();
    for i in 0..leases {
        let at = started + gap * i as u32;
        tokio::time::sleep_until(at.into()).await;
        let (client, name) = (client.clone(), format!("{prefix}{i:05}"));
        grants.push(tokio::spawn(async move {
            grant_with_key(&client, &name, ttl_ms).await
        }));
    }
    let mut tracked = Vec::new();
    for g in grants {
        if let Ok(Some(t)) = g.await {
            tracked.push(t);
        }
    }
    // Every lease is due by now + ttl; give each failover and expiry time to land.
    let give_up = Instant::now() + ttl * 4 + Duration::from_secs(30);
    while Instant::now() < give_up && !observer.is_finished() {
        let seen = gone.lock().unwrap_or_else(|p| p.into_inner()).len();
        if seen >= tracked.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    let _ = observer.await;
    let gone = gone.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for l in &mut tracked {
        l.gone = gone.get(&l.key).copied();
    }
    let mut early = 0;
    let mut late_us: Vec<u32> = Vec::new();
    let wall = |at: Instant| -> u64 {
        let now = Instant::now();
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis() as u64;
        unix - now.saturating_duration_since(at).as_millis() as u64
    };
    let mut latest: Vec<(Duration, LateLease)> = Vec::new();
    for l in &tracked {
        let Some(gone) = l.gone else { continue };
        if gone < l.sent + ttl {
            early += 1;
        }
        latest.push((
            gone.saturating_duration_since(l.replied + ttl),
            LateLease {
                key: l.key.clone(),
                due_unix_ms: wall(l.replied + ttl),
                gone_unix_ms: wall(gone),
            },
        ));
        late_us.push(
            gone.saturating_duration_since(l.replied + ttl)
                .as_micros()
                .min(u32::MAX as u128) as u32,
        );
    }
    late_us.sort_unstable();
    Ok(ChurnExpiryResult {
        leases,
        ttl_ms,
        observed: late_us.len(),
        early,
        p50_ms: percentile_ms(&late_us, 0.50),
        p99_ms: percentile_ms(&late_us, 0.99),
        max_ms: late_us.last().map_or(0.0, |l| *l as f64 / 1000.0),
        first_term,
        last_term: term(&nodes).await,
        latest: {
            latest.sort_by_key(|(late, _)| std::cmp::Reverse(*late));
            latest.into_iter().take(5).map(|(_, l)| l).collect()
        },
    })
}

/// The shortest TTL `mass_expiry` grants while aligning deadlines: below it the server's
/// minimum TTL would move the deadline.
const MIN_ALIGNED_TTL_MS: u64 = 5_000;

/// Many leases expiring together.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MassExpiryResult {
    pub leases: usize,
    pub ttl_ms: u64,
    /// Seconds the registrations took (every lease is due at the same instant regardless).
    pub register_s: f64,
    /// From the first lease's nominal expiry until none is left, seconds.
    pub drain_s: f64,
    /// The leader's term before and after: equal means leadership was kept.
    pub term_before: u64,
    pub term_after: u64,
    /// The slowest of the puts written one after another through the expiry, ms.
    pub max_put_ms: f64,
    pub p99_put_ms: f64,
    pub puts: usize,
    pub failed_puts: usize,
    /// The longest time a node's applied index stayed behind a commit index the leader had
    /// reported before, ms (a stalled follower shows here).
    pub max_apply_lag_ms: f64,
}

/// Register `leases` leases with one key each from `conns` connections, each with the TTL that
/// makes it due at the same instant (`start + ttl_ms`: the later a lease is granted, the
/// shorter its TTL), then, while they expire, write one key at a time and watch every node's
/// applied index.
pub async fn mass_expiry(
    endpoints: &[String],
    leases: usize,
    ttl_ms: u64,
    conns: usize,
) -> Result<MassExpiryResult, ClientError> {
    let client = Arc::new(Client::new(endpoints)?);
    let nodes = Arc::new(
        endpoints
            .iter()
            .map(|e| Client::with_timeout(std::slice::from_ref(e), Duration::from_secs(2)))
            .collect::<Result<Vec<_>, _>>()?,
    );
    let prefix = format!("bench-mass-{}/", run_tag());
    let term_before = term(&nodes).await;
    let started = Instant::now();
    let due = started + Duration::from_millis(ttl_ms);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..conns.max(1) {
        let (client, prefix, next) = (client.clone(), prefix.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= leases {
                    return Ok::<(), ClientError>(());
                }
                let name = format!("{prefix}{i:06}");
                let left = due.saturating_duration_since(Instant::now()).as_millis() as u64;
                if left < MIN_ALIGNED_TTL_MS {
                    return Err(ClientError::Usage(format!(
                        "registering {leases} leases takes longer than --ttl-ms {ttl_ms} \
                         allows; raise it"
                    )));
                }
                client.grant(&name, left).await?;
                client
                    .put(&format!("{name}/k"), "v", Some(&name), None)
                    .await?;
            }
        }));
    }
    for w in workers {
        w.await.map_err(|e| ClientError::Usage(e.to_string()))??;
    }
    let register_s = started.elapsed().as_secs_f64();
    let first_due = due;

    // The apply-lag observer: every 50 ms, each node's applied index against the highest
    // commit index reported so far, remembering since when each node has been behind it.
    let stop = tokio_util::sync::CancellationToken::new();
    let lag = {
        let (nodes, stop) = (nodes.clone(), stop.clone());
        tokio::spawn(async move {
            let mut targets: BTreeMap<u64, Instant> = BTreeMap::new();
            let mut worst = Duration::ZERO;
            while !stop.is_cancelled() {
                let mut views = Vec::new();
                for n in nodes.iter() {
                    if let Ok(v) = n.cluster_status().await {
                        views.push(v);
                    }
                }
                let now = Instant::now();
                if let Some(commit) = views.iter().map(|v| v.commit_index).max() {
                    targets.entry(commit).or_insert(now);
                }
                let slowest = views.iter().map(|v| v.applied_index).min().unwrap_or(0);
                // Commit points every node has applied are done; the oldest one left is how
                // long the slowest node has been behind.
                targets.retain(|index, _| *index > slowest);
                if let Some((_, since)) = targets.first_key_value() {
                    worst = worst.max(now - *since);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            worst
        })
    };
    tokio::time::sleep_until(first_due.into()).await;
    let writer_key = format!("{prefix}writer");
    let mut put_us: Vec<u32> = Vec::new();
    let mut failed_puts = 0;
    let drain_deadline =
        Instant::now() + Duration::from_millis(ttl_ms) * 2 + Duration::from_secs(120);
    let mut drained_at = None;
    while Instant::now() < drain_deadline {
        for _ in 0..20 {
            let t0 = Instant::now();
            match client.put(&writer_key, "w", None, None).await {
                Ok(_) => put_us.push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32),
                Err(_) => failed_puts += 1,
            }
        }
        if let Ok(list) = client.leases(&prefix, Some(1)).await
            && list.leases.is_empty()
        {
            drained_at = Some(Instant::now());
            break;
        }
    }
    stop.cancel();
    let max_apply_lag = lag.await.unwrap_or_default();
    put_us.sort_unstable();
    Ok(MassExpiryResult {
        leases,
        ttl_ms,
        register_s,
        drain_s: drained_at
            .map(|at| at.saturating_duration_since(first_due).as_secs_f64())
            .unwrap_or(f64::INFINITY),
        term_before,
        term_after: term(&nodes).await,
        max_put_ms: put_us.last().map_or(0.0, |l| *l as f64 / 1000.0),
        p99_put_ms: percentile_ms(&put_us, 0.99),
        puts: put_us.len(),
        failed_puts,
        max_apply_lag_ms: max_apply_lag.as_secs_f64() * 1000.0,
    })
}
