//! Reading the history: the live keys at a revision (a whole range, a page, or an iterator
//! that reads a page at a time), a key's version before a change, the events after a revision
//! for watches, and a snapshot's keys brought forward by the records after it.
//!
//! # Invariants
//! - Locations are taken from the index a piece at a time, its lock never held for long (an
//!   apply waits for it while it holds the state's lock), then read: a location that a fold
//!   moved meanwhile is an error, and the caller reads again.
//! - A page of events ends at a revision's end: a revision's events are never split, and it
//!   is bounded by bytes as a watch batch is ([`crate::domain::watch_batch`]).
//! - An event record is read once per read of versions, however many of them it holds.
//!
//! # What it must not do
//! Write anything, or answer below the floor: callers check the revision first.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;

use super::{History, LIVE_PAGE, WALK_STEP, corrupt, malformed};
use crate::domain::auth::KeyRange;
use crate::domain::command::Event;
use crate::domain::history::{Batch, KeyFilter};
use crate::domain::key_bytes;
use crate::domain::key_index::{IndexKey, Located};
use crate::domain::kv::{KeyMap, Versioned};
use crate::domain::mvcc::{
    decode_events, decode_version, encode_version_of, event_key, events_from, find_event,
    has_offsets, index_key, parse_event_key, version_of,
};
use crate::domain::types::Revision;
use crate::domain::watch_batch::{BatchCut, BatchLimit, Cut, batch_cost};
use crate::storage::StorageError;

/// Keys read in the first page of [`History::range_at_admitted`].
const FIRST_ADMIT_PAGE: usize = 4;
/// About the bytes of keys and values one page of [`History::range_at_admitted`] reads.
const ADMIT_PAGE_BYTES: usize = 1 << 20;

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
        BatchLimit::UNBOUNDED,
    )?;
    let replayed = batch.events.len();
    for e in batch.events {
        // Through the version encoding, so that the result is exactly what a read of the
        // versions gives.
        match decode_version(e.revision, &encode_version_of(&e)).map_err(malformed("event"))? {
            Some(version) => base.insert(e.key.into(), version),
            None => base.remove(e.key.as_str()),
        };
    }
    Ok((base, replayed))
}

/// Runs of keys read from the spans of one range, each in raw order, as one run in raw
/// order.
fn merge_runs(mut runs: Vec<Vec<(String, Versioned)>>) -> Vec<(String, Versioned)> {
    let second = if runs.len() > 1 { runs.pop() } else { None };
    let first = runs.pop().unwrap_or_default();
    match second {
        None => first,
        Some(second) if second.is_empty() => first,
        Some(second) => key_bytes::merge(first, second, |(k, _)| k.as_str()).collect(),
    }
}

impl History {
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
        mut start: Bound<IndexKey>,
        end: Bound<&[u8]>,
        revision: Revision,
        limit: usize,
    ) -> Vec<Located> {
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

    /// The live keys of `range` as they were at `revision` (at or above the floor), in the
    /// order of their raw bytes (each span of [`key_bytes::spans`] read, and merged).
    pub fn range_at(
        &self,
        range: &KeyRange,
        revision: Revision,
    ) -> Result<Vec<(String, Versioned)>, StorageError> {
        let mut runs = Vec::with_capacity(2);
        for span in key_bytes::spans(range) {
            let end = span
                .end
                .as_deref()
                .map_or(Bound::Unbounded, Bound::Excluded);
            let start = Bound::Included(IndexKey::from(span.start.as_slice()));
            let locs = self.locate(start, end, revision, usize::MAX);
            runs.push(self.read_locs(locs)?);
        }
        Ok(merge_runs(runs))
    }

    /// [`History::range_at`], read a few keys at a time, each handed to `admit` as it is
    /// read: `admit` may drop its value (the answer will not hold it), or end the read with
    /// its error (the answer would be too large) before the rest of the range is read. Pages
    /// start small and grow while values are small, so that what is held beyond what
    /// `admit` lets through is about [`ADMIT_PAGE_BYTES`] (or a few of the largest values).
    /// (The spans of binary and text keys are read one after the other: `admit` sees the
    /// keys of each in order, the answer has them all in raw order.)
    pub fn range_at_admitted<E: From<StorageError>>(
        &self,
        range: &KeyRange,
        revision: Revision,
        admit: &mut dyn FnMut(&str, &mut Versioned) -> Result<(), E>,
    ) -> Result<Vec<(String, Versioned)>, E> {
        let mut runs = Vec::with_capacity(2);
        for span in key_bytes::spans(range) {
            runs.push(self.span_admitted(&span, revision, admit)?);
        }
        Ok(merge_runs(runs))
    }

    fn span_admitted<E: From<StorageError>>(
        &self,
        span: &KeyRange,
        revision: Revision,
        admit: &mut dyn FnMut(&str, &mut Versioned) -> Result<(), E>,
    ) -> Result<Vec<(String, Versioned)>, E> {
        let end = span
            .end
            .as_deref()
            .map_or(Bound::Unbounded, Bound::Excluded);
        let mut start = Bound::Included(IndexKey::from(span.start.as_slice()));
        let mut page = FIRST_ADMIT_PAGE;
        let mut out = Vec::new();
        loop {
            let locs = self.locate(start, end, revision, page);
            let Some((last, _)) = locs.last() else {
                return Ok(out);
            };
            let full = locs.len() == page;
            start = Bound::Excluded(last.clone());
            let mut bytes = 0usize;
            let read = self.read_locs(locs)?;
            let keys = read.len().max(1);
            for (k, mut v) in read {
                bytes = bytes.saturating_add(k.len() + v.value.len());
                admit(&k, &mut v)?;
                out.push((k, v));
            }
            if !full {
                return Ok(out);
            }
            page = (ADMIT_PAGE_BYTES / (bytes / keys).max(1)).clamp(1, LIVE_PAGE);
        }
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
    fn read_locs(&self, locs: Vec<Located>) -> Result<Vec<(String, Versioned)>, StorageError> {
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

/// Matching events with revision `>= from`, up to `through` (inclusive), within `limit`
/// (whole revisions, bounded by bytes unless one revision alone is larger:
/// [`crate::domain::watch_batch`]). `from` must be above the floor.
pub fn events_since(
    tree: &sled::Tree,
    from: Revision,
    through: Revision,
    filter: &KeyFilter,
    limit: BatchLimit,
) -> Result<Batch, StorageError> {
    let mut cut = BatchCut::new(limit);
    let mut events: Vec<Event> = Vec::new();
    for item in tree.range(events_from(from)..) {
        let (k, v) = item?;
        if parse_event_key(&k).is_none() {
            break; // past the event records
        }
        // One record decoded at a time: what is held is the batch (within its bound, or one
        // revision) and the record being read.
        for e in decode_events(&v).map_err(malformed("history event"))? {
            if e.revision < from {
                continue;
            }
            if e.revision > through {
                return Ok(Batch { events, through });
            }
            if !filter.matches(&e.key) {
                continue;
            }
            match cut.offer(e.revision, batch_cost(&e)) {
                Cut::Take => events.push(e),
                Cut::End { keep, through } => {
                    events.truncate(keep);
                    return Ok(Batch { events, through });
                }
            }
        }
    }
    Ok(Batch { events, through })
}
