//! `leasecore lease grant|refresh|revoke|get|list|keepalive`: leases, and a keeper that
//! refreshes one until stopped (Ctrl-C / SIGTERM).

use std::sync::Arc;

use clap::Subcommand;
use leasecore::client::{Client, ClientError, LeaseKeeper, LeaseStatus};
use leasecore::wire::LeaseInfo;

use super::{ConnArgs, not_found, print_json, show, shutdown_signal};

#[derive(Subcommand)]
pub enum LeaseCmd {
    /// Register a lease.
    Grant {
        /// The lease's name (unique in the cluster).
        name: String,
        /// Time to live, in milliseconds.
        #[arg(long)]
        ttl_ms: u64,
    },
    /// Refresh a lease once.
    Refresh {
        /// The lease's name.
        name: String,
    },
    /// Revoke a lease, deleting its keys.
    Revoke {
        /// The lease's name.
        name: String,
    },
    /// Show a lease: TTL, time left on the leader, revision, keys.
    Get {
        /// The lease's name.
        name: String,
    },
    /// List leases.
    List {
        /// List leases whose name starts with this (default: every lease).
        #[arg(default_value = "")]
        prefix: String,
        /// At most this many leases (server default 10000).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Keep a lease alive (registering it if --ttl-ms is given and it does not exist) until
    /// stopped, printing each refresh.
    Keepalive {
        /// The lease's name.
        name: String,
        /// Time to live in milliseconds, used to register the lease if it does not exist
        /// (default: the existing lease's TTL; the lease must then exist). Refreshed every
        /// third of it.
        #[arg(long)]
        ttl_ms: Option<u64>,
        /// Revoke the lease when stopped (Ctrl-C / SIGTERM).
        #[arg(long)]
        revoke_on_exit: bool,
    },
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

pub async fn run(cmd: LeaseCmd, conn: &ConnArgs) -> Result<(), ClientError> {
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
