//! `leasecore kv put|get|del|list`: keys, read and written through any node.

use clap::Subcommand;
use leasecore::client::ClientError;

use super::{ConnArgs, not_found, print_json, show};

#[derive(Subcommand)]
pub enum KvCmd {
    /// Set a key.
    Put {
        /// The key (any UTF-8 string; `/` has no special meaning but prefixes group keys).
        key: String,
        /// The value to store (UTF-8; at most the server's --max-value-bytes).
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
        /// The key to read.
        key: String,
        /// Serve from the answering node's applied state, without a quorum round.
        #[arg(long)]
        local: bool,
    },
    /// Delete a key.
    Del {
        /// The key to delete.
        key: String,
        /// Only if the key's mod revision is this (0: only if it does not exist).
        #[arg(long)]
        prev_revision: Option<u64>,
    },
    /// List keys under a prefix.
    List {
        /// List keys starting with this (default: every key).
        #[arg(default_value = "")]
        prefix: String,
        /// At most this many keys (server default 10000, at most 100000); the footer says
        /// when there were more.
        #[arg(long)]
        limit: Option<usize>,
        /// Serve from the answering node's applied state, without a quorum round.
        #[arg(long)]
        local: bool,
    },
}

pub async fn run(cmd: KvCmd, conn: &ConnArgs) -> Result<(), ClientError> {
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
