//! [`NodeConfig`]: everything a node is started with, and what it derives from it (openraft's
//! configuration, the consensus timeouts).
//!
//! # What it must not do
//! Start anything: `Node::start` reads it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use openraft::SnapshotPolicy;

use super::NodeError;
use crate::domain::flease::FleaseConfig;
use crate::domain::history::HistoryLimits;
use crate::domain::limits::Limits;
use crate::domain::resources::{Quota, peer_address};
use crate::domain::types::NodeId;
use crate::http::listener::ListenerLimits;
use crate::raft::consensus::ConsensusTimeouts;
use crate::runtime::lease::DEFAULT_MIN_TTL_MS;
use crate::tls::{PeerTls, ServerTls};

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
    /// Where to listen for clients (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// Where to listen for peers (Raft, forwarded calls, Flease). Default: `listen` with the
    /// port + 1000. Peers reach this node at its advertised address with the port + 1000,
    /// whatever this says (see [`crate::domain::resources::peer_address`]).
    pub peer_listen: Option<String>,
    /// Connection cap and header timeout of the client listener.
    pub client_limits: ListenerLimits,
    /// Connection cap and header timeout of the peer listener.
    pub peer_limits: ListenerLimits,
    /// The storage quota (live keys and values plus the Raft log): past it, writes get 507.
    pub quota: Quota,
    /// Snapshot and purge the log once its entries hold this many bytes.
    pub snapshot_log_bytes: u64,
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
    /// With an empty data dir while a running cluster still lists this node: have the leader
    /// replace it (remove it, then add it back as a learner that is promoted once caught up)
    /// rather than refuse to start (see `domain::bootstrap::Start::Replace`).
    pub auto_replace: bool,
    /// How long adding a node waits for it to answer and catch up before it is promoted to
    /// voter; on timeout it stays a learner (add it again to resume waiting).
    pub catch_up_ms: u64,
    /// TLS on the client listener (`None`: plaintext). The etcd listener uses it too.
    pub client_tls: Option<ServerTls>,
    /// Where to serve etcd's v3 API (gRPC, and its JSON gateway): `None` serves none.
    pub etcd_listen: Option<String>,
    /// Connection cap and header timeout of the etcd listener.
    pub etcd_limits: ListenerLimits,
    /// Automatic MVCC compaction (etcd's `--auto-compaction-*`): `None` keeps every version
    /// until an explicit compaction.
    pub auto_compaction: Option<crate::domain::auto_compact::Retention>,
    /// Mutual TLS on the peer side, listener and outgoing client (`None`: plaintext). Every
    /// node of a cluster must agree: the scheme peers are dialed with follows this setting.
    pub peer_tls: Option<PeerTls>,
    /// How long an auth token is valid (etcd's `--auth-token-ttl`).
    pub auth_token_ttl_ms: u64,
}

/// The default of [`NodeConfig::snapshot_log_bytes`].
pub const DEFAULT_SNAPSHOT_LOG_BYTES: u64 = 64 << 20;

impl NodeConfig {
    /// Where the peer listener binds.
    pub(super) fn peer_listen_addr(&self, client: &str) -> Result<String, NodeError> {
        match &self.peer_listen {
            Some(a) => Ok(a.clone()),
            None => peer_address(client).map_err(NodeError::Config),
        }
    }

    /// The defaults of `leasecore serve` with no flags, for node `id` in `data_dir`.
    pub fn new(id: NodeId, data_dir: impl Into<PathBuf>) -> Self {
        NodeConfig {
            id,
            listen: "127.0.0.1:7001".into(),
            peer_listen: None,
            client_limits: ListenerLimits::CLIENT,
            peer_limits: ListenerLimits::PEER,
            quota: Quota::default(),
            snapshot_log_bytes: DEFAULT_SNAPSHOT_LOG_BYTES,
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
            auto_replace: true,
            catch_up_ms: 10_000,
            client_tls: None,
            etcd_listen: None,
            etcd_limits: ListenerLimits::ETCD,
            auto_compaction: None,
            peer_tls: None,
            auth_token_ttl_ms: crate::runtime::auth::DEFAULT_TOKEN_TTL_MS,
        }
    }

    pub(super) fn timeouts(&self) -> ConsensusTimeouts {
        ConsensusTimeouts {
            // Long enough to ride out one election (lease + timeout), short enough to answer.
            leader_wait: Duration::from_millis(3 * self.timings.election_max_ms),
            request: Duration::from_secs(10),
            catch_up: Duration::from_millis(self.catch_up_ms),
            election_timeout: Duration::from_millis(self.timings.election_max_ms),
        }
    }

    pub(super) fn raft_config(&self) -> Result<openraft::Config, NodeError> {
        let t = self.timings;
        let config = openraft::Config {
            cluster_name: "leasecore".into(),
            heartbeat_interval: t.heartbeat_ms,
            election_timeout_min: t.election_min_ms,
            election_timeout_max: t.election_max_ms,
            // A whole snapshot travels in one request; give it time (pitfall P3).
            install_snapshot_timeout: 60_000,
            // Snapshots are asked for by `runtime::compaction` alone, which weighs them against
            // the state's size (a snapshot every N entries of a large state stalls the node).
            snapshot_policy: SnapshotPolicy::Never,
            max_in_snapshot_log_to_keep: (self.snapshot_threshold / 2).min(1000),
            // Only openraft's blocking add_learner reads this, and leasecore does not use it:
            // a learner is promoted by `domain::health::learner_caught_up`, which also
            // requires that it answered (a lag threshold alone passes a dead node).
            replication_lag_threshold: self.snapshot_threshold.max(1) * 2,
            max_payload_entries: 512,
            // openraft 0.9 has no pre-vote: its timer would campaign from a node cut off from
            // the others. `runtime::election` is the election timer instead, and asks first.
            enable_elect: false,
            ..Default::default()
        };
        config
            .validate()
            .map_err(|e| NodeError::Config(e.to_string()))
    }
}
