//! A running node: wiring and ordered shutdown.
//!
//! `Node::start` opens sled, builds the state machine and log store, starts openraft, the HTTP
//! server and the drivers, and forms the initial cluster when asked to. Every task it starts is
//! spawned on one `TaskTracker` and stopped by one `CancellationToken`.
//!
//! A node whose data dir is empty asks its peers first and refuses to rejoin a running cluster
//! as the member it was (`domain::bootstrap`). A Raft core that fails stops the node: it never
//! keeps serving half-alive.
//!
//! # Shutdown order (designed, not incidental)
//! 1. cancel: the HTTP server stops accepting and drivers return;
//! 2. `raft.shutdown()`: in-flight proposals fail with `shutting_down` rather than hang;
//! 3. wait for every tracked task (bounded), so nothing outlives the node;
//! 4. flush sled, then drop it, releasing the directory lock for a restart.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use openraft::SnapshotPolicy;
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock::{Clock, SystemClock};
use crate::domain::bootstrap::{DataDir, Refusal, may_start};
use crate::domain::flease::FleaseConfig;
use crate::domain::history::HistoryLimits;
use crate::domain::limits::Limits;
use crate::domain::types::NodeId;
use crate::domain::types::Revision;
use crate::http::{self, AppState};
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::raft::consensus::{Consensus, ConsensusError, ConsensusTimeouts};
use crate::raft::log_store::LogStore;
use crate::raft::network::{Faults, NetworkFactory, PeerClient};
use crate::raft::state_machine::{Observers, StateMachine};
use crate::runtime::bootstrap::probe_peers;
use crate::runtime::election::ElectionWatchdog;
use crate::runtime::flease::FleaseService;
use crate::runtime::lease::{DEFAULT_MIN_TTL_MS, LeaseConfig, LeaseHub, LeaseService};
use crate::runtime::watch::WatchHub;
use crate::storage;

/// Raft timing, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct RaftTimings {
    /// How often the leader sends heartbeats; also openraft's append RPC timeout.
    pub heartbeat_ms: u64,
    /// The election timeout is drawn from `[election_min_ms, election_max_ms)`.
    pub election_min_ms: u64,
    pub election_max_ms: u64,
}

impl Default for RaftTimings {
    fn default() -> Self {
        // A wide window relative to openraft's tick (1.5 x heartbeat) keeps two voters' fixed
        // draws apart (pitfall P1); the watchdog handles the rest.
        RaftTimings {
            heartbeat_ms: 100,
            election_min_ms: 400,
            election_max_ms: 1000,
        }
    }
}

/// Everything a node needs to start.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub id: NodeId,
    /// Where to listen (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// The address peers and clients reach this node at; defaults to the peers entry for this
    /// node, else the bound address.
    pub advertise: Option<String>,
    pub data_dir: PathBuf,
    /// The initial voters, this node included. Empty: a single-node cluster of this node.
    pub peers: BTreeMap<NodeId, String>,
    /// Never initialize a cluster: wait to be added to an existing one.
    pub join: bool,
    pub timings: RaftTimings,
    /// Take a snapshot (and purge the log) every this many applied entries.
    pub snapshot_threshold: u64,
    pub limits: Limits,
    /// sled's page cache, in bytes.
    pub cache_bytes: u64,
    /// The shortest lease TTL (raised to 1.5 x the election timeout if below it).
    pub min_lease_ttl_ms: u64,
    /// Bounds of the watch history.
    pub history: HistoryLimits,
    /// Flease timing (validated at start).
    pub flease: FleaseConfig,
    /// With an empty data dir, how long to wait for the peers to say whether a cluster already
    /// runs (see `domain::bootstrap`); zero skips the question (in-process test clusters whose
    /// peers are bound but not yet serving).
    pub peer_probe: Duration,
}

impl NodeConfig {
    /// The defaults of `leasecore serve` with no flags, for node `id` in `data_dir`.
    pub fn new(id: NodeId, data_dir: impl Into<PathBuf>) -> Self {
        NodeConfig {
            id,
            listen: "127.0.0.1:7001".into(),
            advertise: None,
            data_dir: data_dir.into(),
            peers: BTreeMap::new(),
            join: false,
            timings: RaftTimings::default(),
            snapshot_threshold: 10_000,
            limits: Limits::default(),
            cache_bytes: 64 << 20,
            min_lease_ttl_ms: DEFAULT_MIN_TTL_MS,
            history: HistoryLimits::default(),
            flease: FleaseConfig::default(),
            peer_probe: Duration::from_secs(2),
        }
    }

    fn timeouts(&self) -> ConsensusTimeouts {
        ConsensusTimeouts {
            // Long enough to ride out one election (lease + timeout), short enough to answer.
            leader_wait: Duration::from_millis(3 * self.timings.election_max_ms),
            request: Duration::from_secs(10),
            catch_up: Duration::from_secs(120),
        }
    }

    fn raft_config(&self) -> Result<openraft::Config, NodeError> {
        let t = self.timings;
        let config = openraft::Config {
            cluster_name: "leasecore".into(),
            heartbeat_interval: t.heartbeat_ms,
            election_timeout_min: t.election_min_ms,
            election_timeout_max: t.election_max_ms,
            // A whole snapshot travels in one request; give it time (pitfall P3).
            install_snapshot_timeout: 60_000,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(self.snapshot_threshold.max(1)),
            max_in_snapshot_log_to_keep: (self.snapshot_threshold / 2).min(1000),
            replication_lag_threshold: self.snapshot_threshold.max(1) * 2,
            max_payload_entries: 512,
            ..Default::default()
        };
        config
            .validate()
            .map_err(|e| NodeError::Config(e.to_string()))
    }
}

/// Why a node could not start.
#[derive(Debug, Error)]
pub enum NodeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Storage(#[from] storage::StorageError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("starting raft: {0}")]
    Raft(String),
    #[error("forming the cluster: {0}")]
    Initialize(#[from] ConsensusError),
    /// The data dir is empty and starting would rejoin a running cluster as a member that lost
    /// its data (`leasecore serve` exits with [`EXIT_REFUSED`]).
    #[error("refusing to start: {0}")]
    Refused(Refusal),
}

/// The exit code of `leasecore serve` when it refuses to start ([`NodeError::Refused`]).
pub const EXIT_REFUSED: u8 = 3;
/// The exit code of `leasecore serve` when the Raft core failed (a panic, a storage error).
pub const EXIT_FATAL: u8 = 70;

/// Make any panic stop the process: one clear line, exit code [`EXIT_FATAL`].
///
/// openraft runs its core on a spawned task; a panic there (tokio catches it) would otherwise
/// leave a process whose HTTP server still answers `/health` while nothing applies. For the
/// binary only: in-process test clusters keep the default hook (and rely on `stop_on_fatal`).
pub fn exit_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        tracing::error!(at, "panic: {info}; the node exits with code {EXIT_FATAL}");
        eprintln!("fatal: panic at {at}; the node exits with code {EXIT_FATAL}");
        std::process::exit(i32::from(EXIT_FATAL));
    }));
}

/// The file in the data dir that names the node it belongs to.
const IDENTITY_FILE: &str = "node-id";

/// A running node.
pub struct Node {
    /// Fault injection into this node's peer traffic (tests).
    faults: Arc<Faults>,
    id: NodeId,
    addr: SocketAddr,
    advertise: String,
    consensus: Consensus,
    watch: Arc<WatchHub>,
    flease: Arc<FleaseService>,
    db: sled::Db,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl Node {
    /// Bind `cfg.listen` and start.
    pub async fn start(cfg: NodeConfig) -> Result<Node, NodeError> {
        let listener = tokio::net::TcpListener::bind(&cfg.listen)
            .await
            .map_err(|source| NodeError::Bind {
                addr: cfg.listen.clone(),
                source,
            })?;
        Self::start_on(cfg, listener).await
    }

    /// Start on an already bound listener (tests bind port 0 first to learn the addresses).
    pub async fn start_on(
        cfg: NodeConfig,
        listener: tokio::net::TcpListener,
    ) -> Result<Node, NodeError> {
        let addr = listener.local_addr().map_err(|source| NodeError::Bind {
            addr: cfg.listen.clone(),
            source,
        })?;
        let advertise = match (&cfg.advertise, cfg.peers.get(&cfg.id)) {
            (Some(a), _) => a.clone(),
            (None, Some(a)) => a.clone(),
            (None, None) if addr.ip().is_unspecified() => {
                return Err(NodeError::Config(format!(
                    "listening on {addr} (all interfaces): give --advertise, the address peers reach this node at"
                )));
            }
            (None, None) => addr.to_string(),
        };
        let raft_config = Arc::new(cfg.raft_config()?);
        cfg.flease
            .validate()
            .map_err(|e| NodeError::Config(e.to_string()))?;

        std::fs::create_dir_all(&cfg.data_dir)
            .map_err(|e| NodeError::Config(format!("creating {}: {e}", cfg.data_dir.display())))?;
        let dir = cfg.data_dir.clone();
        let cache = cfg.cache_bytes;
        let db = tokio::task::spawn_blocking(move || storage::open_db(&dir, cache))
            .await
            .map_err(|e| NodeError::Raft(e.to_string()))??;
        check_identity(&cfg)?;
        let empty = |tree: &str| -> Result<bool, storage::StorageError> {
            Ok(db.open_tree(tree)?.is_empty())
        };
        let data = if empty(storage::TREE_RAFT)? && empty(storage::TREE_STATE)? {
            DataDir::Empty
        } else {
            DataDir::Existing
        };
        if data == DataDir::Empty && !cfg.peer_probe.is_zero() {
            let reports = probe_peers(cfg.id, &cfg.peers, cfg.peer_probe).await;
            if let Err(refusal) = may_start(cfg.id, data, cfg.join, &reports) {
                return Err(NodeError::Refused(refusal));
            }
        }
        write_identity(&cfg)?;
        let log_store = LogStore::open(&db)?;
        let committed = log_store.committed_index();
        let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
        let lease_hub = Arc::new(LeaseHub::new(
            clock.clone(),
            LeaseConfig::new(cfg.min_lease_ttl_ms, cfg.timings.election_max_ms),
        ));
        let cancel = CancellationToken::new();
        let start_revision = storage_revision(&db)?;
        let watch_hub = Arc::new(WatchHub::new(cfg.history, start_revision, cancel.clone()));
        let observers = Observers(vec![lease_hub.clone(), watch_hub.clone()]);
        let (mut state_machine, view) =
            StateMachine::open(&db, &cfg.data_dir, Arc::new(observers))?;
        let mut log_store = log_store;
        seed_watch_history(
            &mut log_store,
            &mut state_machine,
            &view,
            &watch_hub,
            &cfg,
            &*clock,
        )
        .await;

        let peers = PeerClient::new();
        let faults = peers.faults();
        let flease_peers = peers.clone();
        let raft = Raft::new(
            cfg.id,
            raft_config,
            NetworkFactory::new(peers.clone()),
            log_store,
            state_machine,
        )
        .await
        .map_err(|e| NodeError::Raft(e.to_string()))?;
        let (consensus, proposal_queue) =
            Consensus::new(cfg.id, raft, peers, view, committed, cfg.timeouts());

        let tasks = TaskTracker::new();
        tasks.spawn(proposal_queue.run(cancel.clone()));
        let leases = Arc::new(LeaseService::new(
            lease_hub,
            consensus.clone(),
            tasks.clone(),
        ));
        tasks.spawn(leases.clone().run(cancel.clone()));
        let flease = Arc::new(FleaseService::new(
            cfg.id,
            cfg.flease,
            clock.clone(),
            consensus.clone(),
            flease_peers,
        ));
        tasks.spawn(flease.clone().run_maintenance(cancel.clone()));
        let state = AppState {
            consensus: consensus.clone(),
            limits: cfg.limits,
            metrics: Arc::new(Metrics::default()),
            leases,
            watch: watch_hub.clone(),
            flease: flease.clone(),
        };
        let app = http::router(state);
        tasks.spawn({
            let cancel = cancel.clone();
            async move {
                if let Err(e) = http::serve(listener, app, cancel).await {
                    tracing::error!(error = %e, "HTTP server failed");
                }
            }
        });
        tasks.spawn(stop_on_fatal(consensus.clone(), cancel.clone()));
        let election_max = Duration::from_millis(cfg.timings.election_max_ms);
        tasks.spawn(
            ElectionWatchdog {
                port: consensus.clone(),
                check_every: election_max / 2,
                stall_after: election_max * 4,
                jitter_max: election_max,
            }
            .run(cancel.clone()),
        );

        let node = Node {
            faults,
            id: cfg.id,
            addr,
            advertise: advertise.clone(),
            consensus,
            watch: watch_hub,
            flease,
            db,
            cancel,
            tasks,
        };
        if let Some(voters) = initial_voters(&cfg, &advertise)
            && let Err(e) = node.consensus.initialize(voters).await
        {
            node.shutdown().await;
            return Err(e.into());
        }
        tracing::info!(id = cfg.id, %addr, advertise = %node.advertise, "node started");
        Ok(node)
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address peers reach this node at.
    pub fn advertise(&self) -> &str {
        &self.advertise
    }

    pub fn consensus(&self) -> &Consensus {
        &self.consensus
    }

    /// Flease on this node.
    pub fn flease(&self) -> &FleaseService {
        &self.flease
    }

    /// The watch hub (history and waiting watches).
    pub fn watch_hub(&self) -> &WatchHub {
        &self.watch
    }

    /// Fault injection into this node's outgoing peer traffic (tests).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// A token that fires when the node begins shutting down.
    pub fn cancelled(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Stop everything, in order (see the module docs).
    pub async fn shutdown(self) {
        self.cancel.cancel();
        if let Err(e) = self.consensus.raft().shutdown().await {
            tracing::warn!(error = %e, "raft shutdown");
        }
        self.tasks.close();
        if tokio::time::timeout(Duration::from_secs(10), self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("tasks still running 10 s after shutdown began");
        }
        if let Err(e) = self.db.flush_async().await {
            tracing::error!(error = %e, "final flush failed");
        }
        tracing::info!(id = self.id, "node stopped");
    }
}

/// A data dir belongs to one node id: starting node 2 on node 1's data would make it vote and
/// answer as a member it is not.
fn check_identity(cfg: &NodeConfig) -> Result<(), NodeError> {
    let path = cfg.data_dir.join(IDENTITY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) if s.trim() == cfg.id.to_string() => Ok(()),
        Ok(s) => Err(NodeError::Config(format!(
            "{} belongs to node {}, not node {}",
            cfg.data_dir.display(),
            s.trim(),
            cfg.id
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NodeError::Config(format!(
            "reading {}: {e}",
            path.display()
        ))),
    }
}

fn write_identity(cfg: &NodeConfig) -> Result<(), NodeError> {
    let path = cfg.data_dir.join(IDENTITY_FILE);
    if path.exists() {
        return Ok(());
    }
    std::fs::write(&path, format!("{}\n", cfg.id))
        .map_err(|e| NodeError::Config(format!("writing {}: {e}", path.display())))
}

/// A Raft core that stopped (a panic inside openraft, a storage error) leaves a node that can
/// only serve stale reads: stop the whole node instead (the binary then exits non-zero).
async fn stop_on_fatal(consensus: Consensus, cancel: CancellationToken) {
    let mut metrics = consensus.raft().metrics();
    loop {
        let failed = metrics.borrow().running_state.clone().err();
        if let Some(fatal) = failed {
            if !matches!(fatal, openraft::error::Fatal::Stopped) {
                tracing::error!(error = %fatal, "the Raft core stopped; stopping the node");
                cancel.cancel();
            }
            return;
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = metrics.changed() => if changed.is_err() {
                // The core is gone without saying why (a panic drops its metrics sender).
                if !cancel.is_cancelled() {
                    tracing::error!("the Raft core exited; stopping the node");
                    cancel.cancel();
                }
                return;
            },
        }
    }
}

/// The store revision persisted in `db` (where the watch history starts).
fn storage_revision(db: &sled::Db) -> Result<Revision, storage::StorageError> {
    crate::raft::state_machine::persisted_revision(db)
}

/// Rebuild the watch history from the snapshot and the log (`raft::history_replay`); on any
/// failure log it and keep the empty history at the persisted revision: never fail the start.
async fn seed_watch_history(
    log: &mut LogStore,
    sm: &mut StateMachine,
    view: &crate::raft::state_machine::StateView,
    hub: &WatchHub,
    cfg: &NodeConfig,
    clock: &dyn Clock,
) {
    use crate::raft::history_replay::{DEFAULT_BUDGET_MS, rebuild};
    match rebuild(log, sm, view, cfg.history, clock, DEFAULT_BUDGET_MS).await {
        Ok((history, report)) => {
            let (compacted, events) = (history.compacted(), history.len());
            if hub.seed(history) {
                tracing::info!(id = cfg.id, entries = report.entries, events, %compacted, took_ms = report.took_ms, "watch history rebuilt");
            } else {
                tracing::warn!(
                    id = cfg.id,
                    "rebuilt watch history does not end at the persisted revision: not used"
                );
            }
        }
        Err(e) => {
            tracing::warn!(id = cfg.id, error = %e, "watch history not rebuilt: it starts at the persisted revision")
        }
    }
}

/// The voters to initialize with, or `None` when this node must wait to be added.
fn initial_voters(cfg: &NodeConfig, advertise: &str) -> Option<BTreeMap<NodeId, String>> {
    if cfg.join {
        return None;
    }
    if cfg.peers.is_empty() {
        return Some(BTreeMap::from([(cfg.id, advertise.to_string())]));
    }
    // A node outside the initial voter list joins later through `cluster add`. Every listed
    // node proposes the same initial membership; openraft accepts it on a node with an empty
    // log and refuses it (harmlessly) everywhere else.
    cfg.peers.contains_key(&cfg.id).then(|| cfg.peers.clone())
}
