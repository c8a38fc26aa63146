//! `leasecore flease|paxoslease acquire|release|get`: per-resource leases decided by the
//! nodes without the Raft leader (Flease, or PaxosLease without synchronized clocks).

use std::time::Duration;

use clap::Subcommand;
use leasecore::client::ClientError;
use leasecore::domain::flease::Protocol;
use leasecore::runtime::flease::LeaseView;

use super::{ConnArgs, show, shutdown_signal};

#[derive(Subcommand)]
pub enum FleaseCmd {
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

pub async fn run(proto: Protocol, cmd: FleaseCmd, conn: &ConnArgs) -> Result<(), ClientError> {
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
