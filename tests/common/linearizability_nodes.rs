//! Three `leasecore serve` processes on loopback for `tests/linearizability.rs`: each with a
//! client, peer and etcd port of its own, their data dirs and logs in one temporary directory,
//! started, signalled (SIGKILL, SIGSTOP/SIGCONT, SIGTERM) and restarted on the same ports.
//!
//! Every wait polls a condition under a deadline. A node that exits without the test asking
//! (a crash, a refusal to start) fails the wait at once, naming the node and its exit status.
//! If the test panics the processes are killed, the logs' tails printed and the directory kept;
//! `LEASECORE_LIN_KEEP=1` keeps it after a passing run too. This file must not judge results.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use leasecore::raft::consensus::ClusterView;

pub const NODES: usize = 3;
/// The deadline of every wait on the cluster.
pub const WAIT: Duration = Duration::from_secs(30);

pub struct Nodes {
    dir: Option<tempfile::TempDir>,
    pub addrs: Vec<String>,
    pub etcd: Vec<String>,
    /// Behind a lock so that the waits (which borrow the cluster) can notice an exit.
    procs: Mutex<Vec<Option<Child>>>,
    snapshot_threshold: u64,
    http: reqwest::Client,
}

impl Nodes {
    /// Three nodes (not started) that take a snapshot every `snapshot_threshold` entries.
    pub fn new(snapshot_threshold: u64) -> Nodes {
        let offsets = [0, 1, leasecore::domain::resources::PEER_PORT_OFFSET];
        // Held together, so that the three nodes' ports differ; released just before spawning.
        let held: Vec<_> = (0..NODES)
            .map(|_| crate::common::free_ports_at(&offsets))
            .collect();
        Nodes {
            dir: Some(tempfile::TempDir::new().unwrap()),
            addrs: held.iter().map(|(b, _)| format!("127.0.0.1:{b}")).collect(),
            etcd: held
                .iter()
                .map(|(b, _)| format!("127.0.0.1:{}", b + 1))
                .collect(),
            procs: Mutex::new((0..NODES).map(|_| None).collect()),
            snapshot_threshold,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(1))
                .build()
                .unwrap(),
        }
    }

    fn root(&self) -> PathBuf {
        self.dir.as_ref().unwrap().path().to_path_buf()
    }

    /// Node `id`'s data directory.
    pub fn data(&self, id: usize) -> PathBuf {
        self.root().join(format!("node-{id}"))
    }

    fn log_path(&self, id: usize) -> PathBuf {
        self.root().join(format!("node-{id}.log"))
    }

    pub fn url(&self, id: usize) -> String {
        format!("http://{}", self.addrs[id - 1])
    }

    fn running(&self, id: usize) -> bool {
        self.procs.lock().unwrap()[id - 1].is_some()
    }

    /// Start node `id`; its log is appended to, with a marker line per start.
    pub fn start(&self, id: usize, why: &str) {
        assert!(!self.running(id), "node {id} already runs");
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
        let child = Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .args(["serve", "--id", &id.to_string()])
            .args(["--listen", &self.addrs[id - 1]])
            .args(["--etcd-listen", &self.etcd[id - 1]])
            .arg("--data")
            .arg(self.data(id))
            .args(["--peers", &peers.join(",")])
            .args(["--snapshot-threshold", &self.snapshot_threshold.to_string()])
            .args(["--cache-mb", "16"])
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn the leasecore binary");
        self.procs.lock().unwrap()[id - 1] = Some(child);
    }

    pub fn signal(&self, id: usize, sig: &str) {
        let pid = self.procs.lock().unwrap()[id - 1]
            .as_ref()
            .expect("node runs")
            .id();
        let status = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {sig} node {id}");
    }

    /// SIGKILL, and reap it.
    pub fn kill(&self, id: usize) {
        let mut child = self.procs.lock().unwrap()[id - 1]
            .take()
            .expect("node runs");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM, and wait for a clean exit.
    pub async fn terminate(&self, id: usize) {
        self.signal(id, "-TERM");
        let mut child = self.procs.lock().unwrap()[id - 1].take().unwrap();
        let status = crate::common::exited(&mut child, WAIT, "a node to exit after SIGTERM").await;
        assert!(status.success(), "node {id} after SIGTERM: {status}");
    }

    /// A node the test started that has exited since, and how.
    fn exited(&self) -> Option<String> {
        let mut procs = self.procs.lock().unwrap();
        procs.iter_mut().enumerate().find_map(|(i, p)| {
            let status = p.as_mut()?.try_wait().unwrap()?;
            Some(format!("node {} exited by itself ({status})", i + 1))
        })
    }

    pub async fn view(&self, id: usize) -> Option<ClusterView> {
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
    pub async fn healthy(&self) -> Option<usize> {
        let mut views = Vec::new();
        for id in 1..=NODES {
            if !self.running(id) {
                return None;
            }
            views.push(self.view(id).await?);
        }
        let leader = views[0].leader_id?;
        let agreed = views.iter().all(|v| v.leader_id == Some(leader));
        (agreed && views[leader as usize - 1].state == "leader").then_some(leader as usize)
    }

    /// A running node other than `not` that says it leads.
    pub async fn new_leader(&self, not: usize) -> Option<usize> {
        for id in (1..=NODES).filter(|i| *i != not && self.running(*i)) {
            if self.view(id).await?.state == "leader" {
                return Some(id);
            }
        }
        None
    }

    /// Poll `check` every `every` until it returns `Some`; panic at the deadline, or at once
    /// if a node exits by itself.
    pub async fn wait_every<T, F, Fut>(&self, what: &str, every: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            if let Some(why) = self.exited() {
                panic!("{why} while waiting for: {what}");
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {WAIT:?} waiting for: {what}"
            );
            tokio::time::sleep(every).await;
        }
    }

    pub async fn wait<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        self.wait_every(what, Duration::from_millis(20), check)
            .await
    }

    pub async fn wait_healthy(&self) -> usize {
        self.wait("three nodes agreeing on a leader", || self.healthy())
            .await
    }

    /// Wait until every node has applied what the leader had committed when this was called.
    pub async fn wait_caught_up(&self) {
        let target = self
            .wait("the leader's commit index", || async {
                let leader = self.healthy().await?;
                Some(self.view(leader).await?.commit_index)
            })
            .await;
        self.wait("every node caught up with the leader", || async {
            for id in 1..=NODES {
                if self.view(id).await?.applied_index < target {
                    return None;
                }
            }
            Some(())
        })
        .await;
    }

    fn log_tail(&self, id: usize, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path(id)).unwrap_or_default();
        let all: Vec<&str> = text
            .lines()
            // A panicking node's backtrace would crowd out what led to it.
            .filter(|l| !l.trim_start().starts_with("at ") && !is_frame(l))
            .collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// A numbered backtrace line (`  12: path::to::fn`).
fn is_frame(line: &str) -> bool {
    let t = line.trim_start();
    let digits = t.chars().take_while(char::is_ascii_digit).count();
    digits > 0 && t[digits..].starts_with(": ")
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for child in self.procs.get_mut().unwrap().iter_mut().flatten() {
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
