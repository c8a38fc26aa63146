//! Storage: one sled database per node holding the applied state and the Raft log's marks,
//! the log's segment files, and the latest snapshot file.
//!
//! # Invariants
//! - One `sled::Db` per node for the state and the log's marks; the log's entries are files of
//!   their own (`raft::segment_log`). sled is flushed by its own timer, by a vote, and before a
//!   log purge (so that the state is durable past every entry the purge removes).
//! - Each logical unit of change is one `sled::Batch` on one tree, which sled applies atomically
//!   and recovers as a prefix after a crash: the log store keeps its vote, committed id and
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

/// The layout of a data directory this build reads and writes. Recorded in every data
/// directory (sled's default tree, key [`FORMAT_KEY`]); a directory of another format is
/// refused at start, never reinterpreted. Raise it with any change an older build would
/// misread, and teach the new build to upgrade the old format.
/// Format 2 added the MVCC history (`raft::mvcc_store`); a format-1 directory is upgraded in
/// place when opened (its history starts at its current state), and a build of format 1 then
/// refuses it rather than write state without history. Format 3 keeps the values as the
/// newest MVCC versions (no separate copy) and one event record per applied batch; a
/// format-1 or -2 directory is converted when opened (its history starts at its current
/// state). Format 4 keeps the Raft log's entries in segment files of their own
/// (`<data dir>/raft-log/`, `raft::segment_log`) instead of sled; older directories have them
/// moved there when opened. Format 5 writes an applied group as an intent record followed by
/// its writes (`raft::state_writes`), which only a build that redoes the intent on open may
/// read: an older one would load a group a crash cut, or leave a stale intent behind. A
/// format-4 directory needs nothing to become format 5. Format 6 writes an applied change
/// once, in its event record, found through the key index (`raft::mvcc_store`): an older
/// build would read only the base versions and lose every key changed since. A format-5
/// directory (a base version beside every event) reads the same as format 6 and needs nothing.
/// Format 7 journals the leases an applied group changed in one record per group
/// (`raft::state_machine::lease_journal`), folded into the per-lease records later: an older
/// build would read only those and lose every lease changed since. A format-6 directory (no
/// journal) reads the same as format 7 and needs nothing.
pub const STORAGE_FORMAT: u32 = 7;
/// The oldest format this build upgrades in place.
const UPGRADABLE_FROM: u32 = 1;
/// Where the format is recorded.
pub const FORMAT_KEY: &[u8] = b"leasecore/storage_format";

/// A storage failure: the node cannot go on safely and stops.
#[derive(Debug, Error)]
pub enum StorageError {
    #[error(
        "the data directory {path} has storage format {found}; this build reads format \
         {STORAGE_FORMAT} (use the leasecore release that wrote it, or restore a backup)"
    )]
    Format { path: String, found: u32 },
    #[error("opening the data directory {path}: {source}")]
    Open { path: String, source: sled::Error },
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("corrupt record {what}: {detail}")]
    Corrupt { what: String, detail: String },
}

/// Make sled's blob files in `dir` durable. sled 0.34 writes a value longer than a share of
/// its segment to a file of its own and never syncs it, while its log, which points to it, is
/// synced: a power failure could lose the value under writes that survive. Call after a
/// flush (which writes them) and before the write that declares a long operation complete
/// (an install's, a history fill's).
pub fn sync_blobs(dir: &Path) -> Result<(), StorageError> {
    let io = |e: std::io::Error| StorageError::Corrupt {
        what: "blob file".into(),
        detail: e.to_string(),
    };
    let blobs = dir.join("blobs");
    let entries = match std::fs::read_dir(&blobs) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    for entry in entries {
        let path = entry.map_err(io)?.path();
        // sled removes blob files it no longer needs while it runs.
        match std::fs::File::open(&path).and_then(|f| f.sync_all()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
    }
    std::fs::File::open(&blobs)
        .and_then(|f| f.sync_all())
        .map_err(io)
}

/// How often sled writes its buffered changes to its file and syncs it (sled's default is
/// 500 ms). Nothing waits on this flush: the Raft log is what makes a write durable, and a
/// restart re-applies the log past the state's last flush. But the flush is a burst of
/// writes and a sync on the same disk as the log's fdatasync: at 500 ms, several megabytes
/// under a steady write load, and the log's syncs queued behind it for 2-14 ms twice a
/// second, which was most of put's p99 at 16 connections. Smaller bursts five times as often
/// halved that p99 and cost nothing measurable at 1 or 64 connections
/// (`docs/write-path.md`, sixteenth round).
pub const STATE_FLUSH_EVERY_MS: u64 = 100;

/// Open (or create) the node's database in `dir`.
///
/// sled holds an exclusive lock on its directory; a process that just dropped the same Db (a
/// restart within one test process) may still hold it for a moment, so the open is retried for
/// a bounded time.
pub fn open_db(dir: &Path, cache_bytes: u64) -> Result<sled::Db, StorageError> {
    // sled's `conf` is text followed by a binary checksum.
    let existing = std::fs::read(dir.join("conf"))
        .ok()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
    let segment_size = segment_size_for(existing.as_deref());
    // Up to ~10 s of 20 ms attempts.
    let mut attempts_left = 500u32;
    loop {
        let res = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_bytes)
            .segment_size(segment_size)
            .mode(sled::Mode::HighThroughput)
            .flush_every_ms(Some(STATE_FLUSH_EVERY_MS))
            .open();
        match res {
            Ok(db) => {
                check_format(&db).map_err(|found| match found {
                    Ok(found) => StorageError::Format {
                        path: dir.display().to_string(),
                        found,
                    },
                    Err(e) => e,
                })?;
                return Ok(db);
            }
            // sled reports the lock held by another handle as `WouldBlock`, or wrapped as
            // `Other` with this message when its own lock file is taken.
            Err(sled::Error::Io(e))
                if (e.kind() == std::io::ErrorKind::WouldBlock
                    || e.to_string().contains("could not acquire lock"))
                    && attempts_left > 0 =>
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

/// Record [`STORAGE_FORMAT`] in a new data directory (or one from before formats were
/// recorded: that layout is format 1), or check the one recorded. `Err(Ok(found))`: another
/// format.
fn check_format(db: &sled::Db) -> Result<(), Result<u32, StorageError>> {
    match db.get(FORMAT_KEY).map_err(|e| Err(e.into()))? {
        None => {
            db.insert(FORMAT_KEY, &STORAGE_FORMAT.to_be_bytes())
                .map_err(|e| Err(e.into()))?;
            db.flush().map_err(|e| Err(e.into()))?;
            Ok(())
        }
        Some(bytes) => {
            let found = <[u8; 4]>::try_from(bytes.as_ref())
                .map(u32::from_be_bytes)
                .unwrap_or(0);
            if found == STORAGE_FORMAT {
                Ok(())
            } else if (UPGRADABLE_FROM..STORAGE_FORMAT).contains(&found) {
                // What the upgrade needs is done by whoever finds its marks missing (the
                // state machine starts the history); from here on older builds refuse it.
                db.insert(FORMAT_KEY, &STORAGE_FORMAT.to_be_bytes())
                    .map_err(|e| Err(e.into()))?;
                db.flush().map_err(|e| Err(e.into()))?;
                tracing::info!(
                    from = found,
                    to = STORAGE_FORMAT,
                    "upgraded the data directory's format"
                );
                Ok(())
            } else {
                Err(Ok(found))
            }
        }
    }
}

/// sled's segment size for new data dirs: 8 MiB.
///
/// sled stores a value larger than a quarter of a segment as a separate blob file, and deletes
/// a replaced blob only once the segment that pointed to it is full. A blob pointer is a few
/// bytes, so with 512 KiB segments (sled's default) overwriting a 1 MiB value left thousands of
/// dead 1 MiB files behind (12 GB per node after 2,229 overwrites). With 8 MiB segments values
/// and log entries up to 2 MiB (the value limit, and a group-commit batch) are stored inline,
/// and sled's segment cleaning reclaims them like any other write.
pub const SEGMENT_SIZE: usize = 8 << 20;

/// The segment size to open a data dir with: the one it was created with (sled refuses any
/// other), or [`SEGMENT_SIZE`] for a new one. `conf` is the text of sled's `conf` file, if any.
pub fn segment_size_for(conf: Option<&str>) -> usize {
    conf.and_then(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("segment_size:"))
            .and_then(|v| v.trim().parse().ok())
    })
    .unwrap_or(SEGMENT_SIZE)
}

/// The largest value the state machine stores inline in the data dir `dir`: an eighth of its
/// sled segment, well under the quarter past which sled writes a value to a blob file.
pub fn inline_value_limit(dir: &Path) -> usize {
    let conf = std::fs::read(dir.join("conf"))
        .ok()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned());
    segment_size_for(conf.as_deref()) / 8
}

/// A log index as an order-preserving key.
pub fn index_key(prefix: u8, index: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = prefix;
    k[1..].copy_from_slice(&index.to_be_bytes());
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_dir_records_its_format_and_one_of_another_format_is_refused() {
        let tmp = tempfile::TempDir::new().unwrap();
        let dir = tmp.path().join("d");
        let db = open_db(&dir, 1 << 20).unwrap();
        assert_eq!(
            db.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
            STORAGE_FORMAT.to_be_bytes()
        );
        db.insert(FORMAT_KEY, &99u32.to_be_bytes()).unwrap();
        db.flush().unwrap();
        drop(db);
        match open_db(&dir, 1 << 20) {
            Err(e @ StorageError::Format { found: 99, .. }) => {
                let expected = format!("this build reads format {STORAGE_FORMAT}");
                assert!(e.to_string().contains(&expected), "{e}")
            }
            other => panic!("expected a format refusal, got {:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn a_format_1_data_dir_is_upgraded_in_place() {
        let tmp = tempfile::TempDir::new().unwrap();
        let dir = tmp.path().join("d");
        let db = open_db(&dir, 1 << 20).unwrap();
        db.insert(FORMAT_KEY, &1u32.to_be_bytes()).unwrap();
        db.flush().unwrap();
        drop(db);
        let db = open_db(&dir, 1 << 20).unwrap();
        assert_eq!(
            db.get(FORMAT_KEY).unwrap().unwrap().as_ref(),
            STORAGE_FORMAT.to_be_bytes()
        );
    }

    #[test]
    fn a_data_dir_keeps_the_segment_size_it_was_created_with() {
        assert_eq!(segment_size_for(None), SEGMENT_SIZE);
        let old = "segment_size: 524288\nuse_compression: false\nversion: 0.34\n\u{fffd}Q";
        assert_eq!(segment_size_for(Some(old)), 524_288);
        assert_eq!(segment_size_for(Some("garbage")), SEGMENT_SIZE);
    }

    #[test]
    fn an_existing_default_sled_dir_still_opens_and_a_new_one_uses_large_segments() {
        let tmp = tempfile::TempDir::new().unwrap();
        let old = tmp.path().join("old");
        drop(sled::Config::new().path(&old).open().unwrap());
        drop(open_db(&old, 1 << 20).unwrap());
        let new = tmp.path().join("new");
        drop(open_db(&new, 1 << 20).unwrap());
        let conf = String::from_utf8_lossy(&std::fs::read(new.join("conf")).unwrap()).into_owned();
        assert_eq!(segment_size_for(Some(&conf)), SEGMENT_SIZE);
    }
}
