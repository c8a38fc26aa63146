//! The MVCC history in sled and its key index: writes the history with the state, loads the
//! current state from it, reads it at past revisions, replays it to watches, and folds what
//! compaction dropped. Layout, encoding and rules: [`crate::domain::mvcc`]; the index:
//! [`crate::domain::key_index`].
//!
//! # Invariants
//! - Everything is in the state tree, written with the rest of an applied group's state
//!   ([`super::state_writes`]): an applied entry's events are durable exactly when the rest
//!   of its state is, and a crash never leaves one without the other.
//! - **An applied change is written once**, in its group's event record; the key index (in
//!   memory, rebuilt from the tree on open: [`History::open`]) says which record holds each
//!   version. Base versions (`v/`) are only those with no record: a snapshot's live keys,
//!   and what compaction keeps once its record goes. (A store of format 5 also holds a base
//!   for every version a record holds; the index prefers the base, so it reads the same.)
//! - The history is complete above the floor, `max(compact_revision, history_start)`; the
//!   state machine persists `history_start`. A store of format 2 (values under `k/` beside
//!   the history) is converted when opened; its history starts again at its current state.
//! - The sweep runs inside `apply`, a bounded number of events per call, so it never stalls a
//!   write and never runs concurrently with a snapshot install (openraft serializes them).
//!   It removes event records wholly at or below the compaction mark, oldest first, and for
//!   each key they name keeps only what compaction keeps ([`KeyIndex::plan_fold`]): the
//!   newest version at or below the mark, written as a base when its record goes. Reads at
//!   the mark or later, and watches from after it, never see a difference.
//! - The index changes with the writes (the state machine's under the state's write lock, a
//!   fill's under its gate); a history read takes locations from it a piece at a time, then
//!   reads them: a location a fold moved meanwhile is missing, and the caller reads again
//!   ([`super::state_view::read_unswept`]).
//!
//! # What it must not do
//! Decide what is kept (the domain does) or answer a read below the floor (callers check it).

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::state_writes::Writes;
use crate::domain::auth::KeyRange;
use crate::domain::command::{Event, EventKind};
use crate::domain::history::{Batch, KeyFilter};
use crate::domain::key_index::{FoldEdit, KeyIndex, Loc};
use crate::domain::kv::{KeyMap, Versioned};
use crate::domain::mvcc::{
    EVENT_PREFIX, INDEX_PREFIX, LEGACY_PREFIXES, Malformed, decode_events, decode_version,
    encode_events, encode_version, encode_version_of, event_key, events_from, find_event,
    has_offsets, index_key, is_tombstone, parse_event_key, parse_index_key, skim_events,
    version_of,
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

/// Add the events of one applied batch (in log order) to `batch`: event records of whole
/// revisions, each under `record_budget` bytes of keys and values unless one revision alone
/// is larger ([`record_parts`]). sled writes an item past a quarter of its segment to a blob
/// file it never syncs, which a power failure could lose under a durable applied mark;
/// records under the budget stay inline. Returns the records written, for the index
/// ([`index_records`]).
pub fn record<'e>(
    batch: &mut impl Writes,
    events: &'e [Event],
    record_budget: usize,
) -> Vec<&'e [Event]> {
    let parts = record_parts(events, record_budget);
    for part in &parts {
        if let Some(last) = part.last() {
            batch.insert(event_key(last.revision), encode_events(part));
        }
    }
    parts
}

/// Index the versions of event records written by [`record`].
pub fn index_records(index: &mut KeyIndex, records: &[&[Event]]) {
    for part in records {
        let Some(last) = part.last() else { continue };
        for e in *part {
            let tombstone = e.kind == EventKind::Delete;
            index.add(
                e.key.as_bytes(),
                Loc::in_record(e.revision, last.revision, tombstone),
            );
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
/// older format). The index of what it leaves: [`base_index`].
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

/// The index of a history that [`restart`] left: one base version per live key.
pub fn base_index<'a>(keys: impl Iterator<Item = (&'a String, &'a Versioned)>) -> KeyIndex {
    let mut index = KeyIndex::default();
    for (key, v) in keys {
        index.add(key.as_bytes(), Loc::base(v.mod_revision, false));
    }
    index
}

/// The index of every version in `tree`: its base versions, then its event records.
pub fn build_index(tree: &sled::Tree) -> Result<KeyIndex, StorageError> {
    let mut index = KeyIndex::default();
    for prefix in [INDEX_PREFIX, EVENT_PREFIX] {
        for item in tree.scan_prefix(prefix) {
            let (k, v) = item?;
            index_item(&mut index, &k, &v)?;
        }
    }
    Ok(index)
}

/// Index one item of a history: a base version, or the versions of an event record (any
/// other item is not history: nothing).
fn index_item(index: &mut KeyIndex, k: &[u8], v: &[u8]) -> Result<(), StorageError> {
    if k.starts_with(INDEX_PREFIX) {
        let (key, rev) = parse_index_key(k).ok_or_else(|| corrupt("version", "bad key"))?;
        index.add(key.as_bytes(), Loc::base(rev, is_tombstone(v)));
    } else if let Some(record) = parse_event_key(k) {
        skim_events(v, |rev, deleted, key| {
            index.add(key.as_bytes(), Loc::in_record(rev, record, deleted));
        })
        .map_err(malformed("history event"))?;
    }
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

/// Live keys read per look at the index by the paged reads ([`LiveKeys`]).
pub const LIVE_PAGE: usize = 1_024;
/// Keys of the index looked at per hold of its lock by a long read.
const WALK_STEP: usize = 4_096;

/// A history: the state tree and the index of its versions.
#[derive(Clone)]
pub struct History {
    pub tree: sled::Tree,
    index: Arc<RwLock<KeyIndex>>,
}

/// One step of the sweep ([`History::sweep`]).
#[derive(Debug, Default)]
pub struct Swept {
    /// Whether records at or below the mark are left.
    pub more: bool,
    /// The index's changes, to make with the step's writes ([`History::apply_folds`]).
    pub folds: Vec<(Box<[u8]>, FoldEdit)>,
    /// Whether the step removes anything.
    pub removes: bool,
}

impl History {
    /// The history in `tree`, its index rebuilt from it.
    pub fn open(tree: sled::Tree) -> Result<Self, StorageError> {
        let index = build_index(&tree)?;
        Ok(History {
            tree,
            index: Arc::new(RwLock::new(index)),
        })
    }

    /// The index, to change with the writes that make the change.
    pub fn index_mut(&self) -> RwLockWriteGuard<'_, KeyIndex> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }

    fn index(&self) -> RwLockReadGuard<'_, KeyIndex> {
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    /// How many keys have a version in the index, and how many versions it holds.
    pub fn size(&self) -> (usize, usize) {
        let index = self.index();
        (index.keys(), index.versions())
    }

    /// The live keys as the versions say: the whole range at the highest revision, in one
    /// pass over the records that hold them.
    pub fn load(&self) -> Result<KeyMap, StorageError> {
        let everything = KeyRange {
            start: Vec::new(),
            end: None,
        };
        Ok(self
            .range_at(&everything, Revision(u64::MAX))?
            .into_iter()
            .collect())
    }

    /// The locations of at most `limit` live keys at `revision` in `(start, end)`, walked a
    /// piece at a time: the index's lock is never held for long (an apply waits for it
    /// while it holds the state's lock).
    fn locate(
        &self,
        mut start: Bound<Box<[u8]>>,
        end: Bound<&[u8]>,
        revision: Revision,
        limit: usize,
    ) -> Vec<(Box<[u8]>, Loc)> {
        let mut out = Vec::new();
        loop {
            let (found, next) = self.index().live_at(
                start.as_ref().map(|k| &k[..]),
                end,
                revision,
                limit - out.len(),
                WALK_STEP,
            );
            out.extend(found);
            match next {
                Some(key) if out.len() < limit => start = Bound::Included(key),
                _ => return out,
            }
        }
    }

    /// The live keys of `range` as they were at `revision` (at or above the floor), in key
    /// order.
    pub fn range_at(
        &self,
        range: &KeyRange,
        revision: Revision,
    ) -> Result<Vec<(String, Versioned)>, StorageError> {
        let end = range
            .end
            .as_deref()
            .map_or(Bound::Unbounded, Bound::Excluded);
        let start = Bound::Included(range.start.clone().into_boxed_slice());
        let locs = self.locate(start, end, revision, usize::MAX);
        self.read_locs(locs)
    }

    /// At most `limit` live keys at `revision`, after `after` (from the first when `None`).
    pub fn live_page(
        &self,
        after: Option<&str>,
        revision: Revision,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, StorageError> {
        let start = after.map_or(Bound::Unbounded, |a| Bound::Excluded(a.as_bytes().into()));
        let locs = self.locate(start, Bound::Unbounded, revision, limit);
        self.read_locs(locs)
    }

    /// Every live key at `revision`, in key order, read a page at a time as it is consumed.
    pub fn live_keys(&self, revision: Revision) -> LiveKeys<'_> {
        LiveKeys::new(move |after| self.live_page(after, revision, LIVE_PAGE))
    }

    /// A page of the live keys at `revision`, in key order: those after `after` (from the
    /// first key when `None`), at most `limit` of them, ended early once their keys and
    /// values pass `max_bytes`. `true` with it: no live key comes after the page.
    pub fn range_page(
        &self,
        after: Option<&str>,
        revision: Revision,
        limit: usize,
        max_bytes: usize,
    ) -> Result<(Vec<(String, Versioned)>, bool), StorageError> {
        let mut page = self.live_page(after, revision, limit)?;
        let mut bytes = 0usize;
        for (i, (k, v)) in page.iter().enumerate() {
            bytes = bytes.saturating_add(k.len() + v.value.len());
            if bytes >= max_bytes && i + 1 < page.len() {
                page.truncate(i + 1);
                return Ok((page, false));
            }
        }
        let done = page.len() < limit && bytes < max_bytes;
        Ok((page, done))
    }

    /// The version of `key` before the change at `revision` (`prev_kv`), if it was live.
    pub fn version_before(
        &self,
        key: &str,
        revision: Revision,
    ) -> Result<Option<Versioned>, StorageError> {
        let Some(loc) = self.index().before(key.as_bytes(), revision) else {
            return Ok(None);
        };
        if loc.tombstone() {
            return Ok(None);
        }
        let mut read = self.read_locs(vec![(key.as_bytes().into(), loc)])?;
        Ok(read.pop().map(|(_, v)| v))
    }

    /// The versions at `locs` (live ones), in the same order. A location that is not there
    /// (a fold moved it after it was taken) is an error: the caller reads again.
    fn read_locs(
        &self,
        locs: Vec<(Box<[u8]>, Loc)>,
    ) -> Result<Vec<(String, Versioned)>, StorageError> {
        let moved = || {
            corrupt(
                "version",
                "not where the key index says (moved by a compaction meanwhile, or a damaged record)",
            )
        };
        // Each record is read once, however many of its versions are wanted.
        let mut wanted: BTreeMap<Revision, Vec<usize>> = BTreeMap::new();
        let mut out: Vec<Option<(String, Versioned)>> = vec![None; locs.len()];
        for (i, (key, loc)) in locs.iter().enumerate() {
            match loc.record() {
                Some(record) => wanted.entry(record).or_default().push(i),
                None => {
                    let name = String::from_utf8(key.to_vec())
                        .map_err(|e| corrupt("version", e.to_string()))?;
                    let bytes = self
                        .tree
                        .get(index_key(&name, loc.revision))?
                        .ok_or_else(moved)?;
                    if let Some(v) =
                        decode_version(loc.revision, &bytes).map_err(malformed("version"))?
                    {
                        out[i] = Some((name, v));
                    }
                }
            }
        }
        for (record, slots) in wanted {
            let bytes = self.tree.get(event_key(record))?.ok_or_else(moved)?;
            if slots.len() > 1 && !has_offsets(&bytes) {
                // A record without an offset table (written before it had one) is decoded
                // once for all its wanted versions, not skimmed once per version.
                let mut by_revision: HashMap<Revision, Vec<usize>> = HashMap::new();
                for &i in &slots {
                    by_revision.entry(locs[i].1.revision).or_default().push(i);
                }
                let mut left = slots.len();
                for e in decode_events(&bytes).map_err(malformed("history event"))? {
                    let Some(at) = by_revision.get_mut(&e.revision) else {
                        continue;
                    };
                    if let Some(j) = at.iter().position(|&i| *locs[i].0 == *e.key.as_bytes()) {
                        let i = at.swap_remove(j);
                        out[i] = version_of(&e).map(|v| (e.key.clone(), v));
                        left -= 1;
                    }
                }
                if left > 0 {
                    return Err(moved());
                }
                continue;
            }
            for i in slots {
                let (key, loc) = &locs[i];
                let key =
                    std::str::from_utf8(key).map_err(|e| corrupt("version", e.to_string()))?;
                let event = find_event(&bytes, loc.revision, key)
                    .map_err(malformed("history event"))?
                    .ok_or_else(moved)?;
                out[i] = version_of(&event).map(|v| (event.key, v));
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// One bounded step of the sweep towards `compact` (in `batch`): takes the event records
    /// wholly at or below it, oldest first, until `budget` events are looked at; for each key
    /// they name, keeps only what compaction keeps (a base written for a kept version whose
    /// record goes, superseded bases removed); then removes the records. The index is changed
    /// by the caller with the writes ([`History::apply_folds`]).
    pub fn sweep(
        &self,
        batch: &mut impl Writes,
        compact: Revision,
        budget: usize,
    ) -> Result<Swept, StorageError> {
        let index = self.index();
        let mut step = Swept::default();
        let mut seen = 0;
        for item in self.tree.range(EVENT_PREFIX.to_vec()..=event_key(compact)) {
            let (k, v) = item?;
            if seen >= budget {
                step.more = true;
                return Ok(step);
            }
            let record = parse_event_key(&k).ok_or_else(|| corrupt("history event", "bad key"))?;
            let events = decode_events(&v).map_err(malformed("history event"))?;
            seen += events.len().max(1);
            // Each key's last event here: the version compaction keeps, if it is in this
            // record (the record is wholly at or below the mark).
            let mut last: HashMap<&str, usize> = HashMap::new();
            for (i, e) in events.iter().enumerate() {
                last.insert(&e.key, i);
            }
            // Planned against the index as it was before this step: a key in two records of
            // one step is planned twice, the later record's plan last (and right). In the
            // record's order, so that every replica writes the same.
            for (i, e) in events.iter().enumerate() {
                if last.get(e.key.as_str()) != Some(&i) {
                    continue;
                }
                let plan = index.plan_fold(e.key.as_bytes(), compact, record);
                for dropped in plan.drop_bases {
                    batch.remove(index_key(&e.key, dropped));
                }
                if let Some(kept) = plan.write_base {
                    if e.revision != kept {
                        return Err(corrupt(
                            "history event",
                            "the version the index places in it is not its last of the key",
                        ));
                    }
                    batch.insert(index_key(&e.key, kept), encode_version_of(e));
                }
                step.folds.push((e.key.as_bytes().into(), plan.edit));
            }
            batch.remove(k);
            step.removes = true;
        }
        Ok(step)
    }

    /// Add a history fill's versions (none newer than this index's of their keys) a few
    /// thousand keys per hold of the lock, each key's at once, each step while `hold`'s
    /// guard is held (the fill's gate: an install that replaced the index meanwhile stops it).
    pub fn merge_older<G, E>(
        &self,
        older: &KeyIndex,
        hold: impl Fn() -> Result<G, E>,
    ) -> Result<(), E> {
        let mut after: Option<Box<[u8]>> = None;
        loop {
            let _held = hold()?;
            let next = self
                .index_mut()
                .merge_older(older, after.as_deref(), WALK_STEP);
            match next {
                Some(key) => after = Some(key),
                None => return Ok(()),
            }
        }
    }

    /// Make a sweep step's changes to the index (with its writes, under the state's lock).
    pub fn apply_folds(&self, folds: Vec<(Box<[u8]>, FoldEdit)>) {
        if folds.is_empty() {
            return;
        }
        let mut index = self.index_mut();
        for (key, edit) in folds {
            index.apply_fold(&key, edit);
        }
    }
}

/// Live keys and their versions, in key order.
pub type KeyPage = Vec<(String, Versioned)>;
/// Reads the page of live keys after a key (from the first when `None`).
type PageReader<'a> = Box<dyn FnMut(Option<&str>) -> Result<KeyPage, StorageError> + 'a>;

/// The live keys at a revision, in key order, read a page at a time through `page` (which
/// takes the last key read).
pub struct LiveKeys<'a> {
    page: PageReader<'a>,
    buffered: std::vec::IntoIter<(String, Versioned)>,
    after: Option<String>,
    done: bool,
}

impl<'a> LiveKeys<'a> {
    pub fn new(page: impl FnMut(Option<&str>) -> Result<KeyPage, StorageError> + 'a) -> Self {
        LiveKeys {
            page: Box::new(page),
            buffered: Vec::new().into_iter(),
            after: None,
            done: false,
        }
    }
}

impl Iterator for LiveKeys<'_> {
    type Item = Result<(String, Versioned), StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some((k, v)) = self.buffered.next() {
                self.after = Some(k.clone());
                return Some(Ok((k, v)));
            }
            if self.done {
                return None;
            }
            match (self.page)(self.after.as_deref()) {
                Ok(page) if page.is_empty() => self.done = true,
                Ok(page) => self.buffered = page.into_iter(),
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
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
    fn record_in_batches(h: &History, events: &[Event], chunk: usize, budget: usize) {
        for part in events.chunks(chunk) {
            let mut b = sled::Batch::default();
            let records = record(&mut b, part, budget);
            h.tree.apply_batch(b).unwrap();
            index_records(&mut h.index_mut(), &records);
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
                        let want = states[r as usize - 1].get(&key).cloned();
                        prop_assert_eq!(h.version_before(&key, Revision(r)).unwrap(), want);
                    }
                }
                let replay = events_since(&t, c.next(), top, &KeyFilter::Prefix(String::new()), usize::MAX).unwrap();
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
}
