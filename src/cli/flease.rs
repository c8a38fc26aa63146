//! `leasecore flease|paxoslease acquire|release|get`: per-resource leases decided by the
//! nodes without the Raft leader (Flease, or PaxosLease without synchronized clocks).

use std::process::ExitCode;
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
    #[command(
        after_help = "Exit status: 0 granted (with --hold: held until stopped, then released); \
                      3 held by another owner, or lost while holding; 1 any other error \
                      (e.g. 503 while the nodes wait out their restart wait)."
    )]
    Acquire {
        /// The resource's name (any string; Flease and PaxosLease names are separate).
        resource: String,
        /// Who acquires it (any string; the same owner renews its own lease).
        #[arg(long)]
        owner: String,
        /// Keep the lease: renew it at half its validity (the server's --flease-lease-ms,
        /// default 10000 ms) until Ctrl-C / SIGTERM, then release it. Exits 3 if it is lost.
        #[arg(long)]
        hold: bool,
    },
    /// Release an owner's lease on a resource.
    Release {
        /// The resource's name.
        resource: String,
        /// The owner whose lease to release (another owner's lease is left alone).
        #[arg(long)]
        owner: String,
    },
    /// What the answering node knows of a resource.
    Get {
        /// The resource's name.
        resource: String,
    },
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

/// The exit status of `acquire` when another owner holds the resource, or when a held lease
/// is lost (as `flock -n` fails when the lock is taken): scripts can tell it from an error (1).
pub const EXIT_HELD_ELSEWHERE: u8 = 3;

/// Run a Flease or PaxosLease command; `Ok` carries the exit status.
pub async fn run(
    proto: Protocol,
    cmd: FleaseCmd,
    conn: &ConnArgs,
) -> Result<ExitCode, ClientError> {
    let client = conn.client()?;
    match cmd {
        FleaseCmd::Acquire {
            resource,
            owner,
            hold,
        } => {
            let v = client.resource_acquire(proto, &resource, &owner).await?;
            show(conn.json, &v, print_flease);
            if v.granted != Some(true) {
                return Ok(ExitCode::from(EXIT_HELD_ELSEWHERE));
            }
            if !hold {
                return Ok(ExitCode::SUCCESS);
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
                    eprintln!("{resource}: lost");
                    return Ok(ExitCode::from(EXIT_HELD_ELSEWHERE));
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
    Ok(ExitCode::SUCCESS)
}
