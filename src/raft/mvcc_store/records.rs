//! Writing the history: an applied batch's events as event records of whole revisions; a
//! history restarted from a store that arrived whole (a snapshot, a restore, an older format);
//! and the key index of what is written, built from the tree when a history opens.
//!
//! # Invariants
//! - An applied change is written once, in its batch's event record. A record stays under the
//!   byte budget unless one revision alone is larger, and a revision is never split between
//!   two records.
//! - A restart removes the whole history (and any fill being adopted) and leaves one base
//!   version per live key; its index is exactly that ([`base_index`]).
//!
//! # What it must not do
//! Make a write on its own: every write goes into the caller's batch, one group with the rest
//! of the applied state, and the caller changes the shared index with it.

use super::{KEY_HISTORY_START, KEY_SWEEP_LIMIT, LEGACY_KEY_SWEPT, corrupt, malformed};
use crate::domain::command::{Event, EventKind};
use crate::domain::key_index::{KeyIndex, Loc};
use crate::domain::kv::{StoredKey, Versioned};
use crate::domain::mvcc::{
    EVENT_PREFIX, INDEX_PREFIX, LEGACY_PREFIXES, encode_events, encode_version, event_key,
    index_key, is_tombstone, parse_event_key, parse_index_key, skim_events,
};
use crate::domain::types::Revision;
use crate::raft::state_writes::{Writes, remove_prefix};
use crate::storage::StorageError;

/// Add the events of one applied batch (in log order) to `batch`: event records of whole
/// revisions, each under `record_budget` bytes of keys and values unless one revision alone
/// is larger ([`record_parts`]). sled writes an item past a quarter of its segment to a blob
/// file it never syncs, which a power failure could lose under a durable applied mark;
/// records under the budget stay inline. A revision larger than that alone is one record, so
/// it may be such a blob: its group is then written as one batch, and the state machine syncs
/// sled's blobs right after it ([`crate::raft::state_writes::Persisted::Batch`]). Returns the
/// records written, for the index ([`index_records`]).
pub fn record<'e>(
    batch: &mut impl Writes,
    events: &'e [Event],
    record_budget: usize,
) -> Vec<&'e [Event]> {
    let parts = record_parts(events, record_budget);
    for part in &parts {
        if let Some(last) = part.last() {
            // New keys: a group's writes store them before its intent (`state_writes`).
            batch.insert_new(event_key(last.revision), encode_events(part));
        }
    }
    parts
}

/// Remove the event records above `revision`, the store's: on open, before the history's
/// index is built. An applied group writes its records before its intent
/// (`state_writes`), so a crash between the two leaves records of a group that did not
/// happen; its entries are applied again from the log, their records written again (perhaps
/// cut differently). Returns how many were removed.
pub fn drop_records_above(tree: &sled::Tree, revision: Revision) -> Result<usize, StorageError> {
    let Some(next) = revision.0.checked_add(1) else {
        return Ok(0);
    };
    let mut removed = 0;
    for item in tree.range(event_key(Revision(next))..) {
        let (key, _) = item?;
        if !key.starts_with(EVENT_PREFIX) {
            break;
        }
        // Only this format's record keys (an older format's are longer, and converted).
        if parse_event_key(&key).is_some_and(|last| last > revision) {
            tree.remove(&key)?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Index the versions of event records written by [`record`]. `live` gives the state's
/// allocation of a live key, which a key new to the index shares; `created` gives, in the
/// order of their puts, the allocations of keys the records' group created
/// (`KvState::take_created_keys`), so that those need no lookup.
pub fn index_records(
    index: &mut KeyIndex,
    records: &[&[Event]],
    created: &[StoredKey],
    live: impl Fn(&str) -> Option<StoredKey>,
) {
    // The puts that created keys, in order, each with its key's allocation: the events of
    // version 1 take them in turn, and one that finds another key there looks its key up.
    let mut created = created.iter().peekable();
    for part in records {
        let Some(last) = part.last() else { continue };
        for e in *part {
            let tombstone = e.kind == EventKind::Delete;
            let loc = Loc::in_record(e.revision, last.revision, tombstone);
            let share = || live(&e.key).map_or_else(|| e.key.as_bytes().into(), Into::into);
            match e.version {
                // A put that created its key: seldom in the index yet.
                Some(1) => {
                    let key = match created.next_if(|k| ***k == *e.key) {
                        Some(k) => k.clone().into(),
                        None => share(),
                    };
                    index.add_created(key, loc)
                }
                _ => index.add_shared(e.key.as_bytes(), share, loc),
            }
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
    keys: impl Iterator<Item = (&'a StoredKey, &'a Versioned)>,
    revision: Revision,
) -> Result<(), StorageError> {
    for prefix in [EVENT_PREFIX, INDEX_PREFIX]
        .into_iter()
        .chain(LEGACY_PREFIXES)
    {
        remove_prefix(tree, batch, prefix)?;
    }
    for (key, v) in keys {
        batch.insert(index_key(key, v.mod_revision), encode_version(Some(v)));
    }
    batch.insert(KEY_HISTORY_START, &revision.0.to_be_bytes());
    // A fill being adopted filled the history that is gone now: it must not be finished.
    batch.remove(crate::raft::history_fill::KEY_FILL_MOVE);
    // Every record at or below `revision` is gone with the rest of the history.
    batch.insert(KEY_SWEEP_LIMIT, &revision.0.to_be_bytes());
    batch.remove(LEGACY_KEY_SWEPT);
    Ok(())
}

/// The index of a history that [`restart`] left: one base version per live key.
pub fn base_index<'a>(keys: impl Iterator<Item = (&'a StoredKey, &'a Versioned)>) -> KeyIndex {
    let mut index = KeyIndex::default();
    for (key, v) in keys {
        index.add_shared(
            key.as_bytes(),
            || key.clone().into(),
            Loc::base(v.mod_revision, false),
        );
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
