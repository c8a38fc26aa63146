//! Rebuilding the watch history at start-up from the latest snapshot and the Raft log. Pure.
//!
//! A restarted node used to start its [`EventHistory`] empty at its persisted revision, so a
//! watch resuming from any earlier revision got `410 compacted` even though the node still
//! had, on disk, everything needed to say what happened: its latest snapshot (the state at
//! log index `S`) and its log from the last purge on. [`KvState::apply`] is pure and returns
//! the events of an entry, so re-applying the entries `(S, A]` (`A`: the applied index
//! persisted with the state) to a scratch copy of the snapshot state regenerates exactly the
//! events of the revisions after the snapshot's revision. Those seed the history, whose
//! compaction mark is the snapshot's revision.
//!
//! # Why a replay, and not persisted events
//! Persisting events would add a write (and bytes) to every apply, the path issue 15 is
//! making faster. The replay costs nothing while the node runs: only start-up pays, once,
//! for at most the entries since the last snapshot (`--snapshot-threshold`, 10,000 by
//! default; openraft snapshots every that many entries). Measured on this 2-core machine,
//! release build, the whole rebuild (reading the log from sled, decoding, re-applying,
//! filling the history; `raft::history_replay::tests::rebuild_time`, run with `cargo test
//! --release --lib history_replay -- --ignored --nocapture`): 10,000 entries in 42 ms,
//! 100,000 in 326 ms (debug build: 349 ms and 6.9 s). The apply path is unchanged.
//!
//! # Invariants
//! - Entries are fed in log order and must be contiguous, starting right after the
//!   snapshot's index (or at 0, the first index openraft writes, without a snapshot).
//! - The result is accepted only if the replay ends exactly at the persisted applied index
//!   and at the persisted revision (and agrees with the persisted state's size): anything
//!   else is an error, and the caller starts with an empty history as before.
//! - Memory is bounded by [`HistoryLimits`] (the history drops its oldest events as the
//!   running history would) plus one scratch copy of the state; time by the number of entries
//!   the caller feeds (the shell also stops at a deadline).
//! - Entries before the snapshot are not replayable (their starting state is gone): the
//!   history knows nothing at or before the snapshot's revision.
//!
//! # What it must not do
//! Read the disk, a clock, or anything else: the shell (`raft::history_replay`) reads the
//! snapshot and the log and feeds them here.

use thiserror::Error;

use super::command::Command;
use super::history::{EventHistory, HistoryLimits};
use super::kv::{KvSnapshot, KvState};
use super::types::Revision;

/// One log entry as the replay sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayEntry {
    pub index: u64,
    /// The command of a normal entry; `None` for blank and membership entries (no events).
    pub command: Option<Command>,
}

/// Why the replay cannot be trusted (the caller falls back to an empty history).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ReplayError {
    #[error("the log is not contiguous: expected entry {expected}, got {got}")]
    Gap { expected: u64, got: u64 },
    #[error("the snapshot (next entry {next}) is ahead of the applied index {applied:?}")]
    SnapshotAhead { next: u64, applied: Option<u64> },
    #[error("the replay stopped at entry {reached:?}, the applied index is {applied:?}")]
    Incomplete {
        reached: Option<u64>,
        applied: Option<u64>,
    },
    #[error(
        "the replay reached {replayed} (keys {replayed_keys}, leases {replayed_leases}), the persisted state is {persisted} (keys {persisted_keys}, leases {persisted_leases})"
    )]
    Diverged {
        replayed: Revision,
        replayed_keys: usize,
        replayed_leases: usize,
        persisted: Revision,
        persisted_keys: usize,
        persisted_leases: usize,
    },
    #[error("stopped: {0}")]
    Aborted(String),
}

/// What the persisted state says, to check the replay against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistedState {
    /// The applied log index (`None`: nothing applied).
    pub applied_index: Option<u64>,
    pub revision: Revision,
    pub keys: usize,
    pub leases: usize,
}

/// A replay in progress: feed it the log entries after the snapshot, then [`Replay::finish`].
#[derive(Debug)]
pub struct Replay {
    state: KvState,
    history: EventHistory,
    /// The index the next entry must have.
    next: u64,
    /// The last index fed (or the snapshot's).
    reached: Option<u64>,
}

impl Replay {
    /// Start from `snapshot`, the state at log index `snapshot_index` (`None`: no snapshot,
    /// the empty state before entry 0).
    pub fn new(snapshot: KvSnapshot, snapshot_index: Option<u64>, limits: HistoryLimits) -> Self {
        let history = EventHistory::new(limits, snapshot.revision);
        Replay {
            state: KvState::from_snapshot(snapshot),
            history,
            next: snapshot_index.map_or(0, |i| i + 1),
            reached: snapshot_index,
        }
    }

    /// The index the next entry must have.
    pub fn next_index(&self) -> u64 {
        self.next
    }

    /// Apply one entry and keep its events.
    pub fn feed(&mut self, entry: ReplayEntry) -> Result<(), ReplayError> {
        if entry.index != self.next {
            return Err(ReplayError::Gap {
                expected: self.next,
                got: entry.index,
            });
        }
        if let Some(cmd) = entry.command {
            let applied = self.state.apply(&cmd);
            // The dirty sets only matter to the storage adapter: drop them as we go.
            self.state.take_dirty_leases();
            self.history.push(applied.events, self.state.revision());
        }
        self.reached = Some(entry.index);
        self.next = entry.index + 1;
        Ok(())
    }

    /// The rebuilt history, if the replay ended exactly where the persisted state is.
    pub fn finish(self, persisted: PersistedState) -> Result<EventHistory, ReplayError> {
        if self.reached != persisted.applied_index {
            return Err(ReplayError::Incomplete {
                reached: self.reached,
                applied: persisted.applied_index,
            });
        }
        let replayed = (
            self.state.revision(),
            self.state.len(),
            self.state.leases().len(),
        );
        if replayed != (persisted.revision, persisted.keys, persisted.leases) {
            return Err(ReplayError::Diverged {
                replayed: replayed.0,
                replayed_keys: replayed.1,
                replayed_leases: replayed.2,
                persisted: persisted.revision,
                persisted_keys: persisted.keys,
                persisted_leases: persisted.leases,
            });
        }
        Ok(self.history)
    }
}

/// Check that a snapshot at `snapshot_index` can lead to `applied_index` (the persisted state
/// may lag a snapshot after a crash: its tail was not flushed, the snapshot file was).
pub fn check_start(
    snapshot_index: Option<u64>,
    applied_index: Option<u64>,
) -> Result<(), ReplayError> {
    let next = snapshot_index.map_or(0, |i| i + 1);
    match applied_index {
        Some(a) if a + 1 >= next => Ok(()),
        None if snapshot_index.is_none() => Ok(()),
        applied => Err(ReplayError::SnapshotAhead { next, applied }),
    }
}

/// Replay `entries` (the log after the snapshot, up to the applied index) from `snapshot`.
pub fn replay(
    snapshot: KvSnapshot,
    snapshot_index: Option<u64>,
    entries: impl IntoIterator<Item = ReplayEntry>,
    persisted: PersistedState,
    limits: HistoryLimits,
) -> Result<EventHistory, ReplayError> {
    check_start(snapshot_index, persisted.applied_index)?;
    let mut r = Replay::new(snapshot, snapshot_index, limits);
    for e in entries {
        r.feed(e)?;
    }
    r.finish(persisted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::Event;
    use crate::domain::history::KeyFilter;

    fn put(key: &str, value: &str) -> Command {
        Command::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
            prev_revision: None,
        }
    }

    fn limits(max_events: usize) -> HistoryLimits {
        HistoryLimits {
            max_events,
            max_bytes: usize::MAX,
        }
    }

    /// A log: membership at 0, then the commands (with a blank entry in the middle).
    fn log(cmds: &[Command]) -> Vec<ReplayEntry> {
        let mut out = vec![ReplayEntry {
            index: 0,
            command: None,
        }];
        for c in cmds {
            if out.len() == 3 {
                out.push(ReplayEntry {
                    index: out.len() as u64,
                    command: None,
                });
            }
            out.push(ReplayEntry {
                index: out.len() as u64,
                command: Some(c.clone()),
            });
        }
        out
    }

    /// Apply `entries` as the state machine did: (state after each entry, every event).
    fn run(entries: &[ReplayEntry]) -> (Vec<KvSnapshot>, Vec<Event>) {
        let mut kv = KvState::new();
        let mut states = Vec::new();
        let mut events = Vec::new();
        for e in entries {
            if let Some(c) = &e.command {
                events.extend(kv.apply(c).events);
            }
            states.push(kv.snapshot());
        }
        (states, events)
    }

    fn persisted(s: &KvSnapshot, applied: u64) -> PersistedState {
        PersistedState {
            applied_index: Some(applied),
            revision: s.revision,
            keys: s.keys.len(),
            leases: s.leases.len(),
        }
    }

    fn all(h: &EventHistory) -> Vec<Event> {
        h.since(
            h.compacted().next(),
            &KeyFilter::Prefix(String::new()),
            usize::MAX,
        )
        .unwrap()
        .events
    }

    fn sample() -> Vec<Command> {
        vec![
            put("a", "1"),
            Command::RegisterLease {
                name: "l".into(),
                ttl_ms: 5000,
                clock_ms: Some(7),
            },
            Command::Put {
                key: "b".into(),
                value: "2".into(),
                lease: Some("l".into()),
                prev_revision: None,
            },
            put("a", "3"),
            Command::Delete {
                key: "a".into(),
                prev_revision: None,
            },
            Command::RevokeLease { name: "l".into() },
            Command::Batch {
                commands: vec![put("c", "4"), put("d", "5")],
            },
            // A rejected CAS: no event, no revision.
            Command::Put {
                key: "c".into(),
                value: "x".into(),
                lease: None,
                prev_revision: Some(Revision(1)),
            },
        ]
    }

    #[test]
    fn replay_from_a_snapshot_regenerates_exactly_the_later_events() {
        let entries = log(&sample());
        let (states, events) = run(&entries);
        let last = entries.len() as u64 - 1;
        for snap in 0..=last {
            let h = replay(
                states[snap as usize].clone(),
                Some(snap),
                entries[snap as usize + 1..].iter().cloned(),
                persisted(&states[last as usize], last),
                limits(1000),
            )
            .unwrap();
            let snap_rev = states[snap as usize].revision;
            assert_eq!(h.compacted(), snap_rev, "compacted at the snapshot");
            assert_eq!(h.current(), states[last as usize].revision);
            let want: Vec<Event> = events
                .iter()
                .filter(|e| e.revision > snap_rev)
                .cloned()
                .collect();
            assert_eq!(all(&h), want, "snapshot at entry {snap}");
        }
    }

    #[test]
    fn replay_without_a_snapshot_starts_at_entry_zero() {
        let entries = log(&sample());
        let (states, events) = run(&entries);
        let last = entries.len() as u64 - 1;
        let h = replay(
            KvSnapshot::default(),
            None,
            entries.clone(),
            persisted(&states[last as usize], last),
            limits(1000),
        )
        .unwrap();
        assert_eq!(h.compacted(), Revision(0));
        assert_eq!(all(&h), events);
        // Nothing applied at all: an empty history at 0.
        let empty = PersistedState {
            applied_index: None,
            revision: Revision(0),
            keys: 0,
            leases: 0,
        };
        let h = replay(KvSnapshot::default(), None, [], empty, limits(10)).unwrap();
        assert_eq!((h.len(), h.compacted()), (0, Revision(0)));
    }

    #[test]
    fn replay_stops_at_the_applied_index_and_checks_it() {
        let entries = log(&sample());
        let (states, _) = run(&entries);
        // Applied up to entry 5: the caller feeds only up to 5 (entries past it are not
        // applied yet, maybe not committed).
        let h = replay(
            KvSnapshot::default(),
            None,
            entries[..=5].iter().cloned(),
            persisted(&states[5], 5),
            limits(1000),
        )
        .unwrap();
        assert_eq!(h.current(), states[5].revision);
        // Feeding past the applied index is caught.
        let err = replay(
            KvSnapshot::default(),
            None,
            entries[..=6].iter().cloned(),
            persisted(&states[5], 5),
            limits(1000),
        )
        .unwrap_err();
        assert!(matches!(err, ReplayError::Incomplete { .. }), "{err}");
        // So is stopping short of it (a log that lost its tail).
        let err = replay(
            KvSnapshot::default(),
            None,
            entries[..=4].iter().cloned(),
            persisted(&states[5], 5),
            limits(1000),
        )
        .unwrap_err();
        assert!(matches!(err, ReplayError::Incomplete { .. }), "{err}");
    }

    #[test]
    fn a_gap_a_snapshot_ahead_or_a_divergence_is_refused() {
        let entries = log(&sample());
        let (states, _) = run(&entries);
        let last = entries.len() as u64 - 1;
        let want = persisted(&states[last as usize], last);
        // A purged prefix without a snapshot: the log starts at 3.
        let err = replay(
            KvSnapshot::default(),
            None,
            entries[3..].iter().cloned(),
            want,
            limits(1000),
        )
        .unwrap_err();
        assert_eq!(
            err,
            ReplayError::Gap {
                expected: 0,
                got: 3
            }
        );
        // A hole in the middle.
        let holed = entries
            .iter()
            .filter(|e| e.index != 4)
            .cloned()
            .collect::<Vec<_>>();
        let err = replay(KvSnapshot::default(), None, holed, want, limits(1000)).unwrap_err();
        assert!(matches!(err, ReplayError::Gap { expected: 4, .. }));
        // The persisted state lags the snapshot (its unflushed tail was lost in a crash).
        let err = replay(
            states[6].clone(),
            Some(6),
            [],
            persisted(&states[4], 4),
            limits(1000),
        )
        .unwrap_err();
        assert!(matches!(err, ReplayError::SnapshotAhead { .. }), "{err}");
        // A snapshot that does not lead to the persisted state.
        let err = replay(
            states[2].clone(),
            Some(4),
            entries[5..].iter().cloned(),
            want,
            limits(1000),
        )
        .unwrap_err();
        assert!(matches!(err, ReplayError::Diverged { .. }), "{err}");
    }

    #[test]
    fn the_rebuilt_history_keeps_the_running_bounds() {
        let cmds: Vec<Command> = (0..50).map(|i| put(&format!("k{i}"), "v")).collect();
        let entries = log(&cmds);
        let (states, events) = run(&entries);
        let last = entries.len() as u64 - 1;
        let h = replay(
            KvSnapshot::default(),
            None,
            entries,
            persisted(&states[last as usize], last),
            limits(10),
        )
        .unwrap();
        assert_eq!(h.len(), 10);
        assert_eq!(h.compacted(), Revision(40));
        assert_eq!(all(&h), events[40..].to_vec());
    }
}
