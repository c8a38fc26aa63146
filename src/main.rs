//! The `leasecore` binary: a node (`serve`) and the client commands, in one.
//!
//! Every flag of `serve` also reads from an environment variable (`LEASECORE_ID`,
//! `LEASECORE_LISTEN`, ...), for containers. Client commands take `--endpoints` (or
//! `LEASECORE_ENDPOINTS`) and fail over between them. Output is for people; `--json` prints the
//! server's documents as they are.

mod cli;

/// jemalloc instead of glibc's malloc: under writes at a million keys, glibc's allocator
/// (`_int_malloc`, `malloc_consolidate`, `unlink_chunk`) took half of the leader's samples in a
/// perf profile (issue 15). jemalloc over mimalloc (used before it): with 100,000 keys of
/// 1 KB each node held 20% less resident memory (566 -> 453 MB), and puts ran 3-8% faster
/// with a lower p99; lease refreshes at 64 connections about 10% slower (`scripts/bench-ab.sh`,
/// alternated fresh clusters; docs/memory.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use leasecore::domain::flease::Protocol;

use cli::{ConnArgs, report};

#[derive(Parser)]
#[command(
    name = "leasecore",
    version,
    about = "A Consistent Core: Raft-replicated keys, leases and watches"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// The connection flags of the client commands, accepted before or after the subcommand.
    #[command(flatten)]
    conn: ConnArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node.
    Serve(Box<cli::serve::ServeArgs>),
    /// Turn authentication on or off, or show whether it is on.
    Auth {
        #[command(subcommand)]
        cmd: cli::auth::AuthCmd,
    },
    /// Manage users (root only once authentication is on).
    User {
        #[command(subcommand)]
        cmd: cli::auth::UserCmd,
    },
    /// Manage roles and their permissions (root only once authentication is on).
    Role {
        #[command(subcommand)]
        cmd: cli::auth::RoleCmd,
    },
    /// Read and write keys.
    Kv {
        #[command(subcommand)]
        cmd: cli::kv::KvCmd,
    },
    /// Register, refresh, inspect and revoke leases.
    Lease {
        #[command(subcommand)]
        cmd: cli::lease::LeaseCmd,
    },
    /// Print changes to a key or prefix as they happen, resuming by revision across reconnects.
    Watch(cli::watch::WatchArgs),
    /// Decentralized per-resource leases (Flease): acquire, release, inspect.
    Flease {
        #[command(subcommand)]
        cmd: cli::flease::FleaseCmd,
    },
    /// The same with PaxosLease (no clock synchronization; a separate resource namespace).
    Paxoslease {
        #[command(subcommand)]
        cmd: cli::flease::FleaseCmd,
    },
    /// Register and list members (nodes that heartbeat).
    Member {
        #[command(subcommand)]
        cmd: cli::member::MemberCmd,
    },
    /// Run beside a service: register it as a member, heartbeat, deregister on SIGTERM/SIGINT.
    Agent(cli::member::AgentArgs),
    /// Inspect and change the cluster's membership.
    Cluster {
        #[command(subcommand)]
        cmd: cli::cluster::ClusterCmd,
    },
    /// Hold a distributed lock while a command runs (fencing token in LEASECORE_FENCE).
    Lock(cli::recipes::LockArgs),
    /// Campaign for leadership of an election and print every change of leader.
    Elect(cli::recipes::ElectArgs),
    /// The Chockler–Malkhi light-weight lease over one plain register (a key or a file).
    Lwlease {
        #[command(subcommand)]
        cmd: cli::lwlease::LwleaseCmd,
    },
    /// Drive a running cluster with load and report throughput and latency.
    Bench(cli::bench::BenchArgs),
    /// Back up a running cluster, inspect a backup, seed a new cluster from one.
    Snapshot {
        #[command(subcommand)]
        cmd: cli::snapshot::SnapshotCmd,
    },
}

/// Parse the command line; for `serve --config FILE`, with the file's settings as the
/// defaults (flags and environment still win: see `cli::config`). `serve --dry-run` prints
/// the settings in force and exits here.
fn parse() -> Result<Cli, ExitCode> {
    let version = leasecore::version::VersionInfo::of_this_build().long();
    let command = || Cli::command().long_version(version.clone());
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let first = command().get_matches_from(&args);
    let Some(("serve", serve_matches)) = first.subcommand() else {
        return Cli::from_arg_matches(&first).map_err(|e| e.exit());
    };
    let file = serve_matches
        .get_one::<std::path::PathBuf>("config")
        .cloned();
    let builtin = command()
        .find_subcommand("serve")
        .expect("serve is a subcommand")
        .clone();
    let settings = match &file {
        None => None,
        Some(path) => match cli::config::load(path, &builtin) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("error: {e}");
                return Err(ExitCode::from(2));
            }
        },
    };
    let matches = match &settings {
        None => first,
        Some(settings) => command()
            .mut_subcommand("serve", |serve| cli::config::with_defaults(serve, settings))
            .get_matches_from(&args),
    };
    if let Some(("serve", serve_matches)) = matches.subcommand()
        && serve_matches.get_flag("dry_run")
    {
        print!(
            "{}",
            cli::config::render(
                &builtin,
                serve_matches,
                file.as_deref().zip(settings.as_ref())
            )
        );
        return Err(ExitCode::SUCCESS);
    }
    Cli::from_arg_matches(&matches).map_err(|e| e.exit())
}

fn main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    // A node sizes its workers to its share of the machine (`node::workers`), once, here; the
    // client commands keep tokio's default.
    let sizing = match &cli.command {
        Command::Serve(args) => Some(args.workers()),
        _ => None,
    };
    match sizing {
        Some((workers, _)) => {
            runtime.worker_threads(workers);
        }
        // `serve` sets its own logging from `--log`, once its flags are read.
        None => cli::init_client_logging(),
    }
    let runtime = runtime.enable_all().build().expect("a tokio runtime");
    let conn = cli.conn;
    runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => {
                let sizing = sizing.expect("sized above for serve");
                cli::serve::run(*args, sizing).await
            }
            Command::Auth { cmd } => {
                report(async { cli::auth::auth(cmd, &conn.client()?, conn.json).await }.await)
            }
            Command::User { cmd } => {
                report(async { cli::auth::user(cmd, &conn.client()?, conn.json).await }.await)
            }
            Command::Role { cmd } => {
                report(async { cli::auth::role(cmd, &conn.client()?, conn.json).await }.await)
            }
            Command::Kv { cmd } => report(cli::kv::run(cmd, &conn).await),
            Command::Lease { cmd } => report(cli::lease::run(cmd, &conn).await),
            Command::Cluster { cmd } => report(cli::cluster::run(cmd, &conn).await),
            Command::Watch(args) => report(cli::watch::run(args, &conn).await),
            Command::Member { cmd } => report(cli::member::run(cmd, &conn).await),
            Command::Flease { cmd } => cli::flease::run(Protocol::Flease, cmd, &conn)
                .await
                .unwrap_or_else(|e| report(Err(e))),
            Command::Paxoslease { cmd } => cli::flease::run(Protocol::PaxosLease, cmd, &conn)
                .await
                .unwrap_or_else(|e| report(Err(e))),
            Command::Agent(args) => report(cli::member::agent(args, &conn).await),
            Command::Lwlease { cmd } => cli::lwlease::run(cmd, &conn).await,
            Command::Lock(args) => cli::recipes::lock(args, &conn).await,
            Command::Elect(args) => cli::recipes::elect(args, &conn).await,
            Command::Bench(args) => report(cli::bench::run(args, &conn).await),
            Command::Snapshot { cmd } => match conn.bearer().await {
                Ok(token) => cli::snapshot::run(cmd, &conn.endpoints, conn.json, token).await,
                Err(e) => report(Err(e)),
            },
        }
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Every argument of every subcommand says what it is for (units and defaults live in
    /// the help text too, but a missing help is what a test can catch).
    #[test]
    fn every_argument_has_help() {
        let cmd = Cli::command();
        cmd.clone().debug_assert();
        let mut missing = Vec::new();
        walk(&cmd, "leasecore", &mut missing);
        assert!(missing.is_empty(), "arguments without help: {missing:#?}");
    }

    fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                missing.push(format!("{path} {id}"));
            }
        }
        for sub in cmd.get_subcommands() {
            if sub.get_about().is_none() {
                missing.push(format!("{path} {} (the subcommand)", sub.get_name()));
            }
            walk(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }
}
