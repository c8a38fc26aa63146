//! Opening the state machine: the persisted state loaded from sled and the snapshot file,
//! once whatever a crash cut is made whole (the last applied group, a snapshot install, a
//! history fill).
//!
//! # Invariants
//! - Nothing reads the state tree before the last applied group is finished and an
//!   interrupted install is redone from its snapshot file, and nothing reads the history
//!   before the records of a group cut before its intent are removed.
//! - The live keys come from the snapshot on disk and the event records after it only when
//!   those records are all there (the snapshot at or above where the history starts and the
//!   sweep went, and not ahead of the state); otherwise from every version. A torn or
//!   unreadable snapshot file is only a slower start.
//! - A store of an older format (values under `k/`) is converted once; its history starts at
//!   its current revision.
//!
//! # What it must not do
//! Apply or decide anything: it reads what was persisted and finishes only what a crash cut.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::raft::off_workers::RwLock;

use tokio::sync::watch;

use super::lease_journal;
use super::snapshot::{cut_before_its_marker, decode_payload, finish_install, installing};
use super::{
    AppliedMark, ApplyObserver, HistoryRemovals, KEY_APPLIED, KEY_AUTH, KEY_COMPACT,
    KEY_LEASE_CLOCK, KEY_MEMBERSHIP, KEY_REVISION, LEASE_PREFIX, LEGACY_KEY_PREFIX, StateMachine,
    StateView, Written,
};
use crate::domain::kv::{KeyMap, KvSnapshot, KvState, LeaseRecord, StoredKey, Versioned};
use crate::domain::types::Revision;
use crate::raft::state_writes::KEY_INTENT;
use crate::raft::{LogId, StoredMembership, history_fill, mvcc_store};
use crate::storage::TREE_STATE;
use crate::storage::snapshot_file::SnapshotFile;

/// Make the last applied group whole if a crash cut it ([`crate::raft::state_writes`]): before
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
    crate::raft::state_writes::redo(state, |intent| {
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

impl StateMachine {
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
        } else if let Some(marker) = cut_before_its_marker(&state, &snapshots)? {
            finish_install(&state, &snapshots, &marker, dir)?;
            tracing::info!(
                last_log_id = ?marker.last_log_id,
                "a snapshot install cut before its marker was durable finished from the file"
            );
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
        // Before the journal is read: records of a group a crash cut before its intent.
        let dropped = lease_journal::drop_above(&state, last_applied.map_or(0, |l| l.index))?;
        if dropped > 0 {
            tracing::info!(
                dropped,
                "removed lease journal records of an applied group a crash cut"
            );
        }
        let journal = lease_journal::replay(&state, &mut leases)?;
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
        if !mvcc_store::is_legacy(&state)? {
            // Before the index is built from them: records of a group a crash cut before its
            // intent (`state_writes`).
            let dropped = mvcc_store::drop_records_above(&state, revision)?;
            if dropped > 0 {
                tracing::info!(dropped, %revision, "removed event records of an applied group a crash cut");
            }
        }
        let history = mvcc_store::History::open(state.clone())?;
        let on_disk = read_snapshot_state(&snapshots);
        let snapshot_revision = on_disk.as_ref().map_or(Revision(0), |kv| kv.revision);
        // What the sweep may have removed: a store from before the limit was kept swept
        // towards its compaction mark.
        let mut sweep_limit = mvcc_store::sweep_limit(&state)?.unwrap_or(compact_revision);
        // The sweep keeps the compaction mark's own records (`mvcc::sweep_mark`), but an older
        // version swept through the mark: its records may be gone, and a watch from it with them.
        let mark_swept = if sweep_limit >= compact_revision {
            compact_revision
        } else {
            Revision(0)
        };
        let (keys, history_start) = match stored_start {
            Some(start) if !mvcc_store::is_legacy(&state)? => {
                let keys = load_keys(&history, on_disk, start.max(sweep_limit), revision)?;
                (keys, start)
            }
            _ => {
                let keys: KeyMap = legacy_keys(&state)?
                    .into_iter()
                    .map(|(k, v)| (StoredKey::from(k), v))
                    .collect();
                let mut batch = sled::Batch::default();
                mvcc_store::restart(&state, &mut batch, keys.iter(), revision)?;
                batch.remove(KEY_INTENT);
                state.apply_batch(batch)?;
                state.flush()?;
                *history.index_mut() = mvcc_store::base_index(keys.iter());
                sweep_limit = sweep_limit.max(revision);
                tracing::info!(%revision, "MVCC history starts at the current revision");
                (keys, revision)
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
        let data_bytes = Arc::new(AtomicU64::new(kv.data_bytes()));
        let kv = Arc::new(RwLock::new(kv));
        let history_start = Arc::new(AtomicU64::new(history_start.0));
        let removals = HistoryRemovals::default();
        let view = StateView {
            kv: kv.clone(),
            applied: applied_rx,
            history: history.clone(),
            history_start: history_start.clone(),
            mark_swept,
            removals: removals.clone(),
            data_bytes: data_bytes.clone(),
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
            data_bytes,
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
            journal,
            journal_fold_at: lease_journal::FOLD_AT,
            dir: dir.to_path_buf(),
        };
        Ok((sm, view))
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
