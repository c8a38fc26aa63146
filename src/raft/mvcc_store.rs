//! The MVCC history in sled: writes it with the state (the versions by key ARE the key-value
//! state), loads the current state from it, reads it at past revisions, replays it to watches,
//! and sweeps what compaction dropped. Layout, encoding and rules: [`crate::domain::mvcc`].
//!
//! # Invariants
//! - Everything is in the state tree, written with the rest of an applied group's state
//!   ([`super::state_writes`]): an applied entry's versions and events are durable exactly
//!   when the rest of its state is, and a crash never leaves one without the other.
//! - The history is complete above the floor, `max(compact_revision, history_start)`; the
//!   state machine persists `history_start`. A store of format 2 (values under `k/` beside
//!   the history) is converted when opened; its history starts again at its current state.
//! - The sweep runs inside `apply`, a bounded number of events per call, so it never stalls a
//!   write and never runs concurrently with a snapshot install (openraft serializes them).
//!   It only removes versions at or below the compaction mark that a newer version at or
//!   below the mark supersedes (or tombstones), and event records wholly at or below it:
//!   reads at the mark or later, and watches from after it, never see a difference.
//!
//! # What it must not do
//! Decide what is kept (the domain does) or answer a read below the floor (callers check it).

use std::collections::HashSet;
use std::ops::Bound;

use super::state_writes::Writes;
use crate::domain::auth::KeyRange;
use crate::domain::command::Event;
use crate::domain::history::{Batch, KeyFilter};
use crate::domain::kv::{KeyMap, Versioned};
use crate::domain::mvcc::{
    EVENT_PREFIX, INDEX_PREFIX, LEGACY_PREFIXES, Malformed, decode_events, decode_version,
    dropped_by_compaction, encode_events, encode_version, encode_version_of, event_key,
    events_from, index_end, index_from, index_key, is_tombstone, key_versions, parse_event_key,
    parse_index_key,
};
use crate::domain::types::Revision;
use crate::storage::StorageError;

/// Where the history of this node begins (a snapshot, or a store from before history).
pub const KEY_HISTORY_START: &[u8] = b"m/history_start";
/// Format 2's sweep position: removed when such a store is converted.
const LEGACY_KEY_SWEPT: &[u8] = b"m/history_swept";
/// The highest revision through which the sweep has been allowed to remove event records
/// (absent in a store from before it was kept: the compaction mark bounds it there). The sweep
/// stops at the snapshot on disk, so the records after a snapshot survive until the next
/// one: a restart loads the snapshot and replays them ([`replay_onto`]) instead of reading
/// every version.
pub const KEY_SWEEP_LIMIT: &[u8] = b"m/sweep_limit";
/// The bytes of keys and values after which an applied group's events go on in another
/// event record (cut at a revision's end). sled 0.34 writes an item past a quarter of its
/// segment (2 MiB) to a blob file it never syncs, and it logs a whole leaf node (up to about
/// 17 neighbouring records) at once: records this small keep such a node of event records
/// under that size.
pub const EVENT_RECORD_BYTES: usize = 96 << 10;
/// Events the sweep looks at per applied batch, at least: a few sled reads each, so at most
/// a couple of milliseconds added to a small apply.
pub const SWEEP_BUDGET: usize = 128;

/// Events the sweep looks at after an applied batch that recorded `recorded` events: twice
/// as many (and at least [`SWEEP_BUDGET`]), so that the sweep outpaces any write rate. A fixed
/// budget fell behind for good under group commit: one applied batch of a loaded leader
/// carries up to 1,024 commands, and 128-put transactions each record 128 events, so a
/// compaction of 10M versions would never have been swept while writes went on.
pub fn sweep_budget(recorded: usize) -> usize {
    recorded.saturating_mul(2).max(SWEEP_BUDGET)
}

fn corrupt(what: &str, detail: impl ToString) -> StorageError {
    StorageError::Corrupt {
        what: what.into(),
        detail: detail.to_string(),
    }
}

fn malformed(what: &'static str) -> impl Fn(Malformed) -> StorageError {
    move |e| corrupt(what, e)
}

/// Add the events of one applied batch (in log order) to `batch`: a version per change, and
/// event records of whole revisions, each under `record_budget` bytes of keys and values
/// unless one revision alone is larger ([`record_parts`]). sled writes an item past a
/// quarter of its segment to a blob file it never syncs, which a power failure could lose
/// under a durable applied mark; records under the budget stay inline.
pub fn record(batch: &mut impl Writes, events: &[Event], record_budget: usize) {
    for e in events {
        batch.insert(index_key(&e.key, e.revision), encode_version_of(e));
    }
    for part in record_parts(events, record_budget) {
        if let Some(last) = part.last() {
            batch.insert(event_key(last.revision), encode_events(part));
        }
    }
}

/// `events` cut into runs of whole revisions whose keys and values stay under `budget` bytes
/// (a revision larger than that alone is one run).
pub fn record_parts(events: &[Event], budget: usize) -> Vec<&[Event]> {
    let size = |e: &Event| 64 + e.key.len() + e.value.as_ref().map_or(0, String::len);
    let mut parts = Vec::new();
    // The current part starts at `start` and holds `bytes`; whole revisions join it.
    let (mut start, mut bytes) = (0usize, 0usize);
    let mut i = 0;
    while i < events.len() {
        let revision = events[i].revision;
        let end = i + events[i..]
            .iter()
            .take_while(|e| e.revision == revision)
            .count();
        let group: usize = events[i..end].iter().map(size).sum();
        if i > start && bytes + group > budget {
            parts.push(&events[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += group;
        i = end;
    }
    if start < events.len() {
        parts.push(&events[start..]);
    }
    parts
}

/// Remove the whole history (in `batch`) and record every live key of `keys` as its base
/// version: the state of a store that arrived whole (a snapshot, a restore, a store of an
/// older format).
pub fn restart<'a>(
    tree: &sled::Tree,
    batch: &mut impl Writes,
    keys: impl Iterator<Item = (&'a String, &'a Versioned)>,
    revision: Revision,
) -> Result<(), StorageError> {
    for prefix in [EVENT_PREFIX, INDEX_PREFIX]
        .into_iter()
        .chain(LEGACY_PREFIXES)
    {
        for item in tree.scan_prefix(prefix) {
            batch.remove(item?.0);
        }
    }
    for (key, v) in keys {
        batch.insert(index_key(key, v.mod_revision), encode_version(Some(v)));
    }
    batch.insert(KEY_HISTORY_START, &revision.0.to_be_bytes());
    // A fill being adopted filled the history that is gone now: it must not be finished.
    batch.remove(super::history_fill::KEY_FILL_MOVE);
    // Every record at or below `revision` is gone with the rest of the history.
    batch.insert(KEY_SWEEP_LIMIT, &revision.0.to_be_bytes());
    batch.remove(LEGACY_KEY_SWEPT);
    Ok(())
}

/// The live keys at `through`: `base`, the live keys at `base_revision` (a snapshot's),
/// with the changes of the event records after it. The caller has checked that those
/// records are all there: `base_revision` is at or above the history's start and the sweep
/// limit.
pub fn replay_onto(
    tree: &sled::Tree,
    mut base: KeyMap,
    base_revision: Revision,
    through: Revision,
) -> Result<(KeyMap, usize), StorageError> {
    if through <= base_revision {
        return Ok((base, 0));
    }
    let everything = KeyFilter::Prefix(String::new());
    let batch = events_since(
        tree,
        Revision(base_revision.0 + 1),
        through,
        &everything,
        usize::MAX,
    )?;
    let replayed = batch.events.len();
    for e in batch.events {
        // Through the version encoding, so that the result is exactly what a read of the
        // versions gives.
        match decode_version(e.revision, &encode_version_of(&e)).map_err(malformed("event"))? {
            Some(version) => base.insert(e.key, version),
            None => base.remove(&e.key),
        };
    }
    Ok((base, replayed))
}

/// The live keys as the versions say (the newest version of each key, unless a tombstone):
/// the whole range at the highest revision.
pub fn load(tree: &sled::Tree) -> Result<KeyMap, StorageError> {
    let everything = KeyRange {
        start: Vec::new(),
        end: None,
    };
    Ok(range_at(tree, &everything, Revision(u64::MAX))?
        .into_iter()
        .collect())
}

/// Whether the tree holds a store of format 2 (values under `k/`, an index under `i/`).
pub fn is_legacy(tree: &sled::Tree) -> Result<bool, StorageError> {
    for prefix in LEGACY_PREFIXES {
        if tree.scan_prefix(prefix).next().transpose()?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
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

/// The persisted sweep limit ([`KEY_SWEEP_LIMIT`]), if this store keeps one.
pub fn sweep_limit(tree: &sled::Tree) -> Result<Option<Revision>, StorageError> {
    read_revision(tree, KEY_SWEEP_LIMIT)
}

/// The live keys of `range` as they were at `revision` (at or above the floor), in key order.
pub fn range_at(
    tree: &sled::Tree,
    range: &KeyRange,
    revision: Revision,
) -> Result<Vec<(String, Versioned)>, StorageError> {
    let end = range.end.as_ref().map_or_else(index_end, |e| index_from(e));
    let start = index_from(&range.start);
    LiveKeys::new(
        tree,
        (Bound::Included(start), Bound::Excluded(end)),
        revision,
    )
    .collect()
}

/// Every live key at `revision`, in key order, read as it is consumed (memory: one key's
/// versions at a time).
pub fn live_keys(tree: &sled::Tree, revision: Revision) -> LiveKeys {
    let bounds = (
        Bound::Included(INDEX_PREFIX.to_vec()),
        Bound::Excluded(index_end()),
    );
    LiveKeys::new(tree, bounds, revision)
}

/// A page of the live keys at `revision`, in key order: those after `after` (from the first
/// key when `None`), at most `limit` of them, ended early once their keys and values pass
/// `max_bytes`. `true` with it: no live key comes after the page.
pub fn range_page(
    tree: &sled::Tree,
    after: Option<&str>,
    revision: Revision,
    limit: usize,
    max_bytes: usize,
) -> Result<(Vec<(String, Versioned)>, bool), StorageError> {
    let start = match after {
        // Past every version of `after` (its own revisions sort below this).
        Some(key) => Bound::Excluded(index_key(key, Revision(u64::MAX))),
        None => Bound::Included(INDEX_PREFIX.to_vec()),
    };
    let mut page = Vec::new();
    let mut bytes = 0usize;
    for item in LiveKeys::new(tree, (start, Bound::Excluded(index_end())), revision) {
        let (k, v) = item?;
        bytes = bytes.saturating_add(k.len() + v.value.len());
        page.push((k, v));
        if page.len() >= limit || bytes >= max_bytes {
            return Ok((page, false));
        }
    }
    Ok((page, true))
}

/// The live keys at a revision among the versions in a range of the tree, in key order: for
/// each key, its newest version at or below the revision, unless that is a tombstone.
pub struct LiveKeys {
    versions: sled::Iter,
    revision: Revision,
    /// The key being scanned, and its newest version at or below the revision so far.
    current: Option<String>,
    best: Option<(String, Revision, sled::IVec)>,
    done: bool,
}

impl LiveKeys {
    fn new(
        tree: &sled::Tree,
        bounds: (Bound<Vec<u8>>, Bound<Vec<u8>>),
        revision: Revision,
    ) -> Self {
        LiveKeys {
            versions: tree.range(bounds),
            revision,
            current: None,
            best: None,
            done: false,
        }
    }

    fn fail(&mut self, e: StorageError) -> Option<Result<(String, Versioned), StorageError>> {
        self.done = true;
        Some(Err(e))
    }
}

/// A key's newest version, if it is live.
fn live(
    (key, rev, bytes): (String, Revision, sled::IVec),
) -> Option<Result<(String, Versioned), StorageError>> {
    match decode_version(rev, &bytes) {
        Ok(version) => version.map(|v| Ok((key, v))),
        Err(e) => Some(Err(malformed("version")(e))),
    }
}

impl Iterator for LiveKeys {
    type Item = Result<(String, Versioned), StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let Some(item) = self.versions.next() else {
                self.done = true;
                return self.best.take().and_then(live);
            };
            let (k, v) = match item {
                Ok(kv) => kv,
                Err(e) => return self.fail(e.into()),
            };
            let Some((key, rev)) = parse_index_key(&k) else {
                return self.fail(corrupt("version", "bad key"));
            };
            // A new key: the one before it is complete.
            let finished = if self.current.as_deref() != Some(key.as_str()) {
                self.current = Some(key.clone());
                self.best.take()
            } else {
                None
            };
            if rev <= self.revision {
                self.best = Some((key, rev, v));
            }
            if let Some(out) = finished.and_then(live) {
                return Some(out);
            }
        }
        None
    }
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
            let (_, rev) = parse_index_key(&k).ok_or_else(|| corrupt("version", "bad key"))?;
            decode_version(rev, &v).map_err(malformed("version"))
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
    events_page(tree, from, through, filter, limit, usize::MAX)
}

/// [`events_since`], also ended (at a revision's end) once the keys and values taken pass
/// `max_bytes`.
pub fn events_page(
    tree: &sled::Tree,
    from: Revision,
    through: Revision,
    filter: &KeyFilter,
    limit: usize,
    max_bytes: usize,
) -> Result<Batch, StorageError> {
    let mut events: Vec<Event> = Vec::new();
    let mut bytes = 0usize;
    for item in tree.range(events_from(from)..) {
        let (k, v) = item?;
        if parse_event_key(&k).is_none() {
            break; // past the event records
        }
        for e in decode_events(&v).map_err(malformed("history event"))? {
            if e.revision < from {
                continue;
            }
            if e.revision > through {
                return Ok(Batch { events, through });
            }
            let full = events.len() >= limit || bytes >= max_bytes;
            if full && events.last().is_none_or(|l| l.revision != e.revision) {
                return Ok(Batch {
                    events,
                    through: Revision(e.revision.0 - 1),
                });
            }
            if filter.matches(&e.key) {
                bytes = bytes.saturating_add(e.key.len() + e.value.as_ref().map_or(0, String::len));
                events.push(e);
            }
        }
    }
    Ok(Batch { events, through })
}

/// One bounded step of the sweep towards `compact` (in `batch`): takes the event records
/// wholly at or below it, oldest first, until `budget` events are looked at; for each key
/// they name, drops the versions at or below the mark that compaction does not keep; then
/// drops the records. Returns whether anything is left.
pub fn sweep(
    tree: &sled::Tree,
    batch: &mut impl Writes,
    compact: Revision,
    budget: usize,
) -> Result<bool, StorageError> {
    let mut seen = 0;
    // Keys already swept in this step (the batch's removals are not visible to reads yet).
    let mut swept: HashSet<String> = HashSet::new();
    for item in tree.range(EVENT_PREFIX.to_vec()..=event_key(compact)) {
        let (k, v) = item?;
        if seen >= budget {
            return Ok(true);
        }
        let events = decode_events(&v).map_err(malformed("history event"))?;
        seen += events.len().max(1);
        for e in events {
            if !swept.insert(e.key.clone()) {
                continue;
            }
            let mut versions = Vec::new();
            let mut tombstones = Vec::new();
            for version in tree.range(key_versions(&e.key)..=index_key(&e.key, compact)) {
                let (vk, vv) = version?;
                tombstones.push(is_tombstone(&vv));
                versions.push(vk);
            }
            for i in dropped_by_compaction(&tombstones) {
                batch.remove(versions[i].clone());
            }
        }
        batch.remove(k);
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::{Cause, EventKind};
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
                state.insert(key, v);
            }
            states.push(state.clone());
        }
        (events, states)
    }

    /// Record `events` as applied batches of `chunk` requests each: event records of at most
    /// `budget` bytes per batch (one per batch when the budget is large).
    fn record_in_batches(t: &sled::Tree, events: &[Event], chunk: usize, budget: usize) {
        for part in events.chunks(chunk) {
            let mut b = sled::Batch::default();
            record(&mut b, part, budget);
            t.apply_batch(b).unwrap();
        }
    }

    fn all() -> KeyRange {
        KeyRange {
            start: Vec::new(),
            end: Some(vec![0xFF]),
        }
    }

    fn live(s: &KeyMap) -> Vec<(String, Versioned)> {
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
            chunk in 1usize..5,
            record_budget in prop_oneof![Just(usize::MAX), 60usize..200],
        ) {
            let t = tree();
            let (events, states) = history(&ops);
            record_in_batches(&t, &events, chunk, record_budget);
            prop_assert_eq!(load(&t).unwrap(), states[ops.len()].clone());
            let top = Revision(ops.len() as u64);
            let mut marks: Vec<u64> = marks.iter().map(|m| (*m as u64).min(top.0)).collect();
            marks.sort();
            for &c in &marks {
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
            // The state is untouched, and what reads need is all that is left below the last
            // mark: no event record wholly at or below it.
            prop_assert_eq!(load(&t).unwrap(), states[ops.len()].clone());
            let last = *marks.last().unwrap();
            prop_assert!(t.scan_prefix(EVENT_PREFIX).all(|r| parse_event_key(&r.unwrap().0).unwrap().0 > last));
            // Below the last batch wholly at or below it (one revision per request here), at
            // most one version per key: the ones live there.
            let swept = last / chunk as u64 * chunk as u64;
            let old = t
                .scan_prefix(INDEX_PREFIX)
                .filter(|r| parse_index_key(&r.as_ref().unwrap().0).unwrap().1.0 <= swept)
                .count();
            prop_assert!(old <= states[swept as usize].len(), "{old} versions at or below {swept}");
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
            let (events, states) = history(&ops);
            record_in_batches(&t, &events, chunk, usize::MAX);
            let top = ops.len();
            let swept_to = swept_to.min(top);
            let snapshot_at = snapshot_at.clamp(swept_to, top);
            loop {
                let mut b = sled::Batch::default();
                let more = sweep(&t, &mut b, Revision(swept_to as u64), 3).unwrap();
                t.apply_batch(b).unwrap();
                if !more { break; }
            }
            let (keys, replayed) = replay_onto(
                &t,
                states[snapshot_at].clone(),
                Revision(snapshot_at as u64),
                Revision(top as u64),
            ).unwrap();
            prop_assert_eq!(replayed, top - snapshot_at);
            prop_assert_eq!(&keys, &load(&t).unwrap());
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
            let (events, states) = history(&ops);
            record_in_batches(&t, &events, 3, 100);
            let at = at.min(ops.len());
            let mut after: Option<String> = None;
            let mut pages = Vec::new();
            for _ in 0..=states[at].len() + 1 {
                let (page, done) = range_page(&t, after.as_deref(), Revision(at as u64), limit, max_bytes).unwrap();
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
        let (events, states) = history(&[(1, false), (1, false), (2, false), (1, true)]);
        let mut b = sled::Batch::default();
        record(&mut b, &events, usize::MAX);
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
}
