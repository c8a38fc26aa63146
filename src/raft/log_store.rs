//! The Raft log: entries in segment files ([`super::segment_log`]), the vote, committed id and
//! purge mark in sled.
//!
//! # Invariants
//! - Entries live in `<data dir>/raft-log/` as checksummed records; the marks (vote,
//!   committed, last purged) in one sled tree ([`TREE_RAFT`]) under `m/...`. A crash leaves the
//!   log a prefix of what was written: a torn tail is cut when the log is opened.
//! - An append is reported durable (`log_io_completed`) only after an fdatasync that started
//!   after the entries were written: a vote or acknowledgement is never given for an entry a
//!   crash could lose. The syncs run on a thread of their own ([`super::log_sync`]), not in
//!   `append`, which openraft's core awaits inline; callbacks complete in the order of the
//!   appends, and every append queued while a sync runs shares the next one (group commit).
//! - sled is no longer flushed by appends. The state machine's writes become durable with
//!   sled's own periodic flush; after a crash openraft re-applies what the log holds past the
//!   persisted applied mark. So the log must never lose what the persisted state lacks: a
//!   purge waits until the state machine has applied up to it (openraft asks for the purge
//!   of an installed snapshot while the install is still under way), writes its mark and
//!   flushes sled (the state with it), and only then forgets entries and deletes segments.
//! - The persisted committed id may run ahead of the durable entries (it is a sled write,
//!   the entries are not): it is read back no higher than the last entry in the log.
//! - `save_vote` flushes before returning: a node never votes twice in one term across a crash.
//! - A purge runs on a task of its own; readers see it the moment it is asked for
//!   (`purge_asked`), before the entries are gone.
//! - [`LogStore::log_bytes`] counts the stored entries' bytes, for the storage quota and
//!   compaction by bytes.
//! - Replication reads at most [`READ_BUDGET_BYTES`] of entries per request
//!   (`limited_get_log_entries`): openraft asks for up to `max_payload_entries` entries at a
//!   time, and 512 entries of 1 MiB each, read at once for every follower, made the node's memory
//!   grow with the bytes in the log.
//! - A data directory whose entries are still in sled (format 3 and older) has them moved to
//!   the segment files when opened; the move can be interrupted and done again.
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

use super::durability::{Durability, DurableView, may_acknowledge_early};
use super::entry_cache::{self, EntryCache};
use super::log_sync::{SyncJob, Syncer};
use super::segment_log::{LogFileError, SegmentLog};
use super::state_machine::AppliedMark;
use super::{Entry, LogId, NodeId, StorageError, TypeConfig, any_err};
use crate::metrics::SyncStats;
use crate::storage::TREE_RAFT;

const ENTRY: u8 = b'e';
const KEY_VOTE: &[u8] = b"m/vote";
const KEY_COMMITTED: &[u8] = b"m/committed";
const KEY_PURGED: &[u8] = b"m/purged";
/// The entries' directory, inside the data directory.
pub const LOG_DIR: &str = "raft-log";

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

/// The log store. Cheap to clone: clones share the same files and tree.
#[derive(Clone)]
pub struct LogStore {
    db: sled::Db,
    /// The marks.
    tree: sled::Tree,
    entries: Arc<SegmentLog>,
    /// The latest committed index this node was told of, for status reports.
    committed: Arc<AtomicU64>,
    receipts: Option<Arc<dyn LogReceipts>>,
    syncer: Syncer,
    /// This node, once known ([`LogStore::with_node`]): only then may it acknowledge its own
    /// appends before they are synced ([`super::durability`]).
    me: Option<NodeId>,
    /// The vote as last saved.
    vote: Arc<std::sync::Mutex<Option<Vote<NodeId>>>>,
    durability: Durability,
    /// Started on the first purge; shared by clones.
    purger: Arc<std::sync::OnceLock<tokio::sync::mpsc::Sender<LogId>>>,
    /// The latest purge asked for: entries up to it are gone for every reader at once, even
    /// while the purger is still removing them.
    purge_asked: Arc<std::sync::Mutex<Option<LogId>>>,
    /// The newest entries, decoded: most reads are of entries just appended.
    cache: Arc<std::sync::Mutex<EntryCache>>,
    /// How far the state machine has applied, once known ([`LogStore::with_applied`]): a
    /// purge waits until the state holds what it removes.
    applied: Option<tokio::sync::watch::Receiver<AppliedMark>>,
    /// Told of every membership appended ([`LogStore::with_vote_hold`]).
    vote_hold: Option<Arc<super::vote_hold::VoteHold>>,
}

/// The vote a node starts with, given the one it stored: a leader's own vote comes back
/// uncommitted, so that it must win a new term before it leads again.
///
/// openraft 0.9 restores a node whose stored vote is its own committed one as the leader of
/// that term at once. But the leader acknowledges its own entries before they are synced
/// (`super::durability`), so a crash of the machine may have taken entries of that term from
/// its log that the followers hold. Leading the same term again, it would write new entries
/// under those same log ids, and the followers, which match entries by id, would keep their
/// old ones: two different entries applied under one id. In a new term every id is new. The
/// vote stays the node's own for that term, so it still grants no other vote in it.
pub fn vote_to_restart_with(stored: Option<Vote<NodeId>>, me: NodeId) -> Option<Vote<NodeId>> {
    match stored {
        Some(v) if v.committed && v.leader_id().node_id == me => {
            Some(Vote::new(v.leader_id().term, me))
        }
        other => other,
    }
}

fn file_err(e: LogFileError) -> crate::storage::StorageError {
    crate::storage::StorageError::Corrupt {
        what: "raft log".into(),
        detail: e.to_string(),
    }
}

impl LogStore {
    /// Open the log of the data directory `dir`, whose sled database is `db`.
    pub fn open(
        db: &sled::Db,
        dir: &std::path::Path,
    ) -> Result<Self, crate::storage::StorageError> {
        let tree = db.open_tree(TREE_RAFT)?;
        let corrupt = |what: &str, detail: String| crate::storage::StorageError::Corrupt {
            what: what.into(),
            detail,
        };
        let purged: Option<LogId> =
            read_mark(&tree, KEY_PURGED).map_err(|e| corrupt("log purge mark", e.to_string()))?;
        let vote: Option<Vote<NodeId>> =
            read_mark(&tree, KEY_VOTE).map_err(|e| corrupt("vote", e.to_string()))?;
        let log_dir = dir.join(LOG_DIR);
        if tree.scan_prefix([ENTRY]).next().is_some() {
            move_entries_out_of_sled(db, &tree, &log_dir, purged)?;
        }
        let entries =
            Arc::new(SegmentLog::open(&log_dir, purged.map(|p| p.index)).map_err(file_err)?);
        // The open synced what it found: all of it is durable.
        let durability = Durability::new(
            last_entry_id(&entries).map_err(|e| corrupt("raft log", e.to_string()))?,
        );
        let syncer = Syncer::start(entries.clone(), durability.clone())
            .map_err(|e| corrupt("raft log sync thread", e.to_string()))?;
        Ok(LogStore {
            db: db.clone(),
            tree,
            entries,
            committed: Arc::new(AtomicU64::new(0)),
            receipts: None,
            vote_hold: None,
            syncer,
            me: None,
            vote: Arc::new(std::sync::Mutex::new(vote)),
            durability,
            purger: Arc::new(std::sync::OnceLock::new()),
            purge_asked: Arc::new(std::sync::Mutex::new(None)),
            cache: Arc::new(std::sync::Mutex::new(EntryCache::new(
                entry_cache::DEFAULT_MAX_BYTES,
                entry_cache::DEFAULT_MAX_ENTRIES,
            ))),
            applied: None,
        })
    }

    /// Purge only entries the state machine has applied (`marks` are its applied marks).
    /// openraft asks for the purge a snapshot install covers at the same time as it hands the
    /// install to the state machine, and a purge flushes sled with its mark: without the
    /// wait, a crash during the install could leave a log purged past the persisted state,
    /// which openraft cannot re-apply from.
    pub fn with_applied(mut self, marks: tokio::sync::watch::Receiver<AppliedMark>) -> Self {
        self.applied = Some(marks);
        self
    }

    /// How long this log's syncs take (`leasecore_raft_log_fsync_duration_seconds`).
    pub fn sync_stats(&self) -> Arc<SyncStats> {
        self.syncer.times.clone()
    }

    /// Tell `hold` of every membership appended from now on.
    pub fn with_vote_hold(mut self, hold: Arc<super::vote_hold::VoteHold>) -> Self {
        self.vote_hold = Some(hold);
        self
    }

    /// Report appended and truncated entries to `receipts` from now on.
    pub fn with_receipts(mut self, receipts: Arc<dyn LogReceipts>) -> Self {
        self.receipts = Some(receipts);
        self
    }

    /// This node's id: from now on it acknowledges the entries it appends as leader before
    /// they are synced ([`super::durability`] says why that is safe).
    pub fn with_node(mut self, me: NodeId) -> Self {
        self.me = Some(me);
        let mut vote = self.vote.lock().unwrap_or_else(|p| p.into_inner());
        *vote = vote_to_restart_with(*vote, me);
        drop(vote);
        self
    }

    /// How far the log is durable.
    pub fn durable_view(&self) -> DurableView {
        self.durability.view()
    }

    /// Bytes of the stored entries (shared; updated as the log changes).
    pub fn log_bytes(&self) -> Arc<AtomicU64> {
        self.entries.bytes_counter()
    }

    /// The committed index as last saved (shared; updated as openraft saves it).
    pub fn committed_index(&self) -> Arc<AtomicU64> {
        self.committed.clone()
    }

    fn read_mark<T: DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, StorageError> {
        read_mark(&self.tree, key)
    }

    fn last_entry_id(&self) -> Result<Option<LogId>, StorageError> {
        last_entry_id(&self.entries)
    }

    /// The first index a reader may see: past the latest purge asked for.
    fn first_readable(&self, start: u64) -> u64 {
        let asked = *self.purge_asked.lock().unwrap_or_else(|p| p.into_inner());
        asked.map_or(start, |p| start.max(p.index + 1))
    }

    fn purge_parts(&self) -> PurgeParts {
        PurgeParts {
            db: self.db.clone(),
            tree: self.tree.clone(),
            entries: self.entries.clone(),
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, EntryCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn truncate_from(&self, index: u64) -> Result<(), StorageError> {
        // The cache first: no reader may find the removed entries there once the files
        // have lost them.
        self.cache().truncate_from(index);
        self.entries
            .truncate(index)
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        self.durability.truncated(index, self.last_entry_id()?);
        if let Some(hold) = &self.vote_hold {
            hold.truncated(index);
        }
        Ok(())
    }

    fn read_entries(&self, from: u64, to: u64, budget: usize) -> Result<Vec<Entry>, StorageError> {
        let from = self.first_readable(from);
        if let Some(cached) = self.cache().read(from, to, budget) {
            return Ok(cached);
        }
        let raw = self
            .entries
            .read(from, to, budget)
            .map_err(|e| StorageIOError::read_logs(any_err(&e)))?;
        raw.iter().map(|bytes| decode_entry(bytes)).collect()
    }
}

/// A mark (a small JSON document) of `tree`, if it is there.
fn read_mark<T: DeserializeOwned>(
    tree: &sled::Tree,
    key: &[u8],
) -> Result<Option<T>, StorageError> {
    let raw = tree
        .get(key)
        .map_err(|e| StorageIOError::read_logs(any_err(&e)))?;
    raw.map(|bytes| serde_json::from_slice(&bytes))
        .transpose()
        .map_err(|e| StorageIOError::read_logs(any_err(&e)).into())
}

/// The id of the last entry in `entries`.
fn last_entry_id(entries: &SegmentLog) -> Result<Option<LogId>, StorageError> {
    let Some((_, last)) = entries.span() else {
        return Ok(None);
    };
    let raw = entries
        .read(last, last + 1, usize::MAX)
        .map_err(|e| StorageIOError::read_logs(any_err(&e)))?;
    match raw.last() {
        Some(bytes) => Ok(Some(decode_entry(bytes)?.log_id)),
        None => Ok(None),
    }
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, StorageError> {
    serde_json::to_vec(v).map_err(|e| StorageIOError::write_logs(any_err(&e)).into())
}

/// An entry's stored form.
pub fn encode_entry(entry: &Entry) -> Result<Vec<u8>, StorageError> {
    rmp_serde::to_vec_named(entry).map_err(|e| StorageIOError::write_logs(any_err(&e)).into())
}

/// An entry's stored form, which is also its form inside an append to a follower. With `keep`
/// (the leader's own entries), the encoding is kept with the entry's command
/// ([`LogCommand::keep_encoded_entry`](crate::raft::LogCommand::keep_encoded_entry)) for the
/// appends that send it; an encoding kept already is used as it is.
pub fn entry_bytes(entry: &Entry, keep: bool) -> Result<bytes::Bytes, StorageError> {
    if let Some(bytes) = kept_entry_bytes(entry) {
        return Ok(bytes);
    }
    let bytes = bytes::Bytes::from(encode_entry(entry)?);
    if keep && let EntryPayload::Normal(cmd) = &entry.payload {
        cmd.keep_encoded_entry(entry.log_id, bytes.clone());
    }
    Ok(bytes)
}

/// The encoding [`entry_bytes`] kept for `entry`, if it kept one.
pub fn kept_entry_bytes(entry: &Entry) -> Option<bytes::Bytes> {
    match &entry.payload {
        EntryPayload::Normal(cmd) => cmd.encoded_entry(entry.log_id),
        _ => None,
    }
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
        let end = match range.end_bound() {
            Bound::Included(&i) => i.saturating_add(1),
            Bound::Excluded(&i) => i,
            Bound::Unbounded => u64::MAX,
        };
        self.read_entries(start, end, usize::MAX)
    }

    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry>, StorageError> {
        self.read_entries(start, end, READ_BUDGET_BYTES)
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
        self.db
            .flush_async()
            .await
            .map_err(|e| StorageIOError::write_vote(any_err(&e)))?;
        *self.vote.lock().unwrap_or_else(|p| p.into_inner()) = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        // As loaded on open and kept by `save_vote`; once the node is known, a leader's own
        // vote comes back uncommitted (`with_node`, `vote_to_restart_with`).
        Ok(*self.vote.lock().unwrap_or_else(|p| p.into_inner()))
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Not flushed on its own: the committed id is a restart hint (re-apply up to it), read
        // back no higher than the durable entries (`read_committed`).
        self.tree
            .insert(KEY_COMMITTED, encode(&committed)?)
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        if let Some(c) = committed {
            self.committed.fetch_max(c.index, Ordering::Relaxed);
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        let saved = self.read_mark::<Option<LogId>>(KEY_COMMITTED)?.flatten();
        let Some(saved) = saved else {
            return Ok(None);
        };
        // The entries past the last one that survived were never durable here; everything up
        // to it that the saved id covers is committed (a prefix of a committed log).
        let purged: Option<LogId> = self.read_mark(KEY_PURGED)?;
        let last = self.last_entry_id()?.or(purged);
        Ok(match last {
            Some(last) if last.index < saved.index => Some(last),
            None => None,
            _ => Some(saved),
        })
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
        let entries: Vec<Entry> = entries.into_iter().collect();
        let early = self.me.is_some_and(|me| {
            let vote = self.vote.lock().unwrap_or_else(|p| p.into_inner());
            may_acknowledge_early(me, vote.as_ref(), &entries)
        });
        let mut records = Vec::new();
        let mut stamps = Vec::new();
        for entry in &entries {
            let index = entry.log_id.index;
            if let EntryPayload::Normal(cmd) = &entry.payload
                && let Some(stamp) = cmd.lease_clock_stamp()
            {
                stamps.push((index, stamp));
            }
            if let (EntryPayload::Membership(m), Some(hold)) = (&entry.payload, &self.vote_hold) {
                hold.stored(index, m);
            }
            records.push((index, entry_bytes(entry, early)?));
        }
        if let (Some(receipts), Some((first, _)), Some((last, _))) =
            (&self.receipts, records.first(), records.last())
        {
            receipts.received(*first, *last, &stamps);
        }
        // openraft truncates a conflicting suffix before it appends over it, and never appends
        // below the purge point; its storage suite does both: an append that starts inside the
        // log replaces from there, and entries already purged are dropped.
        let asked = *self.purge_asked.lock().unwrap_or_else(|p| p.into_inner());
        let floor = (self.entries.floor()).max(asked.map_or(0, |p| p.index + 1));
        records.retain(|(index, _)| *index >= floor);
        if let Some(&(start, _)) = records.first() {
            let after_log = match self.entries.span() {
                Some((first, last)) if start <= last => {
                    self.truncate_from(first.max(start))?;
                    false
                }
                Some((_, last)) => start > last + 1,
                None => start > self.entries.floor(),
            };
            // The log goes on past a purge beyond its end (a snapshot was installed): the
            // purge must be durable first, or a restart would find the old entries, a hole,
            // then the new ones.
            if after_log && let Some(upto) = asked.filter(|p| p.index + 1 >= start) {
                let parts = self.purge_parts();
                tokio::task::spawn_blocking(move || parts.purge(upto))
                    .await
                    .map_err(|e| StorageIOError::write_logs(any_err(&e)))??;
            }
        }
        self.entries
            .append(&records)
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        let last = records
            .last()
            .and_then(|(index, _)| entries.iter().rev().find(|e| e.log_id.index == *index))
            .map(|e| e.log_id);
        // `records` is the suffix of `entries` at or above the floor.
        let kept = entries.len() - records.len();
        let sizes = records.iter().map(|(_, bytes)| bytes.len());
        self.cache()
            .appended(entries.into_iter().skip(kept).zip(sizes));
        let callback = match early {
            true => {
                callback.log_io_completed(Ok(()));
                None
            }
            false => Some(callback),
        };
        let job = SyncJob {
            callback,
            last,
            generation: self.durability.generation(),
        };
        if let Err(closed) = self.syncer.queue.send(job).await {
            // The sync thread is gone only if it panicked: sync here instead.
            let entries = self.entries.clone();
            let synced = tokio::task::spawn_blocking(move || entries.sync())
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
            match (&synced, closed.0.last) {
                (Ok(()), Some(last)) => self.durability.synced(last, closed.0.generation),
                (Err(_), _) => self.durability.failed(),
                _ => {}
            }
            if let Some(callback) = closed.0.callback {
                callback.log_io_completed(synced);
            }
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        if let Some(receipts) = &self.receipts {
            receipts.truncated(log_id.index);
        }
        self.truncate_from(log_id.index)
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
        self.cache().purged_upto(log_id.index);
        let purger = self.purger.get_or_init(|| {
            let (queue, waiting) = tokio::sync::mpsc::channel::<LogId>(64);
            // The task holds what a purge needs, never the store (whose sender would keep it,
            // and the database, alive after the node stops).
            tokio::spawn(run_purger(
                self.purge_parts(),
                waiting,
                self.applied.clone(),
            ));
            queue
        });
        if purger.send(log_id).await.is_err() {
            // The purger is gone only if its task panicked: purge here instead.
            self.purge_parts().purge(log_id)?;
        }
        Ok(())
    }
}

/// The purger: each purge once the state machine has applied up to it (`applied`, when
/// known). A purge asked while it waits replaces the one it waits for (the later purge covers
/// the earlier), so its queue never fills and `purge` never holds up the Raft core.
async fn run_purger(
    parts: PurgeParts,
    mut waiting: tokio::sync::mpsc::Receiver<LogId>,
    mut applied: Option<tokio::sync::watch::Receiver<AppliedMark>>,
) {
    while let Some(mut upto) = waiting.recv().await {
        if let Some(marks) = &mut applied {
            loop {
                let target = upto.index;
                tokio::select! {
                    // As a bool: the guard `wait_for` returns must not live across an await.
                    reached = async { marks.wait_for(|m| m.log_index >= target).await.is_ok() } => {
                        if !reached {
                            // The state machine is gone (shutdown): purge nothing more, but
                            // keep taking requests, so that `purge` never purges unguarded.
                            while waiting.recv().await.is_some() {}
                            return;
                        }
                        break;
                    }
                    later = waiting.recv() => match later {
                        Some(later) if later.index > upto.index => upto = later,
                        Some(_) => {}
                        None => return,
                    },
                }
            }
        }
        let parts = parts.clone();
        let done = tokio::task::spawn_blocking(move || parts.purge(upto)).await;
        if !matches!(done, Ok(Ok(()))) {
            tracing::warn!(upto = upto.index, "purging the log failed: {done:?}");
        }
    }
}

/// What a purge touches.
#[derive(Clone)]
struct PurgeParts {
    db: sled::Db,
    tree: sled::Tree,
    entries: Arc<SegmentLog>,
}

impl PurgeParts {
    /// Record the purge mark, make it and the state durable, then forget the entries and
    /// delete the segments that held only them.
    // The wall clock times a log line only; nothing is decided by it.
    #[allow(clippy::disallowed_methods)]
    fn purge(&self, upto: LogId) -> Result<(), StorageError> {
        let started = std::time::Instant::now();
        let write_err =
            |e: sled::Error| StorageError::from(StorageIOError::write_logs(any_err(&e)));
        let mark: Option<LogId> = read_mark(&self.tree, KEY_PURGED)?;
        if mark.is_none_or(|m| m.index < upto.index) {
            self.tree
                .insert(KEY_PURGED, encode(&upto)?)
                .map_err(write_err)?;
        }
        self.db.flush().map_err(write_err)?;
        let removed = self
            .entries
            .purge(upto.index)
            .map_err(|e| StorageIOError::write_logs(any_err(&e)))?;
        tracing::debug!(
            upto = upto.index,
            bytes = removed,
            ms = started.elapsed().as_millis() as u64,
            "log purged"
        );
        Ok(())
    }
}

/// Move the entries of a data directory of format 3 or older from sled to the segment files:
/// write them all anew (whatever an interrupted move left is discarded), sync, then remove
/// them from sled and flush. Interrupted at any point, it is done again on the next open.
fn move_entries_out_of_sled(
    db: &sled::Db,
    tree: &sled::Tree,
    log_dir: &std::path::Path,
    purged: Option<LogId>,
) -> Result<(), crate::storage::StorageError> {
    match std::fs::remove_dir_all(log_dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(file_err(LogFileError::Misuse(format!(
                "removing {}: {e}",
                log_dir.display()
            ))));
        }
        _ => {}
    }
    let log = SegmentLog::open(log_dir, purged.map(|p| p.index)).map_err(file_err)?;
    let floor = purged.map_or(0, |p| p.index + 1);
    let mut chunk = Vec::new();
    let mut moved = 0u64;
    for item in tree.scan_prefix([ENTRY]) {
        let (k, v) = item?;
        let index = u64::from_be_bytes(k[1..].try_into().map_err(|_| {
            crate::storage::StorageError::Corrupt {
                what: "log entry key".into(),
                detail: format!("{} bytes", k.len()),
            }
        })?);
        if index < floor {
            continue;
        }
        chunk.push((index, v.to_vec()));
        if chunk.len() == 1024 {
            log.append(&chunk).map_err(file_err)?;
            moved += chunk.len() as u64;
            chunk.clear();
        }
    }
    log.append(&chunk).map_err(file_err)?;
    moved += chunk.len() as u64;
    log.sync()
        .map_err(|e| file_err(LogFileError::Misuse(e.to_string())))?;
    let keys: Vec<sled::IVec> = tree.scan_prefix([ENTRY]).keys().collect::<Result<_, _>>()?;
    for part in keys.chunks(1024) {
        let mut batch = sled::Batch::default();
        for k in part {
            batch.remove(k);
        }
        tree.apply_batch(batch)?;
    }
    db.flush()?;
    tracing::info!(
        entries = moved,
        "moved the raft log out of sled into its segment files"
    );
    Ok(())
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

#[cfg(test)]
mod tests {
    use openraft::Vote;

    use super::vote_to_restart_with;

    #[test]
    fn only_a_nodes_own_committed_vote_comes_back_uncommitted() {
        let mut led = Vote::new(4, 1);
        led.commit();
        assert_eq!(vote_to_restart_with(Some(led), 1), Some(Vote::new(4, 1)));
        // Another leader's vote, a candidate's vote and no vote stay as stored.
        assert_eq!(vote_to_restart_with(Some(led), 2), Some(led));
        assert_eq!(
            vote_to_restart_with(Some(Vote::new(4, 1)), 1),
            Some(Vote::new(4, 1))
        );
        assert_eq!(vote_to_restart_with(None, 1), None);
    }
}
