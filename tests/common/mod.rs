//! A cluster of in-process nodes on 127.0.0.1 port 0, in temporary directories.
//!
//! Nothing here sleeps and hopes: every wait is a condition polled until a deadline.
#![allow(dead_code)]
// Tests wait for conditions against real deadlines.
#![allow(clippy::disallowed_methods)]

pub mod certs;
pub mod etcdctl;
pub mod processes;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasecore::client::Client;
use leasecore::domain::types::NodeId;
use leasecore::node::{Node, NodeConfig, RaftTimings};
use tempfile::TempDir;

/// Poll `check` until it returns `Some`, or panic with `what` at the deadline.
/// The `/metrics` page of node `id`.
pub async fn metrics_of(c: &TestCluster, id: NodeId) -> String {
    reqwest::get(format!("{}/metrics", c.url(id)))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait for a child process to exit by itself within `timeout`, or panic with `what`.
pub async fn exited(
    child: &mut std::process::Child,
    timeout: Duration,
    what: &str,
) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LEASECORE_TEST_LOG")
                .unwrap_or_else(|_| "warn,openraft=error".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Bind a client listener on a free loopback port and its peer listener on that port + the
/// peer offset (peers derive a node's peer address from its client address). A pair whose
/// peer port is taken is dropped and another tried.
pub async fn bind_pair() -> (tokio::net::TcpListener, tokio::net::TcpListener) {
    for _ in 0..200 {
        let client = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = client.local_addr().unwrap().to_string();
        let Ok(peer_addr) = leasecore::domain::resources::peer_address(&addr) else {
            continue;
        };
        if let Ok(peer) = tokio::net::TcpListener::bind(&peer_addr).await {
            return (client, peer);
        }
    }
    panic!("no free client/peer port pair on 127.0.0.1");
}

/// A base port with `base + offset` free on 127.0.0.1 for every one of `offsets`, and the
/// listeners that checked them (in the order of `offsets`): drop them a moment before what
/// needs the ports binds them, or keep one to hold its port. The base is drawn below Linux's
/// ephemeral range (32768 and up), where no outgoing connection's source port (nor a port-0
/// listener) can take a port in that moment, and each call starts from its own place in the
/// range, so that the tests of one binary (run in parallel) do not draw the same ones.
/// `offsets` must stay under 1700.
pub fn free_ports_at(offsets: &[u16]) -> (u16, Vec<std::net::TcpListener>) {
    use std::sync::atomic::{AtomicU32, Ordering};
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let mut next = std::process::id()
        .wrapping_mul(31)
        .wrapping_add(call.wrapping_mul(7_919));
    for _ in 0..500 {
        next = next.wrapping_add(97);
        let base = 20_000 + (next % 11_000) as u16;
        let held: Vec<_> = offsets
            .iter()
            .map_while(|o| std::net::TcpListener::bind(("127.0.0.1", base + o)).ok())
            .collect();
        if held.len() == offsets.len() {
            return (base, held);
        }
    }
    panic!("no free ports at {offsets:?} from a base below the ephemeral range");
}

/// Addresses for `n` nodes run as separate processes: free client ports whose peer port
/// (client port + the peer offset) is free too ([`free_ports_at`]). Released before returning,
/// a moment before the nodes bind them.
pub fn free_node_addrs(n: usize) -> Vec<String> {
    let offsets = [0, leasecore::domain::resources::PEER_PORT_OFFSET];
    let held: Vec<_> = (0..n).map(|_| free_ports_at(&offsets)).collect();
    held.into_iter()
        .map(|(base, _)| format!("127.0.0.1:{base}"))
        .collect()
}

/// Adjusts every node's configuration (kept for restarts).
pub type Tweak = Arc<dyn Fn(&mut NodeConfig) + Send + Sync>;

pub struct TestCluster {
    pub tmp: TempDir,
    pub addrs: BTreeMap<NodeId, String>,
    pub nodes: BTreeMap<NodeId, Node>,
    pub initial: BTreeMap<NodeId, String>,
    pub snapshot_threshold: u64,
    pub max_value_bytes: Option<usize>,
    pub tweak: Option<Tweak>,
}

impl TestCluster {
    /// Start `n` voters that form a cluster by themselves.
    pub async fn start(n: u64) -> TestCluster {
        Self::start_with(n, 10_000).await
    }

    pub async fn start_with(n: u64, snapshot_threshold: u64) -> TestCluster {
        Self::start_full(n, snapshot_threshold, None).await
    }

    /// Start `n` voters whose configuration `tweak` adjusts.
    pub async fn start_tweaked(
        n: u64,
        tweak: impl Fn(&mut NodeConfig) + Send + Sync + 'static,
    ) -> TestCluster {
        Self::start_inner(n, 10_000, None, Some(Arc::new(tweak))).await
    }

    /// Start `n` voters with a snapshot threshold and, optionally, a value size limit.
    pub async fn start_full(
        n: u64,
        snapshot_threshold: u64,
        max_value_bytes: Option<usize>,
    ) -> TestCluster {
        Self::start_inner(n, snapshot_threshold, max_value_bytes, None).await
    }

    async fn start_inner(
        n: u64,
        snapshot_threshold: u64,
        max_value_bytes: Option<usize>,
        tweak: Option<Tweak>,
    ) -> TestCluster {
        Self::start_some(n, snapshot_threshold, max_value_bytes, tweak, &[]).await
    }

    /// Start the listed voters in `only` (every one of the `n` when empty).
    async fn start_some(
        n: u64,
        snapshot_threshold: u64,
        max_value_bytes: Option<usize>,
        tweak: Option<Tweak>,
        only: &[NodeId],
    ) -> TestCluster {
        init_tracing();
        let tmp = TempDir::new().unwrap();
        let mut listeners = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        for id in 1..=n {
            let pair = bind_pair().await;
            addrs.insert(id, pair.0.local_addr().unwrap().to_string());
            listeners.insert(id, pair);
        }
        let mut c = TestCluster {
            tmp,
            addrs: addrs.clone(),
            nodes: BTreeMap::new(),
            initial: addrs,
            snapshot_threshold,
            max_value_bytes,
            tweak,
        };
        for (id, (l, p)) in listeners {
            if !only.is_empty() && !only.contains(&id) {
                // Down from the start: its ports refuse connections.
                continue;
            }
            let node = Node::start_on_both(c.config(id, false), l, p)
                .await
                .unwrap();
            c.nodes.insert(id, node);
        }
        c
    }

    /// A new cluster of `n` listed voters of which only `running` ever start.
    pub async fn start_without(n: u64, running: &[NodeId]) -> TestCluster {
        Self::start_some(n, 10_000, None, None, running).await
    }

    pub fn data_dir(&self, id: NodeId) -> PathBuf {
        self.tmp.path().join(format!("node-{id}"))
    }

    pub fn config(&self, id: NodeId, join: bool) -> NodeConfig {
        let mut cfg = NodeConfig::new(id, self.data_dir(id));
        cfg.listen = self.addrs[&id].clone();
        cfg.advertise = Some(self.addrs[&id].clone());
        cfg.peers = if join {
            BTreeMap::new()
        } else {
            self.initial.clone()
        };
        cfg.join = join;
        cfg.timings = RaftTimings::default();
        cfg.snapshot_threshold = self.snapshot_threshold;
        cfg.cache_bytes = 16 << 20;
        // Peers are bound before they serve: asking them would only wait out the timeout.
        cfg.peer_probe = std::time::Duration::ZERO;
        if let Some(m) = self.max_value_bytes {
            cfg.limits.max_value_bytes = m;
        }
        if let Some(t) = &self.tweak {
            t(&mut cfg);
        }
        cfg
    }

    /// The peer listener's URL of a node.
    pub fn peer_url(&self, id: NodeId) -> String {
        let peer = leasecore::domain::resources::peer_address(&self.addrs[&id]).unwrap();
        format!("http://{peer}")
    }

    pub fn url(&self, id: NodeId) -> String {
        format!("http://{}", self.addrs[&id])
    }

    /// A client of every running node.
    pub fn client(&self) -> Client {
        let eps: Vec<String> = self.nodes.keys().map(|id| self.url(*id)).collect();
        Client::new(&eps).unwrap()
    }

    /// A client of one node only.
    pub fn client_of(&self, id: NodeId) -> Client {
        Client::new(&[self.url(id)]).unwrap()
    }

    /// Wait until every running node agrees on one running leader.
    pub async fn leader(&self) -> NodeId {
        eventually(Duration::from_secs(20), "an agreed leader", || async {
            let mut seen = None;
            for node in self.nodes.values() {
                let v = node.consensus().cluster_view();
                match (v.leader_id, seen) {
                    (None, _) => return None,
                    (Some(l), None) => seen = Some(l),
                    (Some(l), Some(s)) if l != s => return None,
                    _ => {}
                }
            }
            let l = seen?;
            (self.nodes.contains_key(&l) && self.nodes[&l].consensus().is_leader()).then_some(l)
        })
        .await
    }

    /// Stop a node (gracefully: its data stays).
    pub async fn stop(&mut self, id: NodeId) {
        let node = self.nodes.remove(&id).expect("node is running");
        node.shutdown().await;
    }

    /// Restart a stopped node from its directory, on its old address.
    pub async fn restart(&mut self, id: NodeId) {
        let join = !self.initial.contains_key(&id);
        let node = Node::start(self.config(id, join)).await.unwrap();
        self.nodes.insert(id, node);
    }

    /// Restart a stopped node on its old address as a joiner (`--join`, no peers), as an
    /// operator restarts a node removed by hand.
    pub async fn restart_as_joiner(&mut self, id: NodeId) {
        let node = Node::start(self.config(id, true)).await.unwrap();
        self.nodes.insert(id, node);
    }

    /// Start a new, empty node that waits to be added.
    pub async fn start_joiner(&mut self, id: NodeId) {
        let (l, p) = bind_pair().await;
        self.addrs.insert(id, l.local_addr().unwrap().to_string());
        let node = Node::start_on_both(self.config(id, true), l, p)
            .await
            .unwrap();
        self.nodes.insert(id, node);
    }

    /// Cut `id` off from every other node, both ways (clients still reach it).
    pub fn partition(&self, id: NodeId) {
        for (other, node) in &self.nodes {
            if *other == id {
                for (peer, addr) in &self.addrs {
                    if *peer != id {
                        node.faults().block(addr);
                    }
                }
            } else {
                node.faults().block(&self.addrs[&id]);
            }
        }
    }

    /// Heal every partition.
    pub fn heal(&self) {
        for node in self.nodes.values() {
            node.faults().heal();
        }
    }

    pub async fn shutdown(mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }
}
