//! Linearizability under faults: concurrent clients read, write and compare-and-set a few keys
//! of a real three-node cluster (separate `leasecore serve` processes on loopback) through both
//! front ends, `/v1` (plain HTTP) and the etcd API (the `etcd-client` crate), while the leader
//! and followers are killed with SIGKILL and restarted, nodes (the leader too) are paused with
//! SIGSTOP/SIGCONT, and a node is restarted with SIGTERM. Every operation's call time, return
//! time and answer is recorded, and afterwards each key's history is checked for
//! linearizability (`common/linearizability.rs`; checking each key alone is sound because
//! linearizability is compositional: the whole store is linearizable iff every key is).
//!
//! The rules that make the check sound:
//! - every written value is unique, so the register model can tell writes apart, and a
//!   compare on a `mod_revision` is a compare on the value that revision holds (a value is
//!   applied once: the test checks that every value is only ever seen at one revision);
//! - each client is bound to one node (followers forward) and has one operation in flight; a
//!   client whose operation got no definite answer (a timeout, a broken connection,
//!   `outcome_unknown`, a `504`, an etcd `Unavailable` other than "no leader") goes on as a new
//!   logical process, and that operation may take effect at any time after its call, or never;
//! - an answer the API documents as "nothing was done" (`503 no_leader`, `no_quorum`,
//!   `shutting_down`; etcd's "no leader"; a refused connection) is left out of the history, so
//!   its value must never be observed;
//! - the recorded interval of an operation contains the real one (the clock is read before the
//!   request is sent and after its answer arrived, on one monotonic clock).
//!
//! Nothing sleeps to let the cluster settle: each step waits for a condition under a deadline.
//! Only a pause is a length of time (it is the fault), and a client backs off briefly after an
//! error so that a node that is down is not hammered. On a violation the test prints the key's
//! operations around it, the fault timeline, and keeps the nodes' logs and data
//! (`LEASECORE_LIN_KEEP=1` keeps them after a passing run too). `LEASECORE_LIN_SEED` repeats a
//! run's choices (faults, keys, operations; not the timing).
// Tests time operations and wait for processes against real deadlines.
#![allow(clippy::disallowed_methods)]

#[path = "common/linearizability.rs"]
mod checker;
#[path = "common/linearizability_tests.rs"]
mod checker_tests;
mod common;
#[path = "common/linearizability_load.rs"]
mod load;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasecore::raft::consensus::ClusterView;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use load::{Got, Rec};

const NODES: usize = 3;
/// Three clients per node.
const CLIENTS: usize = 9;
/// Few keys, so that operations contend.
const KEYS: usize = 5;
/// How long the clients run (the first round of faults runs to its end in any case).
const LOAD: Duration = Duration::from_secs(30);
/// The deadline of every wait on the cluster.
const WAIT: Duration = Duration::from_secs(30);
/// Definite answers required after each fault before the next one.
const PROGRESS: u64 = 30;
/// The checker's step budget per key (a linearizable history takes a few steps per operation).
const BUDGET: u64 = 20_000_000;

// ---------------------------------------------------------------------------------------------
// The node processes.

/// Three `leasecore serve` processes, each with a client, peer and etcd port of its own, their
/// data dirs and logs in one temporary directory (kept, and the logs' tails printed, if the
/// test panics).
struct Nodes {
    dir: Option<tempfile::TempDir>,
    addrs: Vec<String>,
    etcd: Vec<String>,
    procs: Vec<Option<Child>>,
    http: reqwest::Client,
}

impl Nodes {
    fn new() -> Nodes {
        let offsets = [0, 1, leasecore::domain::resources::PEER_PORT_OFFSET];
        // Held together, so that the three nodes' ports differ; released just before spawning.
        let held: Vec<_> = (0..NODES)
            .map(|_| common::free_ports_at(&offsets))
            .collect();
        Nodes {
            dir: Some(tempfile::TempDir::new().unwrap()),
            addrs: held.iter().map(|(b, _)| format!("127.0.0.1:{b}")).collect(),
            etcd: held
                .iter()
                .map(|(b, _)| format!("127.0.0.1:{}", b + 1))
                .collect(),
            procs: (0..NODES).map(|_| None).collect(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(1))
                .build()
                .unwrap(),
        }
    }

    fn root(&self) -> PathBuf {
        self.dir.as_ref().unwrap().path().to_path_buf()
    }

    fn log_path(&self, id: usize) -> PathBuf {
        self.root().join(format!("node-{id}.log"))
    }

    fn url(&self, id: usize) -> String {
        format!("http://{}", self.addrs[id - 1])
    }

    /// Start node `id`; its log is appended to, with a marker line per start.
    fn start(&mut self, id: usize, why: &str) {
        assert!(self.procs[id - 1].is_none(), "node {id} already runs");
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(id))
            .unwrap();
        writeln!(
            log,
            "===== linearizability test: start node {id} ({why}) ====="
        )
        .unwrap();
        let peers: Vec<String> = (1..=NODES)
            .map(|i| format!("{i}={}", self.addrs[i - 1]))
            .collect();
        // A low snapshot threshold, so that a node that was down sometimes catches up by
        // snapshot rather than by log.
        let child = Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .args(["serve", "--id", &id.to_string()])
            .args(["--listen", &self.addrs[id - 1]])
            .args(["--etcd-listen", &self.etcd[id - 1]])
            .arg("--data")
            .arg(self.root().join(format!("node-{id}")))
            .args(["--peers", &peers.join(","), "--snapshot-threshold", "500"])
            .args(["--cache-mb", "16"])
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn the leasecore binary");
        self.procs[id - 1] = Some(child);
    }

    fn signal(&self, id: usize, sig: &str) {
        let pid = self.procs[id - 1].as_ref().expect("node runs").id();
        let status = Command::new("kill")
            .args([sig, &pid.to_string()])
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

    /// SIGTERM, and wait for a clean exit.
    async fn terminate(&mut self, id: usize) {
        self.signal(id, "-TERM");
        let mut child = self.procs[id - 1].take().unwrap();
        let status = common::exited(&mut child, WAIT, "a node to exit after SIGTERM").await;
        assert!(status.success(), "node {id} after SIGTERM: {status}");
    }

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

    /// Every node runs and answers, and all agree on a leader that says it leads.
    async fn healthy(&self) -> Option<usize> {
        let mut views = Vec::new();
        for id in 1..=NODES {
            self.procs[id - 1].as_ref()?;
            views.push(self.view(id).await?);
        }
        let leader = views[0].leader_id?;
        let agreed = views.iter().all(|v| v.leader_id == Some(leader));
        (agreed && views[leader as usize - 1].state == "leader").then_some(leader as usize)
    }

    /// A running node other than `not` that says it leads.
    async fn new_leader(&self, not: usize) -> Option<usize> {
        for id in (1..=NODES).filter(|i| *i != not && self.procs[i - 1].is_some()) {
            if self.view(id).await?.state == "leader" {
                return Some(id);
            }
        }
        None
    }

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
            assert!(
                Instant::now() < deadline,
                "timed out after {WAIT:?} waiting for: {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_healthy(&self) -> usize {
        self.wait("three nodes agreeing on a leader", || self.healthy())
            .await
    }

    fn log_tail(&self, id: usize, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path(id)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for child in self.procs.iter_mut().flatten() {
            // SIGKILL also ends a paused process.
            let _ = child.kill();
            let _ = child.wait();
        }
        let panicking = std::thread::panicking();
        if panicking {
            for id in 1..=NODES {
                eprintln!(
                    "----- node {id} log (last 30 lines) -----\n{}",
                    self.log_tail(id, 30)
                );
            }
        }
        if (panicking || std::env::var_os("LEASECORE_LIN_KEEP").is_some())
            && let Some(dir) = self.dir.take()
        {
            eprintln!(
                "linearizability: node data and logs kept in {}",
                dir.keep().display()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The faults.

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL the leader; wait for another; restart it.
    KillLeader,
    /// SIGKILL a follower; restart it.
    KillFollower,
    /// SIGSTOP a node for this many milliseconds (long enough for the others to elect a new
    /// leader when it led), then SIGCONT.
    Pause(usize, u64),
    /// The same, for the leader: it wakes up believing it still leads.
    PauseLeader(u64),
    /// SIGTERM a node (a clean shutdown), and start it again.
    Restart(usize),
}

fn schedule(rng: &mut StdRng) -> Vec<Fault> {
    let round = |rng: &mut StdRng| {
        let mut r = vec![
            Fault::KillLeader,
            Fault::KillFollower,
            Fault::Pause(rng.random_range(1..=NODES), rng.random_range(1500..=2500)),
            Fault::PauseLeader(rng.random_range(1500..=2500)),
            Fault::Restart(rng.random_range(1..=NODES)),
        ];
        r.shuffle(rng);
        r
    };
    // More than the load time can take; the run stops after the first round once it is over.
    (0..4).flat_map(|_| round(rng)).collect()
}

/// Wait until the clients got `more` definite answers after now.
async fn progress(c: &Nodes, answered: &AtomicU64, more: u64) {
    let target = answered.load(Ordering::Relaxed) + more;
    c.wait("the clients to get answers again", || async {
        (answered.load(Ordering::Relaxed) >= target).then_some(())
    })
    .await;
}

async fn run_fault(c: &mut Nodes, fault: Fault, answered: &AtomicU64) -> String {
    match fault {
        Fault::KillLeader => {
            let old = c.wait_healthy().await;
            c.kill(old);
            let new = c.wait("a new leader", || c.new_leader(old)).await;
            progress(c, answered, PROGRESS).await;
            c.start(old, "after SIGKILL as leader");
            format!("SIGKILL leader {old} (then {new} led), restarted")
        }
        Fault::KillFollower => {
            let leader = c.wait_healthy().await;
            let id = (1..=NODES).find(|i| *i != leader).unwrap();
            c.kill(id);
            progress(c, answered, PROGRESS).await;
            c.start(id, "after SIGKILL as follower");
            format!("SIGKILL follower {id}, restarted")
        }
        Fault::Pause(id, ms) => {
            c.signal(id, "-STOP");
            // The fault itself is a length of time: a stopped process cannot be waited on.
            tokio::time::sleep(Duration::from_millis(ms)).await;
            c.signal(id, "-CONT");
            format!("SIGSTOP node {id} for {ms} ms, SIGCONT")
        }
        Fault::PauseLeader(ms) => {
            let id = c.wait_healthy().await;
            c.signal(id, "-STOP");
            tokio::time::sleep(Duration::from_millis(ms)).await;
            c.signal(id, "-CONT");
            format!("SIGSTOP leader {id} for {ms} ms, SIGCONT")
        }
        Fault::Restart(id) => {
            c.terminate(id).await;
            c.start(id, "after SIGTERM");
            format!("SIGTERM node {id}, restarted")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The test.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_key_is_linearizable_through_both_apis_under_kills_pauses_and_restarts() {
    let seed: u64 = match std::env::var("LEASECORE_LIN_SEED") {
        Ok(s) => s.parse().expect("LEASECORE_LIN_SEED is a number"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let faults = schedule(&mut rng);
    eprintln!("linearizability: seed {seed} (LEASECORE_LIN_SEED={seed})");
    let origin = Instant::now();
    let ms = |t: Instant| t.duration_since(origin).as_secs_f64() * 1e3;

    let mut c = Nodes::new();
    for id in 1..=NODES {
        c.start(id, "initial");
    }
    c.wait_healthy().await;

    let stop = Arc::new(AtomicBool::new(false));
    let records: Arc<Mutex<Vec<Rec>>> = Arc::default();
    let answered = Arc::new(AtomicU64::new(0));
    let processes = Arc::new(AtomicU64::new(CLIENTS as u64));
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let node = i % NODES + 1;
        let w = load::Client::new(load::Setup {
            id: i,
            node,
            keys: KEYS,
            url: c.url(node),
            etcd: format!("http://{}", c.etcd[node - 1]),
            origin,
            seed: seed.wrapping_add(i as u64 + 1),
            records: records.clone(),
            answered: answered.clone(),
            processes: processes.clone(),
        })
        .await;
        clients.push(tokio::spawn(w.run(stop.clone())));
    }
    let load_began = Instant::now();
    progress(&c, &answered, PROGRESS).await;

    let mut timeline: Vec<String> = Vec::new();
    for (i, fault) in faults.into_iter().enumerate() {
        if i >= 5 && load_began.elapsed() >= LOAD {
            break;
        }
        let began = Instant::now();
        let what = run_fault(&mut c, fault, &answered).await;
        let leader = c.wait_healthy().await;
        progress(&c, &answered, PROGRESS).await;
        let line = format!(
            "{:9.1} .. {:9.1} ms  {what}; healthy again, leader {leader}",
            ms(began),
            ms(Instant::now())
        );
        eprintln!("linearizability: fault {}: {line}", i + 1);
        timeline.push(line);
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        tokio::time::timeout(WAIT, client)
            .await
            .expect("a client stops within its operation's timeout")
            .unwrap();
    }
    let load_time = load_began.elapsed();

    let recs = std::mem::take(&mut *records.lock().unwrap());
    let summary = load::summary(&recs);
    eprintln!(
        "linearizability: {} operations in {:.1} s under {} faults\n{summary}",
        recs.len(),
        load_time.as_secs_f64(),
        timeline.len()
    );
    assert!(
        recs.iter()
            .filter(|r| !matches!(r.got, Got::Failed(_) | Got::Unknown(_)))
            .count()
            > 500,
        "too few answered operations for a meaningful check"
    );

    // Each value is seen at one revision only and each revision of a key holds one value: the
    // premise of comparing revisions as values, and a check that no write was applied twice.
    let mut revisions: BTreeMap<(usize, &str), BTreeSet<u64>> = BTreeMap::new();
    let mut values: BTreeMap<(usize, u64), BTreeSet<&str>> = BTreeMap::new();
    for r in &recs {
        if let Some((v, rev)) = &r.revision {
            revisions.entry((r.key, v)).or_default().insert(*rev);
            values.entry((r.key, *rev)).or_default().insert(v);
        }
    }
    let twice: Vec<_> = revisions.iter().filter(|(_, s)| s.len() != 1).collect();
    assert!(
        twice.is_empty(),
        "values seen at more than one revision (seed {seed}): {twice:?}"
    );
    let shared: Vec<_> = values.iter().filter(|(_, s)| s.len() != 1).collect();
    assert!(
        shared.is_empty(),
        "revisions of a key seen with more than one value (seed {seed}): {shared:?}"
    );

    let checked = Instant::now();
    let mut failures = Vec::new();
    for key in 0..KEYS {
        let (ops, index, names) = load::history(&recs, key);
        let mut budget = BUDGET;
        let verdict = checker::check(&ops, &mut budget).unwrap_or_else(|_| {
            panic!(
                "key {key}: the checker gave up after {BUDGET} steps on {} operations \
                 (seed {seed})",
                ops.len()
            )
        });
        eprintln!(
            "linearizability: key lin/k{key}: {} operations ({} unanswered), {} steps: {}",
            ops.len(),
            ops.iter().filter(|o| o.ret.is_none()).count(),
            BUDGET - budget,
            if verdict.is_none() {
                "linearizable"
            } else {
                "NOT LINEARIZABLE"
            }
        );
        if let Some(v) = verdict {
            let who = |i: usize| load::who(&recs[index[i]]);
            let name = |s: checker::State| load::state_name(&names, s);
            let mut text = checker::explain(&ops, &v, &who, &name);
            text.push_str(&load::left_out(&recs, key, &v, &index));
            failures.push(format!("key lin/k{key}:\n{text}"));
        }
    }
    let check_time = checked.elapsed();
    eprintln!(
        "linearizability: checked in {:.3} s; total {:.1} s",
        check_time.as_secs_f64(),
        origin.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "NOT LINEARIZABLE (seed {seed}; times in ms since the test began)\n{}\nfaults:\n{}",
        failures.join("\n"),
        timeline.join("\n")
    );
}
