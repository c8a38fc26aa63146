//! The history against a model: reads at every revision through bounded sweeps and restarts,
//! a snapshot's load with the records after it, pages of live keys, and the cut of event
//! records.

use super::*;
use crate::domain::auth::KeyRange;
use crate::domain::command::{Cause, Event, EventKind};
use crate::domain::history::KeyFilter;
use crate::domain::kv::{KeyMap, StoredKey, Versioned};
use crate::domain::mvcc::{
    EVENT_PREFIX, INDEX_PREFIX, encode_events, encode_version_of, event_key, index_key,
    parse_event_key, parse_index_key,
};
use crate::domain::watch_batch::BatchLimit;
use proptest::prelude::*;

#[test]
fn the_sweep_budget_outpaces_what_a_batch_records() {
    assert_eq!(sweep_budget(0), SWEEP_BUDGET);
    assert_eq!(sweep_budget(10), SWEEP_BUDGET);
    for recorded in [64, 128, 1024, 128 * 1024] {
        assert!(sweep_budget(recorded) >= 2 * recorded);
    }
    assert_eq!(sweep_budget(usize::MAX), usize::MAX);
}

fn tree() -> sled::Tree {
    sled::Config::new()
        .temporary(true)
        .open()
        .unwrap()
        .open_tree("state")
        .unwrap()
}

/// A random history: `ops` of (key index, delete?) at consecutive revisions, with the
/// live state after each revision, as the state machine would produce it.
fn history(ops: &[(u8, bool)]) -> (Vec<Event>, Vec<KeyMap>) {
    let mut state = KeyMap::new();
    let mut events = Vec::new();
    let mut states = vec![state.clone()];
    for (i, (k, delete)) in ops.iter().enumerate() {
        let rev = Revision(i as u64 + 1);
        let key = format!("k{k}");
        if *delete {
            state.remove(key.as_str());
            events.push(Event {
                kind: EventKind::Delete,
                key,
                value: None,
                revision: rev,
                lease: None,
                cause: Cause::Client,
                create_revision: None,
                version: None,
            });
        } else {
            let v = match state.get(key.as_str()) {
                Some(old) => Versioned {
                    value: format!("v{i}"),
                    create_revision: old.create_revision,
                    mod_revision: rev,
                    version: old.version + 1,
                    lease: None,
                },
                None => Versioned {
                    value: format!("v{i}"),
                    create_revision: rev,
                    mod_revision: rev,
                    version: 1,
                    lease: None,
                },
            };
            events.push(Event {
                kind: EventKind::Put,
                key: key.clone(),
                value: Some(v.value.clone()),
                revision: rev,
                lease: None,
                cause: Cause::Client,
                create_revision: Some(v.create_revision),
                version: Some(v.version),
            });
            state.insert(key.into(), v);
        }
        states.push(state.clone());
    }
    (events, states)
}

/// Record `events` as applied batches of `chunk` requests each: event records of at most
/// `budget` bytes per batch (one per batch when the budget is large).
fn record_in_batches(h: &History, events: &[Event], chunk: usize, budget: usize) {
    for part in events.chunks(chunk) {
        let mut b = sled::Batch::default();
        let records = record(&mut b, part, budget);
        h.tree.apply_batch(b).unwrap();
        index_records(&mut h.index_mut(), &records, &[], |_| None);
    }
}

/// Sweep towards `compact` in steps of `budget` events until nothing is left.
fn sweep_all(h: &History, compact: Revision, budget: usize) {
    loop {
        let mut b = sled::Batch::default();
        let step = h.sweep(&mut b, compact, budget).unwrap();
        h.tree.apply_batch(b).unwrap();
        h.apply_folds(step.folds);
        if !step.more {
            break;
        }
    }
}

fn history_in(t: &sled::Tree) -> History {
    History::open(t.clone()).unwrap()
}

fn all() -> KeyRange {
    KeyRange {
        start: Vec::new(),
        end: Some(vec![0xFF]),
    }
}

fn live(s: &KeyMap) -> Vec<(String, Versioned)> {
    s.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Reads at every revision from the compaction mark on, and the events above it, are
    /// the same after any number of bounded sweeps as before.
    #[test]
    fn compaction_keeps_every_read_at_or_above_the_mark(
        ops in proptest::collection::vec((0u8..4, proptest::bool::weighted(0.3)), 1..40),
        marks in proptest::collection::vec(0usize..40, 1..4),
        budget in 1usize..6,
        chunk in 1usize..5,
        record_budget in prop_oneof![Just(usize::MAX), 60usize..200],
        format_5 in proptest::bool::ANY,
        untagged in proptest::bool::ANY,
    ) {
        let t = tree();
        let mut h = history_in(&t);
        let (events, states) = history(&ops);
        record_in_batches(&h, &events, chunk, record_budget);
        if format_5 {
            // A store of format 5 also holds a base version for every event; this build
            // opens it and reads, compacts and sweeps it the same.
            for e in &events {
                t.insert(index_key(&e.key, e.revision), encode_version_of(e)).unwrap();
            }
            h = history_in(&t);
        }
        if untagged {
            // Records without an offset table (as written before it had one) read the same.
            for item in t.scan_prefix(EVENT_PREFIX) {
                let (k, v) = item.unwrap();
                let n = u32::from_be_bytes(v[1..5].try_into().unwrap()) as usize;
                let mut old = v[1..5].to_vec();
                old.extend_from_slice(&v[5 + 4 * n..]);
                t.insert(k, old).unwrap();
            }
            h = history_in(&t);
        }
        prop_assert_eq!(h.load().unwrap(), states[ops.len()].clone());
        let top = Revision(ops.len() as u64);
        let mut marks: Vec<u64> = marks.iter().map(|m| (*m as u64).min(top.0)).collect();
        marks.sort();
        for &c in &marks {
            let c = Revision(c);
            sweep_all(&h, c, budget);
            // The index rebuilt from the tree (a restart) reads the same as the one kept.
            let reopened = history_in(&t);
            for r in c.0..=top.0 {
                prop_assert_eq!(h.range_at(&all(), Revision(r)).unwrap(), live(&states[r as usize]));
                prop_assert_eq!(reopened.range_at(&all(), Revision(r)).unwrap(), live(&states[r as usize]));
            }
            for r in c.0 + 1..=top.0 {
                for k in 0u8..4 {
                    let key = format!("k{k}");
                    let want = states[r as usize - 1].get(key.as_str()).cloned();
                    prop_assert_eq!(h.version_before(&key, Revision(r)).unwrap(), want);
                }
            }
            let replay = events_since(&t, c.next(), top, &KeyFilter::Prefix(String::new()), BatchLimit::UNBOUNDED).unwrap();
            prop_assert_eq!(&replay.events[..], &events[c.0 as usize..]);
        }
        // The state is untouched, and what reads need is all that is left below the last
        // mark: no event record wholly at or below it.
        prop_assert_eq!(h.load().unwrap(), states[ops.len()].clone());
        let last = *marks.last().unwrap();
        prop_assert!(t.scan_prefix(EVENT_PREFIX).all(|r| parse_event_key(&r.unwrap().0).unwrap().0 > last));
        // Base versions only for what compaction kept: at most one per key, none for
        // the changes whose records are still there.
        let mut bases: Vec<String> = t
            .scan_prefix(INDEX_PREFIX)
            .map(|r| parse_index_key(&r.unwrap().0).unwrap().0)
            .collect();
        let all_bases = bases.len();
        bases.dedup();
        prop_assert!(format_5 || bases.len() == all_bases, "two base versions of a key");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// A restart's load: the live keys of a snapshot at any revision at or above where the
    /// sweep went, with the records after it replayed, are the live keys of every version.
    #[test]
    fn a_snapshot_and_the_records_after_it_load_the_same_state(
        ops in proptest::collection::vec((0u8..5, proptest::bool::weighted(0.3)), 1..40),
        swept_to in 0usize..40,
        snapshot_at in 0usize..40,
        chunk in 1usize..5,
    ) {
        let t = tree();
        let h = history_in(&t);
        let (events, states) = history(&ops);
        record_in_batches(&h, &events, chunk, usize::MAX);
        let top = ops.len();
        let swept_to = swept_to.min(top);
        let snapshot_at = snapshot_at.clamp(swept_to, top);
        sweep_all(&h, Revision(swept_to as u64), 3);
        let (keys, replayed) = replay_onto(
            &t,
            states[snapshot_at].clone(),
            Revision(snapshot_at as u64),
            Revision(top as u64),
        ).unwrap();
        prop_assert_eq!(replayed, top - snapshot_at);
        prop_assert_eq!(&keys, &h.load().unwrap());
        prop_assert_eq!(&keys, &states[top]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Pages of the live keys at a revision, each after the last key of the one before,
    /// together are the range at that revision, whatever the page size.
    #[test]
    fn pages_of_live_keys_make_the_whole_range(
        ops in proptest::collection::vec((0u8..12, proptest::bool::weighted(0.3)), 1..60),
        at in 0usize..60,
        limit in 1usize..5,
        max_bytes in 1usize..40,
    ) {
        let t = tree();
        let h = history_in(&t);
        let (events, states) = history(&ops);
        record_in_batches(&h, &events, 3, 100);
        let at = at.min(ops.len());
        let mut after: Option<String> = None;
        let mut pages = Vec::new();
        for _ in 0..=states[at].len() + 1 {
            let (page, done) = h.range_page(after.as_deref(), Revision(at as u64), limit, max_bytes).unwrap();
            prop_assert!(page.len() <= limit);
            after = page.last().map(|(k, _)| k.clone()).or(after);
            pages.extend(page);
            if done { break; }
        }
        prop_assert_eq!(pages, live(&states[at]));
    }
}

#[test]
fn prev_version_and_a_restarted_history() {
    let t = tree();
    let h = history_in(&t);
    let (events, states) = history(&[(1, false), (1, false), (2, false), (1, true)]);
    record_in_batches(&h, &events, events.len(), usize::MAX);
    let prev = h.version_before("k1", Revision(2)).unwrap().unwrap();
    assert_eq!(prev.value, "v0");
    assert_eq!(h.version_before("k1", Revision(1)).unwrap(), None);
    // A snapshot's state replaces the history: reads at its revision still answer.
    let mut b = sled::Batch::default();
    restart(&t, &mut b, states[3].iter(), Revision(3)).unwrap();
    t.apply_batch(b).unwrap();
    *h.index_mut() = base_index(states[3].iter());
    assert_eq!(h.range_at(&all(), Revision(3)).unwrap(), live(&states[3]));
    assert_eq!(
        history_in(&t).range_at(&all(), Revision(3)).unwrap(),
        live(&states[3])
    );
    assert_eq!(history_start(&t).unwrap(), Some(Revision(3)));
}

fn event(revision: u64, value_len: usize) -> Event {
    Event {
        kind: EventKind::Put,
        key: format!("k{revision}"),
        value: Some("x".repeat(value_len)),
        revision: Revision(revision),
        lease: None,
        cause: Cause::Client,
        create_revision: Some(Revision(revision)),
        version: Some(1),
    }
}

proptest! {
    /// The parts are the events in order, each starts at a revision boundary, and each
    /// stays under the budget unless it is one revision alone.
    #[test]
    fn record_parts_cut_at_revisions_within_the_budget(
        sizes in proptest::collection::vec((0u64..3, 0usize..300), 0..60),
        budget in 100usize..1_000,
    ) {
        let mut revision = 0;
        let events: Vec<Event> = sizes
            .iter()
            .map(|(step, len)| {
                revision += step;
                event(revision, *len)
            })
            .collect();
        let parts = record_parts(&events, budget);
        let joined: Vec<Event> = parts.iter().flat_map(|p| p.iter().cloned()).collect();
        prop_assert_eq!(&joined, &events);
        for pair in parts.windows(2) {
            prop_assert!(pair[0].last().unwrap().revision < pair[1][0].revision);
        }
        for part in parts {
            prop_assert!(!part.is_empty());
            let bytes: usize = part.iter().map(|e| 64 + e.key.len() + e.value.as_ref().map_or(0, String::len)).sum();
            let one_revision = part.first().unwrap().revision == part.last().unwrap().revision;
            prop_assert!(bytes <= budget || one_revision, "{bytes} > {budget}");
        }
    }
}

/// A read admitted key by key stops at the first refusal (the keys after it are not handed
/// on, nor read beyond the page being read), and a read that admits everything is exactly
/// [`History::range_at`].
#[test]
fn an_admitted_read_stops_at_the_first_refusal() {
    let t = tree();
    let h = history_in(&t);
    let events: Vec<Event> = (1..=200).map(|r| event(r, 10_000)).collect();
    record_in_batches(&h, &events, 7, usize::MAX);
    let at = Revision(200);
    let everything = h
        .range_at_admitted(&all(), at, &mut |_, _| Ok::<_, Stop>(()))
        .unwrap();
    assert_eq!(everything, h.range_at(&all(), at).unwrap());
    assert_eq!(everything.len(), 200);
    let mut admitted = 0;
    let refused = h.range_at_admitted(&all(), at, &mut |_, v| {
        admitted += 1;
        if admitted > 30 {
            return Err(Stop::TooLarge);
        }
        v.value.clear();
        Ok(())
    });
    assert_eq!(refused, Err(Stop::TooLarge));
    assert_eq!(admitted, 31, "the read ended at the refusal");
}

#[derive(Debug, PartialEq)]
enum Stop {
    TooLarge,
    Storage(String),
}

impl From<StorageError> for Stop {
    fn from(e: StorageError) -> Self {
        Stop::Storage(e.to_string())
    }
}

/// A live key is held once: the key index keeps the state's own allocation of it, for the
/// keys it learns from applied records and for a restart's base versions. (It kept a copy of
/// every key, a second 100 MB for 100,000 keys of 1 KB.)
#[test]
fn the_key_index_shares_the_states_keys() {
    let (events, states) = history(&[(0, false), (1, false), (0, false), (1, true)]);
    let state = states.last().unwrap();
    let h = History::open(tree()).unwrap();
    let mut b = sled::Batch::default();
    let records = record(&mut b, &events, usize::MAX);
    index_records(&mut h.index_mut(), &records, &[], |k| {
        state.get_key_value(k).map(|(k, _)| k.clone())
    });
    let (live, _) = state.get_key_value("k0").unwrap();
    // The state's map, the index, and `live` here.
    assert_eq!(std::sync::Arc::strong_count(live), 3);
    // A restart's index (one base version per live key) shares them too.
    *h.index_mut() = base_index(state.iter());
    assert_eq!(std::sync::Arc::strong_count(live), 3);
    assert_eq!(h.index().keys(), 1);
}

/// The keys a group created are shared in the order of their puts, without a lookup each; a
/// list that does not match the group's creations is not trusted: those keys are looked up.
#[test]
fn created_keys_are_shared_without_a_lookup() {
    // k0 created, k1 created, k0 overwritten, k1 deleted, k1 created again.
    let (events, _) = history(&[(0, false), (1, false), (0, false), (1, true), (1, false)]);
    let index_with = |created: &[StoredKey]| {
        let h = History::open(tree()).unwrap();
        let mut b = sled::Batch::default();
        let records = record(&mut b, &events, usize::MAX);
        let looked_up = std::cell::RefCell::new(Vec::new());
        index_records(&mut h.index_mut(), &records, created, |k| {
            looked_up.borrow_mut().push(k.to_string());
            None
        });
        assert_eq!((h.index().keys(), h.index().versions()), (2, 5));
        (h, looked_up.into_inner())
    };
    let (k0, k1, k1_again): (StoredKey, StoredKey, StoredKey) =
        ("k0".into(), "k1".into(), "k1".into());
    let (held, looked_up) = index_with(&[k0.clone(), k1.clone(), k1_again.clone()]);
    assert!(looked_up.is_empty(), "{looked_up:?}");
    // The index holds k0's and k1's first allocation; k1 created again found k1 there.
    assert_eq!(std::sync::Arc::strong_count(&k0), 2);
    assert_eq!(std::sync::Arc::strong_count(&k1), 2);
    assert_eq!(std::sync::Arc::strong_count(&k1_again), 1);
    drop(held);
    let stranger: StoredKey = "zz".into();
    let (_held, looked_up) = index_with(&[stranger, k0.clone()]);
    assert_eq!(looked_up, ["k0", "k1", "k1"]);
    assert_eq!(std::sync::Arc::strong_count(&k0), 1);
}

/// Records above the store's revision (a group cut before its intent) go on open; those at
/// or below it, other keys and an older format's longer record keys stay.
#[test]
fn records_above_the_stored_revision_are_dropped() {
    let t = tree();
    for r in 1..=10 {
        t.insert(event_key(Revision(r)), encode_events(&[event(r, 4)]))
            .unwrap();
    }
    let mut legacy = event_key(Revision(9));
    legacy.extend_from_slice(&[0, 1]);
    t.insert(&legacy, &b"{}"[..]).unwrap();
    t.insert(b"m/revision", &b"6"[..]).unwrap();
    assert_eq!(drop_records_above(&t, Revision(6)).unwrap(), 4);
    let left: Vec<Revision> = t
        .scan_prefix(EVENT_PREFIX)
        .keys()
        .filter_map(|k| parse_event_key(&k.unwrap()))
        .collect();
    assert_eq!(left, (1..=6).map(Revision).collect::<Vec<_>>());
    assert!(t.contains_key(&legacy).unwrap());
    assert!(t.contains_key(b"m/revision").unwrap());
    assert_eq!(drop_records_above(&t, Revision(6)).unwrap(), 0);
    assert_eq!(drop_records_above(&t, Revision(u64::MAX)).unwrap(), 0);
    assert_eq!(drop_records_above(&t, Revision(0)).unwrap(), 6);
}
