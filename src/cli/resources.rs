//! `leasecore serve` flags for resource limits and the peer listener (issue 10): a flattened
//! argument group, so that `main.rs` carries only a one-line hook.
//!
//! Every flag reads an environment variable too (`LEASECORE_*`), like the other serve flags.

use std::time::Duration;

use clap::Args;
use leasecore::domain::resources::{DEFAULT_QUOTA_BYTES, Quota};
use leasecore::http::listener::ListenerLimits;
use leasecore::node::{DEFAULT_SNAPSHOT_LOG_BYTES, NodeConfig};

#[derive(Args, Debug)]
pub struct ResourceArgs {
    /// Address to listen on for peers (Raft, forwarded calls, Flease). Default: --listen with the
    /// port + 1000. Peers always reach a node at its advertised address's port + 1000.
    #[arg(long, env = "LEASECORE_PEER_LISTEN")]
    pub peer_listen: Option<String>,
    /// Client connections held at once; at the cap the longest-idle one is closed for a new
    /// one (a connection with a request in flight is never closed).
    #[arg(long, env = "LEASECORE_MAX_CONNECTIONS", default_value_t = ListenerLimits::CLIENT.max_connections)]
    pub max_connections: usize,
    /// Peer connections held at once (the peer listener's own cap).
    #[arg(long, env = "LEASECORE_PEER_MAX_CONNECTIONS", default_value_t = ListenerLimits::PEER.max_connections)]
    pub peer_max_connections: usize,
    /// A client connection must complete each request's headers within this many
    /// milliseconds of connecting or of its previous response, else it is closed (slow or
    /// idle clients).
    #[arg(long, env = "LEASECORE_HEADER_TIMEOUT_MS", default_value_t = ListenerLimits::CLIENT.header_timeout.as_millis() as u64)]
    pub header_timeout_ms: u64,
    /// A client (on the client port and the etcd port) that takes none of its answers' bytes
    /// for this many milliseconds is disconnected: a write its socket does not take, or a
    /// watch stream whose queue stays full, for that long (a client that stopped reading).
    #[arg(long, env = "LEASECORE_WRITE_TIMEOUT_MS", default_value_t = ListenerLimits::CLIENT.write_timeout.as_millis() as u64)]
    pub write_timeout_ms: u64,
    /// Storage quota in bytes (live keys and values plus the Raft log): past it writes get
    /// 507 quota_exceeded; reads, deletes and revokes still work.
    #[arg(long, env = "LEASECORE_QUOTA_BYTES", default_value_t = DEFAULT_QUOTA_BYTES)]
    pub quota_bytes: u64,
    /// Snapshot and purge the log once its entries hold this many bytes (besides
    /// --snapshot-threshold entries).
    #[arg(long, env = "LEASECORE_SNAPSHOT_LOG_BYTES", default_value_t = DEFAULT_SNAPSHOT_LOG_BYTES)]
    pub snapshot_log_bytes: u64,
}

impl ResourceArgs {
    /// Put these settings into `cfg`.
    pub fn apply(self, cfg: &mut NodeConfig) {
        cfg.peer_listen = self.peer_listen;
        cfg.client_limits = ListenerLimits {
            max_connections: self.max_connections,
            header_timeout: Duration::from_millis(self.header_timeout_ms.max(1)),
            write_timeout: Duration::from_millis(self.write_timeout_ms.max(1)),
            ..ListenerLimits::CLIENT
        };
        cfg.etcd_limits.write_timeout = cfg.client_limits.write_timeout;
        cfg.peer_limits.max_connections = self.peer_max_connections;
        cfg.quota = Quota {
            max_bytes: self.quota_bytes,
        };
        cfg.snapshot_log_bytes = self.snapshot_log_bytes;
    }
}
