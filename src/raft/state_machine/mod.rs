//! The state machine adapter: applies committed entries to [`KvState`] and persists the result.
//!
//! # Layout
//! This file holds the state machine, its applied marks and the apply observers; `load` opens
//! it (finishing what a crash cut), `apply` is openraft's `RaftStateMachine` (apply, install),
//! `snapshot` encodes, builds, saves and installs snapshots (and seeds a restore).
//!
//! # Invariants
//! - The keys an entry batch changed, the applied log id, the membership and the store revision
//!   are written as ONE group on [`TREE_STATE`](crate::storage::TREE_STATE)
//!   ([`super::state_writes`]: an intent record, then the writes; `open` finishes a group a
//!   crash cut): a crash leaves the persisted state at some applied index, never between two.
//!   On restart openraft re-applies from there up to the committed id (the log holds every
//!   entry not yet in a snapshot).
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
//! Decide anything. The rules are in `domain::kv`; this module decodes, calls, persists,
//! publishes.

// openraft's traits impose `StorageError` (large) as the error type of every storage call.
#![allow(clippy::result_large_err)]

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::raft::off_workers::RwLock;

use openraft::StorageIOError;
use serde::Serialize;
use tokio::sync::watch;

use super::{LogId, StorageError, StoredMembership, any_err};
use super::{history_fill, mvcc_store};
use crate::domain::command::{Event, LeaseChange};
use crate::domain::kv::KvState;
use crate::domain::types::Revision;

pub use super::state_view::{HistoryError, HistoryRemovals, StateView};
use crate::storage::snapshot_file::SnapshotFile;

mod apply;
mod lease_journal;
mod load;
mod snapshot;

pub use load::persisted_revision;
pub(crate) use snapshot::seed;
pub use snapshot::{SnapshotBuilder, decode_payload, encode_payload};

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
    /// The state's size as of the last applied batch (shared with the views: read without
    /// the state's lock).
    data_bytes: Arc<AtomicU64>,
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
    /// What the lease journal holds ([`lease_journal`]), and how much it may hold before
    /// the oldest records are folded into the base records.
    journal: lease_journal::Size,
    journal_fold_at: lease_journal::Size,
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

    /// Tests: fold the lease journal into the base records once it holds more than
    /// `changes` or `bytes` (rather than [`lease_journal::FOLD_AT`]).
    #[doc(hidden)]
    pub fn fold_lease_journal_at(&mut self, changes: u64, bytes: u64) {
        self.journal_fold_at = lease_journal::Size { changes, bytes };
    }

    /// Tests of crash recovery: the next snapshot install makes at most `writes` of its
    /// writes, then fails, as if the process had died there.
    #[doc(hidden)]
    pub fn stop_install_after(&mut self, writes: Option<usize>) {
        self.stop_install_after = writes;
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

/// A record as JSON (the encoding of the state tree's marks and leases).
fn enc<T: Serialize>(v: &T) -> Result<Vec<u8>, crate::storage::StorageError> {
    serde_json::to_vec(v).map_err(|e| crate::storage::StorageError::Corrupt {
        what: "record".into(),
        detail: e.to_string(),
    })
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

fn lease_key(name: &str) -> Vec<u8> {
    prefixed(LEASE_PREFIX, name)
}
