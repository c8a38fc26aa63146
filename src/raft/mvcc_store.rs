//! The MVCC history in sled: writes it with the state, reads it at past revisions, replays it
//! to watches, and sweeps what compaction dropped. Layout and rules: [`crate::domain::mvcc`].
//!
//! # Invariants
//! - Everything is in the state tree, in the state machine's own batches: an applied entry's
//!   events are durable exactly when its state is, and a crash never leaves one without the
//!   other.
//! - The history is complete above the floor, `max(compact_revision, history_start)`; the
//!   state machine persists `history_start`, and a store without it (storage format 1, from
//!   before history) starts its history at its current state when opened. Format 2 keeps
//!   builds without history from writing to it since.
//! - The sweep runs inside `apply`, a bounded number of events per call, so it never stalls a
//!   write and never runs concurrently with a snapshot install (openraft serializes them).
//!   It only removes versions below the compaction mark that a newer version at or below the
//!   mark supersedes (or deletions): reads at the mark or later never see a difference.
//!
//! # What it must not do
//! Decide what is kept (the domain does) or answer a read below the floor (callers check it).

use std::ops::Bound;

use crate::domain::auth::KeyRange;
use crate::domain::command::Event;
use crate::domain::history::{Batch, KeyFilter};
use crate::domain::kv::Versioned;
use crate::domain::mvcc::{
    EVENT_PREFIX, base_event, event_key, events_from, index_end, index_from, index_key, keeps,
    key_versions, parse_event_key, parse_index_key, parse_sub, version_of,
};
use crate::domain::types::Revision;
use crate::storage::StorageError;

/// Where the history of this node begins (a snapshot, or a store from before history).
pub const KEY_HISTORY_START: &[u8] = b"m/history_start";
/// The event key the sweep resumes from (every event before it is swept).
pub const KEY_SWEPT: &[u8] = b"m/history_swept";
/// Events the sweep looks at per applied batch: a few sled reads each, so at most a couple
/// of milliseconds added to one apply, while still outpacing any write rate (a batch adds at
/// most as many events as it has entries' changes; the sweep removes up to this many).
pub const SWEEP_BUDGET: usize = 128;

fn corrupt(what: &str, detail: impl ToString) -> StorageError {
    StorageError::Corrupt {
        what: what.into(),
        detail: detail.to_string(),
    }
}

fn decode_event(bytes: &[u8]) -> Result<Event, StorageError> {
    serde_json::from_slice(bytes).map_err(|e| corrupt("history event", e))
}

/// Add the events of one applied batch (in log order) to `batch`. `sub` numbers the changes
/// of one revision; a revision never spans two applied batches (one request is one entry).
pub fn record(batch: &mut sled::Batch, events: &[Event]) -> Result<(), StorageError> {
    let mut sub = 0u32;
    let mut last = None;
    for e in events {
        if last != Some(e.revision) {
            sub = 0;
            last = Some(e.revision);
        }
        let bytes = serde_json::to_vec(e).map_err(|e| corrupt("history event", e))?;
        batch.insert(event_key(e.revision, sub), bytes);
        batch.insert(index_key(&e.key, e.revision), &sub.to_be_bytes());
        sub += 1;
    }
    Ok(())
}

/// Remove the whole history (in `batch`) and record every live key of `keys` as its base
/// version: the history of a state that arrived whole (a snapshot, or an older store).
pub fn restart<'a>(
    tree: &sled::Tree,
    batch: &mut sled::Batch,
    keys: impl Iterator<Item = (&'a String, &'a Versioned)>,
    revision: Revision,
) -> Result<(), StorageError> {
    for prefix in [EVENT_PREFIX, crate::domain::mvcc::INDEX_PREFIX] {
        for item in tree.scan_prefix(prefix) {
            batch.remove(item?.0);
        }
    }
    // Base versions in revision order, so that `record` numbers each revision's keys apart.
    let mut base: Vec<Event> = keys.map(|(k, v)| base_event(k, v)).collect();
    base.sort_by_key(|e| e.revision);
    record(batch, &base)?;
    batch.insert(KEY_HISTORY_START, &revision.0.to_be_bytes());
    batch.insert(KEY_SWEPT, events_from(Revision(0)));
    Ok(())
}

fn read_revision(tree: &sled::Tree, key: &[u8]) -> Result<Option<Revision>, StorageError> {
    tree.get(key)?
        .map(|v| {
            <[u8; 8]>::try_from(v.as_ref())
                .map(|b| Revision(u64::from_be_bytes(b)))
                .map_err(|_| corrupt("history mark", "not 8 bytes"))
        })
        .transpose()
}

/// Where this node's history begins (`None`: a store from before history was kept).
pub fn history_start(tree: &sled::Tree) -> Result<Option<Revision>, StorageError> {
    read_revision(tree, KEY_HISTORY_START)
}

/// The event at `(revision, sub)`.
fn event_at(tree: &sled::Tree, revision: Revision, sub: u32) -> Result<Event, StorageError> {
    let bytes = tree
        .get(event_key(revision, sub))?
        .ok_or_else(|| corrupt("history", format!("no event at {revision}/{sub}")))?;
    decode_event(&bytes)
}

/// The event an index entry points at.
fn indexed(tree: &sled::Tree, k: &[u8], v: &[u8]) -> Result<Event, StorageError> {
    let (_, revision) = parse_index_key(k).ok_or_else(|| corrupt("history index", "bad key"))?;
    let sub = parse_sub(v).ok_or_else(|| corrupt("history index", "bad value"))?;
    event_at(tree, revision, sub)
}

/// The live keys of `range` as they were at `revision` (at or above the floor), in key order.
pub fn range_at(
    tree: &sled::Tree,
    range: &KeyRange,
    revision: Revision,
) -> Result<Vec<(String, Versioned)>, StorageError> {
    let end = range.end.as_ref().map_or_else(index_end, |e| index_from(e));
    let start = index_from(&range.start);
    let mut out = Vec::new();
    // The newest version at or below `revision` of the key being scanned.
    let mut best: Option<(String, sled::IVec, sled::IVec)> = None;
    let mut flush = |best: Option<(String, sled::IVec, sled::IVec)>| -> Result<(), StorageError> {
        if let Some((key, k, v)) = best
            && let Some(version) = version_of(&indexed(tree, &k, &v)?)
        {
            out.push((key, version));
        }
        Ok(())
    };
    let mut current: Option<String> = None;
    for item in tree.range(start..end) {
        let (k, v) = item?;
        let (key, rev) = parse_index_key(&k).ok_or_else(|| corrupt("history index", "bad key"))?;
        if current.as_deref() != Some(key.as_str()) {
            flush(best.take())?;
            current = Some(key.clone());
        }
        if rev <= revision {
            best = Some((key, k, v));
        }
    }
    flush(best.take())?;
    Ok(out)
}

/// The version of `key` before the change at `revision` (`prev_kv`), if it was live.
pub fn version_before(
    tree: &sled::Tree,
    key: &str,
    revision: Revision,
) -> Result<Option<Versioned>, StorageError> {
    let from = key_versions(key);
    let to = index_key(key, revision);
    match tree.range(from..to).next_back() {
        Some(item) => {
            let (k, v) = item?;
            Ok(version_of(&indexed(tree, &k, &v)?))
        }
        None => Ok(None),
    }
}

/// Matching events with revision `>= from`, up to `through` (inclusive), at most `limit`
/// (a revision's events are never split). `from` must be above the floor.
pub fn events_since(
    tree: &sled::Tree,
    from: Revision,
    through: Revision,
    filter: &KeyFilter,
    limit: usize,
) -> Result<Batch, StorageError> {
    let mut events: Vec<Event> = Vec::new();
    let end = events_from(through.next());
    for item in tree.range(events_from(from)..end) {
        let (k, v) = item?;
        let (rev, _) = parse_event_key(&k).ok_or_else(|| corrupt("history", "bad key"))?;
        if events.len() >= limit && events.last().is_none_or(|l| l.revision != rev) {
            return Ok(Batch {
                events,
                through: Revision(rev.0 - 1),
            });
        }
        let e = decode_event(&v)?;
        if filter.matches(&e.key) {
            events.push(e);
        }
    }
    Ok(Batch { events, through })
}

/// One bounded step of the sweep towards `compact` (in `batch`): looks at up to `budget`
/// events below it from where the last step stopped. Returns whether anything is left.
pub fn sweep(
    tree: &sled::Tree,
    batch: &mut sled::Batch,
    compact: Revision,
    budget: usize,
) -> Result<bool, StorageError> {
    let resume = tree
        .get(KEY_SWEPT)?
        .map_or_else(|| events_from(Revision(0)), |v| v.to_vec());
    let end = events_from(compact);
    if resume >= end {
        return Ok(false);
    }
    let mut next = end.clone();
    for (seen, item) in tree.range(resume..end.clone()).enumerate() {
        let (k, v) = item?;
        if seen == budget {
            next = k.to_vec();
            break;
        }
        let (rev, sub) = parse_event_key(&k).ok_or_else(|| corrupt("history", "bad key"))?;
        let event = decode_event(&v)?;
        let this = index_key(&event.key, rev);
        if tree.get(&this)?.as_deref().and_then(parse_sub) != Some(sub) {
            // Not the version its index names (written twice in one request): unreachable.
            batch.remove(k);
            continue;
        }
        // Every older version of the key is superseded by this one, which is below the mark.
        for older in tree.range(key_versions(&event.key)..this.clone()) {
            let (ok, ov) = older?;
            let (_, orev) =
                parse_index_key(&ok).ok_or_else(|| corrupt("history index", "bad key"))?;
            if let Some(osub) = parse_sub(&ov) {
                batch.remove(event_key(orev, osub));
            }
            batch.remove(ok);
        }
        let newest = tree
            .range((
                Bound::Included(key_versions(&event.key)),
                Bound::Included(index_key(&event.key, compact)),
            ))
            .next_back()
            .transpose()?
            .and_then(|(k, _)| parse_index_key(&k))
            .map_or(rev, |(_, r)| r);
        if !keeps(&event, newest) {
            batch.remove(k);
            batch.remove(this);
        }
    }
    batch.insert(KEY_SWEPT, next.clone());
    Ok(next < end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::{Cause, EventKind};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

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
    fn history(ops: &[(u8, bool)]) -> (Vec<Event>, Vec<BTreeMap<String, Versioned>>) {
        let mut state: BTreeMap<String, Versioned> = BTreeMap::new();
        let mut events = Vec::new();
        let mut states = vec![state.clone()];
        for (i, (k, delete)) in ops.iter().enumerate() {
            let rev = Revision(i as u64 + 1);
            let key = format!("k{k}");
            if *delete {
                state.remove(&key);
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
                let v = match state.get(&key) {
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
                events.push(base_event(&key, &v));
                state.insert(key, v);
            }
            states.push(state.clone());
        }
        (events, states)
    }

    fn all() -> KeyRange {
        KeyRange {
            start: Vec::new(),
            end: Some(vec![0xFF]),
        }
    }

    fn live(s: &BTreeMap<String, Versioned>) -> Vec<(String, Versioned)> {
        s.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
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
        ) {
            let t = tree();
            let (events, states) = history(&ops);
            let mut b = sled::Batch::default();
            record(&mut b, &events).unwrap();
            t.apply_batch(b).unwrap();
            let top = Revision(ops.len() as u64);
            let mut marks: Vec<u64> = marks.iter().map(|m| (*m as u64).min(top.0)).collect();
            marks.sort();
            for c in marks {
                let c = Revision(c);
                loop {
                    let mut b = sled::Batch::default();
                    let more = sweep(&t, &mut b, c, budget).unwrap();
                    t.apply_batch(b).unwrap();
                    if !more { break; }
                }
                for r in c.0..=top.0 {
                    prop_assert_eq!(range_at(&t, &all(), Revision(r)).unwrap(), live(&states[r as usize]));
                }
                let replay = events_since(&t, c.next(), top, &KeyFilter::Prefix(String::new()), usize::MAX).unwrap();
                prop_assert_eq!(&replay.events[..], &events[c.0 as usize..]);
            }
            // Only what reads need is left: at most one version per key below the last mark.
            prop_assert!(t.scan_prefix(EVENT_PREFIX).count() <= events.len());
        }
    }

    #[test]
    fn prev_version_and_a_restarted_history() {
        let t = tree();
        let (events, states) = history(&[(1, false), (1, false), (2, false), (1, true)]);
        let mut b = sled::Batch::default();
        record(&mut b, &events).unwrap();
        t.apply_batch(b).unwrap();
        let prev = version_before(&t, "k1", Revision(2)).unwrap().unwrap();
        assert_eq!(prev.value, "v0");
        assert_eq!(version_before(&t, "k1", Revision(1)).unwrap(), None);
        // A snapshot's state replaces the history: reads at its revision still answer.
        let mut b = sled::Batch::default();
        restart(&t, &mut b, states[3].iter(), Revision(3)).unwrap();
        t.apply_batch(b).unwrap();
        assert_eq!(range_at(&t, &all(), Revision(3)).unwrap(), live(&states[3]));
        assert_eq!(history_start(&t).unwrap(), Some(Revision(3)));
    }
}
