//! `leasecore member ...` and `leasecore agent`: members (services that heartbeat), registered
//! once by hand or kept alive by an agent running beside the service.

use std::sync::Arc;

use clap::{Args, Subcommand};
use leasecore::client::ClientError;
use leasecore::client::agent::{AgentConfig, AgentEvent, run_agent};

use super::{ConnArgs, parse_meta, show, shutdown_signal};

#[derive(Subcommand)]
pub enum MemberCmd {
    /// List the live members.
    List,
    /// Register a member once (it expires after its TTL unless something heartbeats it).
    Register {
        /// The member id (unique in the cluster).
        #[arg(long)]
        id: String,
        /// The address others should use to reach the service (free-form, e.g. HOST:PORT).
        #[arg(long)]
        address: String,
        /// Time to live, in milliseconds: the member expires unless heartbeated within it.
        #[arg(long, default_value_t = 5000)]
        ttl_ms: u64,
        /// Metadata, repeatable: --meta zone=a --meta role=db
        #[arg(long, value_parser = parse_meta)]
        meta: Vec<(String, String)>,
    },
    /// Heartbeat a member once.
    Heartbeat {
        /// The member id.
        id: String,
    },
    /// Deregister a member.
    Leave {
        /// The member id.
        id: String,
    },
}

#[derive(Args)]
pub struct AgentArgs {
    /// The member id (unique in the cluster).
    #[arg(long)]
    pub id: String,
    /// The address others should use to reach the service.
    #[arg(long)]
    pub address: String,
    /// Time to live, in milliseconds: heartbeats go every third of it, and the member
    /// expires this long after the agent dies without leaving.
    #[arg(long, default_value_t = 5000)]
    pub ttl_ms: u64,
    /// Metadata, repeatable: --meta zone=a --meta role=db
    #[arg(long, value_parser = parse_meta)]
    pub meta: Vec<(String, String)>,
    /// Print every heartbeat, not only changes.
    #[arg(long)]
    pub verbose: bool,
}

pub async fn run(cmd: MemberCmd, conn: &ConnArgs) -> Result<(), ClientError> {
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

/// `leasecore agent`: register, heartbeat until stopped, then leave.
pub async fn agent(args: AgentArgs, conn: &ConnArgs) -> Result<(), ClientError> {
    let cfg = AgentConfig {
        id: args.id,
        address: args.address,
        ttl_ms: args.ttl_ms,
        meta: args.meta.into_iter().collect(),
    };
    run_agent_cmd(cfg, args.verbose, conn).await
}

async fn run_agent_cmd(
    cfg: AgentConfig,
    verbose: bool,
    conn: &ConnArgs,
) -> Result<(), ClientError> {
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
