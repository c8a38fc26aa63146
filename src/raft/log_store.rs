//! The Raft log, vote and committed id in sled.
//!
//! # Invariants
//! - Everything lives in one tree ([`TREE_RAFT`]): entries under `e` + big-endian index, and the
//!   marks (vote, committed, last purged) under `m/...`. Every append and truncation is one
//!   atomic batch, so a crash leaves the log a prefix of what was written. A purge runs on a
//!   task of its own in batches of [`PURGE_CHUNK`] entries, oldest first, each with the purge
//!   mark of what it removed: never a purge mark without its purge. Readers see a purge the
//!   moment it is asked for (`purge_asked`), before the entries are gone.
//! - An append is reported durable (`log_io_completed`) only after a `flush_async` that started
//!   after the entries were written returns: a vote or acknowledgement is never given for an
//!   entry a crash could lose. The flush runs on a task of its own ([`Flusher`]), not in
//!   `append`: openraft's core awaits `append` inline, so a flush inside it (seconds, when sled
//!   writes out a large state) stopped heartbeats and answers to peers, and nodes under heavy
//!   writes at a million keys lost their leader every half minute. Callbacks complete in the
//!   order of the appends; every append queued while a flush runs shares the next one.
//! - `save_vote` flushes before returning: a node never votes twice in one term across a crash.
//!
//! - [`LogStore::log_bytes`] counts the stored entries' bytes (appends add, truncation and purge
//!   subtract; counted once at open), for the storage quota and compaction by bytes.
//! - Replication reads at most [`READ_BUDGET_BYTES`] of entries per request
//!   (`limited_get_log_entries`): openraft asks for up to `max_payload_entries` entries at a
//!   time, and 512 entries of 1 MiB each, read at once for every follower, made the node's memory
//!   grow with the bytes in the log.
//!
//! Entries are MessagePack (named fields, so optional fields may be omitted): values are stored
//! as raw bytes rather than JSON-escaped text, which keeps a 1 MiB value near 1 MiB on disk and
//! on the wire. The marks are small JSON documents.

// openraft's traits impose `StorageError` (large) as the error type of every storage call.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{EntryPayload, OptionalSend, RaftLogReader, StorageIOError, Vote};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Entry, LogId, NodeId, StorageError, TypeConfig, any_err};
use crate::storage::{TREE_RAFT, index_key};

const ENTRY: u8 = b'e';
const KEY_VOTE: &[u8] = b"m/vote";
const KEY_COMMITTED: &[u8] = b"m/committed";
const KEY_PURGED: &[u8] = b"m/purged";

/// The most entry bytes one replication read returns (at least one entry): the peer network
/// sends at most this much per AppendEntries anyway.
pub const READ_BUDGET_BYTES: usize = super::network::MAX_APPEND_BYTES;

/// Told which entries this node's log received and lost (the lease clock's witness, see
/// [`crate::domain::lease::ClockWitness`]). Called before the entries are written, so before
/// any of them can apply. Must be quick: it runs on the append path.
pub trait LogReceipts: Send + Sync + 'static {
    /// Entries `first..=last` were appended; `stamps` are `(index, highest lease clock stamp)`
    /// of those that carry one.
    fn received(&self, first: u64, last: u64, stamps: &[(u64, u64)]);
    /// Entries from `index` on were removed (a conflicting suffix).
    fn truncated(&self, index: u64);
}

/// The sled-backed log store. Cheap to clone: clones share the same tree.
#[derive(Clone)]
pub struct LogStore {
    db: sled::Db,
    tree: sled::Tree,
    /// The latest committed index this node was told of, for status reports.
    committed: Arc<AtomicU64>,
    /// Bytes of the stored entries.
    log_bytes: Arc<AtomicU64>,
    receipts: Option<Arc<dyn LogReceipts>>,
    /// Started on the first append (an async context); shared by clones.
    flusher: Arc<std::sync::OnceLock<Flusher>>,
    /// Started on the first purge; shared by clones.
    purger: Arc<std::sync::OnceLock<tokio::sync::mpsc::Sender<LogId>>>,
    /// The latest purge asked for: entries up to it are gone for every reader at once, even
    /// while the purger is still removing them.
    purge_asked: Arc<std::sync::Mutex<Option<LogId>>>,
}

/// Entries removed per purge batch. sled applies a batch under a lock that every other
/// writer waits for: purging 10,000 entries in one batch took 125 ms, during which neither
/// appends nor the state machine could write.
const PURGE_CHUNK: usize = 256;

/// How many appends may wait for a flush before `append` itself waits (back-pressure on the
/// Raft core instead of an unbounded queue).
const FLUSH_QUEUE: usize = 4096;

/// Completes appends once a flush covers them: one task per log store, which drains every
/// waiting callback, flushes once, and completes them in order. It ends when the log store
/// (every clone) is dropped, after completing what is queued.
struct Flusher {
    queue: tokio::sync::mpsc::Sender<LogFlushed<TypeConfig>>,
}

impl Flusher {
    fn start(db: sled::Db) -> Flusher {
        let (queue, mut waiting) =
            tokio::sync::mpsc::channel::<LogFlushed<TypeConfig>>(FLUSH_QUEUE);
        tokio::spawn(async move {
            let mut batch = Vec::new();
            while waiting.recv_many(&mut batch, FLUSH_QUEUE).await > 0 {
                let flushed = db.flush_async().await;
                for callback in batch.drain(..) {
                    let result = match &flushed {
                        Ok(_) => Ok(()),
                        Err(e) => Err(std::io::Error::other(e.to_string())),
                    };
                    callback.log_io_completed(result);
                }
            }
        });
        Flusher { queue }
    }
}

impl LogStore {
    pub fn open(db: &sled::Db) -> Result<Self, crate::storage::StorageError> {
        let tree = db.open_tree(TREE_RAFT)?;
        let mut bytes = 0u64;
        for item in tree.scan_prefix([ENTRY]) {
            bytes += item?.1.len() as u64;
        }
        Ok(LogStore {
            db: db.clone(),
            tree,
            committed: Arc::new(AtomicU64::new(0)),
            log_bytes: Arc::new(AtomicU64::new(bytes)),
            receipts: None,
            flusher: Arc::new(std::sync::OnceLock::new()),
            purger: Arc::new(std::sync::OnceLock::new()),
            purge_asked: Arc::new(std::sync::Mutex::new(None)),
        })
    }

    /// Report appended and truncated entries to `receipts` from now on.
    pub fn with_receipts(mut self, receipts: Arc<dyn LogReceipts>) -> Self {
        self.receipts = Some(receipts);
        self
    }

    /// Bytes of the stored entries (shared; updated as the log changes).
    pub fn log_bytes(&self) -> Arc<AtomicU64> {
        self.log_bytes.clone()
    }

    /// The committed index as last saved (shared; updated as openraft saves it).
    pub fn committed_index(&self) -> Arc<AtomicU64> {
        self.committed.clone()
    }

    fn read_mark<T: DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, StorageError> {
        let raw = self
            .tree
            .get(key)
            .map_err(|e| StorageIOError::read_logs(any_err(&e)))?;
        raw.map(|bytes| serde_json::from_slice(&bytes))
            .transpose()
            .map_err(|e| StorageIOError::read_logs(any_err(&e)).into())
    }

    fn last_entry_id(&self) -> Result<Option<LogId>, StorageError> {
        let last = self
            .tree
            .scan_prefix([ENTRY])
            .next_back()
            .transpose()
            .map_err(|e| StorageIOError::read_logs(any_err(&e)))?;
        match last {
            None => Ok(None),
            Some((_, bytes)) => Ok(Some(decode_entry(&bytes)?.log_id)),
        }
    }

    /// The first index a reader may see: past the latest purge asked for.
    fn first_readable(&self, start: u64) -> u64 {
        let asked = *self.purge_asked.lock().unwrap_or_else(|p| p.into_inner());
        asked.map_or(start, |p| start.max(p.index + 1))
    }

    /// Entries of `bytes` left the log.
    fn forget(&self, bytes: u64) {
        forget(&self.log_bytes, bytes);
    }

    async fn flush(&self) -> Result<(), sled::Error> {
        self.db.flush_async().await.map(|_| ())
    }
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, StorageError> {
    serde_json::to_vec(v).map_err(|e| StorageIOError::write_logs(any_err(&e)).into())
}

/// An entry's stored form.
pub fn encode_entry(entry: &Entry) -> Result<Vec<u8>, StorageError> {
    rmp_serde::to_vec_named(entry).map_err(|e| StorageIOError::write_logs(any_err(&e)).into())
}

/// An entry back from its stored form.
pub fn decode_entry(bytes: &[u8]) -> Result<Entry, StorageError> {
    rmp_serde::from_slice(bytes).map_err(|e| StorageIOError::read_logs(any_err(&e)).into())
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&i) => i,
            Bound::Excluded(&i) => i.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let start = self.first_readable(start);
        let lo = index_key(ENTRY, start).to_vec();
        let iter = match range.end_bound() {
            Bound::Included(&i) => self.tree.range(lo..=index_key(ENTRY, i).to_vec()),
            Bound::Excluded(&i) => self.tree.range(lo..index_key(ENTRY, i).to_vec()),
            Bound::Unbounded => self.tree.range(lo..entries_end()),
        };
        let mut out = Vec::new();
        for item in iter {
            let (_, bytes) = item.map_err(|e| StorageIOError::read_logs(any_err(&e)))?;
            out.push(decode_entry(&bytes)?);
        }
        Ok(out)
    }

    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry>, StorageError> {
        let mut out = Vec::new();
        let mut total = 0usize;
        let start = self.first_readable(start);
        let range = index_key(ENTRY, start).to_vec()..index_key(ENTRY, end.max(start)).to_vec();
        for item in self.tree.range(range) {
            let (_, bytes) = item.map_err(|e| StorageIOError::read_logs(any_err(&e)))?;
            total += bytes.len();
            if total > READ_BUDGET_BYTES && !out.is_empty() {
                break;
            }
            out.push(decode_entry(&bytes)?);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let persisted: Option<LogId> = self.read_mark(KEY_PURGED)?;
        let asked = *self.purge_asked.lock().unwrap_or_else(|p| p.into_inner());
        let last_purged = std::cmp::max_by_key(persisted, asked, |l| l.map(|l| l.index));
        let last_log_id = match (self.last_entry_id()?, last_purged) {
            (Some(last), Some(p)) if last.index <= p.index => Some(p),
            (last, p) => last.or(p),
        };
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.tree
            .insert(KEY_VOTE, encode(vote)?)
            .map_err(|e| StorageIOError::write_vote(any_err(&e)))?;
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_vote(any_err(&e)))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.read_mark(KEY_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Not flushed on its own: the committed id is a restart hint (re-apply up to it), and it
        // becomes durable with the next append's flush. sled recovers a prefix of writes, so a
        // durable committed id never points past durable entries.
        self.tree
            .insert(KEY_COMMITTED, encode(&committed)?)
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        if let Some(c) = committed {
            self.committed.fetch_max(c.index, Ordering::Relaxed);
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.read_mark::<Option<LogId>>(KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = sled::Batch::default();
        let mut added = 0u64;
        let mut span: Option<(u64, u64)> = None;
        let mut stamps = Vec::new();
        for entry in entries {
            let index = entry.log_id.index;
            span = Some(span.map_or((index, index), |(first, _)| (first, index)));
            if let EntryPayload::Normal(cmd) = &entry.payload
                && let Some(stamp) = cmd.lease_clock_stamp()
            {
                stamps.push((index, stamp));
            }
            let bytes = encode_entry(&entry)?;
            added += bytes.len() as u64;
            batch.insert(&index_key(ENTRY, index), bytes);
        }
        if let (Some(receipts), Some((first, last))) = (&self.receipts, span) {
            receipts.received(first, last, &stamps);
        }
        self.tree
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        self.log_bytes.fetch_add(added, Ordering::Relaxed);
        // Group commit off the Raft core: the flusher's next flush starts after this write, and
        // covers every append queued meanwhile.
        let flusher = self.flusher.get_or_init(|| Flusher::start(self.db.clone()));
        if let Err(closed) = flusher.queue.send(callback).await {
            // The flusher is gone only if its task panicked: flush here instead.
            let flushed = self.flush().await.map_err(std::io::Error::other);
            closed.0.log_io_completed(flushed);
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        if let Some(receipts) = &self.receipts {
            receipts.truncated(log_id.index);
        }
        let mut batch = sled::Batch::default();
        let mut removed = 0u64;
        for item in self
            .tree
            .range(index_key(ENTRY, log_id.index).to_vec()..entries_end())
        {
            let (k, v) = item.map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
            removed += v.len() as u64;
            batch.remove(k);
        }
        self.tree
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        self.forget(removed);
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // openraft's core awaits this inline: hand it to the purger and return. Entries at or
        // below `log_id` are covered by a snapshot and never read again, so nothing waits on
        // their removal; appends and truncations touch only higher indexes.
        {
            let mut asked = self.purge_asked.lock().unwrap_or_else(|p| p.into_inner());
            if asked.is_none_or(|a| a.index < log_id.index) {
                *asked = Some(log_id);
            }
        }
        let purger = self.purger.get_or_init(|| {
            let (queue, mut waiting) = tokio::sync::mpsc::channel::<LogId>(64);
            // The task holds the tree and the byte count, never the store (whose sender would
            // keep it, and the database, alive after the node stops).
            let (tree, log_bytes) = (self.tree.clone(), self.log_bytes.clone());
            tokio::spawn(async move {
                while let Some(upto) = waiting.recv().await {
                    let (tree, log_bytes) = (tree.clone(), log_bytes.clone());
                    let done =
                        tokio::task::spawn_blocking(move || purge_now(&tree, &log_bytes, upto))
                            .await;
                    if !matches!(done, Ok(Ok(()))) {
                        tracing::warn!(upto = upto.index, "purging the log failed: {done:?}");
                    }
                }
            });
            queue
        });
        if purger.send(log_id).await.is_err() {
            // The purger is gone only if its task panicked: purge here instead.
            purge_now(&self.tree, &self.log_bytes, log_id)?;
        }
        Ok(())
    }
}

/// Remove the entries up to `upto` in batches of [`PURGE_CHUNK`], oldest first. Each batch
/// records as purged the last entry it removes (`upto` itself for the last batch), so a crash
/// between two leaves a log that is a suffix with the right purge mark.
// The wall clock times a log line only; nothing is decided by it.
#[allow(clippy::disallowed_methods)]
fn purge_now(tree: &sled::Tree, log_bytes: &AtomicU64, upto: LogId) -> Result<(), StorageError> {
    let started = std::time::Instant::now();
    let write_err = |e: sled::Error| StorageError::from(StorageIOError::write_logs(any_err(&e)));
    let mut total = 0u64;
    loop {
        let mut batch = sled::Batch::default();
        let (mut removed, mut count, mut last) = (0u64, 0usize, None);
        for item in tree
            .range(index_key(ENTRY, 0)..=index_key(ENTRY, upto.index))
            .take(PURGE_CHUNK)
        {
            let (k, v) = item.map_err(write_err)?;
            removed += v.len() as u64;
            count += 1;
            last = Some(v);
            batch.remove(k);
        }
        let done = count < PURGE_CHUNK;
        let mark = match (&last, done) {
            (Some(bytes), false) => decode_entry(bytes)?.log_id,
            _ => upto,
        };
        batch.insert(KEY_PURGED, encode(&mark)?);
        tree.apply_batch(batch).map_err(write_err)?;
        forget(log_bytes, removed);
        total += removed;
        if done {
            break;
        }
    }
    tracing::debug!(
        upto = upto.index,
        bytes = total,
        ms = started.elapsed().as_millis() as u64,
        "log purged"
    );
    Ok(())
}

/// Entries of `bytes` left the log: never below zero, even if a count was missed.
fn forget(log_bytes: &AtomicU64, bytes: u64) {
    let _ = log_bytes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
        Some(b.saturating_sub(bytes))
    });
}

/// Seed an empty log with `last` as its purged and committed id (a restore): the log then
/// starts right after a snapshot at `last`, which the state machine holds.
pub(crate) fn seed(db: &sled::Db, last: LogId) -> Result<(), crate::storage::StorageError> {
    let tree = db.open_tree(TREE_RAFT)?;
    let corrupt = |e: serde_json::Error| crate::storage::StorageError::Corrupt {
        what: "log mark".into(),
        detail: e.to_string(),
    };
    let mut batch = sled::Batch::default();
    batch.insert(KEY_PURGED, serde_json::to_vec(&last).map_err(corrupt)?);
    batch.insert(
        KEY_COMMITTED,
        serde_json::to_vec(&Some(last)).map_err(corrupt)?,
    );
    tree.apply_batch(batch)?;
    db.flush()?;
    Ok(())
}

/// The first key past every entry key.
fn entries_end() -> Vec<u8> {
    vec![ENTRY + 1]
}
