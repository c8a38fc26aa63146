//! The MVCC history in sled and its key index: writes the history with the state, loads the
//! current state from it, reads it at past revisions, replays it to watches, and folds what
//! compaction dropped. Layout, encoding and rules: [`crate::domain::mvcc`]; the index:
//! [`crate::domain::key_index`].
//!
//! # Layout
//! This file holds the history's handle ([`History`]: the state tree and its key index), its
//! marks and budgets; `records` writes event records and restarts and builds the index from
//! the tree, `read` answers reads at past revisions and replays events, `compact` is the
//! sweep, `tests` checks them against a model.
//!
//! # Invariants
//! - Everything is in the state tree, written with the rest of an applied group's state
//!   ([`super::state_writes`]): an applied entry's events are durable exactly when the rest
//!   of its state is, and a crash never leaves one without the other.
//! - **An applied change is written once**, in its group's event record; the key index (in
//!   memory, rebuilt from the tree on open: [`History::open`]) says which record holds each
//!   version. Base versions (`v/`) are only those with no record: a snapshot's live keys,
//!   and what compaction keeps once its record goes. (A store of format 5 also holds a base
//!   for every version a record holds; the index prefers the base, so it reads the same.)
//! - The history is complete above the floor, `max(compact_revision, history_start)`, and
//!   from the compaction mark itself where the history starts at or below it and the store
//!   was not swept through the mark by an older version (`mvcc::watch_floor`: etcd watches
//!   may start at the mark, as etcd's); the state machine persists `history_start`. A store of format 2 (values under `k/` beside
//!   the history) is converted when opened; its history starts again at its current state.
//! - The sweep runs inside `apply`, a bounded number of events per call, so it never stalls a
//!   write and never runs concurrently with a snapshot install (openraft serializes them).
//!   The state machine sweeps towards the revision below the compaction mark
//!   (`mvcc::sweep_mark`: the mark's own records stay, for etcd watches from the mark). It
//!   removes event records wholly at or below its mark, oldest first, and for each key they
//!   name keeps only what compaction keeps ([`KeyIndex::plan_fold`]): the newest version at
//!   or below the mark, written as a base when its record goes. Reads at the mark or later,
//!   and watches from after it, never see a difference.
//! - The index changes with the writes (the state machine's under the state's write lock, a
//!   fill's under its gate); a history read takes locations from it a piece at a time, then
//!   reads them: a location a fold moved meanwhile is missing, and the caller reads again
//!   ([`super::state_view::read_unswept`]).
//!
//! # What it must not do
//! Decide what is kept (the domain does) or answer a read below the floor (callers check it).

use std::sync::Arc;

use crate::raft::off_workers::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::domain::key_index::KeyIndex;
use crate::domain::mvcc::{LEGACY_PREFIXES, Malformed};
use crate::domain::types::Revision;
use crate::raft::off_workers;
use crate::storage::StorageError;

mod compact;
mod read;
mod records;
#[cfg(test)]
mod tests;

pub use compact::Swept;
pub use read::{KeyPage, LiveKeys, events_since, replay_onto};
pub use records::{
    base_index, build_index, drop_records_above, index_records, record, record_parts, restart,
};

/// Where the history of this node begins (a snapshot, or a store from before history).
pub const KEY_HISTORY_START: &[u8] = b"m/history_start";
/// Format 2's sweep position: removed when such a store is converted.
const LEGACY_KEY_SWEPT: &[u8] = b"m/history_swept";
/// The highest revision through which the sweep has been allowed to remove event records
/// (absent in a store from before it was kept: the compaction mark bounds it there). Below the
/// compaction mark, or at a snapshot install's revision; a store whose limit reaches its
/// compaction mark otherwise was swept by an older version, which removed the mark's records. The sweep
/// stops at the snapshot on disk, so the records after a snapshot survive until the next
/// one: a restart loads the snapshot and replays them ([`replay_onto`]) instead of reading
/// every version.
pub const KEY_SWEEP_LIMIT: &[u8] = b"m/sweep_limit";
/// The bytes of keys and values after which an applied group's events go on in another
/// event record (cut at a revision's end). sled 0.34 writes an item past a quarter of its
/// segment (2 MiB) to a blob file it never syncs, and it logs a whole leaf node (up to about
/// 17 neighbouring records) at once: records this small keep such a node of event records
/// under that size.
pub const EVENT_RECORD_BYTES: usize = 96 << 10;
/// Events the sweep looks at per applied batch, at least: a few sled reads each, so at most
/// a couple of milliseconds added to a small apply.
pub const SWEEP_BUDGET: usize = 128;

/// Events the sweep looks at after an applied batch that recorded `recorded` events: twice
/// as many (and at least [`SWEEP_BUDGET`]), so that the sweep outpaces any write rate. A fixed
/// budget fell behind for good under group commit: one applied batch of a loaded leader
/// carries up to 1,024 commands, and 128-put transactions each record 128 events, so a
/// compaction of 10M versions would never have been swept while writes went on.
pub fn sweep_budget(recorded: usize) -> usize {
    recorded.saturating_mul(2).max(SWEEP_BUDGET)
}

fn corrupt(what: &str, detail: impl ToString) -> StorageError {
    StorageError::Corrupt {
        what: what.into(),
        detail: detail.to_string(),
    }
}

fn malformed(what: &'static str) -> impl Fn(Malformed) -> StorageError {
    move |e| corrupt(what, e)
}

/// Whether the tree holds a store of format 2 (values under `k/`, an index under `i/`).
pub fn is_legacy(tree: &sled::Tree) -> Result<bool, StorageError> {
    for prefix in LEGACY_PREFIXES {
        if tree.scan_prefix(prefix).next().transpose()?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

fn read_revision(tree: &sled::Tree, key: &[u8]) -> Result<Option<Revision>, StorageError> {
    tree.get(key)?
        .map(|v| {
            <[u8; 8]>::try_from(v.as_ref())
                .map(|b| Revision(u64::from_be_bytes(b)))
                .map_err(|_| corrupt("history mark", "not 8 bytes"))
        })
        .transpose()
}

/// Where this node's history begins (`None`: a store from before history was kept).
pub fn history_start(tree: &sled::Tree) -> Result<Option<Revision>, StorageError> {
    read_revision(tree, KEY_HISTORY_START)
}

/// The persisted sweep limit ([`KEY_SWEEP_LIMIT`]), if this store keeps one.
pub fn sweep_limit(tree: &sled::Tree) -> Result<Option<Revision>, StorageError> {
    read_revision(tree, KEY_SWEEP_LIMIT)
}

/// Live keys read per look at the index by the paged reads ([`LiveKeys`]).
pub const LIVE_PAGE: usize = 1_024;
/// Keys of the index looked at per hold of its lock by a long read.
const WALK_STEP: usize = 4_096;

/// A history: the state tree and the index of its versions.
#[derive(Clone)]
pub struct History {
    pub tree: sled::Tree,
    index: Arc<RwLock<KeyIndex>>,
}

impl History {
    /// The history in `tree`, its index rebuilt from it.
    pub fn open(tree: sled::Tree) -> Result<Self, StorageError> {
        let index = build_index(&tree)?;
        Ok(History {
            tree,
            index: Arc::new(RwLock::new(index)),
        })
    }

    /// The index, to change with the writes that make the change.
    pub fn index_mut(&self) -> RwLockWriteGuard<'_, KeyIndex> {
        off_workers::write(&self.index)
    }

    fn index(&self) -> RwLockReadGuard<'_, KeyIndex> {
        off_workers::read(&self.index)
    }

    /// How many keys have a version in the index, and how many versions it holds.
    pub fn size(&self) -> (usize, usize) {
        let index = self.index();
        (index.keys(), index.versions())
    }

    /// Add a history fill's versions (none newer than this index's of their keys) a few
    /// thousand keys per hold of the lock, each key's at once, each step while `hold`'s
    /// guard is held (the fill's gate: an install that replaced the index meanwhile stops it).
    pub fn merge_older<G, E>(
        &self,
        older: &KeyIndex,
        hold: impl Fn() -> Result<G, E>,
    ) -> Result<(), E> {
        let mut after: Option<crate::domain::key_index::IndexKey> = None;
        loop {
            let _held = hold()?;
            let next = self
                .index_mut()
                .merge_older(older, after.as_deref(), WALK_STEP);
            match next {
                Some(key) => after = Some(key),
                None => return Ok(()),
            }
        }
    }
}
