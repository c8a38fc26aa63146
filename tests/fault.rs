//! Fault test (issue 10): three real `leasecore serve` processes on loopback while clients
//! write. A seeded schedule kills nodes (SIGKILL) and restarts them, pauses them (SIGSTOP, then
//! SIGCONT after 1 to 3 s), stops them gracefully (SIGTERM, the leader too) and restarts them,
//! kills the leader, and once kills a follower, wipes its data dir and replaces it the
//! documented way (it must first refuse to start as the member it was).
//!
//! Afterwards, once every node applied the same index:
//! - every acknowledged write is on every node (`consistency=local`), with the acknowledged value
//!   and `mod_revision` (no key is written twice, so the revision must match exactly);
//! - no key was applied twice (each is put once: a second application means the client resent a
//!   put after an answer that promised nothing was done);
//! - no write that failed definitely (a retryable 503, or no node reachable) is anywhere: the API
//!   promises that such a write did nothing;
//! - the three nodes' listings are identical.
//!
//! Writes whose outcome is unknown (`outcome_unknown`, `timeout`, a broken connection) may or may
//! not be present; they are only counted.
//!
//! A second test pins, deterministically and in-process, the bug the first one found: a leader
//! that shut down with a write in its log answered `503 shutting_down` (a promise that nothing
//! was done, so the client resent it) although the write may still commit.
//!
//! A third test holds both followers' syncs back (strace's fault injection, 150 ms each, longer
//! than the leader's append timeout): writes must keep committing and be on every node.
//!
//! Reproduce a run with `LEASECORE_FAULT_SEED=<seed>` (the seed is printed first). When a check
//! fails the nodes' logs and data dirs are kept and their path printed, with the tail of each
//! log; `LEASECORE_FAULT_KEEP=1` keeps them after a passing run too.
// Tests wait for processes against real deadlines, and a fault needs a real pause.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasecore::client::{Client, ClientError};
use leasecore::raft::consensus::ClusterView;
use leasecore::wire::{KeyValue, ListResponse};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const NODES: usize = 3;
const WRITERS: usize = 3;
/// Faults in one run, the wipe-and-replace included.
const FAULTS: usize = 12;
/// Acknowledged writes required after each fault: the cluster took writes again, so every fault
/// lands on a log that moved (and usually on a node still catching up).
const PROGRESS: u64 = 40;
/// Acknowledged writes while a node is down: enough for a snapshot and a purge (threshold 200
/// entries) to happen without it now and then, so that it catches up by snapshot.
const DOWN: u64 = 120;
/// The deadline of every wait for the cluster (an election, a restart, a catch-up).
const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// The node processes.

/// Three `leasecore serve` processes on ports the OS handed out, with their data dirs and logs
/// in one temporary directory (kept, and the logs' tails printed, if the test panics).
struct Cluster {
    dir: Option<tempfile::TempDir>,
    addrs: Vec<String>,
    procs: Vec<Option<Child>>,
    /// Started with `--join` (a replacement): restarts keep the flag.
    joined: Vec<bool>,
    http: reqwest::Client,
}

impl Cluster {
    fn new() -> Cluster {
        let addrs = common::free_node_addrs(NODES);
        Cluster {
            dir: Some(tempfile::TempDir::new().unwrap()),
            addrs,
            procs: (0..NODES).map(|_| None).collect(),
            joined: vec![false; NODES],
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        }
    }

    fn root(&self) -> PathBuf {
        self.dir.as_ref().unwrap().path().to_path_buf()
    }

    fn data(&self, id: usize) -> PathBuf {
        self.root().join(format!("node-{id}"))
    }

    fn log_path(&self, id: usize) -> PathBuf {
        self.root().join(format!("node-{id}.log"))
    }

    fn url(&self, id: usize) -> String {
        format!("http://{}", self.addrs[id - 1])
    }

    fn peers(&self) -> String {
        let list: Vec<String> = (1..=NODES)
            .map(|id| format!("{id}={}", self.addrs[id - 1]))
            .collect();
        list.join(",")
    }

    /// Start node `id` with the flags it was configured with (plus `--join` once replaced).
    /// Its log is appended to, with a marker line per start.
    fn spawn(&self, id: usize, why: &str) -> Child {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(id))
            .unwrap();
        writeln!(log, "===== fault test: start node {id} ({why}) =====").unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasecore"));
        cmd.args(["serve", "--id", &id.to_string()])
            .args(["--listen", &self.addrs[id - 1]])
            .arg("--data")
            .arg(self.data(id))
            .args(["--peers", &self.peers(), "--snapshot-threshold", "200"])
            .args(["--cache-mb", "16"])
            .env("NO_COLOR", "1");
        if self.joined[id - 1] {
            cmd.arg("--join");
        }
        // The node logs (tracing) and reports refusals on stderr; both go to its log.
        cmd.stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn the leasecore binary")
    }

    fn start(&mut self, id: usize, why: &str) {
        assert!(self.procs[id - 1].is_none(), "node {id} already runs");
        self.procs[id - 1] = Some(self.spawn(id, why));
    }

    fn pid(&self, id: usize) -> String {
        self.procs[id - 1]
            .as_ref()
            .expect("node runs")
            .id()
            .to_string()
    }

    fn signal(&self, id: usize, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid(id)])
            .status()
            .unwrap();
        assert!(status.success(), "kill {sig} node {id}");
    }

    /// SIGKILL, and reap it.
    fn kill(&mut self, id: usize) {
        let mut child = self.procs[id - 1].take().expect("node runs");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM: the node must shut down cleanly (exit 0) in time.
    async fn terminate(&mut self, id: usize) {
        self.signal(id, "-TERM");
        let mut child = self.procs[id - 1].take().unwrap();
        let status = wait_exit(&mut child, WAIT).await;
        assert!(
            status.is_some_and(|s| s.success()),
            "node {id} after SIGTERM: {status:?}"
        );
    }

    /// This node's own view, if it answers within 2 s.
    async fn view(&self, id: usize) -> Option<ClusterView> {
        let resp = self
            .http
            .get(format!("{}/v1/cluster", self.url(id)))
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.json().await.ok()
    }

    /// Every node runs and answers; they agree on a leader that says it leads, and all three
    /// are voters in every view. Returns the leader.
    async fn healthy(&self) -> Option<usize> {
        let mut views = Vec::new();
        for id in 1..=NODES {
            self.procs[id - 1].as_ref()?;
            views.push(self.view(id).await?);
        }
        let leader = views[0].leader_id?;
        let agreed = views.iter().all(|v| {
            v.leader_id == Some(leader) && v.nodes.iter().filter(|n| n.voter).count() == NODES
        });
        (agreed && views[leader as usize - 1].state == "leader").then_some(leader as usize)
    }

    async fn wait_healthy(&self, what: &str) -> usize {
        self.wait(what, || self.healthy()).await
    }

    /// Poll `check` until it returns `Some`, or fail (with the logs) at the deadline.
    async fn wait<T, F, Fut>(&self, what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            if Instant::now() >= deadline {
                panic!("timed out after {WAIT:?} waiting for: {what}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A client of the given nodes (1 s backoffs at most; each attempt bounded).
    fn client(&self, ids: &[usize]) -> Client {
        let eps: Vec<String> = ids.iter().map(|i| self.url(*i)).collect();
        Client::with_timeout(&eps, Duration::from_secs(5)).unwrap()
    }

    /// Every key under `w` on node `id`, from its applied state.
    async fn listing(&self, id: usize) -> Option<ListResponse> {
        let url = format!(
            "{}/v1/kv?prefix=w&limit=100000&consistency=local",
            self.url(id)
        );
        let resp = self.http.get(url).send().await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let list: ListResponse = resp.json().await.ok()?;
        assert!(!list.more, "node {id}: the listing was cut short");
        Some(list)
    }

    fn log_tail(&self, id: usize, lines: usize) -> String {
        common::processes::tail_of(&self.log_path(id), lines)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        common::processes::kill_all(&mut self.procs);
        let panicking = std::thread::panicking();
        if panicking {
            for id in 1..=NODES {
                eprintln!(
                    "----- node {id} log (last 40 lines) -----\n{}",
                    self.log_tail(id, 40)
                );
            }
        }
        let keep = panicking || std::env::var_os("LEASECORE_FAULT_KEEP").is_some();
        if keep && let Some(dir) = self.dir.take() {
            eprintln!(
                "fault test: node data and logs kept in {}",
                dir.keep().display()
            );
        }
    }
}

async fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

// ---------------------------------------------------------------------------------------------
// The writers.

/// What happened to one put.
#[derive(Clone, Debug)]
enum Outcome {
    /// Acknowledged at this revision.
    Acked(u64),
    /// It may or may not have been applied.
    Unknown(String),
    /// It certainly was not applied (the API's promise for a retryable 503 or no answer at
    /// all).
    Failed(String),
}

fn classify(e: &ClientError) -> Outcome {
    match e {
        // Every attempt certainly did nothing (connection refused, or a retryable 503): the
        // client gives up with `Unavailable` only then, and returns at once otherwise.
        ClientError::Unavailable(m) => Outcome::Failed(format!("unavailable: {m}")),
        ClientError::Api {
            status: 503, code, ..
        } if matches!(code.as_str(), "no_leader" | "no_quorum" | "shutting_down") => {
            Outcome::Failed(code.clone())
        }
        ClientError::Api { status, code, .. } => Outcome::Unknown(format!("{status} {code}")),
        ClientError::Uncertain(_) => Outcome::Unknown("no answer".into()),
        ClientError::Usage(m) => panic!("usage error: {m}"),
    }
}

/// Every put of every writer: key -> (value, outcome).
type Record = Arc<Mutex<BTreeMap<String, (String, Outcome)>>>;

/// Put `w{t}/{n}` for n = 0, 1, ... (each key once) through every endpoint with failover,
/// until `stop`.
async fn writer(
    t: usize,
    endpoints: Vec<String>,
    run: u64,
    stop: Arc<AtomicBool>,
    record: Record,
    acked: Arc<AtomicU64>,
) {
    // A short per-attempt deadline: a paused node costs a writer at most this per call.
    let client = Client::with_timeout(&endpoints, Duration::from_secs(3)).unwrap();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let key = format!("w{t}/{n:06}");
        let value = format!("{run:x}-{t}-{n}");
        let outcome = match client.put(&key, &value, None, None).await {
            Ok(r) => {
                acked.fetch_add(1, Ordering::Relaxed);
                Outcome::Acked(r.revision.0)
            }
            Err(e) => classify(&e),
        };
        record.lock().unwrap().insert(key, (value, outcome));
        n += 1;
        // Pace the load: the 2-core machine also runs the three nodes and their snapshots.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The schedule.

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL a node; writes go on with two; restart it.
    Kill(usize),
    /// SIGSTOP a node for this many milliseconds, then SIGCONT.
    Pause(usize, u64),
    /// SIGKILL the current leader; a new one takes over; restart it.
    KillLeader,
    /// SIGTERM a node (a clean shutdown); restart it.
    Terminate(usize),
    /// SIGTERM the current leader while writes are in flight; restart it.
    TerminateLeader,
    /// SIGKILL a follower, wipe its data dir, check it refuses to start as the member it was,
    /// then replace it: `cluster remove`, start with `--join`, `cluster add`.
    Replace,
}

fn schedule(rng: &mut StdRng) -> Vec<Fault> {
    let node = |rng: &mut StdRng| rng.random_range(1..=NODES);
    let mut faults = vec![
        Fault::Kill(node(rng)),
        Fault::Pause(node(rng), rng.random_range(1000..=3000)),
        Fault::KillLeader,
        Fault::Terminate(node(rng)),
        Fault::TerminateLeader,
    ];
    while faults.len() < FAULTS - 1 {
        let f = match rng.random_range(0..5) {
            0 => Fault::Kill(node(rng)),
            1 => Fault::Pause(node(rng), rng.random_range(1000..=3000)),
            2 => Fault::KillLeader,
            3 => Fault::TerminateLeader,
            _ => Fault::Terminate(node(rng)),
        };
        faults.push(f);
    }
    faults.shuffle(rng);
    let at = rng.random_range(1..faults.len());
    faults.insert(at, Fault::Replace);
    faults
}

/// Wait until `more` writes were acknowledged after now.
async fn progress(c: &Cluster, acked: &AtomicU64, more: u64, what: &str) {
    let target = acked.load(Ordering::Relaxed) + more;
    c.wait(what, || async {
        (acked.load(Ordering::Relaxed) >= target).then_some(())
    })
    .await;
}

async fn run_fault(c: &mut Cluster, fault: Fault, acked: &AtomicU64) {
    match fault {
        Fault::Kill(id) => {
            c.kill(id);
            progress(c, acked, DOWN, "writes with a node killed").await;
            c.start(id, "after SIGKILL");
        }
        Fault::Pause(id, ms) => {
            c.signal(id, "-STOP");
            // The fault itself is a length of time: a stopped process cannot be waited on.
            tokio::time::sleep(Duration::from_millis(ms)).await;
            c.signal(id, "-CONT");
        }
        Fault::KillLeader => {
            let old = c.wait_healthy("a leader to kill").await;
            c.kill(old);
            let others: Vec<usize> = (1..=NODES).filter(|i| *i != old).collect();
            c.wait("a new leader", || async {
                for id in &others {
                    let v = c.view(*id).await?;
                    if v.state == "leader" {
                        return Some(());
                    }
                }
                None
            })
            .await;
            progress(c, acked, DOWN, "writes under the new leader").await;
            c.start(old, "after SIGKILL as leader");
        }
        Fault::Terminate(id) => {
            c.terminate(id).await;
            progress(c, acked, DOWN, "writes with a node stopped").await;
            c.start(id, "after SIGTERM");
        }
        Fault::TerminateLeader => {
            let old = c.wait_healthy("a leader to stop").await;
            c.terminate(old).await;
            progress(c, acked, DOWN, "writes with the leader stopped").await;
            c.start(old, "after SIGTERM as leader");
        }
        Fault::Replace => replace(c, acked).await,
    }
}

/// Kill a follower, wipe it, and start it again with the same flags: the cluster replaces it
/// (README.md: removed before it answers anything, added back as a learner, promoted once
/// caught up), under the same load and faults as the rest. (The manual procedure and the
/// refusal with `--no-auto-replace` are tests/wiped_node.rs's.)
async fn replace(c: &mut Cluster, acked: &AtomicU64) {
    let leader = c.wait_healthy("a leader before the replacement").await;
    let id = (1..=NODES).find(|i| *i != leader).unwrap();
    c.kill(id);
    std::fs::remove_dir_all(c.data(id)).unwrap();
    progress(c, acked, DOWN, "writes with a node wiped").await;

    c.start(id, "wiped, same flags: replaced by the cluster");
    c.wait("the wiped node a voter again", || async {
        let leader = c.wait_healthy("a leader during the replacement").await;
        let v = c.view(leader).await?;
        v.nodes
            .iter()
            .any(|n| n.id == id as u64 && n.voter)
            .then_some(())
    })
    .await;
    let leader = c.wait_healthy("three voters after the replacement").await;
    // Caught up (by snapshot: the log was compacted long ago) to what the leader had committed.
    let commit = c.view(leader).await.map_or(0, |v| v.commit_index);
    c.wait("the replacement caught up", || async {
        (c.view(id).await?.applied_index >= commit).then_some(())
    })
    .await;
    eprintln!("fault test: node {id} replaced (caught up to index {commit})");
}

// ---------------------------------------------------------------------------------------------
// The test.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acknowledged_writes_survive_kills_pauses_restarts_and_a_replacement() {
    let seed: u64 = match std::env::var("LEASECORE_FAULT_SEED") {
        Ok(s) => s.parse().expect("LEASECORE_FAULT_SEED is a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let faults = schedule(&mut rng);
    eprintln!("fault test: seed {seed} (LEASECORE_FAULT_SEED={seed}); schedule {faults:?}");
    let began = Instant::now();

    let mut c = Cluster::new();
    for id in 1..=NODES {
        c.start(id, "initial");
    }
    c.wait_healthy("a leader").await;

    let stop = Arc::new(AtomicBool::new(false));
    let record: Record = Arc::default();
    let acked = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            // Each writer starts on a different node and fails over from there.
            let endpoints = (0..NODES).map(|i| c.url((t + i) % NODES + 1)).collect();
            tokio::spawn(writer(
                t,
                endpoints,
                seed,
                stop.clone(),
                record.clone(),
                acked.clone(),
            ))
        })
        .collect();
    progress(&c, &acked, PROGRESS, "the first writes").await;

    for (i, fault) in faults.iter().enumerate() {
        let at = began.elapsed().as_secs_f64();
        eprintln!(
            "fault test: [{at:6.1} s] fault {}/{FAULTS}: {fault:?}",
            i + 1
        );
        run_fault(&mut c, *fault, &acked).await;
        c.wait_healthy("the cluster back to three nodes and a leader")
            .await;
        progress(&c, &acked, PROGRESS, "writes after the fault").await;
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let faults_done = began.elapsed();

    // Every node applied the same index (nothing writes any more).
    let (index, revision) = c
        .wait("every node at the same applied index", || async {
            let mut seen = BTreeSet::new();
            for id in 1..=NODES {
                let v = c.view(id).await?;
                seen.insert((v.applied_index, v.revision.0, v.commit_index));
            }
            let (a, r, commit) = *seen.iter().next()?;
            (seen.len() == 1 && a == commit).then_some((a, r))
        })
        .await;

    let record = std::mem::take(&mut *record.lock().unwrap());
    let (mut n_acked, mut n_unknown, mut n_failed) = (0, 0, 0);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for (_, outcome) in record.values() {
        match outcome {
            Outcome::Acked(_) => n_acked += 1,
            Outcome::Unknown(why) => {
                n_unknown += 1;
                *reasons.entry(format!("unknown: {why}")).or_default() += 1;
            }
            Outcome::Failed(why) => {
                n_failed += 1;
                let why = if why.starts_with("unavailable") {
                    "unavailable"
                } else {
                    why
                };
                *reasons.entry(format!("failed: {why}")).or_default() += 1;
            }
        }
    }

    // The three listings are identical.
    let mut listings: Vec<BTreeMap<String, KeyValue>> = Vec::new();
    for id in 1..=NODES {
        let list = c
            .listing(id)
            .await
            .unwrap_or_else(|| panic!("node {id} lists its keys"));
        assert_eq!(list.revision.0, revision, "node {id}: store revision");
        listings.push(
            list.items
                .into_iter()
                .map(|kv| (kv.key.clone(), kv))
                .collect(),
        );
    }
    for id in 2..=NODES {
        if listings[id - 1] != listings[0] {
            let (a, b) = (&listings[0], &listings[id - 1]);
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            let diff: Vec<_> = keys
                .into_iter()
                .filter(|k| a.get(*k) != b.get(*k))
                .take(5)
                .map(|k| (k, a.get(k), b.get(k)))
                .collect();
            panic!("node 1 and node {id} differ (seed {seed}), first: {diff:#?}");
        }
    }

    // Every acknowledged write, read from each node's own state; no failed write anywhere.
    let checks = record
        .iter()
        .filter(|(_, (_, o))| matches!(o, Outcome::Acked(_)))
        .flat_map(|(k, (v, o))| (1..=NODES).map(move |id| (id, k, v, o)));
    let readers: Vec<Client> = (1..=NODES).map(|id| c.client(&[id])).collect();
    let missing: Vec<String> = futures::stream::iter(checks)
        .map(|(id, key, value, outcome)| {
            let reader = &readers[id - 1];
            async move {
                let Outcome::Acked(rev) = outcome else {
                    unreachable!()
                };
                match reader.get(key, true).await {
                    Ok(Some(got)) if got.kv.value == *value && got.kv.mod_revision.0 == *rev => {
                        None
                    }
                    Ok(got) => Some(format!(
                        "node {id}: {key} acknowledged as {value:?} at revision {rev}, holds {:?}",
                        got.map(|g| (g.kv.value, g.kv.mod_revision.0))
                    )),
                    Err(e) => Some(format!("node {id}: {key}: read failed: {e}")),
                }
            }
        })
        .buffer_unordered(32)
        .filter_map(|m| async move { m })
        .collect()
        .await;
    let failed_present: Vec<String> = record
        .iter()
        .filter(|(_, (_, o))| matches!(o, Outcome::Failed(_)))
        .filter_map(|(k, (_, o))| {
            listings[0]
                .get(k)
                .map(|kv| format!("{k} ({o:?}) is present at revision {}", kv.mod_revision.0))
        })
        .collect();
    let unknown_present = record
        .iter()
        .filter(|(k, (_, o))| matches!(o, Outcome::Unknown(_)) && listings[0].contains_key(*k))
        .count();
    // Each key is put once: a second application can only come from the client resending a put
    // after an error that promised nothing was done (a retryable 503).
    let twice: Vec<String> = listings[0]
        .values()
        .filter(|kv| kv.version != 1)
        .map(|kv| {
            format!(
                "{} version {} (created at {}, modified at {}), recorded {:?}",
                kv.key,
                kv.version,
                kv.create_revision.0,
                kv.mod_revision.0,
                record.get(&kv.key)
            )
        })
        .collect();
    let stray: Vec<&String> = listings[0]
        .keys()
        .filter(|k| !record.contains_key(*k))
        .collect();

    eprintln!(
        "fault test: seed {seed}: {FAULTS} faults in {:.1} s; writes: {} acknowledged, {} \
         unknown ({} of them applied), {} failed; every node at index {index}, revision \
         {revision}, {} keys; total {:.1} s",
        faults_done.as_secs_f64(),
        n_acked,
        n_unknown,
        unknown_present,
        n_failed,
        listings[0].len(),
        began.elapsed().as_secs_f64()
    );
    eprintln!("fault test: error outcomes {reasons:?}");
    assert!(n_acked > 0, "no write was acknowledged");
    assert!(stray.is_empty(), "keys nobody wrote: {stray:?}");
    assert!(
        missing.is_empty(),
        "{} acknowledged writes missing or different (seed {seed}), first: {:#?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    assert!(
        twice.is_empty(),
        "{} keys were applied twice (seed {seed}), first: {:#?}",
        twice.len(),
        &twice[..twice.len().min(10)]
    );
    assert!(
        failed_present.is_empty(),
        "{} writes that failed with a 'nothing was done' error were applied (seed {seed}), \
         first: {:#?}",
        failed_present.len(),
        &failed_present[..failed_present.len().min(10)]
    );
}

/// A write the leader accepted into its log, answered while the leader shuts down: the outcome
/// is unknown (the entry may still commit), so the answer must not be a retryable 503 that
/// promises nothing was done. Here the entry does commit: the restarted leader holds the only
/// up-to-date log, wins the election and commits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_in_flight_when_the_leader_shuts_down_is_never_answered_as_not_done() {
    use common::{TestCluster, eventually};

    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    c.client().put("before", "x", None, None).await.unwrap();
    let others: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    let (follower, stopped) = (others[0], others[1]);
    // One follower down, the other cut off: the leader appends but cannot commit, and the
    // follower cannot elect anyone (a quorum needs the leader's vote).
    eventually(
        Duration::from_secs(20),
        "the follower has 'before'",
        || async { c.client_of(follower).get("before", true).await.ok()? },
    )
    .await;
    c.stop(stopped).await;
    c.partition(leader);
    let last = c.nodes[&leader].consensus().cluster_view().last_log_index;

    let url = format!("{}/v1/kv/in-flight", c.url(leader));
    let put = tokio::spawn(async move {
        let resp = reqwest::Client::new()
            .put(url)
            .json(&serde_json::json!({ "value": "v" }))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body: serde_json::Value = resp.json().await.unwrap();
        (
            status,
            body["error"]["code"].as_str().unwrap_or("").to_string(),
        )
    });
    let node = &c.nodes[&leader];
    eventually(
        Duration::from_secs(20),
        "the write in the leader's log",
        || async { (node.consensus().cluster_view().last_log_index > last).then_some(()) },
    )
    .await;
    c.stop(leader).await;
    let (status, code) = put.await.unwrap();

    // The leader comes back with the write in its log; only it can win (its log is longer).
    c.heal();
    // The stopped node's last tasks may hold the data dir's lock for a moment.
    let restarted = eventually(Duration::from_secs(20), "the leader restarted", || async {
        leasecore::node::Node::start(c.config(leader, false))
            .await
            .ok()
    })
    .await;
    c.nodes.insert(leader, restarted);
    let got = eventually(Duration::from_secs(30), "a leader and the key", || async {
        c.client_of(follower).get("in-flight", false).await.ok()?
    })
    .await;
    assert_eq!(got.kv.value, "v", "the write in flight was committed");
    assert!(
        !(status == 503 && matches!(code.as_str(), "shutting_down" | "no_leader" | "no_quorum")),
        "the write was applied, but its answer ({status} {code}) said nothing was done"
    );
    assert_eq!((status, code.as_str()), (503, "outcome_unknown"));
    c.shutdown().await;
}

/// Both followers' disks sync slower than openraft 0.9's append timeout (its heartbeat
/// interval, 100 ms here): every `fdatasync` they make is held 150 ms by strace's fault
/// injection, so every append to them times out on the leader before its answer comes. The
/// retry finds the entries already there and is answered: writes keep committing, slowly, and
/// every acknowledged one is on every node afterwards. Skipped, with a message, where strace
/// is missing or may not trace (no ptrace permission).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_commit_while_the_followers_disks_sync_slower_than_the_append_timeout() {
    let mut c = Cluster::new();
    for id in 1..=NODES {
        c.start(id, "slow follower disks");
    }
    let leader = c.wait_healthy("a healthy cluster").await;
    let term_before = c.view(leader).await.expect("the leader answers").term;

    let Some(tracers) = hold_followers_syncs(&c, leader, 150_000).await else {
        return;
    };

    // Four writers, each putting its own keys one after another: the acknowledged ones must
    // all be there afterwards, on every node.
    const EACH: usize = 8;
    let writers = (0..4).map(|w| {
        let client = c.client(&[1, 2, 3]);
        async move {
            let mut acked = Vec::new();
            for i in 0..EACH {
                let key = format!("w/slow-{w}-{i}");
                for attempt in 1.. {
                    match client.put(&key, "v", None, None).await {
                        Ok(put) => {
                            acked.push((key.clone(), put.revision.0));
                            break;
                        }
                        // Nothing was done: the same put again is the same write.
                        Err(e)
                            if e.status() == Some(503) && e.code() != Some("outcome_unknown") =>
                        {
                            assert!(
                                attempt < 20,
                                "{key}: still refused after {attempt} tries: {e}"
                            );
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        Err(e) => panic!("{key}: {e}"),
                    }
                }
            }
            acked
        }
    });
    let acked: Vec<(String, u64)> = futures::future::join_all(writers)
        .await
        .into_iter()
        .flatten()
        .collect();
    release_syncs(tracers);
    assert_eq!(acked.len(), 4 * EACH);
    let term_after = c.view(leader).await.map(|v| v.term);
    eprintln!("term before the slow syncs {term_before}, after {term_after:?}");

    for id in 1..=NODES {
        let listing = c
            .wait(
                &format!("node {id} holds every acknowledged write"),
                || async {
                    let list = c.listing(id).await?;
                    let have: BTreeMap<String, u64> = list
                        .items
                        .iter()
                        .map(|kv| (kv.key.clone(), kv.mod_revision.0))
                        .collect();
                    acked
                        .iter()
                        .all(|(k, rev)| have.get(k) == Some(rev))
                        .then_some(have)
                },
            )
            .await;
        assert!(listing.len() >= acked.len());
    }
}

/// Linearizable reads on the leader are answered while both followers' disks sync slower than
/// a heartbeat. openraft 0.9 confirms leadership for a read with heartbeats that time out
/// after one heartbeat interval (100 ms here); a follower busy syncing an append answers
/// later, so the confirmation fails with "quorum not enough" on a healthy cluster, and the
/// read failed with `no leader` (seen under mixed load at 2,000 requests a second, on the
/// leader and on followers alike). The round is tried again while this node leads, as long as
/// it could still hold a quorum (an election timeout): the reads now wait for the syncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn linearizable_reads_wait_out_followers_slower_than_a_heartbeat() {
    let mut c = Cluster::new();
    for id in 1..=NODES {
        c.start(id, "reads beside slow follower disks");
    }
    let leader = c.wait_healthy("a healthy cluster").await;
    let base = c.url(leader);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let put = {
        let (http, base) = (http.clone(), base.clone());
        move |key: String| {
            let (http, base) = (http.clone(), base.clone());
            async move {
                http.put(format!("{base}/v1/kv/{key}"))
                    .json(&serde_json::json!({ "value": "v" }))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            }
        }
    };
    assert_eq!(put("w/probe".into()).await.unwrap(), 200);

    let Some(tracers) = hold_followers_syncs(&c, leader, 150_000).await else {
        return;
    };
    // One writer keeps the followers syncing; linearizable reads on the leader meanwhile.
    let writer = tokio::spawn({
        let put = put.clone();
        async move {
            for i in 0..6 {
                let _ = put(format!("w/busy-{i}")).await;
            }
        }
    });
    let (mut reads, mut failed) = (0, Vec::new());
    while !writer.is_finished() {
        reads += 1;
        let got = http
            .get(format!("{base}/v1/kv/w/probe"))
            .send()
            .await
            .expect("the leader answers");
        let status = got.status();
        if status != 200 {
            failed.push(format!(
                "{status}: {}",
                got.text().await.unwrap_or_default()
            ));
        }
    }
    release_syncs(tracers);
    assert!(reads > 0);
    assert!(
        failed.is_empty(),
        "{} of {reads} linearizable reads on a healthy cluster's leader failed: {failed:?}",
        failed.len()
    );
}

/// [`hold_syncs`] on every node but `leader`; `None` (and a SKIPPED line) where strace cannot.
async fn hold_followers_syncs(c: &Cluster, leader: usize, delay_us: u64) -> Option<Vec<Child>> {
    let mut tracers = Vec::new();
    for id in (1..=NODES).filter(|i| *i != leader) {
        match hold_syncs(c, id, delay_us).await {
            Ok(tracer) => tracers.push(tracer),
            Err(why) => {
                release_syncs(tracers);
                eprintln!("SKIPPED: {why}");
                return None;
            }
        }
    }
    Some(tracers)
}

/// Hold every `fdatasync` of node `id` back by `delay_us` with strace's fault injection (a slow
/// disk), once strace says it holds the process. `Err` says why it cannot (strace missing, no
/// ptrace permission): the caller skips.
async fn hold_syncs(c: &Cluster, id: usize, delay_us: u64) -> Result<Child, String> {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    if Command::new("strace").arg("-V").output().is_err() {
        return Err("strace is not installed (apt-get install strace)".into());
    }
    let mut tracer = Command::new("strace")
        .args(["-f", "-e", "trace=fdatasync"])
        .args(["-e", &format!("inject=fdatasync:delay_exit={delay_us}")])
        .args(["-o", "/dev/null", "-p", &c.pid(id)])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn strace");
    let stderr = tracer.stderr.take().unwrap();
    let said = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(stderr).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        // Keep draining, so that strace never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        first
    });
    let first = tokio::time::timeout(WAIT, said)
        .await
        .expect("strace says something")
        .unwrap();
    if !first.contains("attached") {
        release_syncs(vec![tracer]);
        return Err(format!("strace cannot trace here: {first}"));
    }
    Ok(tracer)
}

/// Stop the tracers: on SIGTERM strace detaches, and the node syncs at full speed again.
fn release_syncs(tracers: Vec<Child>) {
    for mut t in tracers {
        let _ = Command::new("kill")
            .args(["-TERM", &t.id().to_string()])
            .status();
        let _ = t.wait();
    }
}

/// A write answered through a follower is in that follower's applied state when the answer
/// comes, as etcd's are (it waits for its own apply): a `consistency=local` read there, or
/// anything the node decides from its state (an etcd auth check after `auth disable`), sees
/// it. The follower's syncs are held back 200 ms each, so that its apply lags the quorum's
/// commit (the leader and the other follower) by that much: without the wait, the read after
/// the put found the key missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_answered_through_a_follower_is_applied_there() {
    let mut c = Cluster::new();
    for id in 1..=NODES {
        c.start(id, "read your writes on a follower");
    }
    let leader = c.wait_healthy("a healthy cluster").await;
    let follower = (1..=NODES).find(|i| *i != leader).unwrap();
    let tracer = match hold_syncs(&c, follower, 200_000).await {
        Ok(tracer) => tracer,
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let base = c.url(follower);
    let mut stale = Vec::new();
    for i in 0..5 {
        let key = format!("w/ryw-{i}");
        let put = http
            .put(format!("{base}/v1/kv/{key}"))
            .json(&serde_json::json!({ "value": format!("v{i}") }))
            .send()
            .await
            .expect("the follower answers the put");
        assert_eq!(put.status(), 200, "put {key}: {:?}", put.text().await);
        let got = http
            .get(format!("{base}/v1/kv/{key}?consistency=local"))
            .send()
            .await
            .expect("the follower answers the read");
        if got.status() != 200 {
            stale.push(format!("{key}: {}", got.status()));
        }
    }
    release_syncs(vec![tracer]);
    assert!(
        stale.is_empty(),
        "node {follower} answered writes it had not applied yet; its own reads then missed: {stale:?}"
    );
}
