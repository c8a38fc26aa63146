//! A node that installed a snapshot fills in the history before it from a peer
//! (`domain::history_fill`, `raft::history_fill`): afterwards it answers every read and watch
//! above the new floor as the peer does, also when the adoption is cut by a crash, and an
//! install meanwhile wins over the fill.

use std::sync::Arc;

use leasecore::domain::auth::KeyRange;
use leasecore::domain::command::Command;
use leasecore::domain::history::{KeyFilter, OlderEvents, Resume};
use leasecore::domain::history_fill::{FillPlan, PageAsk};
use leasecore::domain::types::Revision;
use leasecore::domain::watch_batch::BatchLimit;
use leasecore::raft::Entry;
use leasecore::raft::history_fill::{FillError, FillStore};
use leasecore::raft::state_machine::{DiscardEvents, StateMachine, StateView};
use leasecore::storage::open_db;
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId, RaftSnapshotBuilder};
use tempfile::TempDir;

fn entries(first: u64, cmds: Vec<Command>) -> Vec<Entry> {
    cmds.into_iter()
        .enumerate()
        .map(|(i, cmd)| Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), first + i as u64),
            payload: EntryPayload::Normal(cmd.into()),
        })
        .collect()
}

/// Puts and deletes over a few keys, `n` commands, deterministic.
fn churn(seed: u64, n: usize) -> Vec<Command> {
    let mut x = seed;
    (0..n)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let key = format!("k{}", (x >> 33) % 12);
            if (x >> 20).is_multiple_of(4) {
                Command::Delete {
                    key,
                    prev_revision: None,
                }
            } else {
                Command::Put {
                    key,
                    value: format!("v{seed}-{i}"),
                    lease: None,
                    prev_revision: None,
                }
            }
        })
        .collect()
}

fn all() -> KeyRange {
    KeyRange {
        start: Vec::new(),
        end: None,
    }
}

/// Drive a fill from `source` with pages of `page` items (no network).
fn fill_from(source: &StateView, fill: &FillStore, page: usize) -> Result<FillPlan, FillError> {
    let mut plan = FillPlan::choose(fill.local(), &[(1, source.reach())]).expect("a gap to fill");
    let epoch = fill.begin()?;
    while let Some(ask) = plan.ask() {
        match ask {
            PageAsk::Keys {
                revision, after, ..
            } => {
                let answer = source.keys_page(revision, after.as_deref(), page).unwrap();
                let keys = plan.on_keys(answer).expect("a good page");
                fill.stage_keys(epoch, &keys)?;
            }
            PageAsk::Events { from, through, .. } => {
                let answer = source.events_page(from, through, page).unwrap();
                let events = plan.on_events(answer).expect("a good page");
                fill.stage_events(epoch, &events)?;
            }
        }
    }
    fill.adopt(epoch, plan.floor, plan.start)?;
    Ok(plan)
}

/// Reads at every revision from `floor` and the events after it are the same on both.
fn assert_same_history(a: &StateView, b: &StateView, floor: Revision) {
    let top = a.applied().revision;
    assert_eq!(b.applied().revision, top);
    assert_eq!(b.history_floor(), floor);
    for r in floor.0..=top.0 {
        let at = Some(Revision(r));
        assert_eq!(
            a.range_at(&all(), at).unwrap().1,
            b.range_at(&all(), at).unwrap().1,
            "range at {r}"
        );
    }
    let everything = KeyFilter::Prefix(String::new());
    let events = |v: &StateView| {
        v.since(
            floor.next(),
            top,
            &everything,
            BatchLimit::UNBOUNDED,
            Resume::AfterMark,
        )
        .unwrap()
    };
    assert_eq!(events(a), events(b));
    assert!(!events(a).events.is_empty());
}

struct Pair {
    _dirs: (TempDir, TempDir),
    source: (StateMachine, StateView),
    follower_db: sled::Db,
    follower_dir: std::path::PathBuf,
    follower: (StateMachine, StateView),
    next_index: u64,
}

/// A source with history from a compaction at 20 up to 80, whose snapshot at 80 the
/// follower installs; then both apply 40 more commands.
async fn installed_pair() -> Pair {
    let dirs = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let db = open_db(dirs.0.path(), 16 << 20).unwrap();
    let mut source = StateMachine::open(&db, dirs.0.path(), Arc::new(DiscardEvents)).unwrap();
    source.0.apply(entries(1, churn(1, 30))).await.unwrap();
    source
        .0
        .apply(entries(
            31,
            vec![Command::Compact {
                revision: Revision(20),
            }],
        ))
        .await
        .unwrap();
    source.0.apply(entries(32, churn(2, 50))).await.unwrap();
    let snapshot = source
        .0
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();
    let follower_db = open_db(dirs.1.path(), 16 << 20).unwrap();
    let mut follower =
        StateMachine::open(&follower_db, dirs.1.path(), Arc::new(DiscardEvents)).unwrap();
    follower
        .0
        .install_snapshot(&snapshot.meta, snapshot.snapshot)
        .await
        .unwrap();
    let after = entries(82, churn(3, 40));
    source.0.apply(after.clone()).await.unwrap();
    follower.0.apply(after).await.unwrap();
    Pair {
        follower_dir: dirs.1.path().to_path_buf(),
        _dirs: dirs,
        source,
        follower_db,
        follower,
        next_index: 122,
    }
}

#[tokio::test]
async fn a_filled_follower_answers_the_history_as_its_source() {
    let pair = installed_pair().await;
    let (source, follower) = (&pair.source.1, &pair.follower.1);
    let start = follower.history_floor();
    assert!(start > Revision(20), "the install cut the history");
    assert!(follower.range_at(&all(), Some(Revision(25))).is_err());
    let plan = fill_from(source, &pair.follower.0.fill_store(), 3).unwrap();
    assert_eq!(plan.floor, Revision(20));
    assert_same_history(source, follower, Revision(20));
    // Nothing more to fill.
    assert_eq!(
        FillPlan::choose(pair.follower.0.fill_store().local(), &[(1, source.reach())]),
        None
    );
}

#[tokio::test]
async fn an_adoption_cut_anywhere_finishes_when_the_node_opens() {
    let mut cuts = 0;
    for stop_after in [0, 1, 3, 5, 9, 1_000_000] {
        let Pair {
            _dirs,
            source,
            follower_db,
            follower_dir,
            follower,
            next_index,
        } = installed_pair().await;
        let mut fill = follower.0.fill_store();
        fill.stop_after(Some(stop_after));
        let start = follower.1.history_floor();
        let cut = fill_from(&source.1, &fill, 4).is_err();
        cuts += cut as usize;
        if cut {
            // Midway, reads from the old start on answer as before (a deleted key's older
            // versions never show before its tombstone).
            assert_eq!(follower.1.history_floor(), start);
            for r in start.0..=source.1.applied().revision.0 {
                let at = Some(Revision(r));
                assert_eq!(
                    source.1.range_at(&all(), at).unwrap().1,
                    follower.1.range_at(&all(), at).unwrap().1,
                    "range at {r} after a cut at {stop_after}"
                );
            }
        }
        drop(follower);
        let mut reopened =
            StateMachine::open(&follower_db, &follower_dir, Arc::new(DiscardEvents)).unwrap();
        assert_same_history(&source.1, &reopened.1, Revision(20));
        // And it goes on as a store that was never cut (the sweep included).
        let more = entries(
            next_index,
            vec![Command::Compact {
                revision: Revision(60),
            }],
        )
        .into_iter()
        .chain(entries(next_index + 1, churn(4, 20)))
        .collect::<Vec<_>>();
        let mut source = source;
        source.0.apply(more.clone()).await.unwrap();
        reopened.0.apply(more).await.unwrap();
        assert_same_history(&source.1, &reopened.1, Revision(60));
    }
    assert_eq!(cuts, 5, "every cut but the last one stopped the adoption");
}

#[tokio::test]
async fn an_install_during_a_fill_wins() {
    let mut pair = installed_pair().await;
    let fill = pair.follower.0.fill_store();
    let source = &pair.source.1;
    let mut plan = FillPlan::choose(fill.local(), &[(1, source.reach())]).unwrap();
    let epoch = fill.begin().unwrap();
    let Some(PageAsk::Keys { revision, .. }) = plan.ask() else {
        panic!("keys first")
    };
    let keys = plan
        .on_keys(source.keys_page(revision, None, 2).unwrap())
        .unwrap();
    fill.stage_keys(epoch, &keys).unwrap();
    // The source moves on, and the follower installs its newer snapshot.
    pair.source
        .0
        .apply(entries(pair.next_index, churn(5, 10)))
        .await
        .unwrap();
    let snapshot = pair
        .source
        .0
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();
    pair.follower
        .0
        .install_snapshot(&snapshot.meta, snapshot.snapshot)
        .await
        .unwrap();
    assert!(matches!(
        fill.stage_keys(epoch, &keys),
        Err(FillError::Superseded)
    ));
    assert!(matches!(
        fill.adopt(epoch, plan.floor, plan.start),
        Err(FillError::Superseded)
    ));
    let installed_at = pair.source.1.applied().revision;
    assert_eq!(pair.follower.1.history_floor(), installed_at);
    // A fill from the new start works.
    fill_from(&pair.source.1, &fill, 5).unwrap();
    assert_same_history(&pair.source.1, &pair.follower.1, Revision(20));
}

/// A source whose history does not lead to this node's state (a bug, a hostile peer) is
/// refused before anything is adopted.
#[tokio::test]
async fn a_history_that_disagrees_with_the_state_is_not_adopted() {
    let pair = installed_pair().await;
    let fill = pair.follower.0.fill_store();
    let source = &pair.source.1;
    let mut plan = FillPlan::choose(fill.local(), &[(1, source.reach())]).unwrap();
    let epoch = fill.begin().unwrap();
    while let Some(ask) = plan.ask() {
        match ask {
            PageAsk::Keys {
                revision, after, ..
            } => {
                let mut keys = plan
                    .on_keys(source.keys_page(revision, after.as_deref(), 100).unwrap())
                    .unwrap();
                // A key that never existed, as if it were live at the floor.
                if let Some((_, v)) = keys.first().cloned() {
                    keys.push(("zz-invented".into(), v));
                }
                fill.stage_keys(epoch, &keys).unwrap();
            }
            PageAsk::Events { from, through, .. } => {
                let events = plan
                    .on_events(source.events_page(from, through, 100).unwrap())
                    .unwrap();
                fill.stage_events(epoch, &events).unwrap();
            }
        }
    }
    let start = pair.follower.1.history_floor();
    let refused = fill.adopt(epoch, plan.floor, plan.start).unwrap_err();
    assert!(matches!(refused, FillError::Mismatch { .. }), "{refused}");
    assert_eq!(pair.follower.1.history_floor(), start, "nothing adopted");
    // A proper fill afterwards succeeds.
    fill_from(source, &fill, 7).unwrap();
    assert_same_history(source, &pair.follower.1, Revision(20));
}

/// An adoption that fails midway (a storage error, not a crash) keeps the sweep frozen and
/// its marker; the driver's next round (`resume`, also `begin`) finishes it from what was
/// staged.
#[tokio::test]
async fn the_next_fill_finishes_an_adoption_that_failed_midway() {
    let mut pair = installed_pair().await;
    let mut fill = pair.follower.0.fill_store();
    fill.stop_after(Some(7));
    assert!(fill_from(&pair.source.1, &fill, 5).is_err());
    assert!(
        pair.follower.1.history_floor() > Revision(20),
        "not adopted yet"
    );
    fill.stop_after(None);
    // The driver resumes it first thing, whether or not another fill is needed.
    assert!(fill.resume().unwrap());
    assert_same_history(&pair.source.1, &pair.follower.1, Revision(20));
    assert!(!fill.resume().unwrap());
    // Nothing is left to do, and the sweep runs again: a compaction is swept as usual.
    assert!(fill.begin().is_ok());
    assert_eq!(
        FillPlan::choose(fill.local(), &[(1, pair.source.1.reach())]),
        None
    );
    let removals = pair.follower.1.history_removals();
    let more: Vec<Entry> = entries(
        pair.next_index,
        vec![Command::Compact {
            revision: Revision(60),
        }],
    )
    .into_iter()
    .chain(entries(pair.next_index + 1, churn(6, 10)))
    .collect();
    pair.source.0.apply(more.clone()).await.unwrap();
    pair.follower.0.apply(more).await.unwrap();
    assert!(
        pair.follower.1.history_removals() > removals,
        "the sweep ran"
    );
    assert_same_history(&pair.source.1, &pair.follower.1, Revision(60));
}
