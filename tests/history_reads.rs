//! Reads of the MVCC history at a past revision while the compaction sweep removes records.
//!
//! sled's iterators are not snapshots: a scan that read a key's older version just before the
//! sweep removed it, and reached the key's tombstone just after the sweep removed that too,
//! would answer the deleted key as live. A history read must never answer that: one that
//! overlapped a removal reads again (`raft::state_view::read_unswept`, whose retry is tested
//! deterministically there). The window is narrow (sled's iterator reads a leaf at a time, so
//! a key's records must straddle two leaves just as the sweep passes), so this test is a
//! guard of the whole path under real concurrency, not a reliable reproduction.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use leasecore::domain::auth::KeyRange;
use leasecore::domain::command::Command;
use leasecore::domain::types::Revision;
use leasecore::domain::watch_batch::BatchLimit;
use leasecore::raft::Entry;
use leasecore::raft::state_machine::{DiscardEvents, StateMachine};
use leasecore::storage::open_db;
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder};
use tempfile::TempDir;

fn entry(index: u64, cmd: Command) -> Entry {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(cmd.into()),
    }
}

fn put(key: String, value: &str) -> Command {
    Command::Put {
        key,
        value: value.into(),
        lease: None,
        prev_revision: None,
    }
}

/// Keys written a few times and deleted, compacted at their deletion: the sweep removes every
/// version and the tombstone of each, while a reader reads at the compaction mark, where none
/// of them is live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_read_never_sees_a_key_the_sweep_is_removing() {
    const KEYS: usize = 3_000;
    const WRITES: usize = 3;
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 64 << 20).unwrap();
    let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    let mut index = 0;
    let mut next = |cmd| {
        index += 1;
        entry(index, cmd)
    };
    let mut group = Vec::new();
    for w in 0..WRITES {
        for k in 0..KEYS {
            group.push(next(put(format!("k{k:05}"), &format!("v{w}"))));
        }
    }
    for k in 0..KEYS {
        group.push(next(Command::Delete {
            key: format!("k{k:05}"),
            prev_revision: None,
        }));
    }
    // One group per change: the sweep then takes a few keys per step, so many steps run
    // while the reader scans.
    for e in group {
        sm.apply(vec![e]).await.unwrap();
    }
    let mark = view.applied().revision;
    sm.apply(vec![next(Command::Compact { revision: mark })])
        .await
        .unwrap();
    // The sweep stops at the snapshot on disk.
    sm.get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();

    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (view, done) = (view.clone(), done.clone());
        std::thread::spawn(move || {
            let all = KeyRange {
                start: Vec::new(),
                end: Some(vec![0xFF]),
            };
            let mut reads = 0u64;
            while !done.load(Ordering::Acquire) {
                let (_, kvs) = view.range_at(&all, Some(mark)).expect("held at the mark");
                let live: Vec<_> = kvs.iter().filter(|(k, _)| k.starts_with('k')).collect();
                assert!(
                    live.is_empty(),
                    "read {reads} at {mark} answered deleted keys as live: {:?}",
                    &live[..live.len().min(3)]
                );
                reads += 1;
            }
            reads
        })
    };
    // Each applied entry sweeps a bounded step; enough of them sweep everything.
    let steps = (KEYS * (WRITES + 1)) / leasecore::raft::mvcc_store::SWEEP_BUDGET + 8;
    for i in 0..steps * 2 {
        if reader.is_finished() {
            break;
        }
        sm.apply(vec![next(put(format!("z{i}"), "filler"))])
            .await
            .unwrap();
    }
    done.store(true, Ordering::Release);
    let reads = reader.join().expect("the reader saw a deleted key");
    assert!(reads > 0);
    // Nothing of the deleted keys is left at or below the mark.
    let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
    let left = leasecore::raft::mvcc_store::History::open(state)
        .unwrap()
        .range_at(
            &KeyRange {
                start: b"k".to_vec(),
                end: Some(b"l".to_vec()),
            },
            Revision(u64::MAX),
        )
        .unwrap();
    assert!(left.is_empty());
}

/// Only a group whose sweep removes records announces removals: any other apply leaves history
/// reads alone (an announcement makes every overlapping history read run again).
#[tokio::test]
async fn only_a_sweeping_apply_announces_removals() {
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 16 << 20).unwrap();
    let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    let mut index = 0;
    let mut next = |cmd| {
        index += 1;
        entry(index, cmd)
    };
    for i in 0..20 {
        sm.apply(vec![next(put(format!("k{}", i % 3), "v"))])
            .await
            .unwrap();
    }
    assert_eq!(view.history_removals(), 0, "puts remove no history");
    let mark = view.applied().revision;
    sm.apply(vec![next(Command::Compact { revision: mark })])
        .await
        .unwrap();
    sm.get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();
    sm.apply(vec![next(put("z".into(), "v"))]).await.unwrap();
    let after_sweep = view.history_removals();
    assert!(after_sweep >= 2 && after_sweep % 2 == 0, "{after_sweep}");
    // Swept through the mark: later applies remove nothing more.
    for _ in 0..3 {
        sm.apply(vec![next(put("z".into(), "w"))]).await.unwrap();
    }
    assert_eq!(view.history_removals(), after_sweep);
}

/// A large applied group's events are kept in several event records of whole revisions, each
/// small enough for sled to keep inline (sled writes a larger item to a blob file it never
/// syncs), and read back whole.
#[tokio::test]
async fn a_large_group_is_recorded_in_records_sled_keeps_inline() {
    use leasecore::domain::history::{KeyFilter, OlderEvents, Resume};
    let dir = TempDir::new().unwrap();
    let db = open_db(dir.path(), 16 << 20).unwrap();
    let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    let value = "v".repeat(100 << 10);
    let group: Vec<Entry> = (1..=40)
        .map(|i| entry(i, put(format!("k{i:02}"), &value)))
        .collect();
    sm.apply(group).await.unwrap();
    sm.apply(vec![entry(41, put("z".into(), "small"))])
        .await
        .unwrap();
    let state = db.open_tree(leasecore::storage::TREE_STATE).unwrap();
    let records: Vec<usize> = state
        .scan_prefix(b"h/")
        .map(|r| r.unwrap().1.len())
        .collect();
    let inline = 2 * leasecore::raft::mvcc_store::EVENT_RECORD_BYTES;
    assert!(records.len() > 2, "{records:?}");
    assert!(
        records.iter().all(|len| *len <= inline),
        "{records:?} vs {inline}"
    );
    let everything = KeyFilter::Prefix(String::new());
    let events = view
        .since(
            Revision(1),
            Revision(40),
            &everything,
            BatchLimit::UNBOUNDED,
            Resume::AfterMark,
        )
        .unwrap();
    assert_eq!(events.events.len(), 40);
    db.flush().unwrap();
    let blobs = std::fs::read_dir(dir.path().join("blobs"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(blobs, 0, "sled wrote blob files (which it never syncs)");
    assert!(
        events
            .events
            .iter()
            .all(|e| e.value.as_deref() == Some(&value[..]))
    );
}

/// etcd's compaction at `R` keeps revision `R`: the sweep removes the event records below it
/// and keeps `R`'s, so an etcd watch ([`Resume::AtMark`]) from `R` is answered from the store
/// (also after a restart), while `/v1` ([`Resume::AfterMark`]) keeps its documented rule that
/// the mark itself counts as compacted. A store an older version swept through the mark (its
/// records at `R` removed, `m/sweep_limit` at `R`) answers an etcd watch from `R` `compacted`
/// rather than with a silent gap.
#[tokio::test]
async fn the_sweep_keeps_the_compaction_revision_for_etcd_watches() {
    use leasecore::domain::history::{Compacted, KeyFilter, OlderEvents, Resume};
    let dir = TempDir::new().unwrap();
    let everything = KeyFilter::Prefix(String::new());
    let mark = {
        let db = open_db(dir.path(), 16 << 20).unwrap();
        let (mut sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        let mut index = 0;
        let mut next = |cmd| {
            index += 1;
            entry(index, cmd)
        };
        for i in 0..10 {
            sm.apply(vec![next(put(format!("k{}", i % 3), &format!("v{i}")))])
                .await
                .unwrap();
        }
        let mark = view.applied().revision;
        sm.apply(vec![next(Command::Compact { revision: mark })])
            .await
            .unwrap();
        // The sweep stops at the snapshot on disk; the next applies sweep.
        sm.get_snapshot_builder()
            .await
            .build_snapshot()
            .await
            .unwrap();
        for _ in 0..3 {
            sm.apply(vec![next(put("z".into(), "w"))]).await.unwrap();
        }
        assert!(view.history_removals() > 0, "the sweep ran");
        db.flush().unwrap();
        mark
    };
    let state_tree = |db: &sled::Db| db.open_tree(leasecore::storage::TREE_STATE).unwrap();
    let recorded = |db: &sled::Db| -> Vec<Revision> {
        state_tree(db)
            .scan_prefix(leasecore::domain::mvcc::EVENT_PREFIX)
            .map(|r| leasecore::domain::mvcc::parse_event_key(&r.unwrap().0).unwrap())
            .collect()
    };
    // Opened again: what a restart serves from the store.
    {
        let db = open_db(dir.path(), 16 << 20).unwrap();
        let (_sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
        let records = recorded(&db);
        assert_eq!(
            records.first(),
            Some(&mark),
            "swept below the mark only: {records:?}"
        );
        assert_eq!(view.floor(Resume::AtMark), Revision(mark.0 - 1));
        assert_eq!(view.floor(Resume::AfterMark), mark);
        let top = view.applied().revision;
        let at = view
            .since(
                mark,
                top,
                &everything,
                BatchLimit::UNBOUNDED,
                Resume::AtMark,
            )
            .unwrap();
        assert_eq!(at.events.first().map(|e| e.revision), Some(mark));
        assert_eq!(at.events.first().map(|e| e.key.as_str()), Some("k0"));
        assert_eq!(
            view.since(
                Revision(mark.0 - 1),
                top,
                &everything,
                BatchLimit::events(10),
                Resume::AtMark
            ),
            Err(Compacted {
                compacted: Revision(mark.0 - 1)
            })
        );
        assert_eq!(
            view.since(
                mark,
                top,
                &everything,
                BatchLimit::events(10),
                Resume::AfterMark
            ),
            Err(Compacted { compacted: mark })
        );
        db.flush().unwrap();
    }
    // As an older version left it: swept through the mark.
    {
        let db = open_db(dir.path(), 16 << 20).unwrap();
        let state = state_tree(&db);
        state
            .remove(leasecore::domain::mvcc::event_key(mark))
            .unwrap();
        state
            .insert(
                leasecore::raft::mvcc_store::KEY_SWEEP_LIMIT,
                &mark.0.to_be_bytes(),
            )
            .unwrap();
        db.flush().unwrap();
    }
    let db = open_db(dir.path(), 16 << 20).unwrap();
    let (_sm, view) = StateMachine::open(&db, dir.path(), Arc::new(DiscardEvents)).unwrap();
    assert_eq!(view.floor(Resume::AtMark), mark);
    let top = view.applied().revision;
    assert_eq!(
        view.since(
            mark,
            top,
            &everything,
            BatchLimit::events(10),
            Resume::AtMark
        ),
        Err(Compacted { compacted: mark })
    );
}
