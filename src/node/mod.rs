//! A running node: wiring and ordered shutdown.
//!
//! `Node::start` opens sled, builds the state machine and log store, starts openraft, the two
//! HTTP listeners (clients on `listen`, peers on `peer_listen`) and the drivers, and forms the
//! initial cluster when asked to. Every task it starts is spawned on one `TaskTracker` and
//! stopped by one `CancellationToken`.
//!
//! A node whose data dir is empty asks its peers first and never rejoins a running cluster as
//! the member it was: it has itself replaced, or refuses to start (`domain::bootstrap`). A Raft core that fails stops the node: it never
//! keeps serving half-alive.
//!
//! `config` holds [`NodeConfig`] and how it becomes openraft's configuration and the
//! consensus timeouts.
//!
//! # Shutdown order (designed, not incidental)
//! 1. cancel: the HTTP server stops accepting and drivers return;
//! 2. `raft.shutdown()`: in-flight proposals fail rather than hang: `shutting_down` if they
//!    never reached the Raft core, `outcome_unknown` if they did (the entry may still commit);
//! 3. wait for every tracked task (bounded), so nothing outlives the node;
//! 4. wait (bounded) until openraft's state-machine task has dropped the state machine: it runs
//!    in its own task, which may end after `raft.shutdown()` returns, and holds sled open;
//! 5. flush sled, then drop it, releasing the directory lock for a restart.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::clock::{Clock, SystemClock};
use crate::domain::bootstrap::{DataDir, Refusal, forming_waits};
use crate::domain::resources::CompactionPolicy;
use crate::domain::resources::peer_address;
use crate::domain::types::NodeId;
use crate::domain::types::Revision;
use crate::http::listener::serve_limited;
use crate::http::{self, AppState, AppStateParts};
use crate::metrics::Metrics;
use crate::raft::Raft;
use crate::raft::consensus::{Consensus, ConsensusError, StorageUse};
use crate::raft::log_store::LogStore;
use crate::raft::network::reversion::ReversionGuard;
use crate::raft::network::{Faults, NetworkFactory, PeerClient};
use crate::raft::state_machine::{Observers, StateMachine};
use crate::raft::vote_hold::VoteHold;
use crate::runtime::compaction::LogCompactor;
use crate::runtime::election::ElectionWatchdog;
use crate::runtime::flease::FleaseService;
use crate::runtime::lease::{LeaseConfig, LeaseHub, LeaseService};
use crate::runtime::quorum::QuorumWatchdog;
use crate::runtime::replace::{
    HeldNode, StartCheck, ask_to_be_added, check_empty_start, promotion_pending,
    replace_if_held_as_voter, replace_reverted_nodes,
};
use crate::runtime::watch::WatchHub;
use crate::storage;
use crate::tls::{PeerTls, RELOAD_POLL, Reload, Reloadable, ServerTls, TlsError, run_reloader};

mod config;
pub mod workers;

/// How often the runtime's pulse ticks (`runtime::stall`): fine enough to see a stall of a
/// fraction of an election timeout, cheap enough to run always (100 wakes a second).
const STALL_TICK_MS: u64 = 10;

pub use config::{DEFAULT_SNAPSHOT_LOG_BYTES, NodeConfig, RaftTimings};

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
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
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
    peer_addr: SocketAddr,
    /// The etcd API's bound address, if it serves one.
    etcd_addr: Option<SocketAddr>,
    advertise: String,
    consensus: Consensus,
    watch: Arc<WatchHub>,
    flease: Arc<FleaseService>,
    db: sled::Db,
    /// Completes when openraft has dropped the state machine (see the shutdown order).
    state_machine_dropped: tokio::sync::oneshot::Receiver<()>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl Node {
    /// Bind `cfg.listen` and the peer listener, and start.
    pub async fn start(cfg: NodeConfig) -> Result<Node, NodeError> {
        let listener = bind(&cfg.listen).await?;
        let peer = bind(&cfg.peer_listen_addr(&cfg.listen)?).await?;
        Self::start_on_both(cfg, listener, peer).await
    }

    /// Start on an already bound client listener; the peer listener binds `cfg.peer_listen`,
    /// by default the bound client port + 1000.
    pub async fn start_on(
        cfg: NodeConfig,
        listener: tokio::net::TcpListener,
    ) -> Result<Node, NodeError> {
        let addr = local_addr(&listener, &cfg.listen)?;
        let peer = bind(&cfg.peer_listen_addr(&addr.to_string())?).await?;
        Self::start_on_both(cfg, listener, peer).await
    }

    /// Start on already bound client and peer listeners (tests bind them first to learn the
    /// addresses).
    pub async fn start_on_both(
        cfg: NodeConfig,
        listener: tokio::net::TcpListener,
        peer_listener: tokio::net::TcpListener,
    ) -> Result<Node, NodeError> {
        let addr = local_addr(&listener, &cfg.listen)?;
        let peer_addr = local_addr(&peer_listener, "the peer listener")?;
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
        // Every member's peer address is derived from its client address: refuse one that
        // gives none rather than fail on the first peer call.
        for a in std::iter::once(&advertise).chain(cfg.peers.values()) {
            peer_address(a).map_err(NodeError::Config)?;
        }
        let raft_config = Arc::new(cfg.raft_config()?);
        let etcd_listener = match &cfg.etcd_listen {
            Some(a) => Some(bind(a).await?),
            None => None,
        };
        let etcd_addr = match &etcd_listener {
            Some(l) => Some(local_addr(l, "the etcd listener")?),
            None => None,
        };
        // TLS files are read before anything else starts: a bad file stops the start with
        // a message that names it.
        let client_tls = server_tls("client listener", cfg.client_tls.as_ref())?;
        let peer_server_tls = server_tls(
            "peer listener",
            cfg.peer_tls.as_ref().map(PeerTls::server).as_ref(),
        )?;
        let peers = match &cfg.peer_tls {
            Some(tls) => PeerClient::with_tls(cfg.id, tls)?,
            None => PeerClient::new(cfg.id),
        };
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
        let no_entries = !crate::raft::segment_log::SegmentLog::exists_in(
            &cfg.data_dir.join(crate::raft::log_store::LOG_DIR),
        );
        let data = if empty(storage::TREE_RAFT)? && empty(storage::TREE_STATE)? && no_entries {
            DataDir::Empty
        } else {
            DataDir::Existing
        };
        // The leader's address, when the leader replaced this node (`Start::Replace`).
        let replaced = if data == DataDir::Empty && !cfg.peer_probe.is_zero() {
            let check = StartCheck {
                me: cfg.id,
                listed: &cfg.peers,
                advertise: &advertise,
                data_dir: &cfg.data_dir,
                join: cfg.join,
                auto_replace: cfg.auto_replace,
                probe: cfg.peer_probe,
                // The leader's removal and learner add, each within its request timeout.
                ask: cfg.timeouts().request * 2 + Duration::from_secs(5),
                election_max: Duration::from_millis(cfg.timings.election_max_ms),
            };
            check_empty_start(&peers, check)
                .await
                .map_err(NodeError::Refused)?
        } else {
            None
        };
        write_identity(&cfg)?;
        // A node that starts empty to join a running cluster votes only once the cluster has
        // listed it as a non-voter (`raft::vote_hold`): a member that lost its data must not
        // vote as the member it was.
        let joins_empty = data == DataDir::Empty && (cfg.join || replaced.is_some());
        let vote_hold = VoteHold::open(cfg.id, &cfg.data_dir, joins_empty).map_err(|e| {
            NodeError::Config(format!(
                "writing {} in {}: {e}",
                crate::raft::vote_hold::HOLD_FILE,
                cfg.data_dir.display()
            ))
        })?;
        let log_store = LogStore::open(&db, &cfg.data_dir)?
            .with_node(cfg.id)
            .with_vote_hold(vote_hold.clone());
        let log_syncs = log_store.sync_stats();
        let committed = log_store.committed_index();
        let storage_use = StorageUse {
            log_bytes: log_store.log_bytes(),
            quota: cfg.quota,
            data_dir: Some(cfg.data_dir.clone()),
        };
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
        // Watches that resume before the in-memory history read the MVCC store.
        watch_hub.set_older(Arc::new(view.clone()));
        let log_store = log_store
            .with_receipts(lease_hub.clone())
            .with_applied(view.applied_marks());
        state_machine.apply_when_durable(log_store.durable_view());
        let fill_store = state_machine.fill_store();
        let durable_view = log_store.durable_view();
        let state_machine_dropped = state_machine.dropped();

        let faults = peers.faults();
        let flease_peers = peers.clone();
        let (reversion_guard, reversion_reports) = ReversionGuard::new();
        let raft = Raft::new(
            cfg.id,
            raft_config,
            NetworkFactory::new(peers.clone())
                .with_durability(log_store.durable_view())
                .with_reversion_guard(reversion_guard.clone()),
            log_store,
            state_machine,
        )
        .await
        .map_err(|e| NodeError::Raft(e.to_string()))?;
        let (consensus, proposal_queue) = Consensus::new(
            cfg.id,
            raft,
            peers,
            view,
            committed,
            cfg.timeouts(),
            storage_use.clone(),
        );

        consensus.set_reversion_guard(reversion_guard);
        consensus.set_durable_view(durable_view.clone());
        if vote_hold.is_held() {
            // What a start before this one stored (the log store is told only of appends).
            let m = consensus.raft().metrics().borrow().clone();
            let membership = m.membership_config.log_id().map(|at| at.index);
            vote_hold.opened_with(
                m.last_log_index,
                membership.map(|at| (at, m.membership_config.membership())),
            );
        }
        consensus.set_vote_hold(vote_hold.clone());

        let tasks = TaskTracker::new();
        tasks.spawn(proposal_queue.run(cancel.clone()));
        tasks.spawn(replace_reverted_nodes(
            consensus.clone(),
            reversion_reports,
            cancel.clone(),
        ));
        if vote_hold.is_held() {
            tasks.spawn(
                vote_hold
                    .clone()
                    .follow_durable(durable_view.clone(), cancel.clone()),
            );
            let t = cfg.timeouts();
            tasks.spawn(replace_if_held_as_voter(
                consensus.clone(),
                vote_hold,
                HeldNode {
                    address: advertise.clone(),
                    ask_replacement: cfg.auto_replace,
                    data_dir: cfg.data_dir.clone(),
                    ask_within: t.catch_up + t.request * 2,
                },
                cancel.clone(),
            ));
        }
        // A commit the leader told its followers cut to its durable log (`raft::durability`)
        // is told again as soon as the log catches up.
        tasks.spawn({
            let (raft, cancel) = (consensus.raft().clone(), cancel.clone());
            let recommit = durable_view.recommit_when_durable(move || {
                let raft = raft.clone();
                async move {
                    let _ = raft.trigger().heartbeat().await;
                }
            });
            async move {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = recommit => {}
                }
            }
        });
        tasks.spawn(
            LogCompactor {
                raft: consensus.raft().clone(),
                log_bytes: storage_use.log_bytes,
                view: consensus.view().clone(),
                policy: CompactionPolicy {
                    entries: cfg.snapshot_threshold,
                    max_log_bytes: cfg.snapshot_log_bytes,
                    gate_cap_bytes: CompactionPolicy::gate_cap_for(cfg.quota),
                },
            }
            .run(cancel.clone()),
        );
        tasks.spawn(
            crate::runtime::history_fill::HistoryFiller {
                consensus: consensus.clone(),
                store: fill_store,
            }
            .run(cancel.clone()),
        );
        if let Some(retention) = cfg.auto_compaction {
            tasks.spawn(
                crate::runtime::auto_compact::AutoCompactor {
                    retention,
                    consensus: consensus.clone(),
                    clock: clock.clone(),
                }
                .run(cancel.clone()),
            );
        }
        let leases = Arc::new(LeaseService::new(
            lease_hub,
            consensus.clone(),
            tasks.clone(),
        ));
        {
            // Registrations leave the leader stamped with its lease clock.
            let hub = leases.hub_handle();
            consensus.set_lease_stamper(Arc::new(move || hub.clock_now()));
            consensus.set_lease_tracking(leases.tracking());
        }
        tasks.spawn(leases.clone().run(cancel.clone()));
        let flease = Arc::new(FleaseService::new(
            cfg.id,
            cfg.flease,
            clock.clone(),
            consensus.clone(),
            flease_peers,
        ));
        tasks.spawn(flease.clone().run_maintenance(cancel.clone()));
        let metrics = Arc::new(Metrics::with_log_syncs(log_syncs));
        {
            let mut reloadable: Vec<Arc<dyn Reload>> = Vec::new();
            reloadable.extend(client_tls.clone().map(|t| t as Arc<dyn Reload>));
            reloadable.extend(peer_server_tls.clone().map(|t| t as Arc<dyn Reload>));
            reloadable.extend(consensus.peers().tls().map(|t| t as Arc<dyn Reload>));
            let _ = metrics.tls.set(reloadable.clone());
            tasks.spawn(run_reloader(reloadable, RELOAD_POLL, cancel.clone()));
        }
        let etcd_url = etcd_addr.map(|bound| {
            crate::etcd::client_urls::own_url(client_tls.is_some(), bound, &advertise)
        });
        let state = AppState::new(AppStateParts {
            consensus: consensus.clone(),
            limits: cfg.limits,
            metrics: metrics.clone(),
            leases,
            watch: watch_hub.clone(),
            flease: flease.clone(),
            auth: Arc::new(crate::runtime::auth::AuthService::new(
                clock.clone(),
                consensus.view().clone(),
                cfg.auth_token_ttl_ms,
                // Half the cores at most: password checks never take every core.
                std::thread::available_parallelism().map_or(1, |n| n.get() / 2),
            )),
            peer_streams: http::peer_stream::PeerStreams::new(
                tasks.clone(),
                cancel.clone(),
                cfg.peer_limits.header_timeout,
            ),
            etcd_url,
        });
        if let Some(listener) = etcd_listener {
            let app = crate::etcd::router(state.clone());
            let (cancel, limits, stats, tls) = (
                cancel.clone(),
                cfg.etcd_limits,
                metrics.etcd_conns.clone(),
                client_tls.clone(),
            );
            tasks.spawn(async move {
                if let Err(e) = serve_limited(listener, app, cancel, limits, stats, tls).await {
                    tracing::error!(error = %e, "etcd API server failed");
                }
            });
        }
        // Two listeners, each with its own cap: clients that exhaust theirs leave the peers'
        // untouched.
        let servers = [
            (
                listener,
                http::client_router(state.clone()),
                cfg.client_limits,
                metrics.client_conns.clone(),
                client_tls,
            ),
            (
                peer_listener,
                http::peer_router(state),
                cfg.peer_limits,
                metrics.peer_conns.clone(),
                peer_server_tls,
            ),
        ];
        for (listener, app, limits, stats, tls) in servers {
            let cancel = cancel.clone();
            tasks.spawn(async move {
                if let Err(e) = serve_limited(listener, app, cancel, limits, stats, tls).await {
                    tracing::error!(error = %e, "HTTP server failed");
                }
            });
        }
        tasks.spawn(stop_on_fatal(consensus.clone(), cancel.clone()));
        let election_max = Duration::from_millis(cfg.timings.election_max_ms);
        let heartbeat = Duration::from_millis(cfg.timings.heartbeat_ms.max(1));
        tasks.spawn(
            ElectionWatchdog {
                port: consensus.clone(),
                check_every: heartbeat,
                election_min: Duration::from_millis(cfg.timings.election_min_ms),
                election_max,
                // openraft's leader lease is the largest election timeout; a heartbeat more
                // covers the other voters, which accepted the last append a little later.
                silence_after: election_max + heartbeat,
                silence_jitter_max: Duration::from_millis(cfg.timings.election_min_ms / 2),
            }
            .run(cancel.clone()),
        );
        tasks.spawn(
            QuorumWatchdog {
                port: consensus.clone(),
                clock: clock.clone(),
                check_every: Duration::from_millis(cfg.timings.heartbeat_ms),
                election_timeout: election_max,
            }
            .run(cancel.clone()),
        );
        tasks.spawn(
            crate::runtime::stall::StallMonitor {
                clock: clock.clone(),
                every: Duration::from_millis(STALL_TICK_MS),
                election_min: Duration::from_millis(cfg.timings.election_min_ms),
                stats: metrics.runtime_stalls.clone(),
            }
            .run(cancel.clone()),
        );

        let node = Node {
            faults,
            id: cfg.id,
            addr,
            peer_addr,
            etcd_addr,
            advertise: advertise.clone(),
            consensus,
            watch: watch_hub,
            flease,
            db,
            state_machine_dropped,
            cancel,
            tasks,
        };
        // Replaced as a voter (now or by an earlier start): promoted once caught up.
        if promotion_pending(&cfg.data_dir) {
            let t = cfg.timeouts();
            let mut addresses: Vec<String> = cfg.peers.values().cloned().collect();
            addresses.extend(replaced.clone());
            node.tasks.spawn(ask_to_be_added(
                node.consensus.clone(),
                node.advertise.clone(),
                addresses,
                cfg.data_dir.clone(),
                t.catch_up + t.request * 2,
                node.cancel.clone(),
            ));
        }
        if replaced.is_some() {
            // A learner of the running cluster: nothing to form.
        } else if let Some(voters) = initial_voters(&cfg, &advertise) {
            let waits = forming_waits(
                cfg.id,
                voters.keys().copied(),
                data,
                !cfg.peer_probe.is_zero(),
                Duration::from_millis(cfg.timings.election_max_ms),
                crate::runtime::bootstrap::LISTED_WAIT,
            );
            if waits.none() {
                if let Err(e) = node.consensus.initialize(voters).await {
                    node.shutdown().await;
                    return Err(e.into());
                }
            } else {
                node.tasks
                    .spawn(crate::runtime::bootstrap::initialize_later(
                        node.consensus.clone(),
                        voters,
                        waits,
                        node.cancel.clone(),
                    ));
            }
        }
        tracing::info!(
            id = cfg.id,
            %addr,
            %peer_addr,
            etcd = ?etcd_addr,
            advertise = %node.advertise,
            client_tls = cfg.client_tls.is_some(),
            peer_tls = cfg.peer_tls.is_some(),
            "node started"
        );
        Ok(node)
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound peer listener's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// The etcd API listener's bound address, if the node serves the etcd API.
    pub fn etcd_addr(&self) -> Option<SocketAddr> {
        self.etcd_addr
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
        if tokio::time::timeout(Duration::from_secs(10), self.state_machine_dropped)
            .await
            .is_err()
        {
            tracing::warn!("the state machine still held 10 s after shutdown began");
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

/// A listener's reloadable TLS config, built now (`None`: plaintext).
fn server_tls(
    what: &'static str,
    tls: Option<&ServerTls>,
) -> Result<Option<Arc<Reloadable<rustls::ServerConfig>>>, TlsError> {
    let Some(tls) = tls.cloned() else {
        return Ok(None);
    };
    let files = tls.files();
    Ok(Some(Arc::new(Reloadable::new(what, files, move || {
        tls.build()
    })?)))
}

async fn bind(addr: &str) -> Result<tokio::net::TcpListener, NodeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::Bind {
            addr: addr.to_string(),
            source,
        })
}

fn local_addr(l: &tokio::net::TcpListener, what: &str) -> Result<SocketAddr, NodeError> {
    l.local_addr().map_err(|source| NodeError::Bind {
        addr: what.to_string(),
        source,
    })
}

/// The store revision persisted in `db` (where the watch history starts).
fn storage_revision(db: &sled::Db) -> Result<Revision, storage::StorageError> {
    crate::raft::state_machine::persisted_revision(db)
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
    // node proposes the same initial membership (the lowest id at once, the others in turn:
    // `first_campaign_delay`); openraft accepts it on a node with an empty log and refuses it
    // (harmlessly) everywhere else.
    cfg.peers.contains_key(&cfg.id).then(|| cfg.peers.clone())
}
