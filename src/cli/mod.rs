//! The `leasecore` command line: one module per role (a subcommand's arguments and its
//! handler), plus what every client command shares here: the connection flags ([`ConnArgs`]),
//! printing (`--json` or lines for people) and the process-level plumbing (signals, exit codes).
//!
//! Modules print and exit; they decide nothing about the state (the library does).

pub mod auth;
pub mod bench;
pub mod cluster;
pub mod cluster_health;
pub mod config;
pub mod flease;
pub mod kv;
pub mod lease;
pub mod lwlease;
pub mod member;
pub mod recipes;
pub mod resources;
pub mod serve;
pub mod snapshot;
pub mod tls;
pub mod watch;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use leasecore::client::{Client, ClientError, Waiting};
use serde::Serialize;

/// A client command's diagnostics: none unless `RUST_LOG` asks (for example
/// `RUST_LOG=h2=debug leasecore kv get k`), to stderr.
///
/// Why a subscriber at all when the default is silence: without one, every `tracing` span of
/// the libraries a client runs on (`h2` makes several per call) is still built and handed to
/// the `log` crate's check (`tracing`'s `log` feature is on through axum), which was about 6%
/// of `leasecore bench --etcd`'s CPU per call. With a subscriber whose filter is off, the
/// span macros stop at their level check.
/// A `RUST_LOG` that does not parse is ignored: the command's own output matters more.
pub fn init_client_logging() {
    let asked = std::env::var("RUST_LOG")
        .ok()
        .filter(|f| !f.trim().is_empty());
    // `init_logging` refuses a filter that does not parse before it sets anything.
    if let Some(f) = asked
        && serve::init_logging(&f, serve::LogFormat::Text).is_ok()
    {
        return;
    }
    let _ = serve::init_logging("off", serve::LogFormat::Text);
}

/// The connection flags, global: `leasecore --endpoints ... kv get k` and
/// `leasecore kv get k --endpoints ...` mean the same.
#[derive(Args, Clone)]
#[command(next_help_heading = "Connection")]
pub struct ConnArgs {
    /// Nodes to talk to, comma-separated; the client fails over between them.
    #[arg(
        long,
        global = true,
        env = "LEASECORE_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:7001"
    )]
    pub endpoints: Vec<String>,
    /// Print the server's JSON documents as they are.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(flatten)]
    pub tls: tls::ClientTlsArgs,
    /// Authenticate as this user: name:password, or name (the password is then asked for).
    #[arg(long, global = true, env = "LEASECORE_USER", hide_env_values = true)]
    pub user: Option<String>,
    /// A bearer token (from `POST /v1/auth/authenticate`), when --user is not given.
    #[arg(long, global = true, env = "LEASECORE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

impl ConnArgs {
    /// The client of a command: endpoints plus credentials or a token. Every client
    /// command builds its clients through here (or after it: it also installs the TLS flags
    /// for the whole process).
    pub fn client(&self) -> Result<Client, ClientError> {
        self.tls.install()?;
        let client = auth::client(&self.endpoints, self.user.as_deref(), self.token.as_deref())?;
        Ok(if std::io::stderr().is_terminal() {
            client.on_wait(Arc::new(draw_wait))
        } else {
            client
        })
    }

    /// A token for calls made outside [`Client`], if the command authenticates (installs the
    /// TLS flags too).
    pub async fn bearer(&self) -> Result<Option<String>, ClientError> {
        self.tls.install()?;
        auth::token(&self.endpoints, self.user.as_deref(), self.token.as_deref()).await
    }
}

/// The progress line of a call that keeps failing over, on a terminal's stderr only (pipes
/// and log files get the final error alone): erased when the call ends.
fn draw_wait(waiting: Option<&Waiting>) {
    let mut err = std::io::stderr().lock();
    let _ = match waiting {
        Some(w) => write!(
            err,
            "\r\x1b[2Kwaiting for the cluster ({:.0} s, {} attempts): {}",
            w.elapsed.as_secs_f64(),
            w.attempts,
            // One terminal line: `\r` cannot erase a wrapped one.
            truncate_chars(&w.last_failure, 72)
        ),
        None => write!(err, "\r\x1b[2K"),
    };
    let _ = err.flush();
}

fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((cut, _)) => format!("{}...", &s[..cut]),
        None => s.to_string(),
    }
}

pub fn parse_meta(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

pub fn report(result: Result<(), ClientError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Completes at SIGTERM or SIGINT (Ctrl-C).
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    // The handlers are installed here, not at the first poll: a command that registers
    // something before it first waits for the signal (`agent` registers its member) must not
    // be killed outright by a SIGTERM in between, which would skip its deregistration.
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
        async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// A 404 the client turned into `None`, back as an error for the command line.
pub fn not_found(code: &str, message: String) -> ClientError {
    ClientError::Api {
        status: 404,
        code: code.into(),
        message,
        body: serde_json::Value::Null,
    }
}

/// Print the server's document with `--json`, else the person-readable line(s).
pub fn show<T: Serialize>(json: bool, doc: &T, for_people: impl FnOnce(&T)) {
    if json {
        print_json(doc);
    } else {
        for_people(doc);
    }
}

pub fn print_json<T: Serialize>(v: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    );
}
