//! openraft's storage conformance suite against the sled log store and state machine.

use std::sync::Arc;

use leasecore::raft::log_store::LogStore;
use leasecore::raft::state_machine::{DiscardEvents, StateMachine};
use leasecore::raft::{StorageError, TypeConfig};
use leasecore::storage::open_db;
use openraft::testing::{StoreBuilder, Suite};
use openraft::{AnyError, StorageIOError};
use tempfile::TempDir;

struct SledBuilder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine, TempDir> for SledBuilder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachine), StorageError> {
        let fail = |e: &dyn std::fmt::Display| {
            StorageError::from(StorageIOError::write(AnyError::error(e.to_string())))
        };
        let dir = TempDir::new().map_err(|e| fail(&e))?;
        let db = open_db(dir.path(), 8 << 20).map_err(|e| fail(&e))?;
        let log = LogStore::open(&db, dir.path()).map_err(|e| fail(&e))?;
        let (sm, _view) =
            StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).map_err(|e| fail(&e))?;
        Ok((dir, log, sm))
    }
}

/// `cmds` as consecutive log entries of term 1 from index `first`.
/// The live keys as the state tree's history has them (every version read back from sled).
fn history_keys(db: &sled::Db) -> Vec<(String, leasecore::domain::kv::Versioned)> {
    let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
    leasecore::raft::mvcc_store::History::open(state)
        .unwrap()
        .load()
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn entries(
    first: u64,
    cmds: Vec<leasecore::domain::command::Command>,
) -> Vec<leasecore::raft::Entry> {
    use openraft::{CommittedLeaderId, EntryPayload, LogId};
    cmds.into_iter()
        .enumerate()
        .map(|(i, cmd)| leasecore::raft::Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), first + i as u64),
            payload: EntryPayload::Normal(cmd.into()),
        })
        .collect()
}

/// A put of `k<index>` = "v" as the entry at `index`, written by leader 1 in `term`.
fn put_entry(term: u64, index: u64) -> leasecore::raft::Entry {
    use openraft::{CommittedLeaderId, EntryPayload, LogId};
    let cmd = leasecore::domain::command::Command::Put {
        key: format!("k{index}"),
        value: "v".into(),
        lease: None,
        prev_revision: None,
    };
    leasecore::raft::Entry {
        log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
        payload: EntryPayload::Normal(cmd.into()),
    }
}

#[test]
fn sled_stores_pass_openraft_suite() {
    Suite::test_all(SledBuilder).expect("openraft storage suite");
}

/// A data directory of storage format 2 (values as JSON under `k/`, a version index under
/// `i/`, one JSON event per change under `h/`) opens with every value intact, as base
/// versions of a history that starts at its revision, and keeps nothing of the old layout.
#[test]
fn a_format_2_state_is_converted_when_opened() {
    use leasecore::domain::kv::Versioned;
    use leasecore::domain::types::Revision;
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
    let a = Versioned {
        value: "va".into(),
        create_revision: Revision(1),
        mod_revision: Revision(3),
        version: 2,
        lease: None,
    };
    state
        .insert(b"k/a", serde_json::to_vec(&a).unwrap())
        .unwrap();
    state
        .insert(b"i/a\0\x01\0\0\0\0\0\0\0\x03", &0u32.to_be_bytes())
        .unwrap();
    state
        .insert(
            b"h/\0\0\0\0\0\0\0\x03\0\0\0\0",
            br#"{"type":"put"}"#.to_vec(),
        )
        .unwrap();
    state.insert(b"m/revision", b"4".to_vec()).unwrap();
    state
        .insert(b"m/history_start", &0u64.to_be_bytes())
        .unwrap();
    state.insert(b"m/history_swept", b"h/".to_vec()).unwrap();
    let (_sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    assert_eq!(view.get("a"), (Revision(4), Some(a.clone())));
    let all = leasecore::domain::auth::KeyRange {
        start: Vec::new(),
        end: Some(vec![0xFF]),
    };
    assert_eq!(
        leasecore::raft::mvcc_store::History::open(state.clone())
            .unwrap()
            .range_at(&all, Revision(4))
            .unwrap(),
        vec![("a".to_string(), a)]
    );
    for old in [&b"k/"[..], b"i/", b"m/history_swept"] {
        assert!(state.scan_prefix(old).next().is_none(), "{old:?} left");
    }
    // Only the event record's format-2 key is gone; the history starts at the revision.
    assert!(state.scan_prefix(b"h/").next().is_none());
}

/// A restart loads the state from the snapshot on disk and the event records after it: a
/// compaction past the snapshot sweeps nothing above it (the records stay until the next
/// snapshot), and the state that comes back is the one every version says.
#[tokio::test]
async fn a_restart_loads_the_snapshot_and_replays_the_history_after_it() {
    use leasecore::domain::command::Command;
    use leasecore::domain::types::Revision;
    use leasecore::raft::Entry;
    use leasecore::raft::mvcc_store;
    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder};

    let dir = TempDir::new().unwrap();
    let mut index = 0u64;
    let mut entry = |cmd: Command| {
        index += 1;
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(cmd.into()),
        }
    };
    let put = |k: usize, v: usize| Command::Put {
        key: format!("k/{k:03}"),
        value: format!("v{v}"),
        lease: None,
        prev_revision: None,
    };
    let before = {
        let db = open_db(dir.path(), 8 << 20).unwrap();
        let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        let first: Vec<Entry> = (0..100).map(|i| entry(put(i, i))).collect();
        sm.apply(first).await.unwrap();
        let mut builder = sm.get_snapshot_builder().await;
        builder.build_snapshot().await.unwrap();
        let snapshot_revision = view.applied().revision;
        // After the snapshot: overwrites, deletes, and a compaction past the snapshot.
        let mut later: Vec<Entry> = (0..60).map(|i| entry(put(i * 2, 1000 + i))).collect();
        later.extend((0..20).map(|i| {
            entry(Command::Delete {
                key: format!("k/{:03}", i * 5),
                prev_revision: None,
            })
        }));
        sm.apply(later).await.unwrap();
        let top = view.applied().revision;
        let compact = Revision(top.0 - 10);
        sm.apply([entry(Command::Compact { revision: compact })])
            .await
            .unwrap();
        // One more batch lets the sweep run at its new mark.
        sm.apply([entry(put(999, 0))]).await.unwrap();
        let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
        assert_eq!(
            mvcc_store::sweep_limit(&state).unwrap(),
            Some(snapshot_revision),
            "the sweep stops at the snapshot on disk"
        );
        let (_, keys) = view.list("", usize::MAX);
        drop(sm);
        db.flush().unwrap();
        keys
    };
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let (_sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    let (_, after) = view.list("", usize::MAX);
    assert_eq!(after, before);
    assert_eq!(after, history_keys(&db));
    // 100 keys, 10 more from the overwrites (k/100 to k/118), 20 deleted, k/999.
    assert_eq!(after.len(), 100 + 10 - 20 + 1);
}

/// A data directory of storage format 3 kept the log's entries in sled: opened by this build,
/// they move to the segment files (readable, counted, appendable after), sled keeps none of
/// them, and the move is not repeated on the next open.
#[tokio::test]
async fn a_format_3_log_moves_out_of_sled_when_opened() {
    use leasecore::raft::log_store::{LOG_DIR, encode_entry};
    use openraft::storage::RaftLogStorage;
    use openraft::{CommittedLeaderId, LogId, RaftLogReader};

    let dir = TempDir::new().unwrap();
    let entry = |index: u64| put_entry(2, index);
    {
        let db = open_db(dir.path(), 8 << 20).unwrap();
        let tree = db.open_tree(leasecore::storage::TREE_RAFT).unwrap();
        for index in 3..=40u64 {
            let mut key = vec![b'e'];
            key.extend_from_slice(&index.to_be_bytes());
            tree.insert(key, encode_entry(&entry(index)).unwrap())
                .unwrap();
        }
        // Entries up to 5 were purged (the purge had not removed them all yet).
        let purged = LogId::new(CommittedLeaderId::new(2, 1), 5);
        tree.insert(b"m/purged", serde_json::to_vec(&purged).unwrap())
            .unwrap();
        db.flush().unwrap();
    }
    for _ in 0..2 {
        let db = open_db(dir.path(), 8 << 20).unwrap();
        let mut log = LogStore::open(&db, dir.path()).unwrap();
        let tree = db.open_tree(leasecore::storage::TREE_RAFT).unwrap();
        assert!(
            tree.scan_prefix(b"e").next().is_none(),
            "no entry left in sled"
        );
        assert!(dir.path().join(LOG_DIR).is_dir());
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id.map(|l| l.index), Some(5));
        assert_eq!(state.last_log_id.map(|l| l.index), Some(40));
        let read = log.try_get_log_entries(6..=40).await.unwrap();
        assert_eq!(read.len(), 35);
        assert_eq!(read[0].log_id.index, 6);
        assert_eq!(
            format!("{:?}", read[34].payload),
            format!("{:?}", entry(40).payload)
        );
        drop(log);
        drop(db);
    }
}

/// The leader acknowledges its own appends before their sync (`raft::durability`), so the state
/// machine must hold an entry back until the log is durable up to it, and refuse for good once
/// a sync failed. On a paused clock: the wait is on the durable mark alone, never on time.
#[tokio::test(start_paused = true)]
async fn entries_apply_only_once_the_log_is_durable_up_to_them() {
    use leasecore::raft::durability::Durability;
    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, LogId};

    let id = |index| LogId::new(CommittedLeaderId::new(1, 1), index);
    let put = |index: u64| put_entry(1, index);
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    let durability = Durability::new(None);
    sm.apply_when_durable(durability.view());

    let applying = tokio::spawn(async move { sm.apply([put(1), put(2)]).await.map(|_| sm) });
    // A virtual second: the clock only moves once every task waits.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert!(
        !applying.is_finished(),
        "applied before the log was durable"
    );
    durability.synced(id(1), durability.generation());
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert!(!applying.is_finished(), "applied 2 with only 1 durable");
    assert_eq!(view.applied().log_index, 0);
    durability.synced(id(2), durability.generation());
    let mut sm = applying.await.unwrap().unwrap();
    assert_eq!(view.applied().log_index, 2);

    // After a failed sync nothing more applies: the node stops (a storage error).
    durability.failed();
    assert!(sm.apply([put(3)]).await.is_err());
    assert_eq!(view.applied().log_index, 2);
}

/// An applied group is written as an intent and then key by key (sled's atomic batches cost
/// a database-wide lock and two buffer writes each): a crash after any number of those writes
/// reopens to the state the whole group gives, keys, leases, marks and history alike, and the
/// next group applies on top of it as on a store that never crashed.
#[tokio::test]
async fn a_crash_inside_an_applied_group_reopens_to_the_whole_group() {
    use leasecore::domain::command::Command;
    use leasecore::domain::types::Revision;
    use leasecore::raft::Entry;
    use openraft::RaftSnapshotBuilder;
    use openraft::storage::RaftStateMachine;

    let put = |k: &str, v: &str, lease: Option<&str>| Command::Put {
        key: k.into(),
        value: v.into(),
        lease: lease.map(str::to_string),
        prev_revision: None,
    };
    let register = |name: &str| Command::RegisterLease {
        name: name.into(),
        ttl_ms: 5_000,
        clock_ms: Some(10),
    };
    let first = entries(
        1,
        vec![
            register("a"),
            put("k1", "v1", Some("a")),
            put("k2", "v1", None),
            put("k3", "v1", None),
            put("k2", "v2", None),
        ],
    );
    // Revokes a lease with its key, rewrites and deletes keys, compacts below the snapshot
    // (so the sweep removes versions in this very group) and registers another lease.
    let cut_group = entries(
        6,
        vec![
            Command::RevokeLease { name: "a".into() },
            put("k2", "v3", None),
            Command::Delete {
                key: "k3".into(),
                prev_revision: None,
            },
            Command::Compact {
                revision: Revision(4),
            },
            register("b"),
            put("k4", "v1", Some("b")),
        ],
    );
    let next = entries(12, vec![put("k5", "v1", Some("b")), put("k2", "v4", None)]);

    type Seen = (
        leasecore::raft::state_machine::AppliedMark,
        Vec<(String, leasecore::domain::kv::Versioned)>,
        Vec<(String, leasecore::domain::kv::LeaseRecord)>,
        Vec<(String, leasecore::domain::kv::Versioned)>,
    );
    /// Whether the group was cut, what the first group left, what a reopen finds, and what the
    /// next group leaves after it (the cut group applied again first if the reopen did not
    /// find it, as the log would replay it).
    async fn run(stop_after: Option<usize>, groups: [&[Entry]; 3]) -> (bool, Seen, Seen, Seen) {
        let dir = TempDir::new().unwrap();
        let db = open_db(dir.path(), 8 << 20).unwrap();
        let seen = |view: &leasecore::raft::state_machine::StateView| -> Seen {
            (
                view.applied(),
                view.list("", usize::MAX).1,
                view.leases().1,
                history_keys(&db),
            )
        };
        let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        sm.apply(groups[0].to_vec()).await.unwrap();
        let first = seen(&view);
        sm.get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .unwrap();
        sm.stop_writes_after(stop_after);
        let cut = sm.apply(groups[1].to_vec()).await.is_err();
        drop(sm);
        // What a restart finds: every write made before the "crash", nothing after it. The
        // node reads the revision (for its watch history) before it opens the state machine.
        let early = leasecore::raft::state_machine::persisted_revision(&db).unwrap();
        let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        let reopened = seen(&view);
        assert_eq!(early, reopened.0.revision, "the revision read before open");
        if reopened.0 == first.0 {
            sm.apply(groups[1].to_vec()).await.unwrap();
        }
        sm.apply(groups[2].to_vec()).await.unwrap();
        (cut, first, reopened, seen(&view))
    }

    let groups = [&first[..], &cut_group[..], &next[..]];
    let (_, before, whole, then) = run(None, groups).await;
    assert_eq!(whole.0.log_index, 11);
    assert!(
        whole.2.iter().all(|(name, _)| name == "b"),
        "lease a is gone"
    );
    assert!(!whole.1.iter().any(|(k, _)| k == "k1" || k == "k3"));
    // Cut before its intent (among its event records) the group did not happen, and its
    // records written so far are gone; cut after it, the reopen finishes it.
    let (mut cuts, mut not_happened) = (0, 0);
    for stop_after in 0.. {
        let (cut, first, reopened, after) = run(Some(stop_after), groups).await;
        if !cut {
            break;
        }
        cuts += 1;
        assert_eq!(first, before);
        if reopened == before {
            not_happened += 1;
        } else {
            assert_eq!(reopened, whole, "crash after {stop_after} writes");
        }
        assert_eq!(after, then, "the next group after a crash at {stop_after}");
    }
    assert!(not_happened >= 1, "no cut fell among the group's records");
    // After its intent: the sweep's removals and the fold of a version (the marks stay in
    // the intent; the leases' changes are a journal record, before the intent).
    assert!(
        cuts >= not_happened + 2,
        "the group made only {cuts} writes"
    );
}

/// openraft hands a snapshot install to the state machine and asks for the purge it covers at
/// the same time. A purge flushes sled with its mark, so it must wait until the state holds
/// what it removes: a crash mid-install must not leave a log purged past the persisted state.
#[tokio::test]
async fn a_purge_waits_until_the_state_machine_has_applied_that_far() {
    use leasecore::raft::state_machine::AppliedMark;
    use openraft::storage::{RaftLogStorage, RaftLogStorageExt};
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId};
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    let id = |index| LogId::new(CommittedLeaderId::new(1, 1), index);
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let applied_at = |index| AppliedMark {
        log_index: index,
        ..Default::default()
    };
    let (marks, applied) = tokio::sync::watch::channel(applied_at(3));
    let mut log = LogStore::open(&db, dir.path())
        .unwrap()
        .with_applied(applied);
    log.blocking_append((1..=10).map(|i| Entry::<TypeConfig> {
        log_id: id(i),
        payload: EntryPayload::Blank,
    }))
    .await
    .unwrap();
    let bytes = log.log_bytes();
    let before = bytes.load(Ordering::Acquire);
    log.purge(id(8)).await.unwrap();
    // A negative check needs a window: the purger runs at once when it may (milliseconds).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        bytes.load(Ordering::Acquire),
        before,
        "purged past the applied state"
    );
    // Purges asked while it waits never hold up the caller (openraft's core awaits `purge`):
    // far more than the purger's queue holds.
    tokio::time::timeout(Duration::from_secs(10), async {
        for _ in 0..500 {
            log.purge(id(8)).await.unwrap();
        }
    })
    .await
    .expect("purge blocked while the purger waits for the state machine");
    marks.send_replace(applied_at(8));
    tokio::time::timeout(Duration::from_secs(10), async {
        while bytes.load(Ordering::Acquire) == before {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the purge never ran once applied");
}

/// A snapshot install is written key by key (a sled batch of a million keys holds gigabytes),
/// under a marker: cut after any of its writes, as a crash would leave sled, the node opens
/// to exactly the installed state, reads the installed revision first, and goes on from it.
#[tokio::test]
async fn an_install_cut_anywhere_finishes_when_the_node_opens() {
    use leasecore::domain::auth::KeyRange;
    use leasecore::domain::command::Command;
    use openraft::RaftSnapshotBuilder;
    use openraft::storage::RaftStateMachine;

    let put = |k: String, v: &str, lease: Option<&str>| Command::Put {
        key: k,
        value: v.into(),
        lease: lease.map(str::to_string),
        prev_revision: None,
    };
    let register = |name: &str| Command::RegisterLease {
        name: name.into(),
        ttl_ms: 5_000,
        clock_ms: Some(10),
    };
    // The source: leases with keys, rewrites, deletes; its snapshot is installed.
    let mut cmds = vec![register("a"), register("b")];
    for i in 0..30 {
        cmds.push(put(
            format!("k{}", i % 9),
            &format!("s{i}"),
            (i % 4 == 0).then_some("a"),
        ));
        if i % 7 == 6 {
            cmds.push(Command::Delete {
                key: format!("k{}", i % 9),
                prev_revision: None,
            });
        }
    }
    let source_entries = entries(1, cmds);
    let next_index = source_entries.len() as u64 + 1;
    // What the node held before: other keys, another lease, history of its own.
    let mut own = vec![register("old")];
    for i in 0..20 {
        own.push(put(
            format!("o{}", i % 5),
            "mine",
            (i % 3 == 0).then_some("old"),
        ));
    }
    let own_entries = entries(1, own);
    let after = entries(next_index, vec![put("k1".into(), "after", Some("b"))]);

    let src_dir = TempDir::new().unwrap();
    let src_db = open_db(src_dir.path(), 8 << 20).unwrap();
    let (mut source, _) =
        StateMachine::open(&src_db, src_dir.path(), Arc::new(DiscardEvents)).unwrap();
    source.apply(source_entries).await.unwrap();
    let snapshot = source
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();

    type Seen = (
        leasecore::raft::state_machine::AppliedMark,
        Vec<(String, leasecore::domain::kv::Versioned)>,
        Vec<(String, leasecore::domain::kv::LeaseRecord)>,
        Vec<(String, leasecore::domain::kv::Versioned)>,
        leasecore::domain::types::Revision,
    );
    let all = KeyRange {
        start: Vec::new(),
        end: None,
    };
    let seen = |view: &leasecore::raft::state_machine::StateView, db: &sled::Db| -> Seen {
        assert_eq!(
            history_keys(db),
            view.list("", usize::MAX).1,
            "the versions are the state"
        );
        let floor = view.history_floor();
        (
            view.applied(),
            view.list("", usize::MAX).1,
            view.leases().1,
            view.range_at(&all, Some(floor)).unwrap().1,
            floor,
        )
    };
    let run = |stop: Option<usize>| {
        let (snapshot, own_entries, after) = (snapshot.clone(), own_entries.clone(), after.clone());
        async move {
            let dir = TempDir::new().unwrap();
            let db = open_db(dir.path(), 8 << 20).unwrap();
            let (mut sm, _) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
            sm.apply(own_entries).await.unwrap();
            sm.stop_install_after(stop);
            let cut = sm
                .install_snapshot(&snapshot.meta, snapshot.snapshot)
                .await
                .is_err();
            drop(sm);
            let early = leasecore::raft::state_machine::persisted_revision(&db).unwrap();
            let (mut sm, view) =
                StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
            let reopened = seen(&view, &db);
            assert_eq!(early, reopened.0.revision, "the revision read before open");
            sm.apply(after).await.unwrap();
            (cut, reopened, seen(&view, &db))
        }
    };
    let (cut, whole, then) = run(None).await;
    assert!(!cut);
    assert!(
        whole.2.iter().all(|(n, _)| n == "a" || n == "b"),
        "{:?}",
        whole.2
    );
    assert!(whole.1.iter().all(|(k, _)| k.starts_with('k')));
    let mut cuts = 0;
    for stop in 0.. {
        let (cut, reopened, next) = run(Some(stop)).await;
        if !cut {
            break;
        }
        cuts += 1;
        assert_eq!(reopened, whole, "install cut after {stop} writes");
        assert_eq!(next, then, "the next entry after a cut at {stop}");
    }
    assert!(cuts >= 20, "the install made only {cuts} writes");
}

/// openraft builds snapshots in a task of their own, so a build can finish after an install
/// of a newer snapshot: it must not replace the installed file with its older state, also
/// when both are at the same revision (entries that change no revision: blanks, membership).
#[tokio::test]
async fn a_build_that_finishes_after_an_install_keeps_the_installed_snapshot() {
    use leasecore::domain::command::Command;
    use leasecore::raft::Entry;
    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder};

    let id = |index| LogId::new(CommittedLeaderId::new(1, 1), index);
    let puts: Vec<Entry> = (1..=10)
        .map(|i| Entry {
            log_id: id(i),
            payload: EntryPayload::Normal(
                Command::Put {
                    key: format!("k{i}"),
                    value: "v".into(),
                    lease: None,
                    prev_revision: None,
                }
                .into(),
            ),
        })
        .collect();
    let src_dir = TempDir::new().unwrap();
    let src_db = open_db(src_dir.path(), 8 << 20).unwrap();
    let (mut source, _) =
        StateMachine::open(&src_db, src_dir.path(), Arc::new(DiscardEvents)).unwrap();
    source.apply(puts.clone()).await.unwrap();
    source
        .apply(vec![Entry {
            log_id: id(11),
            payload: EntryPayload::Blank,
        }])
        .await
        .unwrap();
    let newer = source
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();

    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let (mut sm, _) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    sm.apply(puts).await.unwrap();
    // A build starts at index 10 (revision 10); the install of index 11 (revision 10 too)
    // happens before it finishes.
    let mut builder = sm.get_snapshot_builder().await;
    sm.install_snapshot(&newer.meta, newer.snapshot)
        .await
        .unwrap();
    builder.build_snapshot().await.unwrap();
    let current = sm.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(
        current.meta.last_log_id,
        Some(id(11)),
        "the installed snapshot is kept"
    );
}

/// An applied group writes its event records before its intent: a crash among them leaves
/// records of a group that did not happen. The reopen removes them before the history is read,
/// and the group applied again from the log records the same history as it would have.
#[tokio::test]
async fn records_of_a_group_cut_before_its_intent_are_gone_after_a_reopen() {
    use leasecore::domain::command::Command;
    use leasecore::raft::mvcc_store;
    use openraft::storage::RaftStateMachine;

    // Each put is past half a record's budget: one record per revision.
    let big = "x".repeat(mvcc_store::EVENT_RECORD_BYTES * 2 / 3);
    let put = |k: &str, v: &str| Command::Put {
        key: k.into(),
        value: v.into(),
        lease: None,
        prev_revision: None,
    };
    let first = entries(1, vec![put("a", "1")]);
    let group = entries(2, (0..4).map(|i| put(&format!("big{i}"), &big)).collect());
    let records = |db: &sled::Db| {
        let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
        state
            .scan_prefix(leasecore::domain::mvcc::EVENT_PREFIX)
            .count()
    };

    let whole_dir = TempDir::new().unwrap();
    let whole = open_db(whole_dir.path(), 8 << 20).unwrap();
    let (mut sm, _) =
        StateMachine::open(&whole, whole_dir.path(), Arc::new(DiscardEvents)).unwrap();
    sm.apply(first.clone()).await.unwrap();
    sm.apply(group.clone()).await.unwrap();
    drop(sm);
    assert_eq!(records(&whole), 5, "one record per revision");

    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let (mut sm, _) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    sm.apply(first.clone()).await.unwrap();
    let before = history_keys(&db);
    sm.stop_writes_after(Some(2));
    assert!(sm.apply(group.clone()).await.is_err(), "cut");
    drop(sm);
    assert_eq!(
        records(&db),
        3,
        "two of the group's records made, then the crash"
    );
    let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    assert_eq!(view.applied().log_index, 1, "the group did not happen");
    assert_eq!(records(&db), 1, "its records are gone");
    assert_eq!(history_keys(&db), before);
    sm.apply(group).await.unwrap();
    drop(sm);
    assert_eq!(history_keys(&db), history_keys(&whole));
    assert_eq!(records(&db), 5);
}

/// Leases registered, attached to keys, revoked and registered again over several groups,
/// with the lease journal folded into the per-lease records at different sizes: a reopen
/// loads the leases that were applied, also after a crash anywhere in the last group (which
/// journals and folds): the group is then whole or not there, and applying it again ends as
/// the uncut run does.
#[tokio::test]
async fn journaled_leases_reopen_to_what_was_applied_after_a_crash_anywhere() {
    use leasecore::domain::command::Command;
    use openraft::storage::RaftStateMachine;

    let register = |name: &str| Command::RegisterLease {
        name: name.into(),
        ttl_ms: 5_000,
        clock_ms: Some(10),
    };
    let revoke = |name: &str| Command::RevokeLease { name: name.into() };
    let put = |k: &str, lease: &str| Command::Put {
        key: k.into(),
        value: "v".into(),
        lease: Some(lease.into()),
        prev_revision: None,
    };
    let g1 = entries(
        1,
        vec![register("a"), register("b"), register("c"), put("k1", "a")],
    );
    let g2 = entries(5, vec![register("d"), revoke("b"), put("k2", "c")]);
    let g3 = entries(
        8,
        vec![revoke("a"), register("f"), put("k3", "d"), register("b")],
    );
    let last = entries(
        12,
        vec![register("g"), revoke("e"), revoke("c"), put("k4", "g")],
    );
    let after = entries(16, vec![register("h"), put("k5", "b")]);

    type Leases = Vec<(String, leasecore::domain::kv::LeaseRecord)>;
    struct Run {
        cut: bool,
        before: Leases,
        reopened: Leases,
        reopened_index: u64,
        after: Leases,
        journal: usize,
        base: usize,
    }
    async fn run(
        fold_at: u64,
        stop_after: Option<usize>,
        groups: [&[leasecore::raft::Entry]; 5],
    ) -> Run {
        let dir = TempDir::new().unwrap();
        let db = open_db(dir.path(), 8 << 20).unwrap();
        let open = || {
            let (mut sm, view) =
                StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
            sm.fold_lease_journal_at(fold_at, u64::MAX);
            (sm, view)
        };
        let (mut sm, view) = open();
        for g in &groups[..3] {
            sm.apply(g.to_vec()).await.unwrap();
        }
        let before = view.leases().1;
        sm.stop_writes_after(stop_after);
        let cut = sm.apply(groups[3].to_vec()).await.is_err();
        drop((sm, view));
        let (mut sm, view) = open();
        let reopened = view.leases().1;
        let reopened_index = view.applied().log_index;
        if reopened_index == 11 {
            sm.apply(groups[3].to_vec()).await.unwrap();
        }
        sm.apply(groups[4].to_vec()).await.unwrap();
        let after = view.leases().1;
        drop((sm, view));
        let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
        Run {
            cut,
            before,
            reopened,
            reopened_index,
            after,
            journal: state.scan_prefix(b"j/").count(),
            base: state.scan_prefix(b"l/").count(),
        }
    }

    let groups = [&g1[..], &g2[..], &g3[..], &last[..], &after[..]];
    let whole = run(u64::MAX, None, groups).await;
    let names = |l: &Leases| {
        l.iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    assert_eq!(names(&whole.reopened), "b,d,f,g");
    assert_eq!(names(&whole.after), "b,d,f,g,h");
    assert_eq!(
        (whole.journal, whole.base),
        (5, 0),
        "never folded: a record per group, no lease record"
    );
    for fold_at in [0, 2, 5, u64::MAX] {
        let folded = run(fold_at, None, groups).await;
        assert_eq!(folded.reopened, whole.reopened, "fold at {fold_at}");
        assert_eq!(folded.after, whole.after, "fold at {fold_at}");
        if fold_at == 0 {
            assert_eq!(folded.journal, 1, "only the newest group's record is left");
            assert_eq!(folded.base, 4, "the other live leases are base records");
        }
        let mut not_happened = 0;
        for stop_after in 0.. {
            let r = run(fold_at, Some(stop_after), groups).await;
            if !r.cut {
                break;
            }
            assert_eq!(r.before, whole.before);
            if r.reopened_index == 11 {
                not_happened += 1;
                assert_eq!(
                    r.reopened, whole.before,
                    "fold at {fold_at}, cut at {stop_after}"
                );
            } else {
                assert_eq!(
                    r.reopened, whole.reopened,
                    "fold at {fold_at}, cut at {stop_after}"
                );
            }
            assert_eq!(
                r.after, whole.after,
                "fold at {fold_at}, cut at {stop_after}"
            );
        }
        assert!(
            not_happened >= 1,
            "no cut fell before the intent (fold at {fold_at})"
        );
    }
}

/// A lease's journal change is its whole record, attached keys included: a lease gaining a key
/// a group at a time journals all its keys again each time. The journal is folded by its bytes
/// too, so it stays near its limit, and a reopen loads the lease with every key.
#[tokio::test]
async fn the_lease_journal_stays_within_its_bytes() {
    use leasecore::domain::command::Command;
    use openraft::storage::RaftStateMachine;

    const LIMIT: u64 = 64 << 10;
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 8 << 20).unwrap();
    let (mut sm, _) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    sm.fold_lease_journal_at(u64::MAX, LIMIT);
    let register = Command::RegisterLease {
        name: "big".into(),
        ttl_ms: 5_000,
        clock_ms: Some(10),
    };
    sm.apply(entries(1, vec![register])).await.unwrap();
    let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
    let journal_bytes = || -> u64 {
        state
            .scan_prefix(b"j/")
            .map(|i| i.unwrap().1.len() as u64)
            .sum()
    };
    let mut largest = 0;
    for i in 0..400u64 {
        let put = Command::Put {
            key: format!("keys/of/the/big/lease/{i:06}"),
            value: "v".into(),
            lease: Some("big".into()),
            prev_revision: None,
        };
        sm.apply(entries(2 + i, vec![put])).await.unwrap();
        largest = largest.max(journal_bytes());
    }
    // Without the fold: 400 records of up to 400 keys, over 3 MB.
    assert!(largest <= LIMIT + (16 << 10), "journal of {largest} bytes");
    assert!(
        state.scan_prefix(b"l/").count() == 1,
        "folded into its record"
    );
    drop(sm);
    let (_sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    let leases = view.leases().1;
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].1.keys.len(), 400);
}
