//! `leasecore lock` and `leasecore elect`: a lock or a campaign held by a session (one
//! kept-alive lease) for as long as the command runs.
//!
//! `lock NAME -- COMMAND...` waits in line, then runs the command with the fencing token in
//! `LEASECORE_FENCE` (and the lock key in `LEASECORE_LOCK_KEY`), and exits with its exit code.
//! If the session's lease is lost meanwhile, the command is killed at once: the next holder
//! may already be running. Without a command it holds until Ctrl-C or SIGTERM.
//!
//! `elect NAME VALUE` campaigns, prints every change of leader (from a watch on the
//! election's keys), and resigns on Ctrl-C or SIGTERM.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use leasecore::client::{ClientError, Session, WatchFilter, Watcher};
use leasecore::domain::recipes::Recipe;

use super::{ConnArgs, shutdown_signal};

/// What `lock` exits with when the lock was lost while the command ran.
pub const EXIT_LOCK_LOST: u8 = 4;

#[derive(Args)]
pub struct LockArgs {
    /// The lock's name (no '/').
    pub name: String,
    /// The session's lease TTL, in milliseconds: how long after this process dies (or is cut
    /// off) the lock is released. Default 10000.
    #[arg(long, default_value_t = 10_000)]
    pub ttl_ms: u64,
    /// The command to run while holding the lock (after `--`); without one, hold until
    /// Ctrl-C.
    #[arg(last = true)]
    pub command: Vec<String>,
}

#[derive(Args)]
pub struct ElectArgs {
    /// The election's name (no '/').
    pub name: String,
    /// This contender's value while it leads (an address, say).
    pub value: String,
    /// The session's lease TTL, in milliseconds: how long after this process dies (or is cut
    /// off) leadership passes on. Default 10000.
    #[arg(long, default_value_t = 10_000)]
    pub ttl_ms: u64,
}

pub async fn lock(args: LockArgs, conn: &ConnArgs) -> ExitCode {
    match run_lock(args, conn).await {
        Ok(code) => code,
        Err(e) => super::report(Err(e)),
    }
}

async fn run_lock(args: LockArgs, conn: &ConnArgs) -> Result<ExitCode, ClientError> {
    let client = Arc::new(conn.client()?);
    let session = Session::new(client.clone(), args.ttl_ms).await?;
    let stopped = shutdown_signal();
    tokio::pin!(stopped);
    let mut told = None;
    // The first call only queues (so that a wait is announced at once); later ones long-poll.
    let mut wait_ms = 0;
    let held = loop {
        let standing = tokio::select! {
            _ = &mut stopped => {
                let _ = session.close().await;
                return Ok(ExitCode::from(130));
            }
            s = client.lock_once(&args.name, session.lease(), wait_ms) => s?,
        };
        wait_ms = 30_000;
        if standing.held {
            break standing;
        }
        if told.as_ref() != standing.waiting_for.as_ref() {
            eprintln!(
                "waiting for lock {} (behind {})",
                args.name,
                standing.waiting_for.as_deref().unwrap_or("?")
            );
            told = standing.waiting_for.clone();
        }
    };
    eprintln!(
        "holding lock {} (key {}, fencing token {})",
        args.name, held.key, held.revision
    );
    let lost = session.lost_signal();
    tokio::pin!(lost);
    let outcome = if args.command.is_empty() {
        tokio::select! {
            _ = &mut stopped => Ok(ExitCode::SUCCESS),
            reason = &mut lost => Err(reason),
        }
    } else {
        let mut child = match tokio::process::Command::new(&args.command[0])
            .args(&args.command[1..])
            .env("LEASECORE_FENCE", held.revision.to_string())
            .env("LEASECORE_LOCK_KEY", &held.key)
            .kill_on_drop(true)
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                let _ = session.close().await;
                return Err(ClientError::Usage(format!(
                    "cannot run {:?}: {e}",
                    args.command[0]
                )));
            }
        };
        tokio::select! {
            status = child.wait() => Ok(status
                .ok()
                .and_then(|s| s.code())
                .map_or(ExitCode::FAILURE, |c| ExitCode::from(c.clamp(0, 255) as u8))),
            reason = &mut lost => {
                let _ = child.kill().await;
                Err(reason)
            }
            _ = &mut stopped => {
                let _ = child.kill().await;
                Ok(ExitCode::from(130))
            }
        }
    };
    match outcome {
        Ok(code) => {
            // Closing revokes the lease: the lock key goes with it, the next waiter holds.
            session.close().await?;
            Ok(code)
        }
        Err(reason) => {
            eprintln!(
                "error: lock {} lost ({reason}); the command was stopped",
                args.name
            );
            Ok(ExitCode::from(EXIT_LOCK_LOST))
        }
    }
}

pub async fn elect(args: ElectArgs, conn: &ConnArgs) -> ExitCode {
    match run_elect(args, conn).await {
        Ok(code) => code,
        Err(e) => super::report(Err(e)),
    }
}

async fn run_elect(args: ElectArgs, conn: &ConnArgs) -> Result<ExitCode, ClientError> {
    let client = Arc::new(conn.client()?);
    let session = Session::new(client.clone(), args.ttl_ms).await?;
    let mine = Recipe::Election.key(&args.name, session.lease());
    let stopped = shutdown_signal();
    tokio::pin!(stopped);
    let lost = session.lost_signal();
    tokio::pin!(lost);
    let lease = session.lease().to_string();
    let campaign = client.campaign(&args.name, &lease, &args.value);
    tokio::pin!(campaign);
    let mut campaigning = true;
    // Follow the election's keys; show the leader after each change.
    let mut watcher = Watcher::new(
        client.clone(),
        WatchFilter::Prefix(Recipe::Election.queue(&args.name)),
        None,
    );
    let mut shown: Option<(String, String)> = None;
    let show = async |shown: &mut Option<(String, String)>| -> Result<(), ClientError> {
        let now = client.leader(&args.name).await?.map(|l| (l.key, l.value));
        if now != *shown {
            match &now {
                Some((key, value)) if *key == mine => println!("leader: {value} (this process)"),
                Some((_, value)) => println!("leader: {value}"),
                None => println!("leader: none"),
            }
            *shown = now;
        }
        Ok(())
    };
    show(&mut shown).await?;
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            reason = &mut lost => {
                eprintln!("error: leadership of {} lost ({reason})", args.name);
                return Ok(ExitCode::from(EXIT_LOCK_LOST));
            }
            elected = &mut campaign, if campaigning => {
                campaigning = false;
                let s = elected?;
                eprintln!("elected {} (term {})", args.name, s.revision);
                show(&mut shown).await?;
            }
            item = watcher.next() => {
                item?;
                show(&mut shown).await?;
            }
        }
    }
    // Closing revokes the lease: the key goes, and the next in line leads.
    let _ = client.resign(&args.name, &lease).await;
    session.close().await?;
    Ok(ExitCode::SUCCESS)
}
