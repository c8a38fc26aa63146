//! `leasecore lwlease contend|renew|hold`: the Chockler–Malkhi light-weight lease over one
//! register with no compare-and-set, either a leasecore key (`kv:KEY`, plain PUT and GET) or a
//! file on a shared file system (`file:PATH`, replaced atomically).
//!
//! `contend` waits until held and exits 0; `renew` takes up this `--id`'s lease from an
//! earlier run if the register still holds its stamp (exit 0), else exits 3; `hold` contends,
//! then renews at half the lease until Ctrl-C, and exits 3 if the lease is lost.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Subcommand};
use leasecore::client::ClientError;
use leasecore::client::lwlease::Timing;
use leasecore::client::register::{
    FileRegister, KvRegister, LightLease, Outcome, Register, RegisterError,
};

use super::flease::EXIT_HELD_ELSEWHERE;
use super::{ConnArgs, shutdown_signal};

#[derive(Subcommand)]
pub enum LwleaseCmd {
    /// Wait until the lease is held, then exit 0 (the lease lapses after --lease-ms unless
    /// renewed).
    Contend(LwleaseArgs),
    /// Renew the lease this --id held in an earlier run, if nobody wrote the register since:
    /// exit 0 if renewed, 3 if not.
    Renew(LwleaseArgs),
    /// Contend, then keep renewing until Ctrl-C or SIGTERM; exit 3 if the lease is lost.
    Hold(LwleaseArgs),
}

#[derive(Args)]
pub struct LwleaseArgs {
    /// The register: `kv:KEY` (a leasecore key) or `file:PATH` (a shared file).
    #[arg(long)]
    pub register: String,
    /// δ, in milliseconds: an upper bound on one register operation. An operation that takes
    /// longer counts as a broken bound and the lease as lost.
    #[arg(long)]
    pub delta_ms: u64,
    /// Δ, in milliseconds: how long a holder holds after a contend or renewal (more than
    /// 4 × δ). Default: 20 × δ.
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// This contender's id, unique among everyone using the register (default: host and
    /// process id).
    #[arg(long)]
    pub id: Option<String>,
}

pub async fn run(cmd: LwleaseCmd, conn: &ConnArgs) -> ExitCode {
    let (args, mode) = match cmd {
        LwleaseCmd::Contend(a) => (a, Mode::Contend),
        LwleaseCmd::Renew(a) => (a, Mode::Renew),
        LwleaseCmd::Hold(a) => (a, Mode::Hold),
    };
    let timing = match Timing::new(args.delta_ms, args.lease_ms.unwrap_or(args.delta_ms * 20)) {
        Ok(t) => t,
        Err(e) => return super::report(Err(ClientError::Usage(e.to_string()))),
    };
    let id = args.id.clone().unwrap_or_else(default_id);
    let result = match args.register.split_once(':') {
        Some(("kv", key)) if !key.is_empty() => match conn.client() {
            Ok(client) => {
                let register = KvRegister::new(Arc::new(client), key);
                drive(LightLease::new(register, &id, timing), mode, &id).await
            }
            Err(e) => Err(RegisterError::Client(e)),
        },
        Some(("file", path)) if !path.is_empty() => {
            let register = FileRegister::new(path);
            drive(LightLease::new(register, &id, timing), mode, &id).await
        }
        _ => Err(RegisterError::Client(ClientError::Usage(format!(
            "--register {:?}: give kv:KEY or file:PATH",
            args.register
        )))),
    };
    match result {
        Ok(code) => code,
        Err(RegisterError::Client(e)) => super::report(Err(e)),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Contend,
    Renew,
    Hold,
}

async fn drive<R: Register>(
    mut lease: LightLease<R>,
    mode: Mode,
    id: &str,
) -> Result<ExitCode, RegisterError> {
    let outcome = match mode {
        Mode::Renew => lease.resume().await?,
        Mode::Contend | Mode::Hold => lease.contend().await?,
    };
    let Outcome::Held(mut until) = outcome else {
        eprintln!("not held: the register holds another contender's stamp");
        return Ok(ExitCode::from(EXIT_HELD_ELSEWHERE));
    };
    let left = |until: leasecore::domain::types::MonoMillis, lease: &LightLease<R>| {
        lease.clock().mono().until(until)
    };
    println!("held by {id} for {} ms", left(until, &lease));
    if mode != Mode::Hold {
        return Ok(ExitCode::SUCCESS);
    }
    let stopped = shutdown_signal();
    tokio::pin!(stopped);
    loop {
        // Renew at half the validity left: a renewal takes a few register operations.
        let wait = Duration::from_millis(left(until, &lease) / 2);
        tokio::select! {
            _ = &mut stopped => return Ok(ExitCode::SUCCESS),
            _ = tokio::time::sleep(wait) => {}
        }
        match lease.renew().await {
            Ok(Outcome::Held(next)) => until = next,
            Ok(Outcome::Lost) => {
                eprintln!("error: lease lost: another contender wrote the register");
                return Ok(ExitCode::from(EXIT_HELD_ELSEWHERE));
            }
            Err(e) => {
                eprintln!("error: lease lost: {e}");
                return Ok(ExitCode::from(EXIT_HELD_ELSEWHERE));
            }
        }
    }
}

fn default_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}
