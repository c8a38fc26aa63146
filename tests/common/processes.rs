//! Three real `leasecore serve` processes on loopback, each with its etcd API: started and
//! awaited until they agree on a leader, killed with real signals, their logs shown when a
//! test fails. For tests that must run the real binary (signals, a node's own runtime and
//! threads), where `TestCluster`'s in-process nodes would not do.
// Tests wait for conditions and processes against real deadlines.
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions};

pub const NODES: usize = 3;
/// The deadline of every wait on the cluster (start-up, an election, an event).
pub const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Three `leasecore serve` processes.

pub struct Cluster {
    dir: Option<tempfile::TempDir>,
    /// Each node's HTTP (and, port + offset, peer) address; node ids are 1..=NODES.
    pub addrs: Vec<String>,
    /// Each node's etcd API address.
    etcd: Vec<String>,
    procs: Vec<Option<Child>>,
}

/// A loopback address of the cluster's own, 127.0.0.2 to 127.0.0.254: its ports never meet
/// those of another test's cluster, nor those of outgoing connections (which leave from
/// 127.0.0.1), so that a port found free stays free until its node binds it.
fn own_loopback() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = std::process::id() as usize * 7 + NEXT.fetch_add(1, Ordering::Relaxed);
    format!("127.0.0.{}", 2 + n % 253)
}

/// Free ports on `host` for each node: its client port, the peer port derived from it, and
/// its etcd port. The listeners are held until the nodes are about to bind them.
fn free_ports(host: &str) -> (Vec<String>, Vec<String>, Vec<std::net::TcpListener>) {
    let (mut addrs, mut etcd, mut held) = (Vec::new(), Vec::new(), Vec::new());
    let bind = |addr: &str| std::net::TcpListener::bind(addr).ok();
    for _ in 0..NODES {
        let found = (0..200).find_map(|_| {
            let client = bind(&format!("{host}:0"))?;
            let addr = client.local_addr().unwrap().to_string();
            let peer = bind(&leasecore::domain::resources::peer_address(&addr).ok()?)?;
            let api = bind(&format!("{host}:0"))?;
            Some((
                addr,
                api.local_addr().unwrap().to_string(),
                [client, peer, api],
            ))
        });
        let (addr, api, listeners) = found.expect("free ports on loopback");
        addrs.push(addr);
        etcd.push(api);
        held.extend(listeners);
    }
    (addrs, etcd, held)
}

impl Cluster {
    /// Start the three nodes and wait until they agree on a leader. A node that cannot bind
    /// its ports (something else took one meanwhile) makes a new attempt on other ports.
    pub async fn start() -> Cluster {
        for attempt in 1..=3 {
            let (addrs, etcd, held) = free_ports(&own_loopback());
            let mut c = Cluster {
                dir: Some(tempfile::TempDir::new().unwrap()),
                addrs,
                etcd,
                procs: (0..NODES).map(|_| None).collect(),
            };
            drop(held);
            for id in 1..=NODES {
                c.procs[id - 1] = Some(c.spawn(id));
            }
            match c.ready().await {
                Ok(()) => return c,
                Err(why) if attempt < 3 => {
                    eprintln!("cluster start, attempt {attempt}: {why}; again on other ports")
                }
                Err(why) => panic!("the cluster did not start: {why}"),
            }
        }
        unreachable!()
    }

    /// Wait until the nodes agree on a leader; an error if one of them exits meanwhile.
    pub async fn ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            for id in 1..=NODES {
                let child = self.procs[id - 1].as_mut().unwrap();
                if let Some(status) = child.try_wait().unwrap() {
                    return Err(format!(
                        "node {id} exited ({status}): {}",
                        self.log_tail(id, 3)
                    ));
                }
            }
            if self.agreed_leader().await.is_some() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("no agreed leader within {WAIT:?}"))
    }

    pub fn root(&self) -> PathBuf {
        self.dir.as_ref().unwrap().path().to_path_buf()
    }

    pub fn log_path(&self, id: usize) -> PathBuf {
        self.root().join(format!("node-{id}.log"))
    }

    pub fn spawn(&self, id: usize) -> Child {
        let peers: Vec<String> = (1..=NODES)
            .map(|i| format!("{i}={}", self.addrs[i - 1]))
            .collect();
        let log = File::create(self.log_path(id)).unwrap();
        Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .args(["serve", "--id", &id.to_string()])
            .args(["--listen", &self.addrs[id - 1]])
            .args(["--etcd-listen", &self.etcd[id - 1]])
            .arg("--data")
            .arg(self.data_dir(id))
            .args(["--peers", &peers.join(","), "--cache-mb", "16"])
            .env("NO_COLOR", "1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn the leasecore binary")
    }

    pub fn running(&self) -> Vec<usize> {
        (1..=NODES)
            .filter(|id| self.procs[id - 1].is_some())
            .collect()
    }

    pub fn endpoint(&self, id: usize) -> String {
        format!("http://{}", self.etcd[id - 1])
    }

    /// An etcd client of the given nodes (etcd-client balances over them).
    pub async fn client(&self, ids: &[usize]) -> Client {
        let eps: Vec<String> = ids.iter().map(|id| self.endpoint(*id)).collect();
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(10));
        Client::connect(eps, Some(opts))
            .await
            .expect("etcd-client connects")
    }

    /// The leader as node `id` reports it through `Maintenance.Status`, if it answers at once.
    pub async fn leader_seen_by(&self, id: usize) -> Option<u64> {
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(2));
        let mut c = Client::connect([self.endpoint(id)], Some(opts))
            .await
            .ok()?;
        let s = c.status().await.ok()?;
        assert_eq!(
            s.header().map(|h| h.member_id()),
            Some(id as u64),
            "node {id} answers as itself"
        );
        (s.leader() != 0 && s.errors().is_empty()).then_some(s.leader())
    }

    /// The leader, if every running node names the same running one.
    pub async fn agreed_leader(&self) -> Option<usize> {
        let ids = self.running();
        let mut seen = BTreeSet::new();
        for id in &ids {
            seen.insert(self.leader_seen_by(*id).await?);
        }
        let l = *seen.first()? as usize;
        (seen.len() == 1 && ids.contains(&l)).then_some(l)
    }

    /// Wait until every running node names the same running leader; returns it.
    pub async fn leader(&self) -> usize {
        crate::common::eventually(WAIT, "the running nodes to agree on a leader", || {
            self.agreed_leader()
        })
        .await
    }

    pub fn followers(&self, leader: usize) -> (usize, usize) {
        let f: Vec<usize> = self
            .running()
            .into_iter()
            .filter(|i| *i != leader)
            .collect();
        (f[0], f[1])
    }

    /// Start node `id` again from its data (after [`Cluster::kill`]).
    pub fn restart(&mut self, id: usize) {
        assert!(self.procs[id - 1].is_none(), "node {id} is stopped");
        self.procs[id - 1] = Some(self.spawn(id));
    }

    /// Send `signal` (`STOP`, `CONT`, ...) to node `id`, which runs.
    pub fn signal(&self, id: usize, signal: &str) {
        let pid = self.procs[id - 1].as_ref().expect("the node runs").id();
        let status = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} node {id}");
    }

    /// Node `id`'s data directory.
    pub fn data_dir(&self, id: usize) -> PathBuf {
        self.root().join(format!("node-{id}"))
    }

    /// SIGKILL node `id` (no shutdown of any kind) and reap it.
    pub fn kill(&mut self, id: usize) {
        let mut child = self.procs[id - 1].take().expect("the node runs");
        child.kill().unwrap(); // SIGKILL on Unix
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(9), "node {id} died of SIGKILL");
    }

    pub fn log_tail(&self, id: usize, lines: usize) -> String {
        tail_of(&self.log_path(id), lines)
    }
}

/// The last `lines` lines of the log file at `path` (empty if it cannot be read).
pub fn tail_of(path: &std::path::Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Kill and reap every process still held (SIGKILL also ends a stopped, paused one).
pub fn kill_all(procs: &mut [Option<Child>]) {
    for child in procs.iter_mut().flatten() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        kill_all(&mut self.procs);
        if std::thread::panicking() {
            for id in 1..=NODES {
                eprintln!(
                    "----- node {id} log (last 30 lines) -----\n{}",
                    self.log_tail(id, 30)
                );
            }
            if let Some(dir) = self.dir.take() {
                eprintln!("node data and logs kept in {}", dir.keep().display());
            }
        }
    }
}
