//! openraft's `RaftStateMachine` for [`StateMachine`]: committed entries applied through
//! `KvState` and persisted as one write group per batch; a snapshot builder from a copy of the
//! state; a received snapshot installed; the current snapshot read back.
//!
//! # Invariants
//! - An entry is applied only once the log is durable up to it (when a durable view is set).
//! - A batch that may touch keys without bound (or of many entries) applies off the async
//!   workers, announced as a long hold (`raft::off_workers`): the node's Raft core, peer
//!   streams and other requests keep their threads however long it holds the state.
//! - A batch's changed keys and leases, its marks and its event records are one write group,
//!   written while the state is locked; the applied mark is published after, so a reader that
//!   sees mark `i` reads a state that includes entry `i`.
//! - The sweep runs inside apply, bounded, never past the snapshot on disk nor while a fill's
//!   records move in, and never removes the compaction mark's own records (an etcd watch from
//!   the mark delivers its events).
//! - An install saves the snapshot file first, then makes the state's writes under the install
//!   marker off the async workers; the state in memory is swapped only after.
//!
//! # What it must not do
//! Decide anything (`domain::kv` does), or hold the state's lock across an await.

use std::sync::atomic::Ordering;

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{EntryPayload, OptionalSend, StorageIOError};

use super::snapshot::{
    Installing, KEY_INSTALLING, SnapshotBuilder, SnapshotPayload, complete_install, install_writes,
    save_snapshot,
};
use super::{
    KEY_APPLIED, KEY_AUTH, KEY_COMPACT, KEY_LEASE_CLOCK, KEY_MEMBERSHIP, KEY_REVISION,
    StateMachine, Written, enc, json, lease_journal, lease_key, write_err,
};
use crate::domain::command::Response;
use crate::domain::kv::KvState;
use crate::domain::mvcc;
use crate::domain::types::Revision;
use crate::raft::off_workers;
use crate::raft::state_writes::{Persisted, WriteSet, Writes};
use crate::raft::{
    Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig, any_err, mvcc_store,
};

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        Ok((self.last_applied, self.membership.clone()))
    }

    // The wall clock times a log line only; nothing is decided by it.
    #[allow(clippy::disallowed_methods)]
    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        if let (Some(view), Some(last)) = (&mut self.durable, entries.last()) {
            view.wait_for(last.log_id.index).await.map_err(write_err)?;
        }
        // A batch that may change a great many keys is applied off the async workers: it holds
        // the state for as long as it takes (seconds for a delete of 100,000s of keys), and the
        // node's Raft core and peer streams must keep running meanwhile.
        let long = entries.len() >= LONG_BATCH_ENTRIES
            || entries.iter().any(|e| match &e.payload {
                EntryPayload::Normal(cmd) => cmd.may_touch_many_keys(),
                _ => false,
            });
        if long {
            // Readers that find the state taken meanwhile wait off the workers too.
            let _long = off_workers::long_hold();
            let (count, started) = (entries.len(), std::time::Instant::now());
            let applied = off_workers::run(|| self.apply_now(entries));
            let ms = started.elapsed().as_millis() as u64;
            if ms >= LONG_APPLY_LOG_MS {
                tracing::info!(
                    entries = count,
                    ms,
                    "applied a long batch off the async workers"
                );
            }
            applied
        } else {
            self.apply_now(entries)
        }
    }

    // The wall clock times a log line only; nothing is decided by it.
    #[allow(clippy::disallowed_methods)]
    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        // Copy now, while apply cannot run: the snapshot is exactly the state at
        // `last_applied` (pitfall P5). Encoding and writing happen later, off the apply path.
        let started = std::time::Instant::now();
        let kv = off_workers::read(&self.kv).snapshot();
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
            let kv = off_workers::write(&self.kv);
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
            let mut kv = off_workers::write(&self.kv);
            self.written = Written {
                compact: installed.compact_revision(),
                lease_clock_ms: installed.lease_clock_ms(),
                // `restart` wrote it.
                sweep_limit: revision,
            };
            self.data_bytes
                .store(installed.data_bytes(), Ordering::Release);
            // `install_writes` wrote every base record and removed the journal.
            self.journal = lease_journal::Size::default();
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

/// How many entries make a batch long enough to apply off the async workers, whatever they are.
const LONG_BATCH_ENTRIES: usize = 1024;
/// A long batch that took at least this long is logged (an operator wondering why requests
/// waited sees what held the state).
const LONG_APPLY_LOG_MS: u64 = 100;

impl StateMachine {
    /// Apply a batch of committed entries (durable ones) and publish the result.
    fn apply_now(&mut self, entries: Vec<Entry>) -> Result<Vec<Response>, StorageError> {
        let mut responses = Vec::new();
        let mut events = Vec::new();
        let mut lease_changes = Vec::new();
        let mut batch = WriteSet::default();
        let mut membership_changed = false;
        let (revision, lease_clock_ms) = {
            let mut kv = off_workers::write(&self.kv);
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
            // Taken at once, so that a group that fails below leaves none for the next.
            let created = kv.take_created_keys();
            // The group's lease changes: one journal record, not a base record each.
            let dirty = kv.take_dirty_leases();
            let mut added = lease_journal::Size::default();
            if !dirty.is_empty() {
                let index = self.last_applied.map_or(0, |l| l.index);
                added = lease_journal::record(&mut batch, index, &dirty).map_err(write_err)?;
                self.journal.add(added);
            }
            let over = self.journal.over(self.journal_fold_at);
            if !over.is_zero() {
                // Oldest first: the excess, but no more than twice what this group added
                // (and a little), so the journal shrinks back without one apply folding it all.
                let need = lease_journal::Size {
                    changes: over.changes.min(2 * added.changes + 1024),
                    bytes: over.bytes.min(2 * added.bytes + (1 << 20)),
                };
                let folded =
                    lease_journal::fold(&self.state, &mut batch, kv.leases(), need, lease_key)
                        .map_err(write_err)?;
                self.journal.sub(folded);
            }
            if let Some(auth) = kv.take_dirty_auth() {
                batch.insert(KEY_AUTH, json(auth)?);
            }
            let revision = kv.revision();
            self.data_bytes.store(kv.data_bytes(), Ordering::Release);
            // The events are the key changes: each becomes the key's new version.
            let records = mvcc_store::record(&mut batch, &events, mvcc_store::EVENT_RECORD_BYTES);
            // Not past the snapshot on disk: the records after it are what a restart replays.
            let on_disk = Revision(self.snapshot_revision.load(Ordering::Acquire));
            // The records below the compaction mark: the mark's own stay (an etcd watch from
            // the mark delivers its events, `mvcc::sweep_mark`).
            let sweep_to = mvcc::sweep_mark(kv.compact_revision()).min(on_disk);
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
            // Marks: every group writes both, so they stay in its intent (`state_writes`).
            batch.insert_mark(KEY_APPLIED, json(&self.last_applied)?);
            batch.insert_mark(KEY_REVISION, json(&revision)?);
            // Written while the state is still locked: a reader that sees revision `r` finds
            // the history through `r` (sled writes to memory here, not to the disk).
            // Not flushed here: the log holds every applied entry durably (a purge flushes sled
            // before it removes any), and sled recovers a prefix of writes, so a lost tail is
            // re-applied from the log on restart.
            // The window covers the index's change too: a history read that took a location
            // the fold moves reads again.
            let sweeping = swept.removes.then(|| self.removals.begin());
            let persisted = batch
                .persist(&self.state, self.inline_limit, self.stop_writes_after)
                .map_err(write_err)?;
            // sled may have put a long value of that batch in a blob file, which it does not
            // sync: synced now, before sled's own flush is likely to make its pointer durable
            // (its recovery would skip a lost blob and keep the applied mark after it).
            if persisted == Persisted::Batch {
                crate::storage::sync_blobs(&self.dir).map_err(write_err)?;
            }
            if !records.is_empty() {
                mvcc_store::index_records(&mut self.history.index_mut(), &records, &created, |k| {
                    kv.stored_key(k)
                });
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
}
