//! Snapshots of the state machine: the payload and its encoding, a snapshot built from a copy
//! of the state and saved durably, and an installed (or restored) snapshot written into the
//! state tree under the install marker.
//!
//! # Invariants
//! - sled's state is flushed before the snapshot file is written, and the file is durable
//!   before openraft may purge the log entries it covers: a restart finds the state at or past
//!   the file.
//! - A build that finishes after an install never replaces the installed (newer) snapshot: the
//!   log id of the file last written is checked under its lock.
//! - An install's writes are made key by key under [`KEY_INSTALLING`], which goes only once they
//!   are durable (sled's blob files included): a node that opens with the marker redoes them
//!   from the file, and so does one that opens with a snapshot file past its applied mark (the
//!   marker was not durable yet: [`cut_before_its_marker`]).
//!
//! # What it must not do
//! Encode or write a snapshot on the apply path (the builder works from a copy), or hold an
//! install's writes in one sled batch (gigabytes at a million keys).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use openraft::storage::Snapshot;
use openraft::{RaftSnapshotBuilder, StorageIOError};
use serde::{Deserialize, Serialize};

use super::{
    KEY_APPLIED, KEY_AUTH, KEY_COMPACT, KEY_LEASE_CLOCK, KEY_MEMBERSHIP, KEY_REVISION,
    LEASE_PREFIX, enc, lease_key, write_err,
};
use crate::domain::kv::KvSnapshot;
use crate::domain::types::Revision;
use crate::raft::state_writes::{DirectWrites, KEY_INTENT, Writes, remove_prefix};
use crate::raft::{LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig, mvcc_store};
use crate::storage::TREE_STATE;
use crate::storage::snapshot_file::SnapshotFile;

/// The snapshot payload: the whole state plus the membership it was taken with.
#[derive(Serialize, Deserialize)]
pub(super) struct SnapshotPayload {
    pub(super) kv: KvSnapshot,
}

/// In the state tree while a snapshot install's writes are being made ([`install_writes`]).
pub(super) const KEY_INSTALLING: &[u8] = b"m/installing";

/// What an install in progress installs.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Installing {
    pub(super) last_log_id: Option<LogId>,
    pub(super) revision: Revision,
}

pub(super) fn installing(
    state: &sled::Tree,
) -> Result<Option<Installing>, crate::storage::StorageError> {
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

/// An install that a crash cut before its marker was durable: the marker is a sled write,
/// flushed with the install's writes, but the snapshot file was saved and synced before it.
/// Such a file is past the state's applied mark, which a snapshot this node built never is
/// (the state is flushed before the file is written). openraft refuses to start on a snapshot
/// past what it knows committed, so the install is finished from the file, as with a marker.
pub(super) fn cut_before_its_marker(
    state: &sled::Tree,
    snapshots: &SnapshotFile,
) -> Result<Option<Installing>, crate::storage::StorageError> {
    let corrupt = |what: &str, detail: String| crate::storage::StorageError::Corrupt {
        what: what.into(),
        detail,
    };
    let Some(meta) = snapshots
        .read_meta()
        .map_err(|e| corrupt("snapshot file", e.to_string()))?
    else {
        return Ok(None);
    };
    let meta: SnapshotMeta =
        serde_json::from_slice(&meta).map_err(|e| corrupt("snapshot meta", e.to_string()))?;
    let applied: Option<LogId> = match state.get(KEY_APPLIED)? {
        Some(b) => serde_json::from_slice(&b).map_err(|e| corrupt("applied", e.to_string()))?,
        None => None,
    };
    Ok((meta.last_log_id > applied).then_some(Installing {
        last_log_id: meta.last_log_id,
        // Known once the file is read; the marker's revision only names the install in logs.
        revision: Revision::default(),
    }))
}

/// Finish an install a crash cut, from the snapshot file it saved first.
pub(super) fn finish_install(
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
pub(super) fn install_writes(
    state: &sled::Tree,
    meta: &SnapshotMeta,
    kv: &KvSnapshot,
    stop_after: Option<usize>,
) -> Result<(), crate::storage::StorageError> {
    let mut w = DirectWrites::new(state, stop_after);
    // The last applied group's intent must not be redone over the snapshot's state.
    w.remove(KEY_INTENT);
    // Every lease record, and the journal they are written over.
    remove_prefix(state, &mut w, LEASE_PREFIX)?;
    remove_prefix(state, &mut w, super::lease_journal::JOURNAL_PREFIX)?;
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
pub(super) fn complete_install(
    state: &sled::Tree,
    dir: &std::path::Path,
) -> Result<(), crate::storage::StorageError> {
    state.flush()?;
    crate::storage::sync_blobs(dir)?;
    state.remove(KEY_INSTALLING)?;
    Ok(())
}

/// Write a snapshot durably (a blocking file write, off the async workers). Takes the data
/// and gives it back: a copy of hundreds of megabytes for the blocking task is not needed.
pub(super) async fn save_snapshot(
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
    pub(super) db: sled::Db,
    pub(super) snapshots: SnapshotFile,
    /// The state machine's
    /// [`StateMachine::snapshot_revision`](super::StateMachine::snapshot_revision).
    pub(super) on_disk: Arc<AtomicU64>,
    pub(super) payload: Option<SnapshotPayload>,
    /// [`StateMachine::snapshot_writes`](super::StateMachine::snapshot_writes).
    pub(super) writes: Arc<tokio::sync::Mutex<Option<LogId>>>,
    pub(super) last_applied: Option<LogId>,
    pub(super) membership: StoredMembership,
    pub(super) seq: u64,
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
