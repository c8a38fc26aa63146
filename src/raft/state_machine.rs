//! The state machine adapter: applies committed entries to [`KvState`] and persists the result.
//!
//! # Invariants
//! - The keys an entry batch changed, the applied log id, the membership and the store revision
//!   are written as ONE group on [`TREE_STATE`] ([`super::state_writes`]: an intent record,
//!   then the writes; `open` finishes a group a crash cut): a crash leaves the persisted state
//!   at some applied index, never between two. On restart openraft re-applies from there up
//!   to the committed id (the log holds every entry not yet in a snapshot).
//! - The in-memory `KvState` is the read view (behind a `RwLock` held for a few lines, never
//!   across an await). It is updated before the applied mark is published, so a reader that sees
//!   mark `i` reads a state that includes entry `i`.
//! - Snapshots are taken from a consistent view: the state is copied in
//!   `get_snapshot_builder`, which openraft runs serialized with `apply` (pitfall P5). The copy
//!   is O(1) (persistent maps), so apply does not wait for it; encoding and writing follow
//!   off the apply path.
//! - A restart loads the snapshot file and replays the event records after it; the sweep
//!   never removes a record above the snapshot on disk (`snapshot_revision`), and
//!   `m/sweep_limit` says how far it went, so the load knows when those records are all there.
//! - Installing a snapshot replaces the state (pitfall P6): the snapshot file is saved first,
//!   then an install marker, then the writes key by key (stale keys removed, new ones
//!   written), then the marker goes. A node that opens with the marker redoes the install
//!   from the file before anything reads (`finish_install`). Not one sled batch: sled 0.34
//!   holds a batch's pages in memory, gigabytes at a million keys.
//!
//! # What it must not do
//! Decide anything. The rules are in `domain::kv`; this file decodes, calls, persists, publishes.

// openraft's traits impose `StorageError` (large) as the error type of every storage call.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder, StorageIOError};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::state_writes::{DirectWrites, KEY_INTENT, WriteSet, Writes};
use super::{Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig, any_err};
use super::{history_fill, mvcc_store};
use crate::domain::command::{Event, LeaseChange, Response};
use crate::domain::kv::{KeyMap, KvSnapshot, KvState, LeaseRecord, Versioned};
use crate::domain::types::Revision;

pub use super::state_view::{HistoryError, HistoryRemovals, StateView};
use crate::storage::TREE_STATE;
use crate::storage::snapshot_file::SnapshotFile;

/// Where formats 1 and 2 kept the values (format 3 keeps them as MVCC versions).
const LEGACY_KEY_PREFIX: &[u8] = b"k/";
const LEASE_PREFIX: &[u8] = b"l/";
const KEY_APPLIED: &[u8] = b"m/applied";
const KEY_MEMBERSHIP: &[u8] = b"m/membership";
const KEY_REVISION: &[u8] = b"m/revision";
/// Users, roles and the auth switch, as one JSON record (small; rewritten on every change).
const KEY_AUTH: &[u8] = b"m/auth";
/// The lease clock (the highest stamp applied): persisted, never rebuilt lower.
const KEY_LEASE_CLOCK: &[u8] = b"m/lease_clock";
/// The MVCC compaction mark (replicated state).
const KEY_COMPACT: &[u8] = b"m/compact_revision";

/// How far the state machine has applied: published after every applied batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppliedMark {
    /// The index of the last applied log entry (0 before any).
    pub log_index: u64,
    /// The term of that entry: a leader whose term this is has applied everything before its
    /// own first entry (the lease tracker's promote condition).
    pub term: u64,
    /// The store revision after it.
    pub revision: Revision,
}

/// What one applied batch changed, in log order.
#[derive(Clone, Debug, Default)]
pub struct AppliedBatch {
    pub mark: AppliedMark,
    pub events: Vec<Event>,
    pub lease_changes: Vec<LeaseChange>,
    /// A snapshot replaced the whole state: what happened between the previous mark and this
    /// one is unknown (no events describe it).
    pub reset: bool,
    /// The lease clock after this batch (the lease tracker notes when it advances).
    pub lease_clock_ms: u64,
}

/// Receives every applied batch, in order, before the proposers are answered (the lease tracker,
/// the watch hub). Must be quick and must not block: it runs on the apply path.
pub trait ApplyObserver: Send + Sync + 'static {
    fn on_applied(&self, batch: &AppliedBatch);
}

/// An observer that ignores everything.
pub struct DiscardEvents;

impl ApplyObserver for DiscardEvents {
    fn on_applied(&self, _batch: &AppliedBatch) {}
}

/// Several observers, called in order.
pub struct Observers(pub Vec<Arc<dyn ApplyObserver>>);

impl ApplyObserver for Observers {
    fn on_applied(&self, batch: &AppliedBatch) {
        for o in &self.0 {
            o.on_applied(batch);
        }
    }
}

/// Make the last applied group whole if a crash cut it ([`super::state_writes`]): before
/// anything reads the state tree. An intent whose applied mark is below the stored one is left
/// over from before newer state and is dropped.
fn finish_last_group(state: &sled::Tree) -> Result<usize, crate::storage::StorageError> {
    let applied = |bytes: Option<&[u8]>| -> Result<Option<LogId>, crate::storage::StorageError> {
        bytes
            .map(serde_json::from_slice::<Option<LogId>>)
            .transpose()
            .map(Option::flatten)
            .map_err(|e| crate::storage::StorageError::Corrupt {
                what: "applied".into(),
                detail: e.to_string(),
            })
    };
    super::state_writes::redo(state, |intent| {
        let stored = applied(state.get(KEY_APPLIED)?.as_deref())?;
        let intended = match intent.last_write(KEY_APPLIED) {
            Some(value) => applied(value.map(|v| &v[..]))?,
            None => return Ok(false),
        };
        Ok(stored.map(|l| l.index) > intended.map(|l| l.index))
    })
}

/// The store revision persisted in `db`, without loading the state.
pub fn persisted_revision(db: &sled::Db) -> Result<Revision, crate::storage::StorageError> {
    let state = db.open_tree(TREE_STATE)?;
    // An install a crash cut is finished when the state machine opens: its revision.
    if let Some(installing) = installing(&state)? {
        return Ok(installing.revision);
    }
    // The revision is among a group's last writes: a group a crash cut must be finished first.
    finish_last_group(&state)?;
    match state.get(KEY_REVISION)? {
        Some(b) => serde_json::from_slice(&b).map_err(|e| crate::storage::StorageError::Corrupt {
            what: "revision".into(),
            detail: e.to_string(),
        }),
        None => Ok(Revision::default()),
    }
}

/// The snapshot payload: the whole state plus the membership it was taken with.
#[derive(Serialize, Deserialize)]
struct SnapshotPayload {
    kv: KvSnapshot,
}

/// Marks persisted with the state that most batches leave unchanged.
#[derive(Clone, Copy, Debug, Default)]
struct Written {
    compact: Revision,
    lease_clock_ms: u64,
    /// [`mvcc_store::KEY_SWEEP_LIMIT`]: only ever raised.
    sweep_limit: Revision,
}

/// The sled-backed state machine.
pub struct StateMachine {
    db: sled::Db,
    state: sled::Tree,
    snapshots: SnapshotFile,
    kv: Arc<RwLock<KvState>>,
    last_applied: Option<LogId>,
    membership: StoredMembership,
    applied_tx: Arc<watch::Sender<AppliedMark>>,
    observer: Arc<dyn ApplyObserver>,
    /// Where this node's MVCC history begins (shared with the views).
    history_start: Arc<AtomicU64>,
    /// Announces removals of history records to the views' history reads.
    removals: HistoryRemovals,
    /// The history and its key index (shared with the views and the fill).
    history: mvcc_store::History,
    /// Shared with the history fill ([`history_fill`]).
    fill_gate: Arc<history_fill::FillGate>,
    fill_staging: sled::Tree,
    /// The revision of the snapshot file on disk (raised by the builder once the file is
    /// durable): the sweep keeps the event records above it, which a restart replays.
    snapshot_revision: Arc<AtomicU64>,
    /// The rarely changing marks as last written, to write them only when they change.
    written: Written,
    /// Distinguishes snapshots built at the same log id.
    snapshot_seq: u64,
    /// How far this node's log is durable: an entry is applied only once it is
    /// ([`super::durability`]). `None` in tests of the state machine alone.
    durable: Option<super::durability::DurableView>,
    /// Dropped with the state machine: tells [`StateMachine::dropped`]'s receiver that this
    /// handle on sled is gone.
    drop_signal: Option<tokio::sync::oneshot::Sender<()>>,
    /// Tests only: make at most this many of a group's writes, then fail (a crash).
    stop_writes_after: Option<usize>,
    /// Tests only: make at most this many of an install's writes, then fail (a crash).
    stop_install_after: Option<usize>,
    /// The log id of the snapshot file this process last wrote, held while it is written:
    /// a build that finishes after an install must not replace the installed (newer)
    /// snapshot with its older one. (By log id: many entries change no revision.)
    snapshot_writes: Arc<tokio::sync::Mutex<Option<LogId>>>,
    /// The longest write intent stored inline (`state_writes::WriteSet::persist`).
    inline_limit: usize,
    /// The data directory (sled's, and the snapshot file's).
    dir: std::path::PathBuf,
}

impl StateMachine {
    /// A receiver that completes when this state machine is dropped. openraft drops it in its
    /// own state-machine task, which can outlive `Raft::shutdown()`; until then it holds sled
    /// open (and its directory lock), so a node reopening the directory must wait for this.
    pub fn dropped(&mut self) -> tokio::sync::oneshot::Receiver<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.drop_signal = Some(tx);
        rx
    }

    /// Apply entries only once the log is durable up to them (the leader acknowledges its
    /// own appends before their sync).
    pub fn apply_when_durable(&mut self, view: super::durability::DurableView) {
        self.durable = Some(view);
    }

    /// Tests of crash recovery: every later applied group makes at most `writes` of its
    /// writes after its intent, then fails, as if the process had died there.
    #[doc(hidden)]
    pub fn stop_writes_after(&mut self, writes: Option<usize>) {
        self.stop_writes_after = writes;
    }

    /// The history fill's handle on this state machine's storage (take it before openraft
    /// takes the state machine).
    pub fn fill_store(&self) -> history_fill::FillStore {
        history_fill::FillStore {
            db: self.db.clone(),
            state: self.state.clone(),
            history: self.history.clone(),
            removals: self.removals.clone(),
            staging: self.fill_staging.clone(),
            gate: self.fill_gate.clone(),
            kv: self.kv.clone(),
            history_start: self.history_start.clone(),
            stop_after: None,
            dir: self.dir.clone(),
        }
    }

    /// Tests of crash recovery: the next snapshot install makes at most `writes` of its
    /// writes, then fails, as if the process had died there.
    #[doc(hidden)]
    pub fn stop_install_after(&mut self, writes: Option<usize>) {
        self.stop_install_after = writes;
    }

    /// Load the persisted state from `db`; snapshots live in `dir`.
    pub fn open(
        db: &sled::Db,
        dir: &std::path::Path,
        observer: Arc<dyn ApplyObserver>,
    ) -> Result<(Self, StateView), crate::storage::StorageError> {
        let state = db.open_tree(TREE_STATE)?;
        // Before anything is read: a crash may have cut the last applied group.
        let redone = finish_last_group(&state)?;
        tracing::debug!(writes = redone, "last applied group's writes made again");
        let snapshots = SnapshotFile::new(dir);
        if let Some(marker) = installing(&state)? {
            finish_install(&state, &snapshots, &marker, dir)?;
            tracing::info!(revision = %marker.revision, "an interrupted snapshot install finished");
        }
        let staging = db.open_tree(history_fill::TREE_FILL)?;
        if let Some(floor) = history_fill::finish_interrupted(&state, &staging, dir)? {
            tracing::info!(%floor, "an interrupted history fill finished");
        }
        let corrupt = |what: &str, e: serde_json::Error| crate::storage::StorageError::Corrupt {
            what: what.to_string(),
            detail: e.to_string(),
        };
        let mut leases = crate::domain::kv::LeaseMap::new();
        for item in state.scan_prefix(LEASE_PREFIX) {
            let (k, v) = item?;
            let name = String::from_utf8(k[LEASE_PREFIX.len()..].to_vec()).map_err(|e| {
                crate::storage::StorageError::Corrupt {
                    what: "lease name".into(),
                    detail: e.to_string(),
                }
            })?;
            let lease: LeaseRecord = serde_json::from_slice(&v).map_err(|e| corrupt("lease", e))?;
            leases.insert(name, lease);
        }
        let read = |k: &[u8]| state.get(k);
        let last_applied: Option<LogId> = match read(KEY_APPLIED)? {
            Some(b) => serde_json::from_slice(&b).map_err(|e| corrupt("applied", e))?,
            None => None,
        };
        let membership: StoredMembership = match read(KEY_MEMBERSHIP)? {
            Some(b) => serde_json::from_slice(&b).map_err(|e| corrupt("membership", e))?,
            None => StoredMembership::default(),
        };
        let revision: Revision = match read(KEY_REVISION)? {
            Some(b) => serde_json::from_slice(&b).map_err(|e| corrupt("revision", e))?,
            None => Revision::default(),
        };
        let auth = match read(KEY_AUTH)? {
            Some(b) => serde_json::from_slice(&b).map_err(|e| corrupt("auth", e))?,
            None => Default::default(),
        };
        let lease_clock_ms: u64 = match read(KEY_LEASE_CLOCK)? {
            Some(b) => serde_json::from_slice(&b).map_err(|e| corrupt("lease clock", e))?,
            None => 0,
        };
        let compact_revision: Revision = match read(KEY_COMPACT)? {
            Some(b) => serde_json::from_slice(&b).map_err(|e| corrupt("compact revision", e))?,
            None => Revision::default(),
        };
        // A store of an older format (values under `k/`; format 1 without history, format 2
        // with it) is converted: its values become the base versions, its history starts here.
        let stored_start = mvcc_store::history_start(&state)?;
        let history = mvcc_store::History::open(state.clone())?;
        let on_disk = read_snapshot_state(&snapshots);
        let snapshot_revision = on_disk.as_ref().map_or(Revision(0), |kv| kv.revision);
        // What the sweep may have removed: a store from before the limit was kept swept
        // towards its compaction mark.
        let mut sweep_limit = mvcc_store::sweep_limit(&state)?.unwrap_or(compact_revision);
        let (keys, history_start) = match stored_start {
            Some(start) if !mvcc_store::is_legacy(&state)? => {
                let keys = load_keys(&history, on_disk, start.max(sweep_limit), revision)?;
                (keys, start)
            }
            _ => {
                let keys = legacy_keys(&state)?;
                let mut batch = sled::Batch::default();
                mvcc_store::restart(&state, &mut batch, keys.iter(), revision)?;
                batch.remove(KEY_INTENT);
                state.apply_batch(batch)?;
                state.flush()?;
                *history.index_mut() = mvcc_store::base_index(keys.iter());
                sweep_limit = sweep_limit.max(revision);
                tracing::info!(%revision, "MVCC history starts at the current revision");
                (keys.into_iter().collect(), revision)
            }
        };
        let kv = KvState::from_snapshot(KvSnapshot {
            revision,
            keys,
            leases,
            auth,
            lease_clock_ms,
            compact_revision,
        });
        let mark = AppliedMark {
            log_index: last_applied.map(|l| l.index).unwrap_or(0),
            term: last_applied.map(|l| l.leader_id.term).unwrap_or(0),
            revision,
        };
        let (applied_tx, applied_rx) = watch::channel(mark);
        let kv = Arc::new(RwLock::new(kv));
        let history_start = Arc::new(AtomicU64::new(history_start.0));
        let removals = HistoryRemovals::default();
        let view = StateView {
            kv: kv.clone(),
            applied: applied_rx,
            history: history.clone(),
            history_start: history_start.clone(),
            removals: removals.clone(),
        };
        let sm = StateMachine {
            db: db.clone(),
            state,
            snapshots,
            kv,
            last_applied,
            membership,
            applied_tx: Arc::new(applied_tx),
            observer,
            history_start,
            removals,
            history,
            fill_gate: Arc::default(),
            fill_staging: staging,
            snapshot_revision: Arc::new(AtomicU64::new(snapshot_revision.0)),
            written: Written {
                compact: compact_revision,
                lease_clock_ms,
                sweep_limit,
            },
            snapshot_seq: 0,
            durable: None,
            drop_signal: None,
            stop_writes_after: None,
            stop_install_after: None,
            snapshot_writes: Arc::default(),
            inline_limit: crate::storage::inline_value_limit(dir),
            dir: dir.to_path_buf(),
        };
        Ok((sm, view))
    }

    fn publish(
        &self,
        (revision, lease_clock_ms): (Revision, u64),
        events: Vec<Event>,
        lease_changes: Vec<LeaseChange>,
        reset: bool,
    ) {
        let batch = AppliedBatch {
            reset,
            lease_clock_ms,
            mark: AppliedMark {
                log_index: self.last_applied.map(|l| l.index).unwrap_or(0),
                term: self.last_applied.map(|l| l.leader_id.term).unwrap_or(0),
                revision,
            },
            events,
            lease_changes,
        };
        self.observer.on_applied(&batch);
        self.applied_tx.send_replace(batch.mark);
    }
}

/// The state in the snapshot file, if there is one that decodes (a torn or unreadable file
/// is only a slower start: the state is also in sled).
fn read_snapshot_state(file: &SnapshotFile) -> Option<KvSnapshot> {
    let (_, data) = match file.read() {
        Ok(stored) => stored?,
        Err(e) => {
            tracing::warn!(error = %e, "the snapshot file is unreadable; loading from the versions");
            return None;
        }
    };
    match decode_payload(&data) {
        Ok(kv) => Some(kv),
        Err(e) => {
            tracing::warn!(error = %e, "the snapshot file does not decode; loading from the versions");
            None
        }
    }
}

/// The live keys at `revision`, the persisted state's. From the snapshot on disk and the
/// event records after it when those are all there (the snapshot is at or above `floor`,
/// below which records may be gone, and not ahead of the state, which a crash can leave
/// behind an unflushed tail); otherwise from every version, which at a million keys with
/// their history takes tens of seconds.
// The wall clock times a log line only; nothing is decided by it.
#[allow(clippy::disallowed_methods)]
fn load_keys(
    history: &mvcc_store::History,
    on_disk: Option<KvSnapshot>,
    floor: Revision,
    revision: Revision,
) -> Result<KeyMap, crate::storage::StorageError> {
    let started = std::time::Instant::now();
    match on_disk {
        Some(snap) if snap.revision >= floor && snap.revision <= revision => {
            let base = snap.revision;
            let (keys, replayed) =
                mvcc_store::replay_onto(&history.tree, snap.keys, base, revision)?;
            tracing::info!(
                keys = keys.len(),
                snapshot_revision = %base,
                %revision,
                replayed,
                ms = started.elapsed().as_millis() as u64,
                "state loaded from the snapshot and the history after it"
            );
            Ok(keys)
        }
        other => {
            let keys = history.load()?;
            tracing::info!(
                keys = keys.len(),
                %revision,
                snapshot_revision = ?other.map(|s| s.revision),
                ms = started.elapsed().as_millis() as u64,
                "state loaded from every version"
            );
            Ok(keys)
        }
    }
}

/// A record as JSON (the encoding of the state tree's marks and leases).
fn enc<T: Serialize>(v: &T) -> Result<Vec<u8>, crate::storage::StorageError> {
    serde_json::to_vec(v).map_err(|e| crate::storage::StorageError::Corrupt {
        what: "record".into(),
        detail: e.to_string(),
    })
}

/// In the state tree while a snapshot install's writes are being made ([`install_writes`]).
const KEY_INSTALLING: &[u8] = b"m/installing";

/// What an install in progress installs.
#[derive(Debug, Serialize, Deserialize)]
struct Installing {
    last_log_id: Option<LogId>,
    revision: Revision,
}

fn installing(state: &sled::Tree) -> Result<Option<Installing>, crate::storage::StorageError> {
    state
        .get(KEY_INSTALLING)?
        .map(|b| {
            serde_json::from_slice(&b).map_err(|e| crate::storage::StorageError::Corrupt {
                what: "install marker".into(),
                detail: e.to_string(),
            })
        })
        .transpose()
}

/// Finish an install a crash cut, from the snapshot file it saved first.
fn finish_install(
    state: &sled::Tree,
    snapshots: &SnapshotFile,
    marker: &Installing,
    dir: &std::path::Path,
) -> Result<(), crate::storage::StorageError> {
    let corrupt = |detail: String| crate::storage::StorageError::Corrupt {
        what: "interrupted snapshot install".into(),
        detail,
    };
    let (meta, data) = snapshots
        .read()
        .map_err(|e| corrupt(e.to_string()))?
        .ok_or_else(|| corrupt("no snapshot file to finish it from".into()))?;
    let meta: SnapshotMeta = serde_json::from_slice(&meta).map_err(|e| corrupt(e.to_string()))?;
    if meta.last_log_id != marker.last_log_id {
        return Err(corrupt(format!(
            "the snapshot file is at {:?}, the install was of {:?}",
            meta.last_log_id, marker.last_log_id
        )));
    }
    let kv = decode_payload(&data).map_err(|e| corrupt(e.to_string()))?;
    install_writes(state, &meta, &kv, None)?;
    complete_install(state, dir)
}

/// The state tree as an installed snapshot (`kv` at `meta`) leaves it, written key by key:
/// not one sled batch, which at a million keys holds gigabytes in memory. The caller has
/// inserted [`KEY_INSTALLING`] first and removes it with [`complete_install`], so a crash
/// in between is finished when the node opens ([`finish_install`]); it starts over, so a
/// redo is right.
fn install_writes(
    state: &sled::Tree,
    meta: &SnapshotMeta,
    kv: &KvSnapshot,
    stop_after: Option<usize>,
) -> Result<(), crate::storage::StorageError> {
    let mut w = DirectWrites::new(state, stop_after);
    // The last applied group's intent must not be redone over the snapshot's state.
    w.remove(KEY_INTENT);
    for item in state.scan_prefix(LEASE_PREFIX) {
        w.remove(item?.0);
    }
    for (name, lease) in &kv.leases {
        w.insert(lease_key(name), enc(lease)?);
    }
    w.insert(KEY_AUTH, enc(&kv.auth)?);
    w.insert(KEY_LEASE_CLOCK, enc(&kv.lease_clock_ms)?);
    w.insert(KEY_COMPACT, enc(&kv.compact_revision)?);
    // The history of the gap is unknown: it starts again at the snapshot.
    mvcc_store::restart(state, &mut w, kv.keys.iter(), kv.revision)?;
    w.insert(KEY_APPLIED, enc(&meta.last_log_id)?);
    w.insert(KEY_MEMBERSHIP, enc(&meta.last_membership)?);
    w.insert(KEY_REVISION, enc(&kv.revision)?);
    w.finish()?;
    Ok(())
}

/// Declare an install's writes complete: durable first, sled's blob files included
/// ([`crate::storage::sync_blobs`]), then the marker goes.
fn complete_install(
    state: &sled::Tree,
    dir: &std::path::Path,
) -> Result<(), crate::storage::StorageError> {
    state.flush()?;
    crate::storage::sync_blobs(dir)?;
    state.remove(KEY_INSTALLING)?;
    Ok(())
}

fn write_err<E: std::error::Error + 'static>(e: E) -> StorageError {
    StorageIOError::write_state_machine(any_err(&e)).into()
}

fn json<T: Serialize>(v: &T) -> Result<Vec<u8>, StorageError> {
    serde_json::to_vec(v).map_err(write_err)
}

fn prefixed(prefix: &[u8], name: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + name.len());
    k.extend_from_slice(prefix);
    k.extend_from_slice(name.as_bytes());
    k
}

/// The values of a store of format 1 or 2 (JSON under `k/`), for its conversion.
fn legacy_keys(
    state: &sled::Tree,
) -> Result<BTreeMap<String, Versioned>, crate::storage::StorageError> {
    let corrupt = |what: &str, detail: String| crate::storage::StorageError::Corrupt {
        what: what.to_string(),
        detail,
    };
    let mut keys = BTreeMap::new();
    for item in state.scan_prefix(LEGACY_KEY_PREFIX) {
        let (k, v) = item?;
        let key = String::from_utf8(k[LEGACY_KEY_PREFIX.len()..].to_vec())
            .map_err(|e| corrupt("key", e.to_string()))?;
        let value: Versioned =
            serde_json::from_slice(&v).map_err(|e| corrupt("value", e.to_string()))?;
        keys.insert(key, value);
    }
    Ok(keys)
}

fn lease_key(name: &str) -> Vec<u8> {
    prefixed(LEASE_PREFIX, name)
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        Ok((self.last_applied, self.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        if let (Some(view), Some(last)) = (&mut self.durable, entries.last()) {
            view.wait_for(last.log_id.index).await.map_err(write_err)?;
        }
        let mut responses = Vec::new();
        let mut events = Vec::new();
        let mut lease_changes = Vec::new();
        let mut batch = WriteSet::default();
        let mut membership_changed = false;
        let (revision, lease_clock_ms) = {
            let mut kv = self.kv.write().unwrap_or_else(|p| p.into_inner());
            for entry in entries {
                self.last_applied = Some(entry.log_id);
                let response = match entry.payload {
                    EntryPayload::Blank => Response::Empty,
                    EntryPayload::Normal(cmd) => {
                        let applied = kv.apply(&cmd);
                        events.extend(applied.events);
                        lease_changes.extend(applied.lease_changes);
                        applied.response
                    }
                    EntryPayload::Membership(m) => {
                        membership_changed = true;
                        self.membership = StoredMembership::new(Some(entry.log_id), m);
                        Response::Empty
                    }
                };
                responses.push(response);
            }
            for (name, lease) in kv.take_dirty_leases() {
                match lease {
                    Some(l) => batch.insert(lease_key(&name), json(l)?),
                    None => batch.remove(lease_key(&name)),
                }
            }
            if let Some(auth) = kv.take_dirty_auth() {
                batch.insert(KEY_AUTH, json(auth)?);
            }
            let revision = kv.revision();
            // The events are the key changes: each becomes the key's new version.
            let records = mvcc_store::record(&mut batch, &events, mvcc_store::EVENT_RECORD_BYTES);
            // Not past the snapshot on disk: the records after it are what a restart replays.
            let on_disk = Revision(self.snapshot_revision.load(Ordering::Acquire));
            let sweep_to = kv.compact_revision().min(on_disk);
            // Not while a fill's records move in (`history_fill`).
            let swept = if sweep_to > Revision(0) && !self.fill_gate.sweep_frozen() {
                self.history
                    .sweep(&mut batch, sweep_to, mvcc_store::sweep_budget(events.len()))
                    .map_err(write_err)?
            } else {
                mvcc_store::Swept::default()
            };
            let sweep_limit = sweep_to.max(self.written.sweep_limit);
            if sweep_limit != self.written.sweep_limit {
                batch.insert(mvcc_store::KEY_SWEEP_LIMIT, &sweep_limit.0.to_be_bytes());
            }
            // The marks that rarely change are written when they do.
            let compact = kv.compact_revision();
            if compact != self.written.compact {
                batch.insert(KEY_COMPACT, json(&compact)?);
            }
            if membership_changed {
                batch.insert(KEY_MEMBERSHIP, json(&self.membership)?);
            }
            let lease_clock = kv.lease_clock_ms();
            if lease_clock != self.written.lease_clock_ms {
                batch.insert(KEY_LEASE_CLOCK, json(&lease_clock)?);
            }
            batch.insert(KEY_APPLIED, json(&self.last_applied)?);
            batch.insert(KEY_REVISION, json(&revision)?);
            // Written while the state is still locked: a reader that sees revision `r` finds
            // the history through `r` (sled writes to memory here, not to the disk).
            // Not flushed here: the log holds every applied entry durably (a purge flushes sled
            // before it removes any), and sled recovers a prefix of writes, so a lost tail is
            // re-applied from the log on restart.
            // The window covers the index's change too: a history read that took a location
            // the fold moves reads again.
            let sweeping = swept.removes.then(|| self.removals.begin());
            batch
                .persist(&self.state, self.inline_limit, self.stop_writes_after)
                .map_err(write_err)?;
            if !records.is_empty() {
                mvcc_store::index_records(&mut self.history.index_mut(), &records);
            }
            self.history.apply_folds(swept.folds);
            drop(sweeping);
            self.written = Written {
                compact,
                lease_clock_ms: lease_clock,
                sweep_limit,
            };
            (revision, lease_clock)
        };
        self.publish((revision, lease_clock_ms), events, lease_changes, false);
        Ok(responses)
    }

    // The wall clock times a log line only; nothing is decided by it.
    #[allow(clippy::disallowed_methods)]
    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        // Copy now, while apply cannot run: the snapshot is exactly the state at
        // `last_applied` (pitfall P5). Encoding and writing happen later, off the apply path.
        let started = std::time::Instant::now();
        let kv = self.kv.read().unwrap_or_else(|p| p.into_inner()).snapshot();
        tracing::debug!(
            copy_ms = started.elapsed().as_millis() as u64,
            "snapshot state copied"
        );
        self.snapshot_seq += 1;
        SnapshotBuilder {
            db: self.db.clone(),
            snapshots: self.snapshots.clone(),
            on_disk: self.snapshot_revision.clone(),
            payload: Some(SnapshotPayload { kv }),
            writes: self.snapshot_writes.clone(),
            last_applied: self.last_applied,
            membership: self.membership.clone(),
            seq: self.snapshot_seq,
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Vec<u8>>, StorageError> {
        Ok(Box::default())
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Vec<u8>>,
    ) -> Result<(), StorageError> {
        let payload: SnapshotPayload = serde_json::from_slice(&snapshot).map_err(|e| {
            StorageError::from(StorageIOError::read_snapshot(
                Some(meta.signature()),
                any_err(&e),
            ))
        })?;
        let revision = payload.kv.revision;
        // The file first: the state's writes are redone from it if a crash cuts them, and
        // it is what this node serves to others. Not replaced by an older build meanwhile.
        {
            let mut on_disk = self.snapshot_writes.lock().await;
            save_snapshot(&self.snapshots, meta, *snapshot).await?;
            *on_disk = meta.last_log_id;
            self.snapshot_revision.store(revision.0, Ordering::Release);
        }
        // History reads stop reading the tree the install rewrites: they answer `compacted`
        // below the current revision (its own reads come from memory) until the swap below.
        // Under the fill's gate (which stops any fill in progress), so that a fill finishing
        // now cannot lower the floor again after it is raised.
        {
            let _fill = self.fill_gate.install();
            let kv = self.kv.write().unwrap_or_else(|p| p.into_inner());
            self.history_start
                .fetch_max(kv.revision().0, Ordering::AcqRel);
        }
        let marker = Installing {
            last_log_id: meta.last_log_id,
            revision,
        };
        let (state, gate, stop_after, dir) = (
            self.state.clone(),
            self.fill_gate.clone(),
            self.stop_install_after,
            self.dir.clone(),
        );
        let (meta_owned, kv) = (meta.clone(), payload.kv);
        // Key by key, off the async workers: a sled batch of a million keys holds gigabytes.
        let kv = tokio::task::spawn_blocking(move || {
            // A fill in progress stops; none writes history records until this is done.
            let _fill = gate.install();
            state.insert(KEY_INSTALLING, enc(&marker)?)?;
            install_writes(&state, &meta_owned, &kv, stop_after)?;
            complete_install(&state, &dir)?;
            // The key index of what the install left: one base version per key.
            let index = mvcc_store::base_index(kv.keys.iter());
            Ok::<_, crate::storage::StorageError>((kv, index))
        })
        .await
        .map_err(write_err)?
        .map_err(write_err)?;

        // The tracker (if this node leads, which it does not while installing) re-learns every
        // lease at its next promote; the watch hub learns that history before `revision` is gone.
        let (kv, index) = kv;
        let installed = KvState::from_snapshot(kv);
        let lease_clock_ms = installed.lease_clock_ms();
        let replaced = {
            let mut kv = self.kv.write().unwrap_or_else(|p| p.into_inner());
            self.written = Written {
                compact: installed.compact_revision(),
                lease_clock_ms: installed.lease_clock_ms(),
                // `restart` wrote it.
                sweep_limit: revision,
            };
            let old = std::mem::replace(&mut *kv, installed);
            let old_index = std::mem::replace(&mut *self.history.index_mut(), index);
            self.history_start.store(revision.0, Ordering::Release);
            (old, old_index)
        };
        // A million keys take a while to free: not while the state is locked, nor on an
        // async worker.
        tokio::task::spawn_blocking(move || drop(replaced));
        self.db.flush_async().await.map_err(write_err)?;
        self.last_applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        self.publish((revision, lease_clock_ms), Vec::new(), Vec::new(), true);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let read_err = |e: &dyn std::fmt::Display| {
            StorageError::from(StorageIOError::read_snapshot(
                None,
                openraft::AnyError::error(e.to_string()),
            ))
        };
        let file = self.snapshots.clone();
        let stored = tokio::task::spawn_blocking(move || file.read())
            .await
            .map_err(|e| read_err(&e))?
            .map_err(|e| read_err(&e))?;
        match stored {
            Some((meta, data)) => {
                let meta: SnapshotMeta = serde_json::from_slice(&meta).map_err(|e| read_err(&e))?;
                Ok(Some(Snapshot {
                    meta,
                    snapshot: Box::new(data),
                }))
            }
            None => Ok(None),
        }
    }
}

/// Write a snapshot durably (a blocking file write, off the async workers). Takes the data
/// and gives it back: a copy of hundreds of megabytes for the blocking task is not needed.
async fn save_snapshot(
    file: &SnapshotFile,
    meta: &SnapshotMeta,
    data: Vec<u8>,
) -> Result<Vec<u8>, StorageError> {
    let err = |e: &dyn std::fmt::Display| {
        StorageError::from(StorageIOError::write_snapshot(
            Some(meta.signature()),
            openraft::AnyError::error(e.to_string()),
        ))
    };
    let meta_bytes = serde_json::to_vec(meta).map_err(|e| err(&e))?;
    let file = file.clone();
    tokio::task::spawn_blocking(move || file.write(&meta_bytes, &data).map(|()| data))
        .await
        .map_err(|e| err(&e))?
        .map_err(|e| err(&e))
}

/// Builds a snapshot from a copy of the state taken when the builder was made.
pub struct SnapshotBuilder {
    db: sled::Db,
    snapshots: SnapshotFile,
    /// The state machine's [`StateMachine::snapshot_revision`].
    on_disk: Arc<AtomicU64>,
    payload: Option<SnapshotPayload>,
    /// [`StateMachine::snapshot_writes`].
    writes: Arc<tokio::sync::Mutex<Option<LogId>>>,
    last_applied: Option<LogId>,
    membership: StoredMembership,
    seq: u64,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    // The wall clock times a log line only; nothing is decided by it.
    #[allow(clippy::disallowed_methods)]
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let payload = self.payload.take().unwrap_or(SnapshotPayload {
            kv: KvSnapshot::default(),
        });
        let revision = payload.kv.revision;
        // Encoding a large state takes a while: do it off the async workers.
        let started = std::time::Instant::now();
        let data = tokio::task::spawn_blocking(move || serde_json::to_vec(&payload))
            .await
            .map_err(write_err)?
            .map_err(write_err)?;
        let encoded_ms = started.elapsed().as_millis() as u64;
        let snapshot_id = match self.last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.index, self.seq),
            None => format!("0-0-{}", self.seq),
        };
        let meta = SnapshotMeta {
            last_log_id: self.last_applied,
            last_membership: self.membership.clone(),
            snapshot_id,
        };
        // The state first (appends no longer flush sled), so that a restart finds the state at
        // or past the snapshot and can load from the file; then the file, durable before
        // openraft may purge the log entries it covers.
        self.db.flush_async().await.map_err(write_err)?;
        let data = {
            let mut written = self.writes.lock().await;
            let index = |id: &Option<LogId>| id.map(|l| l.index);
            if written.is_some() && index(&written) >= index(&self.last_applied) {
                // An install wrote a snapshot as new or newer meanwhile: keep it.
                tracing::info!(%revision, "snapshot built behind an installed one; not saved");
                data
            } else {
                let data = save_snapshot(&self.snapshots, &meta, data).await?;
                *written = self.last_applied;
                self.on_disk.fetch_max(revision.0, Ordering::AcqRel);
                data
            }
        };
        tracing::info!(
            bytes = data.len(),
            encode_ms = encoded_ms,
            total_ms = started.elapsed().as_millis() as u64,
            "snapshot built"
        );
        Ok(Snapshot {
            meta,
            snapshot: Box::new(data),
        })
    }
}

/// The snapshot payload of `kv`: what openraft snapshots, and backups, carry.
pub fn encode_payload(kv: KvSnapshot) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&SnapshotPayload { kv })
}

/// The state in a snapshot payload.
pub fn decode_payload(bytes: &[u8]) -> serde_json::Result<KvSnapshot> {
    serde_json::from_slice::<SnapshotPayload>(bytes).map(|p| p.kv)
}

/// Seed an empty data dir with `kv` as the applied state at `meta.last_log_id` (a restore):
/// the state tree as `apply` would have left it, and the snapshot file openraft serves to
/// peers that need it: the file first, then the state key by key under the install marker,
/// as an install writes it (a crash in between is finished when the node opens).
pub(crate) fn seed(
    db: &sled::Db,
    dir: &std::path::Path,
    meta: &SnapshotMeta,
    payload: &[u8],
    kv: &KvSnapshot,
) -> Result<(), crate::storage::StorageError> {
    let state = db.open_tree(TREE_STATE)?;
    // The file first, then the state key by key under the install marker: a crash
    // in between is finished when the node opens, as an install's is.
    SnapshotFile::new(dir)
        .write(&enc(meta)?, payload)
        .map_err(|e| crate::storage::StorageError::Corrupt {
            what: "snapshot file".into(),
            detail: e.to_string(),
        })?;
    let marker = Installing {
        last_log_id: meta.last_log_id,
        revision: kv.revision,
    };
    state.insert(KEY_INSTALLING, enc(&marker)?)?;
    install_writes(&state, meta, kv, None)?;
    complete_install(&state, dir)?;
    db.flush()?;
    Ok(())
}
