//! Storage of a history fill ([`crate::domain::history_fill`]): pages are staged in a tree of
//! their own, checked against this node's state, then adopted into the state tree.
//!
//! # Invariants
//! - The state tree gets no fill record until the whole span is staged and checked: a fill
//!   cut anywhere before adoption leaves the state tree as it was (the staging tree is
//!   cleared when the node opens).
//! - **Adoption is crash-atomic.** A marker ([`KEY_FILL_MOVE`]) is written first, then the
//!   staged records, then the new history start, then the marker is removed. sled recovers a
//!   prefix of its writes: a node that opens with the marker finishes the adoption from the
//!   staging tree (complete, since it was written before the marker) before anything reads.
//! - **The sweep is frozen while records move in.** The sweep removes a key's versions up to
//!   its tombstone; a base version moved in after the sweep passed its key would bring a
//!   deleted key back. The freeze is set, then the compaction is checked under the state's
//!   write lock (an apply that was sweeping has finished, every later one sees the freeze,
//!   and no sweep so far reached the old start). It stays frozen until the move is done, by
//!   this adoption, the next fill's `begin`, a restart's redo or an install.
//! - **An install wins.** A snapshot install replaces the whole history under the gate and
//!   bumps its epoch; every fill step checks the epoch under the gate and stops, and the
//!   install's writes remove the marker ([`super::mvcc_store::restart`]).
//! - sled's blob files (values past a share of its segment, never synced by sled) are
//!   synced before the start is lowered: a power failure cannot keep the adoption and lose
//!   a record it moved.
//! - **Reads meanwhile stay right.** Reads go through the key index, which gets the moved
//!   versions only once they are all in the tree and durable, each key's at once (under
//!   the gate: an install that replaced the index meanwhile stops it). A history read at or
//!   above the old start (allowed all along) so never finds a deleted key's older version
//!   without its tombstone; reads below it are refused until the start is lowered, last.
//! - Lock order: the gate, then the state's lock, then the key index's (the install and
//!   adoption both take them so).
//!
//! # What it must not do
//! Decide what to fetch or trust a page (the domain module does), or write history records
//! anywhere but through the adoption.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::raft::off_workers::RwLock;

use super::mvcc_store::{self, LiveKeys};
use super::state_view::{HistoryRemovals, read_unswept};
use super::state_writes::{DirectWrites, Writes};
use crate::domain::command::Event;
use crate::domain::history_fill::LocalHistory;
use crate::domain::kv::{KvState, Versioned};
use crate::domain::mvcc::{encode_version, index_key};
use crate::domain::types::Revision;
use crate::raft::off_workers;
use crate::storage::StorageError;

/// The staging tree of a fill.
pub const TREE_FILL: &str = "history_fill";
/// In the state tree while a fill is being adopted: the new start and the old (16 bytes BE).
pub const KEY_FILL_MOVE: &[u8] = b"m/fill_move";
/// Records moved per step of an adoption (the gate is held for one step).
const MOVE_STEP: usize = 1_024;

/// Why a fill stopped.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    #[error("a snapshot was installed meanwhile")]
    Superseded,
    #[error("nothing to fill any more: the compaction passed where the history starts")]
    NotNeeded,
    #[error("an adoption that had failed midway was finished first")]
    Finished,
    #[error("the history fetched disagrees with this node's state at {at}: {detail}")]
    Mismatch { at: Revision, detail: String },
    #[error(transparent)]
    Storage(#[from] StorageError),
}

impl From<sled::Error> for FillError {
    fn from(e: sled::Error) -> Self {
        FillError::Storage(e.into())
    }
}

/// Who may write history records now: shared by the state machine and the fill.
#[derive(Debug, Default)]
pub struct FillGate {
    epoch: Mutex<u64>,
    sweep_frozen: AtomicBool,
}

impl FillGate {
    /// For a snapshot install: hold this across the install's scan and batch. Any fill in
    /// progress stops at its next step, and the sweep runs again.
    pub fn install(&self) -> MutexGuard<'_, u64> {
        let mut epoch = self.lock();
        *epoch += 1;
        self.sweep_frozen.store(false, Ordering::SeqCst);
        epoch
    }

    /// Whether the apply path must not sweep now (read under the state's write lock).
    pub fn sweep_frozen(&self) -> bool {
        self.sweep_frozen.load(Ordering::SeqCst)
    }

    fn lock(&self) -> MutexGuard<'_, u64> {
        self.epoch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The gate, if the epoch is still `epoch`.
    fn held(&self, epoch: u64) -> Result<MutexGuard<'_, u64>, FillError> {
        let guard = self.lock();
        if *guard != epoch {
            return Err(FillError::Superseded);
        }
        Ok(guard)
    }
}

/// The fill's handle on storage.
#[derive(Clone)]
pub struct FillStore {
    pub(super) db: sled::Db,
    pub(super) state: sled::Tree,
    pub(super) staging: sled::Tree,
    pub(super) gate: Arc<FillGate>,
    pub(super) kv: Arc<RwLock<KvState>>,
    /// The state's history and key index.
    pub(super) history: mvcc_store::History,
    /// For reads of the state's history that a sweep may overlap.
    pub(super) removals: HistoryRemovals,
    pub(super) history_start: Arc<AtomicU64>,
    /// Tests of crash recovery: move at most this many records, then fail.
    pub(super) stop_after: Option<usize>,
    /// The data directory (for [`crate::storage::sync_blobs`]).
    pub(super) dir: std::path::PathBuf,
}

impl FillStore {
    /// This node's history start and compaction mark.
    pub fn local(&self) -> LocalHistory {
        let kv = off_workers::read(&self.kv);
        LocalHistory {
            start: Revision(self.history_start.load(Ordering::Acquire)),
            compacted: kv.compact_revision(),
        }
    }

    /// Tests of crash recovery: the next adoption moves at most `records`, then fails as if
    /// the process had died there.
    #[doc(hidden)]
    pub fn stop_after(&mut self, records: Option<usize>) {
        self.stop_after = records;
    }

    /// Finish an adoption that failed midway, if there is one (its marker is there and the
    /// sweep frozen): whether there was. Run before anything else a fill decides, so the
    /// sweep never stays frozen because no new fill is needed or possible.
    pub fn resume(&self) -> Result<bool, FillError> {
        let epoch = *self.gate.lock();
        match fill_marker(&self.state)? {
            Some(floor) => {
                self.move_in(epoch, floor)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Start a fill: an empty staging tree, and the epoch its steps must still see. An
    /// adoption that failed midway (its marker is there, the sweep still frozen) is finished
    /// first, from the staging tree it left: [`FillError::Finished`] then.
    pub fn begin(&self) -> Result<u64, FillError> {
        if self.resume()? {
            return Err(FillError::Finished);
        }
        self.staging.clear()?;
        Ok(*self.gate.lock())
    }

    /// Stage live keys at the fill's floor as base versions.
    pub fn stage_keys(&self, epoch: u64, keys: &[(String, Versioned)]) -> Result<(), FillError> {
        drop(self.gate.held(epoch)?);
        let mut writes = DirectWrites::new(&self.staging, None);
        for (key, v) in keys {
            writes.insert(index_key(key, v.mod_revision), encode_version(Some(v)));
        }
        writes.finish()?;
        Ok(())
    }

    /// Stage events as the apply path records them (event records of whole revisions, small:
    /// [`mvcc_store::EVENT_RECORD_BYTES`]).
    pub fn stage_events(&self, epoch: u64, events: &[Event]) -> Result<(), FillError> {
        drop(self.gate.held(epoch)?);
        let mut writes = DirectWrites::new(&self.staging, None);
        mvcc_store::record(&mut writes, events, mvcc_store::EVENT_RECORD_BYTES);
        writes.finish()?;
        Ok(())
    }

    /// Check the staged history against this node's state at `start`, then adopt it: this
    /// node's history starts at `floor` afterwards. Blocking (sled scans and writes).
    pub fn adopt(&self, epoch: u64, floor: Revision, start: Revision) -> Result<(), FillError> {
        let local = self.local();
        if local.start != start {
            return Err(FillError::Superseded);
        }
        if local.compacted >= start {
            return Err(FillError::NotNeeded);
        }
        // At `start`, this node holds its base versions: the staged history must lead there.
        // Compared as both are read, a key at a time.
        let staging = mvcc_store::History::open(self.staging.clone())?;
        let mut staged = staging.live_keys(start);
        let mut held = LiveKeys::new(|after| {
            read_unswept(
                &self.removals,
                || off_workers::read(&self.kv),
                || self.history.live_page(after, start, mvcc_store::LIVE_PAGE),
            )
        });
        let mut compared = 0usize;
        loop {
            match (staged.next().transpose()?, held.next().transpose()?) {
                (None, None) => break,
                (a, b) if a == b => compared += 1,
                (a, b) => {
                    let detail = format!(
                        "after {compared} equal keys: fetched {:?}, held {:?}",
                        a.map(|(k, _)| k),
                        b.map(|(k, _)| k)
                    );
                    return Err(FillError::Mismatch { at: start, detail });
                }
            }
        }
        // Freeze the sweep, then check the compaction under the state's lock: an apply that
        // was sweeping has finished, and every sweep so far stayed below `start`, where this
        // tree (installed at `start`) has no event records, so it removed nothing. A
        // compaction past `start` now would make the sweep remove versions the move brings
        // back without their tombstones.
        {
            let _gate = self.gate.held(epoch)?;
            self.gate.sweep_frozen.store(true, Ordering::SeqCst);
        }
        let frozen = Thaw(Some(&self.gate));
        if off_workers::write(&self.kv).compact_revision() >= start {
            return Err(FillError::NotNeeded);
        }
        // The staging is durable before the marker that says it is complete (sled's blob
        // files included).
        self.db.flush()?;
        crate::storage::sync_blobs(&self.dir)?;
        {
            let _gate = self.gate.held(epoch)?;
            let mut marker = floor.0.to_be_bytes().to_vec();
            marker.extend_from_slice(&start.0.to_be_bytes());
            self.state.insert(KEY_FILL_MOVE, marker)?;
        }
        // From here the sweep stays frozen until the move is done: by this call, by the next
        // fill's `begin`, by a restart's redo, or by an install, which replaces it all.
        frozen.keep();
        self.move_in(epoch, floor)
    }

    /// Move the staged records in, index them, then lower the history's start to `floor`
    /// and remove the marker. Idempotent (each record is set to its staged value).
    fn move_in(&self, epoch: u64, floor: Revision) -> Result<(), FillError> {
        let moved = move_newest_first(
            &self.state,
            &self.staging,
            || self.gate.held(epoch),
            self.stop_after,
        )?;
        // Everything moved is durable, sled's blob files included, before the start drops.
        self.db.flush()?;
        crate::storage::sync_blobs(&self.dir)?;
        // Only now indexed, each key's older versions at once: until then reads (all at or
        // above the old start) never see a moved version, so none can see a deleted key's
        // older version without its tombstone.
        let moved_in = mvcc_store::build_index(&self.staging)?;
        self.history
            .merge_older(&moved_in, || self.gate.held(epoch))?;
        {
            let _gate = self.gate.held(epoch)?;
            let _kv = off_workers::write(&self.kv);
            self.state
                .insert(mvcc_store::KEY_HISTORY_START, &floor.0.to_be_bytes())?;
            self.state.remove(KEY_FILL_MOVE)?;
            self.history_start.store(floor.0, Ordering::Release);
            self.gate.sweep_frozen.store(false, Ordering::SeqCst);
        }
        self.db.flush()?;
        self.staging.clear()?;
        tracing::info!(%floor, records = moved, "history filled in from a peer");
        Ok(())
    }
}

/// Copy the staged records into the state tree, last key first (nothing reads them until
/// the key index has them all: [`FillStore::move_in`]). Each step of [`MOVE_STEP`] records
/// is made while `hold`'s guard is held. `stop_after` (tests) fails after that many records.
/// How many were moved.
fn move_newest_first<G>(
    state: &sled::Tree,
    staging: &sled::Tree,
    hold: impl Fn() -> Result<G, FillError>,
    stop_after: Option<usize>,
) -> Result<usize, FillError> {
    let mut moved = 0usize;
    let mut records = staging.iter().rev();
    loop {
        let step: Vec<(sled::IVec, sled::IVec)> =
            records.by_ref().take(MOVE_STEP).collect::<Result<_, _>>()?;
        if step.is_empty() {
            return Ok(moved);
        }
        let _held = hold()?;
        for (k, v) in step {
            if stop_after.is_some_and(|n| moved >= n) {
                return Err(StorageError::Corrupt {
                    what: "fill".into(),
                    detail: "stopped (test)".into(),
                }
                .into());
            }
            state.insert(k, v)?;
            moved += 1;
        }
    }
}

/// Lets the sweep run again when dropped, unless kept frozen.
struct Thaw<'a>(Option<&'a FillGate>);

impl Thaw<'_> {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for Thaw<'_> {
    fn drop(&mut self) {
        if let Some(gate) = self.0 {
            gate.sweep_frozen.store(false, Ordering::SeqCst);
        }
    }
}

/// The new start in the marker of an adoption in progress, if there is one.
fn fill_marker(state: &sled::Tree) -> Result<Option<Revision>, StorageError> {
    state
        .get(KEY_FILL_MOVE)?
        .map(|marker| {
            marker
                .get(..8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(|b| Revision(u64::from_be_bytes(b)))
                .ok_or_else(|| StorageError::Corrupt {
                    what: "history fill marker".into(),
                    detail: "shorter than 8 bytes".into(),
                })
        })
        .transpose()
}

/// When the node opens, before anything reads the state: finish an adoption a crash cut
/// (its marker is there), and drop whatever a cut fill left staged. The start it set, if any.
pub fn finish_interrupted(
    state: &sled::Tree,
    staging: &sled::Tree,
    dir: &std::path::Path,
) -> Result<Option<Revision>, StorageError> {
    let finished = match fill_marker(state)? {
        Some(floor) => {
            // Nothing else runs yet: no gate to hold.
            move_newest_first(state, staging, || Ok(()), None).map_err(|e| match e {
                FillError::Storage(e) => e,
                other => StorageError::Corrupt {
                    what: "history fill".into(),
                    detail: other.to_string(),
                },
            })?;
            state.flush()?;
            crate::storage::sync_blobs(dir)?;
            state.insert(mvcc_store::KEY_HISTORY_START, &floor.0.to_be_bytes())?;
            state.remove(KEY_FILL_MOVE)?;
            state.flush()?;
            Some(floor)
        }
        None => None,
    };
    if !staging.is_empty() {
        staging.clear()?;
    }
    Ok(finished)
}
