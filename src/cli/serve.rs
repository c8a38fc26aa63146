//! `leasecore serve`: run a node. Every flag also reads an environment variable
//! (`LEASECORE_ID`, `LEASECORE_LISTEN`, ...), for containers.
//!
//! It only maps flags onto `NodeConfig` and waits for a signal or a fatal stop; the node itself
//! lives in `leasecore::node`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use leasecore::domain::flease::FleaseConfig;
use leasecore::domain::limits::{DEFAULT_MAX_LEASES, DEFAULT_MAX_VALUE_BYTES};
use leasecore::domain::types::NodeId;
use leasecore::node::workers::{WorkerSizing, worker_threads};
use leasecore::node::{EXIT_FATAL, EXIT_REFUSED, Node, NodeConfig, NodeError, RaftTimings};
use leasecore::storage::StorageError;

use super::shutdown_signal;

#[derive(Args)]
pub struct ServeArgs {
    /// A TOML file with any of these settings (keys are the flag names: `heartbeat_ms = 100`).
    /// Flags and the environment override it. See docs/leasecore.example.toml.
    #[arg(long, env = "LEASECORE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the settings in force (after the file, the environment and the flags), each with
    /// where it came from, as a configuration file, and exit without starting.
    #[arg(long)]
    pub dry_run: bool,
    /// This node's id (stable across restarts).
    #[arg(long, env = "LEASECORE_ID", default_value_t = 1)]
    pub id: NodeId,
    /// Address to listen on for clients (peers use --peer-listen).
    #[arg(long, env = "LEASECORE_LISTEN", default_value = "127.0.0.1:7001")]
    pub listen: String,
    /// Address to serve etcd's v3 API on (gRPC and its JSON gateway, as etcd's
    /// --listen-client-urls), for etcdctl and etcd's client libraries; e.g. 127.0.0.1:2379.
    /// Default: none.
    #[arg(long, env = "LEASECORE_ETCD_LISTEN")]
    pub etcd_listen: Option<String>,
    /// The most compares, or operations per branch, of one transaction (etcd's --max-txn-ops).
    #[arg(long, env = "LEASECORE_MAX_TXN_OPS", default_value_t = leasecore::domain::txn::DEFAULT_MAX_TXN_OPS)]
    pub max_txn_ops: usize,
    /// The most bytes one read's answer may hold through the etcd API (a Range, or a txn that
    /// only reads); larger ones are refused before they are built. etcd sets no limit; lower
    /// it on a small machine. A txn that writes answers at most 4 MiB.
    #[arg(long, env = "LEASECORE_ETCD_MAX_READ_ANSWER_BYTES",
          default_value_t = leasecore::domain::limits::DEFAULT_MAX_READ_ANSWER_BYTES)]
    pub etcd_max_read_answer_bytes: usize,
    /// Automatic compaction of the MVCC history (etcd's flag): `periodic` keeps the history
    /// of the last --auto-compaction-retention, `revision` that many revisions.
    #[arg(long, env = "LEASECORE_AUTO_COMPACTION_MODE", default_value = "periodic",
          value_parser = ["periodic", "revision"])]
    pub auto_compaction_mode: String,
    /// What auto-compaction keeps (etcd's flag): a duration for `periodic` (1h, 30m, 90s; a
    /// bare number is hours), a count for `revision`. 0 turns it off: every version is kept
    /// until an explicit compaction (etcdctl compaction, POST /v1/compact). The default keeps
    /// an hour (etcd's keeps everything), so that history never fills a disk unnoticed.
    #[arg(
        long,
        env = "LEASECORE_AUTO_COMPACTION_RETENTION",
        default_value = "1h"
    )]
    pub auto_compaction_retention: String,
    /// Address peers and clients reach this node at (default: this node's --peers entry, else
    /// --listen).
    #[arg(long, env = "LEASECORE_ADVERTISE")]
    pub advertise: Option<String>,
    /// Data directory (default: ./leasecore-data/node-<id>).
    #[arg(long, env = "LEASECORE_DATA")]
    pub data: Option<PathBuf>,
    /// The initial voters, this node included: ID=HOST:PORT,ID=HOST:PORT,...
    #[arg(long, env = "LEASECORE_PEERS", value_parser = parse_peers)]
    pub peers: Option<BTreeMap<NodeId, String>>,
    /// Do not form a cluster: wait to be added to one (`leasecore cluster add`). In the
    /// environment: 1/0, true/false, yes/no, on/off.
    #[arg(long, env = "LEASECORE_JOIN", value_parser = clap::builder::BoolishValueParser::new())]
    pub join: bool,
    /// With an empty data dir while the running cluster still lists this node, refuse to start
    /// (exit code 3) instead of having the leader replace it (remove it, add it back, promote
    /// it once caught up). In the environment: 1/0, true/false, yes/no, on/off.
    #[arg(long, env = "LEASECORE_NO_AUTO_REPLACE", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_auto_replace: bool,
    /// Leader heartbeat interval, in milliseconds.
    #[arg(long, env = "LEASECORE_HEARTBEAT_MS", default_value_t = RaftTimings::default().heartbeat_ms)]
    pub heartbeat_ms: u64,
    /// Smallest election timeout, in milliseconds.
    #[arg(long, env = "LEASECORE_ELECTION_MIN_MS", default_value_t = RaftTimings::default().election_min_ms)]
    pub election_min_ms: u64,
    /// Largest election timeout, in milliseconds.
    #[arg(long, env = "LEASECORE_ELECTION_MAX_MS", default_value_t = RaftTimings::default().election_max_ms)]
    pub election_max_ms: u64,
    /// Snapshot and compact the log every this many applied entries, once the log is at least
    /// as large as the state (a snapshot copies the whole state: its cost is kept in proportion
    /// to the writes it compacts).
    #[arg(long, env = "LEASECORE_SNAPSHOT_THRESHOLD", default_value_t = 10_000)]
    pub snapshot_threshold: u64,
    /// The largest value, in bytes.
    #[arg(long, env = "LEASECORE_MAX_VALUE_BYTES", default_value_t = DEFAULT_MAX_VALUE_BYTES)]
    pub max_value_bytes: usize,
    /// The most leases (members included) the cluster holds; registrations past it get 429.
    #[arg(long, env = "LEASECORE_MAX_LEASES", default_value_t = DEFAULT_MAX_LEASES)]
    pub max_leases: usize,
    /// sled page cache, in MiB.
    #[arg(long, env = "LEASECORE_CACHE_MB", default_value_t = 64)]
    pub cache_mb: u64,
    /// Flease and PaxosLease lease time (PaxosLease's maximum lease time), in milliseconds.
    #[arg(long, env = "LEASECORE_FLEASE_LEASE_MS", default_value_t = 10_000)]
    pub flease_lease_ms: u64,
    /// Flease clock-skew bound between any two nodes, in milliseconds (for PaxosLease, the margin
    /// for clock-rate drift over one lease time).
    #[arg(long, env = "LEASECORE_FLEASE_EPS_MS", default_value_t = 500)]
    pub flease_eps_ms: u64,
    /// Flease phase timeout, in milliseconds.
    #[arg(long, env = "LEASECORE_FLEASE_ROUND_MS", default_value_t = 500)]
    pub flease_round_ms: u64,
    /// How long an auth token is valid, in seconds.
    #[arg(long, env = "LEASECORE_AUTH_TOKEN_TTL", default_value_t = 300)]
    pub auth_token_ttl: u64,
    /// What to log: a level (error, warn, info, debug, trace) or per-module directives, e.g.
    /// `info,leasecore::runtime=debug`. openraft's own messages are off by default (peer
    /// outages are logged once each by leasecore); `info,openraft=info` shows them.
    #[arg(long, env = "LEASECORE_LOG", default_value = DEFAULT_LOG)]
    pub log: String,
    /// Log line format: `text` (colour only on a terminal) or `json` (one object per line,
    /// for collectors).
    #[arg(long, env = "LEASECORE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Async worker threads. Default: the cores available, shared among the nodes listed at
    /// loopback addresses when this node is one of them (a local cluster on one machine: 2
    /// cores and 3 nodes give each 1); a node alone on its machine gets one per core. Set it
    /// for nodes that share a machine without loopback addresses (containers of one host).
    #[arg(long, env = "LEASECORE_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub worker_threads: Option<u16>,
    #[command(flatten)]
    pub resources: super::resources::ResourceArgs,
    #[command(flatten)]
    pub tls: super::tls::ServeTlsArgs,
}

impl ServeArgs {
    /// The async worker threads this node runs, and how that was chosen
    /// (`leasecore::node::workers`).
    pub fn workers(&self) -> (usize, WorkerSizing) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let own = self.advertise.as_deref().unwrap_or(&self.listen);
        let none = BTreeMap::new();
        worker_threads(
            self.worker_threads.map(usize::from),
            cores,
            self.id,
            self.peers.as_ref().unwrap_or(&none),
            own,
        )
    }
}

/// The default log filter: leasecore at info; openraft's retries and ignored-message
/// warnings are noise once leasecore reports peer outages itself. (With openraft's logs on, a
/// leader under writes also logs every commit notice as a failed heartbeat, "commit notice
/// sent; its answer is not awaited": that is how openraft is told to record nothing for it,
/// see `raft::network::connection`.)
pub const DEFAULT_LOG: &str = "info,openraft=off,sled=warn";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Logs go to stderr; colour only when stderr is a terminal and `NO_COLOR` is unset. Set once
/// per process: by `serve` from `--log`, by the client commands from `RUST_LOG`.
pub(super) fn init_logging(filter: &str, format: LogFormat) -> Result<(), String> {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|e| format!("--log {filter:?}: {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
            .init(),
    }
    Ok(())
}

pub fn parse_peers(s: &str) -> Result<BTreeMap<NodeId, String>, String> {
    let mut peers = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not ID=HOST:PORT"))?;
        let id: NodeId = id
            .trim()
            .parse()
            .map_err(|_| format!("{id:?} is not a node id"))?;
        if peers.insert(id, addr.trim().to_string()).is_some() {
            return Err(format!("node id {id} appears twice"));
        }
    }
    if peers.is_empty() {
        return Err("--peers is empty".into());
    }
    Ok(peers)
}

/// Run a node. `workers` is the runtime's worker count as `main` chose it
/// ([`ServeArgs::workers`]), reported here once logging is set up.
pub async fn run(args: ServeArgs, workers: (usize, WorkerSizing)) -> ExitCode {
    if let Err(e) = init_logging(&args.log, args.log_format) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    leasecore::node::exit_on_panic();
    match workers {
        (n, WorkerSizing::Given) => tracing::info!(workers = n, "async workers: as set"),
        (n, WorkerSizing::Shared { cores, nodes }) => tracing::info!(
            workers = n,
            cores,
            nodes_here = nodes,
            "async workers: the cores shared among the listed nodes on this machine's loopback \
             (--worker-threads sets them)"
        ),
    }
    let data = args
        .data
        .unwrap_or_else(|| PathBuf::from(format!("leasecore-data/node-{}", args.id)));
    let mut cfg = NodeConfig::new(args.id, data);
    cfg.listen = args.listen;
    cfg.advertise = args.advertise;
    cfg.peers = args.peers.unwrap_or_default();
    cfg.join = args.join;
    cfg.auto_replace = !args.no_auto_replace;
    cfg.timings = RaftTimings {
        heartbeat_ms: args.heartbeat_ms,
        election_min_ms: args.election_min_ms,
        election_max_ms: args.election_max_ms,
    };
    cfg.snapshot_threshold = args.snapshot_threshold;
    cfg.limits.max_value_bytes = args.max_value_bytes;
    cfg.limits.max_leases = args.max_leases;
    cfg.limits.max_txn_ops = args.max_txn_ops.max(1);
    // Never below what a transaction that writes may answer.
    cfg.limits.max_read_answer_bytes = args
        .etcd_max_read_answer_bytes
        .max(leasecore::domain::range::MAX_RESULT_BYTES);
    cfg.etcd_listen = args.etcd_listen;
    cfg.auto_compaction = match leasecore::domain::auto_compact::Retention::parse(
        &args.auto_compaction_mode,
        &args.auto_compaction_retention,
    ) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    cfg.cache_bytes = args.cache_mb << 20;
    cfg.auth_token_ttl_ms = args.auth_token_ttl.saturating_mul(1000);
    args.resources.apply(&mut cfg);
    if let Err(e) = args.tls.apply(&mut cfg) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    cfg.flease = FleaseConfig::derived(
        args.flease_lease_ms,
        args.flease_eps_ms,
        args.flease_round_ms,
    );
    let node = match Node::start(cfg).await {
        Ok(node) => node,
        Err(e @ (NodeError::Refused(_) | NodeError::Storage(StorageError::Format { .. }))) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_REFUSED);
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let failed = node.cancelled();
    let fatal = tokio::select! {
        _ = shutdown_signal() => false,
        _ = failed.cancelled() => true,
    };
    if fatal {
        eprintln!("error: the Raft core stopped; the node exits (see the log above)");
        node.shutdown().await;
        return ExitCode::from(EXIT_FATAL);
    }
    tracing::info!("signal received; shutting down");
    node.shutdown().await;
    ExitCode::SUCCESS
}
