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
//!   applied once: the test checks that every value is only ever seen at one revision, and
//!   every revision of a key with one value);
//! - each client is bound to one node (followers forward) and has one operation in flight; a
//!   client whose operation got no definite answer (a timeout, a broken connection,
//!   `outcome_unknown`, a `504`, etcd's "request timed out") goes on as a new logical process,
//!   and that operation may take effect at any time after its call, or never;
//! - an answer the API documents as "nothing was done" (`503 no_leader`, `no_quorum`,
//!   `shutting_down`, and the etcd API's `Unavailable` for the same three; a refused
//!   connection) is left out of the history, so its value must never be observed;
//! - the recorded interval of an operation contains the real one (the clock is read before the
//!   request is sent and after its answer arrived, on one monotonic clock).
//!
//! Before each fault every node has caught up with the leader, so that each fault meets a whole
//! cluster. (Without that wait this test found a follower killed while installing the leader's
//! snapshot that could never start again; the last test of this file reproduces it.)
//!
//! Nothing sleeps to let the cluster settle: each step waits for a condition under a deadline.
//! Only a pause is a length of time (it is the fault), and a client backs off briefly after an
//! error so that a node that is down is not hammered. On a violation the test prints the key's
//! operations around it, the fault timeline, and keeps the nodes' logs and data
//! (`LEASECORE_LIN_KEEP=1` keeps them after a passing run too). `LEASECORE_LIN_SEED` repeats a
//! run's choices (faults, keys, operations; not the timing). `LEASECORE_LIN_LOCAL_READS=1`
//! reads from each node's own state instead (`consistency=local`, etcd `serializable`), which
//! is not linearizable: the run should then fail, showing that the test can.
// Tests time operations and wait for processes against real deadlines.
#![allow(clippy::disallowed_methods)]

#[path = "common/linearizability.rs"]
mod checker;
#[path = "common/linearizability_tests.rs"]
mod checker_tests;
#[path = "common/linearizability_load.rs"]
mod load;
#[path = "common/linearizability_nodes.rs"]
mod nodes;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use load::{Got, Rec};
use nodes::{NODES, Nodes, WAIT};

/// Three clients per node.
const CLIENTS: usize = 9;
/// Few keys, so that operations contend.
const KEYS: usize = 5;
/// How long the clients run (the first round of faults runs to its end in any case).
const LOAD: Duration = Duration::from_secs(30);
/// Definite answers required after each fault before the next one.
const PROGRESS: u64 = 30;
/// The checker's step budget per key (a linearizable history takes a few steps per operation).
const BUDGET: u64 = 20_000_000;

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

async fn run_fault(c: &Nodes, fault: Fault, answered: &AtomicU64) -> String {
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

    // A low snapshot threshold, so that a node that was down sometimes catches up by snapshot
    // rather than by log.
    let c = Nodes::new(500);
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
            local_reads: std::env::var_os("LEASECORE_LIN_LOCAL_READS").is_some(),
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
        let what = run_fault(&c, fault, &answered).await;
        let leader = c.wait_healthy().await;
        progress(&c, &answered, PROGRESS).await;
        // Caught up (by log, or by installing the leader's snapshot) before the next fault, so
        // that each fault meets a whole cluster.
        c.wait_caught_up().await;
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

/// Found by the test above (seed 1795754581001446986): a follower restarted (SIGTERM), paused
/// (SIGSTOP 1.6 s) while the others wrote past its log, resumed, and killed with SIGKILL a
/// moment later while it installed the leader's snapshot, never started again: every start
/// panicked in openraft 0.9's state check, `snapshot_last_log_id (index 1610) <= committed
/// (index 1241)`, and exited with code 70.
///
/// Why: an install saves the snapshot file first (synced, renamed into place), then writes the
/// state under an install marker, which is a sled write made durable only with the install's
/// writes. Killed in between, the node found the new snapshot file, no marker, and its old
/// applied mark; openraft takes what is applied as committed and refuses a snapshot past it.
/// Now a node that opens with a snapshot file past its applied mark finishes that install from
/// the file, as it does with a marker (`state_machine::snapshot::cut_before_its_marker`).
///
/// The same sequence on purpose: pause a follower while the leader writes a large state and
/// purges its log past several snapshots, resume it, and kill it the moment its snapshot file
/// is replaced (the install's first step); then start it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_killed_while_installing_a_snapshot_starts_again() {
    let c = Nodes::new(50);
    for id in 1..=NODES {
        c.start(id, "initial");
    }
    let leader = c.wait_healthy().await;
    let follower = (1..=NODES).find(|i| *i != leader).unwrap();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = c.url(leader);
    // One entry putting `keys` keys of `bytes` bytes.
    let txn = |batch: usize, keys: usize, bytes: usize| {
        let puts: Vec<serde_json::Value> = (0..keys)
            .map(|i| {
                let key = format!("snap/{batch}/{i}");
                serde_json::json!({"put": {"key": key, "value": "x".repeat(bytes)}})
            })
            .collect();
        let req = http
            .post(format!("{url}/v1/txn"))
            .json(&serde_json::json!({ "compare": [], "success": puts }));
        async move { req.send().await.is_ok_and(|r| r.status().is_success()) }
    };

    c.signal(follower, "-STOP");
    // A state that takes the install a moment to write (2,000 keys), then entries far past the
    // threshold (a snapshot every 50, 25 kept after it), so that the follower's next entry is
    // purged on the leader, which must send it the snapshot.
    for batch in 0..20 {
        assert!(
            txn(batch, 100, 100).await,
            "txn {batch} through leader {leader}"
        );
    }
    for batch in 20..320 {
        assert!(
            txn(batch, 1, 1).await,
            "txn {batch} through leader {leader}"
        );
    }
    let snapshot = c.data(follower).join("snapshot.bin");
    let before = std::fs::metadata(&snapshot).and_then(|m| m.modified()).ok();
    c.signal(follower, "-CONT");
    c.wait_every(
        "the follower's snapshot file replaced",
        Duration::from_millis(1),
        || async {
            let now = std::fs::metadata(&snapshot).and_then(|m| m.modified()).ok();
            (now.is_some() && now != before).then_some(())
        },
    )
    .await;
    c.kill(follower);

    c.start(follower, "SIGKILLed while installing a snapshot");
    c.wait_healthy().await;
    let target = c
        .view(leader)
        .await
        .expect("the leader answers")
        .commit_index;
    c.wait("the follower to have every write", || async {
        (c.view(follower).await?.applied_index >= target).then_some(())
    })
    .await;
}
