//! `leasecore kv put|get|del|list|txn|compact`: keys, read and written through any node.

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
    /// Run a transaction: compares, then the success or the failure operations, at one
    /// revision. The transaction is JSON, as `POST /v1/txn` takes it, e.g.
    /// {"compare":[{"key":"k","target":"mod_revision","value":0}],"success":[{"put":{"key":"k","value":"v"}}]}.
    /// Prints SUCCESS or FAILURE and the results (or the whole answer with --json).
    Txn {
        /// The file holding the transaction (`-`: standard input).
        #[arg(default_value = "-")]
        file: std::path::PathBuf,
    },
    /// Forget the key versions below a revision, on every node (etcd's compaction): reads
    /// and watches below it answer `compacted` afterwards.
    Compact {
        /// The revision to compact to.
        revision: u64,
    },
}

/// Read a transaction document from `path` (`-`: standard input).
fn read_txn(path: &std::path::Path) -> Result<serde_json::Value, ClientError> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|e| ClientError::Usage(format!("reading {}: {e}", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| ClientError::Usage(format!("the transaction is not JSON: {e}")))
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
        KvCmd::Txn { file } => {
            let txn = read_txn(&file)?;
            let r = client.txn(&txn).await?;
            if conn.json {
                print_json(&r);
            } else {
                let ok = r["succeeded"].as_bool() == Some(true);
                println!("{}", if ok { "SUCCESS" } else { "FAILURE" });
                for result in r["results"].as_array().into_iter().flatten() {
                    println!("{result}");
                }
                eprintln!("revision {}", r["revision"]);
            }
        }
        KvCmd::Compact { revision } => {
            let r = client.compact(revision).await?;
            show(conn.json, &r, |r| {
                println!("compacted to revision {}", r["compact_revision"]);
            });
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
