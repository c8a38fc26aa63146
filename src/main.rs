//! The `leasecore` binary: a node (`serve`) and the client commands, in one.
//!
//! Every flag of `serve` also reads from an environment variable (`LEASECORE_ID`,
//! `LEASECORE_LISTEN`, ...), for containers. Client commands take `--endpoints` (or
//! `LEASECORE_ENDPOINTS`) and fail over between them. Output is for people; `--json` prints the
//! server's documents as they are.

#[path = "cli/auth.rs"]
mod cli_auth;
#[path = "cli/snapshot.rs"]
mod cli_snapshot;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use leasecore::bench::{self, BenchOptions, Workload};
use leasecore::client::agent::{AgentConfig, AgentEvent, run_agent};
use leasecore::client::{
    Client, ClientError, LeaseKeeper, LeaseStatus, WatchFilter, WatchItem, Watcher,
};
use leasecore::domain::command::{Cause, EventKind};
use leasecore::domain::flease::{FleaseConfig, Protocol};
use leasecore::domain::limits::{DEFAULT_MAX_LEASES, DEFAULT_MAX_VALUE_BYTES};
use leasecore::domain::types::NodeId;
use leasecore::node::{EXIT_FATAL, EXIT_REFUSED, Node, NodeConfig, NodeError, RaftTimings};
use leasecore::runtime::flease::LeaseView;
use leasecore::wire::LeaseInfo;
use serde::Serialize;
use std::sync::Arc;

#[path = "cli/resources.rs"]
mod cli_resources;
#[path = "cli/tls.rs"]
mod cli_tls;
#[path = "cli/cluster_health.rs"]
mod cluster_health;

#[derive(Parser)]
#[command(
    name = "leasecore",
    version,
    about = "A Consistent Core: Raft-replicated keys, leases and watches"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node.
    Serve(ServeArgs),
    /// Turn authentication on or off, or show whether it is on.
    Auth {
        #[command(subcommand)]
        cmd: cli_auth::AuthCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Manage users (root only once authentication is on).
    User {
        #[command(subcommand)]
        cmd: cli_auth::UserCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Manage roles and their permissions (root only once authentication is on).
    Role {
        #[command(subcommand)]
        cmd: cli_auth::RoleCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Read and write keys.
    Kv {
        #[command(subcommand)]
        cmd: KvCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Register, refresh, inspect and revoke leases.
    Lease {
        #[command(subcommand)]
        cmd: LeaseCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Print changes to a key or prefix as they happen, resuming by revision across reconnects.
    Watch {
        /// Follow every key under this prefix (default: every key).
        #[arg(long, conflicts_with = "key")]
        prefix: Option<String>,
        /// Follow exactly this key.
        #[arg(long)]
        key: Option<String>,
        /// Start at this revision (inclusive); default: changes from now on.
        #[arg(long)]
        from_revision: Option<u64>,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Decentralized per-resource leases (Flease): acquire, release, inspect.
    Flease {
        #[command(subcommand)]
        cmd: FleaseCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// The same with PaxosLease (no clock synchronization; a separate resource namespace).
    Paxoslease {
        #[command(subcommand)]
        cmd: FleaseCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Register and list members (nodes that heartbeat).
    Member {
        #[command(subcommand)]
        cmd: MemberCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Run beside a service: register it as a member, heartbeat, deregister on SIGTERM/SIGINT.
    Agent {
        /// The member id (unique in the cluster).
        #[arg(long)]
        id: String,
        /// The address others should use to reach the service.
        #[arg(long)]
        address: String,
        #[arg(long, default_value_t = 5000)]
        ttl_ms: u64,
        /// Metadata, repeatable: --meta zone=a --meta role=db
        #[arg(long, value_parser = parse_meta)]
        meta: Vec<(String, String)>,
        /// Print every heartbeat, not only changes.
        #[arg(long)]
        verbose: bool,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Inspect and change the cluster's membership.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Drive a running cluster with load and report throughput and latency.
    Bench(BenchArgs),
    /// Back up a running cluster, inspect a backup, seed a new cluster from one.
    Snapshot {
        #[command(subcommand)]
        cmd: cli_snapshot::SnapshotCmd,
        #[command(flatten)]
        conn: ConnArgs,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// This node's id (stable across restarts).
    #[arg(long, env = "LEASECORE_ID", default_value_t = 1)]
    id: NodeId,
    /// Address to listen on for clients (peers use --peer-listen).
    #[arg(long, env = "LEASECORE_LISTEN", default_value = "127.0.0.1:7001")]
    listen: String,
    /// Address peers and clients reach this node at (default: this node's --peers entry, else
    /// --listen).
    #[arg(long, env = "LEASECORE_ADVERTISE")]
    advertise: Option<String>,
    /// Data directory (default: ./leasecore-data/node-<id>).
    #[arg(long, env = "LEASECORE_DATA")]
    data: Option<PathBuf>,
    /// The initial voters, this node included: ID=HOST:PORT,ID=HOST:PORT,...
    #[arg(long, env = "LEASECORE_PEERS", value_parser = parse_peers)]
    peers: Option<BTreeMap<NodeId, String>>,
    /// Do not form a cluster: wait to be added to one (`leasecore cluster add`).
    #[arg(long, env = "LEASECORE_JOIN")]
    join: bool,
    /// Leader heartbeat interval, in milliseconds.
    #[arg(long, env = "LEASECORE_HEARTBEAT_MS", default_value_t = RaftTimings::default().heartbeat_ms)]
    heartbeat_ms: u64,
    /// Smallest election timeout, in milliseconds.
    #[arg(long, env = "LEASECORE_ELECTION_MIN_MS", default_value_t = RaftTimings::default().election_min_ms)]
    election_min_ms: u64,
    /// Largest election timeout, in milliseconds.
    #[arg(long, env = "LEASECORE_ELECTION_MAX_MS", default_value_t = RaftTimings::default().election_max_ms)]
    election_max_ms: u64,
    /// Snapshot and compact the log every this many applied entries.
    #[arg(long, env = "LEASECORE_SNAPSHOT_THRESHOLD", default_value_t = 10_000)]
    snapshot_threshold: u64,
    /// The largest value, in bytes.
    #[arg(long, env = "LEASECORE_MAX_VALUE_BYTES", default_value_t = DEFAULT_MAX_VALUE_BYTES)]
    max_value_bytes: usize,
    /// The most leases (members included) the cluster holds; registrations past it get 429.
    #[arg(long, env = "LEASECORE_MAX_LEASES", default_value_t = DEFAULT_MAX_LEASES)]
    max_leases: usize,
    /// sled page cache, in MiB.
    #[arg(long, env = "LEASECORE_CACHE_MB", default_value_t = 64)]
    cache_mb: u64,
    /// Flease and PaxosLease lease time (PaxosLease's maximum lease time), in milliseconds.
    #[arg(long, env = "LEASECORE_FLEASE_LEASE_MS", default_value_t = 10_000)]
    flease_lease_ms: u64,
    /// Flease clock-skew bound between any two nodes, in milliseconds (for PaxosLease, the margin
    /// for clock-rate drift over one lease time).
    #[arg(long, env = "LEASECORE_FLEASE_EPS_MS", default_value_t = 500)]
    flease_eps_ms: u64,
    /// Flease phase timeout, in milliseconds.
    #[arg(long, env = "LEASECORE_FLEASE_ROUND_MS", default_value_t = 500)]
    flease_round_ms: u64,
    /// How long an auth token is valid, in seconds.
    #[arg(long, env = "LEASECORE_AUTH_TOKEN_TTL", default_value_t = 300)]
    auth_token_ttl: u64,
    #[command(flatten)]
    resources: cli_resources::ResourceArgs,
    #[command(flatten)]
    tls: cli_tls::ServeTlsArgs,
}

#[derive(Args, Clone)]
struct ConnArgs {
    /// Nodes to talk to, comma-separated; the client fails over between them.
    #[arg(
        long,
        global = true,
        env = "LEASECORE_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:7001"
    )]
    endpoints: Vec<String>,
    /// Print the server's JSON documents as they are.
    #[arg(long, global = true)]
    json: bool,
    #[command(flatten)]
    tls: cli_tls::ClientTlsArgs,
    /// Authenticate as this user: name:password, or name (the password is then asked for).
    #[arg(long, global = true, env = "LEASECORE_USER", hide_env_values = true)]
    user: Option<String>,
    /// A bearer token (from `POST /v1/auth/authenticate`), when --user is not given.
    #[arg(long, global = true, env = "LEASECORE_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl ConnArgs {
    /// The client of a command: endpoints plus credentials or a token. Every client
    /// command builds its clients through here (or after it: it also installs the TLS flags
    /// for the whole process).
    fn client(&self) -> Result<Client, ClientError> {
        self.tls.install()?;
        cli_auth::client(&self.endpoints, self.user.as_deref(), self.token.as_deref())
    }

    /// A token for calls made outside [`Client`], if the command authenticates (installs the
    /// TLS flags too).
    async fn bearer(&self) -> Result<Option<String>, ClientError> {
        self.tls.install()?;
        cli_auth::token(&self.endpoints, self.user.as_deref(), self.token.as_deref()).await
    }
}

#[derive(Subcommand)]
enum KvCmd {
    /// Set a key.
    Put {
        key: String,
        value: String,
        /// Attach the key to this lease.
        #[arg(long)]
        lease: Option<String>,
        /// Only if the key's mod revision is this (0: only if it does not exist).
        #[arg(long)]
        prev_revision: Option<u64>,
    },
    /// Print a key's value.
    Get {
        key: String,
        /// Serve from the answering node's applied state, without a quorum round.
        #[arg(long)]
        local: bool,
    },
    /// Delete a key.
    Del {
        key: String,
        #[arg(long)]
        prev_revision: Option<u64>,
    },
    /// List keys under a prefix.
    List {
        #[arg(default_value = "")]
        prefix: String,
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long)]
        local: bool,
    },
}

#[derive(Subcommand)]
enum LeaseCmd {
    /// Register a lease.
    Grant {
        name: String,
        /// Time to live, in milliseconds.
        #[arg(long)]
        ttl_ms: u64,
    },
    /// Refresh a lease once.
    Refresh { name: String },
    /// Revoke a lease, deleting its keys.
    Revoke { name: String },
    /// Show a lease: TTL, time left on the leader, revision, keys.
    Get { name: String },
    /// List leases.
    List {
        #[arg(default_value = "")]
        prefix: String,
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Keep a lease alive (registering it if --ttl-ms is given and it does not exist) until
    /// stopped, printing each refresh.
    Keepalive {
        name: String,
        #[arg(long)]
        ttl_ms: Option<u64>,
        /// Revoke the lease when stopped (Ctrl-C / SIGTERM).
        #[arg(long)]
        revoke_on_exit: bool,
    },
}

#[derive(Subcommand)]
enum FleaseCmd {
    /// Acquire (or renew) a resource for an owner; with --hold, keep renewing until stopped,
    /// then release.
    Acquire {
        resource: String,
        #[arg(long)]
        owner: String,
        #[arg(long)]
        hold: bool,
    },
    /// Release an owner's lease on a resource.
    Release {
        resource: String,
        #[arg(long)]
        owner: String,
    },
    /// What the answering node knows of a resource.
    Get { resource: String },
}

#[derive(Subcommand)]
enum MemberCmd {
    /// List the live members.
    List,
    /// Register a member once (it expires after its TTL unless something heartbeats it).
    Register {
        #[arg(long)]
        id: String,
        #[arg(long)]
        address: String,
        #[arg(long, default_value_t = 5000)]
        ttl_ms: u64,
        #[arg(long, value_parser = parse_meta)]
        meta: Vec<(String, String)>,
    },
    /// Heartbeat a member once.
    Heartbeat { id: String },
    /// Deregister a member.
    Leave { id: String },
}

fn parse_meta(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Show the leader, terms, indexes and members (reachability, last contact, lag). Exits
    /// non-zero when the node knows no leader.
    Status {
        /// Only ask each endpoint's /readyz; exit non-zero unless all are ready (healthchecks).
        #[arg(long)]
        ready: bool,
    },
    /// Add a node (it must be running with --join): learner first, then voter.
    Add { id: NodeId, address: String },
    /// Remove a node from the membership.
    Remove { id: NodeId },
}

#[derive(Args)]
struct BenchArgs {
    /// put, get (linearizable), get-local, lease-grant, lease-refresh, flease-acquire,
    /// flease-contended, paxoslease-acquire, paxoslease-contended; or an experiment: watch
    /// (wake-up latency at --watchers), expiry (lateness of --leases never refreshed),
    /// expiry-churn (the same, registered over --duration seconds while scripts/lease-churn.sh
    /// kills leaders), mass-expiry (--leases all due at the same instant, start + --ttl-ms:
    /// write stall, leader changes, apply lag),
    /// lease-memory (resident bytes per lease with one key, at --leases), flease-memory and
    /// paxoslease-memory (resident bytes per idle resource, at --resources; serve with a lease
    /// time longer than the run so that no cell is collected meanwhile).
    workload: String,
    /// Watchers for `watch`.
    #[arg(long, default_value_t = 1000)]
    watchers: usize,
    /// `watch` over one SSE stream per watcher instead of long polls.
    #[arg(long)]
    sse: bool,
    /// `watch` with the watchers spread over this many multi-watch streams
    /// (`POST /v1/watches`), as etcd clients multiplex watches on a few gRPC streams.
    #[arg(long, default_value_t = 0)]
    streams: usize,
    /// Puts observed by the watchers in `watch`.
    #[arg(long, default_value_t = 20)]
    events: usize,
    /// Leases for `expiry` and `lease-memory`.
    #[arg(long, default_value_t = 10_000)]
    leases: usize,
    /// Resources for `flease-memory` and `paxoslease-memory`.
    #[arg(long, default_value_t = 1_000_000)]
    resources: usize,
    /// TTL of the leases in `expiry`.
    #[arg(long, default_value_t = 5000)]
    ttl_ms: u64,
    #[command(flatten)]
    conn: ConnArgs,
    /// Concurrent connections (each sends one request at a time).
    #[arg(long, short = 'c', default_value_t = 16)]
    connections: usize,
    /// Seconds to run.
    #[arg(long, short = 'd', default_value_t = 10.0)]
    duration: f64,
    /// Distinct keys written and read.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Value size in bytes.
    #[arg(long, default_value_t = 64)]
    value_size: usize,
}

fn parse_peers(s: &str) -> Result<BTreeMap<NodeId, String>, String> {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve(args).await,
            Command::Auth { cmd, conn } => {
                report(async { cli_auth::auth(cmd, &conn.client()?, conn.json).await }.await)
            }
            Command::User { cmd, conn } => {
                report(async { cli_auth::user(cmd, &conn.client()?, conn.json).await }.await)
            }
            Command::Role { cmd, conn } => {
                report(async { cli_auth::role(cmd, &conn.client()?, conn.json).await }.await)
            }
            Command::Kv { cmd, conn } => report(kv(cmd, &conn).await),
            Command::Lease { cmd, conn } => report(lease(cmd, &conn).await),
            Command::Cluster { cmd, conn } => report(cluster(cmd, &conn).await),
            Command::Watch {
                prefix,
                key,
                from_revision,
                conn,
            } => report(watch(prefix, key, from_revision, &conn).await),
            Command::Member { cmd, conn } => report(member(cmd, &conn).await),
            Command::Flease { cmd, conn } => report(flease(Protocol::Flease, cmd, &conn).await),
            Command::Paxoslease { cmd, conn } => {
                report(flease(Protocol::PaxosLease, cmd, &conn).await)
            }
            Command::Agent {
                id,
                address,
                ttl_ms,
                meta,
                verbose,
                conn,
            } => {
                let cfg = AgentConfig {
                    id,
                    address,
                    ttl_ms,
                    meta: meta.into_iter().collect(),
                };
                report(agent(cfg, verbose, &conn).await)
            }
            Command::Bench(args) => report(run_bench(args).await),
            Command::Snapshot { cmd, conn } => match conn.bearer().await {
                Ok(token) => cli_snapshot::run(cmd, &conn.endpoints, conn.json, token).await,
                Err(e) => report(Err(e)),
            },
        }
    })
}

fn report(result: Result<(), ClientError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: ServeArgs) -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LEASECORE_LOG")
                .unwrap_or_else(|_| "info,openraft=warn,sled=warn".into()),
        )
        .init();
    leasecore::node::exit_on_panic();
    let data = args
        .data
        .unwrap_or_else(|| PathBuf::from(format!("leasecore-data/node-{}", args.id)));
    let mut cfg = NodeConfig::new(args.id, data);
    cfg.listen = args.listen;
    cfg.advertise = args.advertise;
    cfg.peers = args.peers.unwrap_or_default();
    cfg.join = args.join;
    cfg.timings = RaftTimings {
        heartbeat_ms: args.heartbeat_ms,
        election_min_ms: args.election_min_ms,
        election_max_ms: args.election_max_ms,
    };
    cfg.snapshot_threshold = args.snapshot_threshold;
    cfg.limits.max_value_bytes = args.max_value_bytes;
    cfg.limits.max_leases = args.max_leases;
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
        Err(e @ NodeError::Refused(_)) => {
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

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// A 404 the client turned into `None`, back as an error for the command line.
fn not_found(code: &str, message: String) -> ClientError {
    ClientError::Api {
        status: 404,
        code: code.into(),
        message,
        body: serde_json::Value::Null,
    }
}

/// Print the server's document with `--json`, else the person-readable line(s).
fn show<T: Serialize>(json: bool, doc: &T, for_people: impl FnOnce(&T)) {
    if json {
        print_json(doc);
    } else {
        for_people(doc);
    }
}

fn print_json<T: Serialize>(v: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    );
}

async fn kv(cmd: KvCmd, conn: &ConnArgs) -> Result<(), ClientError> {
    let client = conn.client()?;
    match cmd {
        KvCmd::Put {
            key,
            value,
            lease,
            prev_revision,
        } => {
            let r = client
                .put(&key, &value, lease.as_deref(), prev_revision)
                .await?;
            show(conn.json, &r, |r| {
                println!("OK (revision {})", r.revision);
            });
        }
        KvCmd::Get { key, local } => match client.get(&key, local).await? {
            Some(r) if conn.json => print_json(&r),
            Some(r) => println!("{}", r.kv.value),
            None => {
                return Err(not_found(
                    "key_not_found",
                    format!("key {key:?} does not exist"),
                ));
            }
        },
        KvCmd::Del { key, prev_revision } => {
            let r = client.delete(&key, prev_revision).await?;
            if conn.json {
                print_json(&r);
            } else if r.deleted == 0 {
                println!("no such key (revision {})", r.revision);
            } else {
                println!("deleted (revision {})", r.revision);
            }
        }
        KvCmd::List {
            prefix,
            limit,
            local,
        } => {
            let r = client.list(&prefix, limit, local).await?;
            show(conn.json, &r, |r| {
                for item in &r.items {
                    println!("{} = {}", item.key, item.value);
                }
                let more = if r.more { " (more: raise --limit)" } else { "" };
                eprintln!("{} keys at revision {}{more}", r.items.len(), r.revision);
            });
        }
    }
    Ok(())
}

fn print_lease(l: &LeaseInfo) {
    let remaining = l
        .remaining_ms
        .map(|r| format!("{r} ms left"))
        .unwrap_or_else(|| "not tracked".into());
    println!(
        "{}  ttl {} ms, {remaining}, revision {}, {} key(s){}",
        l.name,
        l.ttl_ms,
        l.revision,
        l.keys.len(),
        if l.keys.is_empty() {
            String::new()
        } else {
            format!(": {}", l.keys.join(", "))
        }
    );
}

async fn lease(cmd: LeaseCmd, conn: &ConnArgs) -> Result<(), ClientError> {
    let client = Arc::new(conn.client()?);
    match cmd {
        LeaseCmd::Grant { name, ttl_ms } => {
            let r = client.grant(&name, ttl_ms).await?;
            show(conn.json, &r, |r| {
                println!(
                    "granted {} (ttl {} ms, revision {})",
                    r.name, r.ttl_ms, r.revision
                );
            });
        }
        LeaseCmd::Refresh { name } => {
            let r = client.refresh(&name, None).await?;
            show(conn.json, &r, |r| {
                println!("refreshed {} ({} ms left)", r.name, r.remaining_ms);
            });
        }
        LeaseCmd::Revoke { name } => {
            let r = client.revoke(&name).await?;
            show(conn.json, &r, |r| {
                println!(
                    "revoked {name} (revision {}, {} key(s) deleted)",
                    r.revision,
                    r.deleted_keys.len()
                );
            });
        }
        LeaseCmd::Get { name } => match client.lease(&name).await? {
            Some(l) if conn.json => print_json(&l),
            Some(l) => print_lease(&l),
            None => {
                return Err(not_found(
                    "lease_not_found",
                    format!("lease {name:?} does not exist"),
                ));
            }
        },
        LeaseCmd::List { prefix, limit } => {
            let r = client.leases(&prefix, limit).await?;
            show(conn.json, &r, |r| {
                for l in &r.leases {
                    print_lease(l);
                }
                eprintln!("{} lease(s) at revision {}", r.leases.len(), r.revision);
            });
        }
        LeaseCmd::Keepalive {
            name,
            ttl_ms,
            revoke_on_exit,
        } => keepalive(client, &name, ttl_ms, revoke_on_exit, conn.json).await?,
    }
    Ok(())
}

async fn keepalive(
    client: Arc<Client>,
    name: &str,
    ttl_ms: Option<u64>,
    revoke_on_exit: bool,
    json: bool,
) -> Result<(), ClientError> {
    let ttl_ms = match ttl_ms {
        Some(t) => t,
        None => match client.lease(name).await? {
            Some(l) => l.ttl_ms,
            None => {
                return Err(ClientError::Usage(format!(
                    "lease {name:?} does not exist: give --ttl-ms to register it"
                )));
            }
        },
    };
    let keeper = LeaseKeeper::start(client, name, ttl_ms, true).await?;
    let mut status = keeper.watch();
    let report = |s: &LeaseStatus| match s {
        LeaseStatus::Valid {
            revision,
            refreshes,
            ..
        } if json => println!(
            "{}",
            serde_json::json!({"lease": name, "ttl_ms": ttl_ms, "revision": revision, "refreshes": refreshes})
        ),
        LeaseStatus::Valid {
            revision,
            refreshes,
            ..
        } => println!("{name}: alive (ttl {ttl_ms} ms, revision {revision}, refresh #{refreshes})"),
        LeaseStatus::Lost { reason } => eprintln!("{name}: LOST: {reason}"),
    };
    report(&status.borrow_and_update());
    let stopped = shutdown_signal();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            changed = status.changed() => {
                if changed.is_err() {
                    break;
                }
                let s = status.borrow_and_update().clone();
                report(&s);
                if let LeaseStatus::Lost { reason } = s {
                    return Err(ClientError::Unavailable(reason));
                }
            }
        }
    }
    keeper.stop(revoke_on_exit).await?;
    if revoke_on_exit {
        eprintln!("{name}: revoked");
    }
    Ok(())
}

async fn watch(
    prefix: Option<String>,
    key: Option<String>,
    from_revision: Option<u64>,
    conn: &ConnArgs,
) -> Result<(), ClientError> {
    let client = Arc::new(conn.client()?);
    let filter = match key {
        Some(k) => WatchFilter::Key(k),
        None => WatchFilter::Prefix(prefix.unwrap_or_default()),
    };
    let mut watcher = Watcher::new(client, filter, from_revision);
    let stopped = shutdown_signal();
    tokio::pin!(stopped);
    loop {
        let item = tokio::select! {
            _ = &mut stopped => return Ok(()),
            item = watcher.next() => item?,
        };
        match item {
            WatchItem::Event(e) if conn.json => println!(
                "{}",
                serde_json::to_string(&e).expect("plain data serializes")
            ),
            WatchItem::Event(e) => {
                let cause = match e.cause {
                    Cause::Client => String::new(),
                    other => format!(
                        ", {}",
                        serde_json::to_string(&other)
                            .unwrap_or_default()
                            .trim_matches('"')
                    ),
                };
                match e.kind {
                    EventKind::Put => println!(
                        "PUT {} = {} (revision {}{cause})",
                        e.key,
                        e.value.unwrap_or_default(),
                        e.revision
                    ),
                    EventKind::Delete => {
                        println!("DELETE {} (revision {}{cause})", e.key, e.revision)
                    }
                }
            }
            WatchItem::Resync { revision, items } => {
                if conn.json {
                    println!(
                        "{}",
                        serde_json::json!({"type": "resync", "revision": revision, "items": items})
                    );
                } else {
                    println!(
                        "RESYNC at revision {revision}: history compacted, {} key(s) now:",
                        items.len()
                    );
                    for kv in items {
                        println!("  {} = {}", kv.key, kv.value);
                    }
                }
            }
        }
    }
}

fn print_flease(v: &LeaseView) {
    match (&v.holder, v.granted) {
        (Some(h), Some(true)) => println!(
            "{}: granted to {h} for {} ms (epoch {})",
            v.resource, v.valid_ms, v.epoch
        ),
        (Some(h), _) => println!(
            "{}: held by {h} for {} ms more (epoch {})",
            v.resource, v.valid_ms, v.epoch
        ),
        (None, _) => println!("{}: free", v.resource),
    }
}

async fn flease(proto: Protocol, cmd: FleaseCmd, conn: &ConnArgs) -> Result<(), ClientError> {
    let client = conn.client()?;
    match cmd {
        FleaseCmd::Acquire {
            resource,
            owner,
            hold,
        } => {
            let v = client.resource_acquire(proto, &resource, &owner).await?;
            show(conn.json, &v, print_flease);
            if !hold {
                return Ok(());
            }
            if v.granted != Some(true) {
                return Err(ClientError::Unavailable(format!(
                    "{resource} is held by someone else"
                )));
            }
            // Renew at half the validity; stop acting (and exit) if a renewal fails in time.
            let stopped = shutdown_signal();
            tokio::pin!(stopped);
            let mut valid_ms = v.valid_ms;
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tokio::time::sleep(Duration::from_millis((valid_ms / 2).max(1))) => {}
                }
                let v = client.resource_acquire(proto, &resource, &owner).await?;
                show(conn.json, &v, print_flease);
                if v.granted != Some(true) {
                    return Err(ClientError::Unavailable(format!("lost {resource}")));
                }
                valid_ms = v.valid_ms;
            }
            let released = client.resource_release(proto, &resource, &owner).await?;
            eprintln!("{resource}: released ({released})");
        }
        FleaseCmd::Release { resource, owner } => {
            let released = client.resource_release(proto, &resource, &owner).await?;
            let doc = serde_json::json!({ "released": released });
            show(conn.json, &doc, |_| {
                println!(
                    "{resource}: {}",
                    if released {
                        "released"
                    } else {
                        "not held by that owner"
                    }
                )
            });
        }
        FleaseCmd::Get { resource } => {
            let v = client.resource_get(proto, &resource).await?;
            show(conn.json, &v, print_flease);
        }
    }
    Ok(())
}

async fn member(cmd: MemberCmd, conn: &ConnArgs) -> Result<(), ClientError> {
    let client = conn.client()?;
    match cmd {
        MemberCmd::List => {
            let r = client.members().await?;
            show(conn.json, &r, |r| {
                for m in &r.members {
                    let meta: Vec<String> =
                        m.meta.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    println!("{}  {}  {}", m.id, m.address, meta.join(" "));
                }
                eprintln!("{} member(s) at revision {}", r.members.len(), r.revision);
            });
        }
        MemberCmd::Register {
            id,
            address,
            ttl_ms,
            meta,
        } => {
            let r = client
                .register_member(&id, &address, ttl_ms, meta.into_iter().collect())
                .await?;
            show(conn.json, &r, |r| {
                println!("registered {} (revision {})", r.id, r.revision);
            });
        }
        MemberCmd::Heartbeat { id } => {
            let r = client.heartbeat(&id, None).await?;
            show(conn.json, &r, |r| {
                println!("{}: {} ms left", r.id, r.remaining_ms);
            });
        }
        MemberCmd::Leave { id } => {
            let r = client.leave(&id).await?;
            show(conn.json, &r, |r| {
                println!("{} left (revision {})", r.id, r.revision);
            });
        }
    }
    Ok(())
}

async fn agent(cfg: AgentConfig, verbose: bool, conn: &ConnArgs) -> Result<(), ClientError> {
    let client = Arc::new(conn.client()?);
    let id = cfg.id.clone();
    run_agent(client, cfg, shutdown_signal(), |event| match event {
        AgentEvent::Heartbeat { .. } if !verbose => {}
        AgentEvent::Registered { revision } => println!("{id}: registered (revision {revision})"),
        AgentEvent::Adopted => println!("{id}: adopted its existing registration"),
        AgentEvent::Heartbeat { remaining_ms } => {
            println!("{id}: heartbeat ({remaining_ms} ms left)")
        }
        AgentEvent::HeartbeatFailed { error } => eprintln!("{id}: heartbeat failed: {error}"),
        AgentEvent::Reregistering => eprintln!("{id}: registration lost; registering again"),
        AgentEvent::Left => println!("{id}: left"),
    })
    .await
}

async fn cluster(cmd: ClusterCmd, conn: &ConnArgs) -> Result<(), ClientError> {
    let client = conn.client()?;
    let view = match cmd {
        ClusterCmd::Status { ready } => {
            let token = conn.bearer().await?;
            return cluster_health::status(&conn.endpoints, conn.json, ready, token).await;
        }
        ClusterCmd::Add { id, address } => {
            return cluster_health::add(&client, conn.json, id, &address).await;
        }
        ClusterCmd::Remove { id } => client.remove_node(id).await?,
    };
    if conn.json {
        print_json(&view);
        return Ok(());
    }
    let leader = view
        .leader_id
        .map(|l| l.to_string())
        .unwrap_or_else(|| "none".into());
    println!(
        "node {} ({}), leader {leader}, term {}, commit {}, applied {}, revision {}",
        view.node_id, view.state, view.term, view.commit_index, view.applied_index, view.revision
    );
    println!("{:>6}  {:<24}  role", "id", "address");
    for n in &view.nodes {
        let role = match (n.voter, Some(n.id) == view.leader_id) {
            (true, true) => "voter (leader)",
            (true, false) => "voter",
            (false, _) => "learner",
        };
        println!("{:>6}  {:<24}  {role}", n.id, n.address);
    }
    Ok(())
}

fn print_result<T: Serialize + std::fmt::Debug>(r: &T, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::to_string(r).expect("plain data serializes")
        );
    } else {
        println!("{r:?}");
    }
}

async fn run_bench(args: BenchArgs) -> Result<(), ClientError> {
    use leasecore::bench::experiments;
    args.conn.tls.install()?;
    match args.workload.as_str() {
        "watch" => {
            let r = experiments::watch_latency(
                &args.conn.endpoints,
                args.watchers,
                args.events,
                Duration::from_millis(200),
                args.sse,
                args.streams,
            )
            .await?;
            print_result(&r, args.conn.json);
            return Ok(());
        }
        "expiry" => {
            let r = experiments::expiry_lateness(
                &args.conn.endpoints,
                args.leases,
                args.ttl_ms,
                args.connections,
            )
            .await?;
            print_result(&r, args.conn.json);
            return Ok(());
        }
        "expiry-churn" => {
            let r = leasecore::bench::churn::expiry_under_churn(
                &args.conn.endpoints,
                args.leases,
                args.ttl_ms,
                Duration::from_secs_f64(args.duration.max(0.1)),
            )
            .await?;
            print_result(&r, args.conn.json);
            return Ok(());
        }
        "mass-expiry" => {
            let r = leasecore::bench::churn::mass_expiry(
                &args.conn.endpoints,
                args.leases,
                args.ttl_ms,
                args.connections,
            )
            .await?;
            print_result(&r, args.conn.json);
            return Ok(());
        }
        "lease-memory" => {
            let r = experiments::lease_memory(&args.conn.endpoints, args.leases).await?;
            print_result(&r, args.conn.json);
            return Ok(());
        }
        "flease-memory" | "paxoslease-memory" => {
            let proto = if args.workload.starts_with("flease") {
                Protocol::Flease
            } else {
                Protocol::PaxosLease
            };
            let r = experiments::flease_memory(&args.conn.endpoints, proto, args.resources).await?;
            print_result(&r, args.conn.json);
            return Ok(());
        }
        _ => {}
    }
    let workload: Workload = args.workload.parse().map_err(ClientError::Usage)?;
    let token = args
        .conn
        .bearer()
        .await?
        .map(leasecore::domain::auth::Secret);
    let opts = BenchOptions {
        token,
        workload,
        endpoints: args.conn.endpoints,
        connections: args.connections.max(1),
        duration: Duration::from_secs_f64(args.duration.max(0.1)),
        keys: args.keys.max(1),
        value_size: args.value_size,
    };
    let result = bench::run(&opts).await?;
    if args.conn.json {
        println!(
            "{}",
            serde_json::to_string(&result).expect("plain data serializes")
        );
    } else {
        println!("{result}");
    }
    if result.ok == 0 {
        return Err(ClientError::Unavailable(
            "no request succeeded; is the cluster running?".into(),
        ));
    }
    Ok(())
}
