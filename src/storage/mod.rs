//! sled: one database per node holding the Raft log, the vote, the applied state and the latest
//! snapshot.
//!
//! # Invariants
//! - One `sled::Db` per node. A flush of the Db covers every tree, so the single flush that makes
//!   a log append durable also makes every state-machine write issued before it durable.
//! - Each logical unit of change is one `sled::Batch` on one tree, which sled applies atomically
//!   and recovers as a prefix after a crash: the log store keeps entries, vote, committed id and
//!   purge mark in one tree; the state machine keeps keys and its applied marks in another.
//! - The latest snapshot is a file of its own ([`snapshot_file`]), off the log's flush path.
//!
//! # What it must not do
//! It does not interpret commands or decide anything; it stores bytes under ordered keys.

use std::path::Path;
use std::time::Duration;

use thiserror::Error;

/// Tree holding the Raft log entries and the log store's own marks.
pub const TREE_RAFT: &str = "raft";
/// Tree holding the applied key-value state and the state machine's marks.
pub const TREE_STATE: &str = "state";
pub mod backup;
pub mod snapshot_file;

/// A storage failure: the node cannot go on safely and stops.
#[derive(Debug, Error)]
pub enum StorageError {
    #[error("opening the data directory {path}: {source}")]
    Open { path: String, source: sled::Error },
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("corrupt record {what}: {detail}")]
    Corrupt { what: String, detail: String },
}

/// Open (or create) the node's database in `dir`.
///
/// sled holds an exclusive lock on its directory; a process that just dropped the same Db (a
/// restart within one test process) may still hold it for a moment, so the open is retried for
/// a bounded time.
pub fn open_db(dir: &Path, cache_bytes: u64) -> Result<sled::Db, StorageError> {
    // Up to ~10 s of 20 ms attempts.
    let mut attempts_left = 500u32;
    loop {
        let res = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_bytes)
            .mode(sled::Mode::HighThroughput)
            .open();
        match res {
            Ok(db) => return Ok(db),
            Err(sled::Error::Io(e))
                if e.kind() == std::io::ErrorKind::WouldBlock && attempts_left > 0 =>
            {
                attempts_left -= 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(StorageError::Open {
                    path: dir.display().to_string(),
                    source,
                });
            }
        }
    }
}

/// A log index as an order-preserving key.
pub fn index_key(prefix: u8, index: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = prefix;
    k[1..].copy_from_slice(&index.to_be_bytes());
    k
}
