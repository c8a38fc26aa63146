//! Start-up shell of the watch-history rebuild: reads the latest snapshot and the Raft log
//! after it, up to the applied index persisted with the state, and feeds them to the pure
//! [`crate::domain::replay`] (see its docs for the design and why it was chosen over
//! persisting events: nothing is added to the apply path).
//!
//! # Invariants
//! - Runs once, before openraft starts (the log store and state machine are not shared yet),
//!   through the storage traits' own read methods: it writes nothing.
//! - Replays only up to the *persisted applied index*: the log may hold entries that are not
//!   committed or not applied yet; openraft re-applies the committed ones right after, through
//!   the apply path, which appends their events to the seeded history.
//! - Bounded: entries are read in chunks (memory), the history by [`HistoryLimits`], and the
//!   whole rebuild by a deadline on the node's monotonic clock (time).
//!
//! # What it must not do
//! Fail the start. Any error (an unreadable snapshot, a gap in the log, a replay that does
//! not end at the persisted state, the deadline) is returned for the caller to log; the node
//! then starts with an empty history at its persisted revision, as before this existed.

// openraft's traits impose `StorageError` (large) as the error type of every storage call.
#![allow(clippy::result_large_err)]

use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, RaftLogReader};
use thiserror::Error;

use super::log_store::LogStore;
use super::state_machine::{StateMachine, StateView, decode_payload};
use crate::clock::Clock;
use crate::domain::history::{EventHistory, HistoryLimits};
use crate::domain::kv::KvSnapshot;
use crate::domain::replay::{PersistedState, Replay, ReplayEntry, ReplayError, check_start};

/// Entries read from the log at a time.
const CHUNK: u64 = 256;

/// How long the rebuild may take before the node gives up on it (and starts as before).
pub const DEFAULT_BUDGET_MS: u64 = 10_000;

/// Why the history could not be rebuilt.
#[derive(Debug, Error)]
pub enum RebuildError {
    #[error("reading storage: {0}")]
    Storage(String),
    #[error("decoding the snapshot: {0}")]
    Snapshot(String),
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

impl From<super::StorageError> for RebuildError {
    fn from(e: super::StorageError) -> Self {
        RebuildError::Storage(e.to_string())
    }
}

/// What a successful rebuild did (for the start-up log line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RebuildReport {
    /// Log entries replayed.
    pub entries: u64,
    pub took_ms: u64,
}

/// Rebuild the history of the revisions after the latest snapshot.
pub async fn rebuild(
    log: &mut LogStore,
    sm: &mut StateMachine,
    view: &StateView,
    limits: HistoryLimits,
    clock: &dyn Clock,
    budget_ms: u64,
) -> Result<(EventHistory, RebuildReport), RebuildError> {
    let started = clock.mono();
    let deadline = started.plus(budget_ms);
    let (applied, _) = sm.applied_state().await?;
    let applied_index = applied.map(|l| l.index);
    let persisted = view.with_state(|kv| PersistedState {
        applied_index,
        revision: kv.revision(),
        keys: kv.len(),
        leases: kv.leases().len(),
    });
    let (snapshot, snapshot_index) = match sm.get_current_snapshot().await? {
        Some(s) => {
            let index = s.meta.last_log_id.map(|l| l.index);
            check_start(index, applied_index)?;
            // Decoding a large state takes a while: off the async workers.
            let data = s.snapshot;
            let kv = tokio::task::spawn_blocking(move || decode_payload(&data))
                .await
                .map_err(|e| RebuildError::Snapshot(e.to_string()))?
                .map_err(|e| RebuildError::Snapshot(e.to_string()))?;
            (kv, index)
        }
        None => (KvSnapshot::default(), None),
    };
    check_start(snapshot_index, applied_index)?;
    let mut replay = Replay::new(snapshot, snapshot_index, limits);
    let first = replay.next_index();
    let end = applied_index.map_or(0, |a| a + 1);
    // The log may start later than the snapshot needs (purged past it): the replay reports the
    // gap. It may also hold entries past `end`: never read.
    let mut next = first;
    while next < end {
        if clock.mono() >= deadline {
            return Err(ReplayError::Aborted(format!(
                "the rebuild took over {budget_ms} ms (at entry {next} of {first}..{end})"
            ))
            .into());
        }
        let upto = end.min(next.saturating_add(CHUNK));
        let entries = log.try_get_log_entries(next..upto).await?;
        if entries.is_empty() {
            return Err(ReplayError::Gap {
                expected: next,
                got: upto,
            }
            .into());
        }
        for entry in entries {
            let command = match entry.payload {
                EntryPayload::Normal(cmd) => Some(cmd),
                EntryPayload::Blank | EntryPayload::Membership(_) => None,
            };
            replay.feed(ReplayEntry {
                index: entry.log_id.index,
                command,
            })?;
        }
        next = replay.next_index();
    }
    let history = replay.finish(persisted)?;
    Ok((
        history,
        RebuildReport {
            entries: end.saturating_sub(first),
            took_ms: started.until(clock.mono()),
        },
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use openraft::CommittedLeaderId;

    use super::*;
    use crate::clock::SystemClock;
    use crate::domain::command::Command;
    use crate::domain::history::KeyFilter;
    use crate::domain::types::Revision;
    use crate::raft::log_store::encode_entry;
    use crate::raft::state_machine::DiscardEvents;
    use crate::raft::{Entry, LogId};
    use crate::storage::{TREE_RAFT, index_key, open_db};

    fn entry(index: u64, key: &str) -> Entry {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: if index == 0 {
                EntryPayload::Blank
            } else {
                EntryPayload::Normal(Command::Put {
                    key: key.into(),
                    value: "a value of some bytes".into(),
                    lease: None,
                    prev_revision: None,
                })
            },
        }
    }

    /// A data dir whose log holds entries `0..logged` and whose state applied `0..applied`
    /// (no snapshot), then the rebuild as the node runs it.
    async fn rebuild_after(
        logged: u64,
        applied: u64,
        keys: u64,
    ) -> (
        Result<(EventHistory, RebuildReport), RebuildError>,
        Revision,
    ) {
        let dir = tempfile::TempDir::new().unwrap();
        let db = open_db(dir.path(), 64 << 20).unwrap();
        let raft = db.open_tree(TREE_RAFT).unwrap();
        let entries: Vec<Entry> = (0..logged)
            .map(|i| entry(i, &format!("key/{:06}", i % keys)))
            .collect();
        for e in &entries {
            // `e`: the log store's entry prefix.
            raft.insert(index_key(b'e', e.log_id.index), encode_entry(e).unwrap())
                .unwrap();
        }
        let (mut sm, _) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        for chunk in entries[..applied as usize].chunks(512) {
            sm.apply(chunk.to_vec()).await.unwrap();
        }
        drop(sm);
        let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        let mut log = LogStore::open(&db).unwrap();
        let revision = view.with_state(|kv| kv.revision());
        let res = rebuild(
            &mut log,
            &mut sm,
            &view,
            HistoryLimits::default(),
            &SystemClock::new(),
            DEFAULT_BUDGET_MS,
        )
        .await;
        (res, revision)
    }

    #[tokio::test]
    async fn the_rebuild_replays_up_to_the_applied_index_only() {
        // 300 entries logged, 200 applied: entries 200..300 are not replayed (openraft applies
        // them later, if committed, through the apply path).
        let (res, revision) = rebuild_after(300, 200, 1000).await;
        let (h, report) = res.unwrap();
        assert_eq!(revision, Revision(199));
        assert_eq!(report.entries, 200);
        assert_eq!(
            (h.compacted(), h.current(), h.len()),
            (Revision(0), revision, 199)
        );
        let all = h.since(Revision(1), &KeyFilter::Prefix(String::new()), usize::MAX);
        let revs: Vec<u64> = all.unwrap().events.iter().map(|e| e.revision.0).collect();
        assert_eq!(revs, (1..=199).collect::<Vec<_>>());
    }

    /// Not a test: the figure quoted in `domain::replay`'s docs. Run with
    /// `cargo test --release --lib history_replay -- --ignored --nocapture`.
    #[tokio::test]
    #[ignore]
    async fn rebuild_time() {
        for n in [10_000u64, 100_000] {
            let (res, _) = rebuild_after(n, n, 20_000).await;
            let (h, report) = res.unwrap();
            println!(
                "rebuilt {} entries in {} ms ({} events kept)",
                report.entries,
                report.took_ms,
                h.len()
            );
        }
    }
}
