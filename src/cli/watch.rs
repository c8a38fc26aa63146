//! `leasecore watch`: print changes to a key or prefix as they happen, resuming by revision
//! across reconnects (the library's `Watcher` does the resuming).

use std::sync::Arc;

use clap::Args;
use leasecore::client::{ClientError, WatchFilter, WatchItem, Watcher};
use leasecore::domain::command::{Cause, EventKind};

use super::{ConnArgs, shutdown_signal};

#[derive(Args)]
pub struct WatchArgs {
    /// Follow every key under this prefix (default: every key).
    #[arg(long, conflicts_with = "key")]
    pub prefix: Option<String>,
    /// Follow exactly this key. (A positional argument: `--key` is the global TLS key flag,
    /// as in etcdctl.)
    pub key: Option<String>,
    /// Start at this revision (inclusive); default: changes from now on.
    #[arg(long)]
    pub from_revision: Option<u64>,
}

pub async fn run(args: WatchArgs, conn: &ConnArgs) -> Result<(), ClientError> {
    let WatchArgs {
        prefix,
        key,
        from_revision,
    } = args;
    let client = Arc::new(conn.client()?);
    let filter = match key {
        Some(k) => WatchFilter::Key(k),
        None => WatchFilter::Prefix(prefix.unwrap_or_default()),
    };
    // A stopped cluster is an error at once; an outage after that is reported on stderr
    // while the watch waits it out (and resumes without a gap).
    let mut watcher = Watcher::new(client, filter, from_revision)
        .fail_until_connected(true)
        .on_interruption(Arc::new(|error, resume| {
            let from = resume.map_or("now".to_string(), |r| format!("revision {r}"));
            match error {
                Some(e) => eprintln!("watch interrupted ({e}); retrying, resuming from {from}"),
                None => eprintln!("watch resumed from {from}"),
            }
        }));
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
