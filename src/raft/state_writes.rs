//! One applied group's writes to the state tree, crash-atomic without sled's batches; and
//! [`DirectWrites`], writes made as they are added for writers with a marker of their own.
//!
//! Why not `sled::Batch`: sled 0.34's `apply_batch` takes a lock over the whole database and
//! seals and writes its I/O buffer twice around the batch (each a `pwrite` and a waited
//! `sync_file_range`, on sled's I/O threads). With one batch per applied group on every node,
//! that was about a fifth of the CPU of a put (217 -> 170 µs per put over 3 nodes, measured
//! with `scripts/bench-cpu.sh`), and a disk write per group besides the log's.
//!
//! How instead: the group's writes are first stored as ONE value under [`KEY_INTENT`] (a
//! single insert is atomic in sled), then made key by key. sled recovers a prefix of its
//! writes, so after a crash either this group's intent is not there, and none of its writes
//! are (they came after it), or it is there and [`redo`] finishes the group on open. Redoing a
//! complete group changes nothing: each write sets a key to a value or removes it.
//!
//! New keys ([`Writes::insert_new`]: the group's event records) are written before the
//! intent and are not in it, so that a record reaches sled's log once rather than twice (the
//! intent's copy was about 4% of a follower's CPU under puts, and as much again of sled's I/O
//! threads'). A recovered intent finds them all (they came before it); a crash before the
//! intent leaves some of them without their group, and the reader removes those on open by
//! its own rule, before anything reads them (event records above the stored revision,
//! `mvcc_store::drop_records_above`).
//!
//! Marks ([`Writes::insert_mark`]: the applied log id and the revision, which every group
//! writes again) live only in the intent while it is stored inline: they are made in the tree
//! when the intent is redone on open, or when a group is stored any other way. The next
//! group's intent replaces the intent with newer marks, so nothing reads a stale one: the
//! tree's own copies are read only on open, after [`redo`]. Making them every time was two of
//! a group's four sled inserts (about 10,000 instructions each, 3-4% of the leader's under
//! puts at 64 connections, and more of a follower's). A build from before this redoes the
//! intent on open as well, so it reads the same state.
//!
//! A group too large for one value (sled keeps a long value in a blob file, which its recovery
//! may lose while keeping later writes) is stored in parts under [`KEY_PARTS`], each a value
//! of inline size, and then a head under [`KEY_INTENT`] naming them: the head comes after its
//! parts, so a recovered head finds every part. Once its writes are made, the head goes, then
//! the parts. Parts no head names (a crash came before the head) are removed on open. Such a
//! group never takes sled's batch lock: a delete of 100,000s of keys holds that lock, over
//! every tree of the process, for seconds, and the Raft core's own writes (the commit mark)
//! waited behind it until the leader lost its quorum.
//!
//! # Invariants
//! - Only the apply writes the keys an intent names, one group at a time, so the intent
//!   under [`KEY_INTENT`] is always the last group's and redoing it is always right.
//! - A new key is written only by the group whose intent follows it, and is one the reader's
//!   rule on open removes as long as that intent is not there.
//! - Every group writes the same marks (the state machine writes both on every apply), so an
//!   intent never replaces marks it does not carry; the tree's copies of the marks are read
//!   only after [`redo`].
//! - Every other writer of the state tree removes the intent first: a format conversion in
//!   its sled batch, a snapshot install or a restore as its first write under its install
//!   marker (redone whole on open if cut). An older group's intent is never redone over a
//!   state that replaced it.
//!
//! # What it must not do
//! Decide what is written (the state machine and `mvcc_store` do), or order writes by key:
//! they are made in the order they were added.

use std::sync::atomic::{AtomicU64, Ordering};

use sled::IVec;

use crate::storage::StorageError;

/// The last applied group's writes, encoded by [`WriteSet::encode`], or the head of a group
/// stored in parts.
pub const KEY_INTENT: &[u8] = b"m/intent";
/// The prefix of a large group's parts: then the group (u64) and the part's number (u32),
/// big-endian.
pub const KEY_PARTS: &[u8] = b"m/intent/";

/// The encoding's version byte (the first byte of an intent).
const FORMAT: u8 = 1;
/// The first byte of a parts head: then the group (u64) and the number of parts (u32).
const FORMAT_PARTS: u8 = 2;

/// Numbers the large groups of this process, so that one group's parts never mix with a
/// crashed one's (those are removed on open, before any group is written).
static NEXT_GROUP: AtomicU64 = AtomicU64::new(0);
const TAG_REMOVE: u8 = 0;
const TAG_INSERT: u8 = 1;

/// Somewhere to put writes: a sled batch, or a [`WriteSet`]. The MVCC helpers fill either.
pub trait Writes {
    fn insert(&mut self, key: impl Into<IVec>, value: impl Into<IVec>);
    fn remove(&mut self, key: impl Into<IVec>);
    /// A key that did not exist, which the reader on open removes by a rule of its own when
    /// the group that wrote it did not happen (event records above the stored revision:
    /// `mvcc_store::drop_records_above`). A [`WriteSet`] writes such keys before its intent,
    /// outside it; anything else writes it as any other.
    fn insert_new(&mut self, key: impl Into<IVec>, value: impl Into<IVec>) {
        self.insert(key, value)
    }
    /// A mark every applied group writes again (see the module docs): a [`WriteSet`] keeps it
    /// in its intent and makes it in the tree only when it is not stored as an inline intent;
    /// anything else writes it as any other.
    fn insert_mark(&mut self, key: impl Into<IVec>, value: impl Into<IVec>) {
        self.insert(key, value)
    }
}

/// Remove every key `tree` holds under `prefix`, through `w` (the removals are made when `w`'s
/// writes are).
pub fn remove_prefix(tree: &sled::Tree, w: &mut impl Writes, prefix: &[u8]) -> sled::Result<()> {
    for item in tree.scan_prefix(prefix) {
        w.remove(item?.0);
    }
    Ok(())
}

impl Writes for sled::Batch {
    fn insert(&mut self, key: impl Into<IVec>, value: impl Into<IVec>) {
        sled::Batch::insert(self, key, value)
    }
    fn remove(&mut self, key: impl Into<IVec>) {
        sled::Batch::remove(self, key)
    }
}

/// How [`WriteSet::persist`] stored a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persisted {
    /// Behind an intent stored inline.
    Intent,
    /// Behind an intent stored in parts.
    Parts,
    /// As one sled batch: a write was too long for a part, so sled may have put its value in
    /// a blob file of its own, which it does not sync (the caller syncs it:
    /// [`crate::storage::sync_blobs`]).
    Batch,
}

/// Writes in the order they are added: the value is set (`Some`) or removed (`None`); new
/// keys ([`Writes::insert_new`]), made before the others; and marks ([`Writes::insert_mark`]),
/// after them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteSet {
    writes: Vec<(IVec, Option<IVec>)>,
    /// New keys, written before the intent and not in it (see the module docs).
    ahead: Vec<(IVec, IVec)>,
    /// Marks: in the intent after the writes; made only when the intent is redone, or when
    /// the group is not stored as an inline intent (see the module docs).
    marks: Vec<(IVec, IVec)>,
}

impl Writes for WriteSet {
    fn insert(&mut self, key: impl Into<IVec>, value: impl Into<IVec>) {
        self.writes.push((key.into(), Some(value.into())));
    }
    fn remove(&mut self, key: impl Into<IVec>) {
        self.writes.push((key.into(), None));
    }
    fn insert_new(&mut self, key: impl Into<IVec>, value: impl Into<IVec>) {
        self.ahead.push((key.into(), value.into()));
    }
    fn insert_mark(&mut self, key: impl Into<IVec>, value: impl Into<IVec>) {
        self.marks.push((key.into(), value.into()));
    }
}

impl WriteSet {
    /// Every write of the set, new keys and marks included.
    pub fn len(&self) -> usize {
        self.ahead.len() + self.writes.len() + self.marks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ahead.is_empty() && self.writes.is_empty() && self.marks.is_empty()
    }

    /// The set with its new keys and marks as ordinary writes, in the order they are made.
    fn flattened(&self) -> WriteSet {
        let mut all = WriteSet::default();
        all.writes
            .extend(self.ahead.iter().map(|(k, v)| (k.clone(), Some(v.clone()))));
        all.writes.extend(self.writes.iter().cloned());
        all.writes
            .extend(self.marks.iter().map(|(k, v)| (k.clone(), Some(v.clone()))));
        all
    }

    /// Write the new keys, store the intent, then make the other writes one by one (the
    /// marks stay in the intent). `stop_after` (tests only) makes at most that many writes
    /// (the new keys, then those after the intent) and then fails, as a crash would leave it.
    ///
    /// An intent longer than `inline_limit` (sled keeps a value past a quarter of its segment
    /// in a blob file of its own, written without a sync, and its recovery skips a blob lost
    /// to a power failure while it keeps later writes) is stored in parts of at most
    /// [`part_limit`]. A group with a single write longer than a part is written as one sled
    /// batch instead (atomic, and removing the previous intent). A group stored either way
    /// stores its new keys with its other writes.
    pub fn persist(
        &self,
        tree: &sled::Tree,
        inline_limit: usize,
        stop_after: Option<usize>,
    ) -> sled::Result<Persisted> {
        // Sized before it is encoded: a group stored in parts is never encoded whole (a range
        // delete of 100,000 large keys made a 100 MB copy here only to measure it).
        let ahead_inline = self
            .ahead
            .iter()
            .all(|(k, v)| encoded_len(k, Some(v)) <= inline_limit);
        if ahead_inline && self.encoded_size() <= inline_limit {
            for (made, (key, value)) in self.ahead.iter().enumerate() {
                stop(stop_after, made, self.len())?;
                tree.insert(key, value.clone())?;
            }
            tree.insert(KEY_INTENT, self.encode())?;
            let after = stop_after.map(|n| n.saturating_sub(self.ahead.len()));
            return self.make(tree, after).map(|()| Persisted::Intent);
        }
        if !self.ahead.is_empty() || !self.marks.is_empty() {
            // Too large for an inline intent: the new keys and the marks go with the rest,
            // in parts or in one batch, as every write of such a group (nothing after it
            // makes this group's marks).
            return self.flattened().persist(tree, inline_limit, stop_after);
        }
        let Some(parts) = self.parts(part_limit(inline_limit)) else {
            let mut batch = sled::Batch::default();
            batch.remove(KEY_INTENT);
            // A batch keeps the last write per key: the same end state as writing in order.
            for (key, value) in &self.writes {
                match value {
                    Some(v) => batch.insert(key.clone(), v.clone()),
                    None => batch.remove(key.clone()),
                }
            }
            return tree.apply_batch(batch).map(|()| Persisted::Batch);
        };
        let group = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
        for (n, part) in parts.iter().enumerate() {
            tree.insert(part_key(group, n as u32), part.encode())?;
        }
        let mut head = vec![FORMAT_PARTS];
        head.extend_from_slice(&group.to_be_bytes());
        head.extend_from_slice(&len32(parts.len()));
        tree.insert(KEY_INTENT, head)?;
        self.make(tree, stop_after)?;
        tree.remove(KEY_INTENT)?;
        remove_parts(tree).map(|()| Persisted::Parts)
    }

    /// The writes cut into sets whose encodings each fit `limit`, in order; `None` if one
    /// write alone does not.
    fn parts(&self, limit: usize) -> Option<Vec<WriteSet>> {
        const HEADER: usize = 5;
        let mut parts = vec![WriteSet::default()];
        let mut bytes = HEADER;
        for (key, value) in &self.writes {
            let size = encoded_len(key, value.as_ref());
            if HEADER + size > limit {
                return None;
            }
            if bytes + size > limit {
                parts.push(WriteSet::default());
                bytes = HEADER;
            }
            bytes += size;
            parts
                .last_mut()
                .expect("one part at least")
                .writes
                .push((key.clone(), value.clone()));
        }
        Some(parts)
    }

    /// The value this set last writes to `key`: `Some(None)` if it removes it, `None` if it
    /// does not touch it.
    pub fn last_write(&self, key: &[u8]) -> Option<Option<&IVec>> {
        if let Some((_, v)) = self.marks.iter().rev().find(|(k, _)| &k[..] == key) {
            return Some(Some(v));
        }
        self.writes
            .iter()
            .rev()
            .find(|(k, _)| &k[..] == key)
            .map(|(_, v)| v.as_ref())
    }

    fn make(&self, tree: &sled::Tree, stop_after: Option<usize>) -> sled::Result<()> {
        for (made, (key, value)) in self.writes.iter().enumerate() {
            stop(stop_after, made, self.writes.len())?;
            match value {
                Some(v) => tree.insert(key, v.clone())?,
                None => tree.remove(key)?,
            };
        }
        Ok(())
    }

    /// `[FORMAT] [count: u32]`, then per write `[key len: u32] [key] [tag]` and, for an
    /// insert, `[value len: u32] [value]`; integers big-endian. The marks are inserts after
    /// the writes (a reader, this build's or an older one, makes them as any other write).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_size());
        out.push(FORMAT);
        out.extend_from_slice(&len32(self.writes.len() + self.marks.len()));
        let marks = self.marks.iter().map(|(k, v)| (k, Some(v)));
        for (key, value) in self
            .writes
            .iter()
            .map(|(k, v)| (k, v.as_ref()))
            .chain(marks)
        {
            out.extend_from_slice(&len32(key.len()));
            out.extend_from_slice(key);
            match value {
                None => out.push(TAG_REMOVE),
                Some(v) => {
                    out.push(TAG_INSERT);
                    out.extend_from_slice(&len32(v.len()));
                    out.extend_from_slice(v);
                }
            }
        }
        out
    }

    /// The length of [`WriteSet::encode`]'s answer, without encoding.
    fn encoded_size(&self) -> usize {
        5 + self
            .writes
            .iter()
            .map(|(k, v)| encoded_len(k, v.as_ref()))
            .chain(self.marks.iter().map(|(k, v)| encoded_len(k, Some(v))))
            .sum::<usize>()
    }

    /// The writes of an encoded intent; anything malformed is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<WriteSet, StorageError> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(1)? != [FORMAT] {
            return Err(corrupt("unknown format"));
        }
        let count = r.len32()?;
        // Each write takes at least 5 bytes: a count past that is corrupt, not a huge
        // allocation.
        if count > bytes.len() / 5 {
            return Err(corrupt("count larger than the record"));
        }
        let mut writes = Vec::with_capacity(count);
        for _ in 0..count {
            let key_len = r.len32()?;
            let key = IVec::from(r.take(key_len)?);
            let value = match r.take(1)?[0] {
                TAG_REMOVE => None,
                TAG_INSERT => {
                    let value_len = r.len32()?;
                    Some(IVec::from(r.take(value_len)?))
                }
                _ => return Err(corrupt("unknown write tag")),
            };
            writes.push((key, value));
        }
        if r.at != bytes.len() {
            return Err(corrupt("trailing bytes"));
        }
        Ok(WriteSet {
            writes,
            ahead: Vec::new(),
            marks: Vec::new(),
        })
    }
}

/// Tests' simulated crash: fail instead of making write number `made` (from 0) of `of` once
/// `stop_after` writes are made.
fn stop(stop_after: Option<usize>, made: usize, of: usize) -> sled::Result<()> {
    match stop_after.is_some_and(|n| made >= n) {
        true => Err(sled::Error::Unsupported(format!(
            "stopped after {made} of {of} writes (a simulated crash)"
        ))),
        false => Ok(()),
    }
}

/// Finish the last applied group, if a crash interrupted it: run before anything reads the
/// state. `stale` says whether an intent is older than the state (a guard: with this build's
/// writers it never is); a stale intent is dropped, not redone. Parts no head names are
/// removed. Returns how many writes were made again (0 if there is no intent).
pub fn redo(
    tree: &sled::Tree,
    stale: impl FnOnce(&WriteSet) -> Result<bool, StorageError>,
) -> Result<usize, StorageError> {
    let Some(intent) = tree.get(KEY_INTENT)? else {
        remove_parts(tree)?;
        return Ok(0);
    };
    let in_parts = intent.first() == Some(&FORMAT_PARTS);
    let writes = if in_parts {
        read_parts(tree, &intent)?
    } else {
        WriteSet::decode(&intent)?
    };
    if stale(&writes)? {
        tracing::warn!("dropping a write intent older than the state it would be redone over");
        tree.remove(KEY_INTENT)?;
        remove_parts(tree)?;
        return Ok(0);
    }
    writes.make(tree, None)?;
    if in_parts {
        tree.remove(KEY_INTENT)?;
    }
    remove_parts(tree)?;
    Ok(writes.len())
}

/// The most a part may hold: sled writes a leaf node whole, and a leaf holds up to 16 keys,
/// so 16 neighbouring parts together must stay under what sled keeps inline.
pub fn part_limit(inline_limit: usize) -> usize {
    inline_limit / 16
}

/// The bytes one write takes in an intent: key length, key, tag and, for an insert, value
/// length and value.
fn encoded_len(key: &[u8], value: Option<&IVec>) -> usize {
    5 + key.len() + value.map_or(0, |v| 4 + v.len())
}

fn part_key(group: u64, n: u32) -> Vec<u8> {
    let mut key = KEY_PARTS.to_vec();
    key.extend_from_slice(&group.to_be_bytes());
    key.extend_from_slice(&n.to_be_bytes());
    key
}

/// The writes of the group a parts head names, in order.
fn read_parts(tree: &sled::Tree, head: &[u8]) -> Result<WriteSet, StorageError> {
    let mut r = Reader { bytes: head, at: 1 };
    let group = u64::from_be_bytes(r.take(8)?.try_into().expect("8 bytes"));
    let count = r.len32()?;
    if r.at != head.len() {
        return Err(corrupt("trailing bytes after a parts head"));
    }
    let mut all = WriteSet::default();
    for n in 0..count {
        let part = tree
            .get(part_key(group, n as u32))?
            .ok_or_else(|| corrupt("a part its head names is missing"))?;
        all.writes.extend(WriteSet::decode(&part)?.writes);
    }
    Ok(all)
}

/// Remove every part (once its group is finished, or of a group that never got its head).
fn remove_parts(tree: &sled::Tree) -> sled::Result<()> {
    for key in tree.scan_prefix(KEY_PARTS).keys() {
        tree.remove(key?)?;
    }
    Ok(())
}

fn len32(n: usize) -> [u8; 4] {
    // A value over 4 GiB cannot be in one sled record, let alone a Raft entry.
    u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes()
}

fn corrupt(detail: &str) -> StorageError {
    StorageError::Corrupt {
        what: "state write intent".into(),
        detail: detail.into(),
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StorageError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| corrupt("truncated"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn len32(&mut self) -> Result<usize, StorageError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
}

/// Writes made straight to a tree as they are added, one by one, with no intent: for writes
/// whose own marker makes them crash-safe (a snapshot install) or that nobody reads before
/// they are complete (a history fill's staging). Not a sled batch: sled 0.34 holds a batch's
/// pages in memory far past its cache capacity (2.5 KB per record measured, growing without
/// bound), where single inserts stay near it. The first error stops the rest.
pub struct DirectWrites<'a> {
    tree: &'a sled::Tree,
    made: usize,
    stop_after: Option<usize>,
    error: Option<sled::Error>,
}

impl<'a> DirectWrites<'a> {
    /// Writes to `tree`; `stop_after` (tests only) fails every write after that many, as
    /// a crash would leave it.
    pub fn new(tree: &'a sled::Tree, stop_after: Option<usize>) -> Self {
        DirectWrites {
            tree,
            made: 0,
            stop_after,
            error: None,
        }
    }

    fn write(&mut self, f: impl FnOnce(&sled::Tree) -> sled::Result<Option<sled::IVec>>) {
        if self.error.is_some() {
            return;
        }
        if self.stop_after.is_some_and(|n| self.made >= n) {
            self.error = Some(sled::Error::Unsupported(format!(
                "stopped after {} writes (a simulated crash)",
                self.made
            )));
            return;
        }
        match f(self.tree) {
            Ok(_) => self.made += 1,
            Err(e) => self.error = Some(e),
        }
    }

    /// The first error, if a write failed.
    pub fn finish(self) -> sled::Result<()> {
        self.error.map_or(Ok(()), Err)
    }
}

impl Writes for DirectWrites<'_> {
    fn insert(&mut self, key: impl Into<sled::IVec>, value: impl Into<sled::IVec>) {
        let (key, value) = (key.into(), value.into());
        self.write(|t| t.insert(key, value));
    }
    fn remove(&mut self, key: impl Into<sled::IVec>) {
        let key = key.into();
        self.write(|t| t.remove(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tree() -> sled::Tree {
        sled::Config::new()
            .temporary(true)
            .open()
            .unwrap()
            .open_tree("t")
            .unwrap()
    }

    fn contents(t: &sled::Tree) -> Vec<(IVec, IVec)> {
        t.iter()
            .map(|r| r.unwrap())
            .filter(|(k, _)| &k[..] != KEY_INTENT && !k.starts_with(KEY_PARTS))
            .collect()
    }

    /// Small enough that a group of a few writes takes several parts, each part large enough
    /// for any one write of `write_set`.
    const PART_LIMIT: usize = 16 * 26;

    fn fresh(_: &WriteSet) -> Result<bool, StorageError> {
        Ok(false)
    }

    /// The marks' keys: every group writes the same ones (as the state machine's applied id
    /// and revision), with values of its own.
    const MARKS: [&[u8]; 2] = [&[7], &[7, 1]];

    fn write_set() -> impl Strategy<Value = WriteSet> {
        let key = prop::collection::vec(0u8..4, 0..3);
        let value = prop::option::of(prop::collection::vec(any::<u8>(), 0..6));
        let marks = prop::collection::vec(any::<u8>(), 0..4);
        (prop::collection::vec((key, value), 0..40), marks).prop_map(|(ws, mark)| {
            let mut set = WriteSet::default();
            for (k, v) in ws {
                match v {
                    Some(v) => set.insert(k, v),
                    None => set.remove(k),
                }
            }
            for key in MARKS {
                set.insert_mark(key, mark.clone());
            }
            set
        })
    }

    /// The state a reader sees: what the tree holds once the last intent is redone (as every
    /// open does first).
    fn opened(t: &sled::Tree) -> Vec<(IVec, IVec)> {
        redo(t, fresh).unwrap();
        contents(t)
    }

    /// How many writes a group stored as an inline intent makes after it (not its marks).
    fn made_inline(set: &WriteSet) -> usize {
        set.len() - set.marks.len()
    }

    proptest! {
        #[test]
        fn an_intent_decodes_to_the_writes_it_holds(set in write_set()) {
            prop_assert_eq!(set.encoded_size(), set.encode().len());
            // The marks come back as writes after the others, as a reader makes them.
            prop_assert_eq!(WriteSet::decode(&set.encode()).unwrap(), set.flattened());
        }

        /// Stored as an inline intent, a group's marks stay in it: the tree gets them when
        /// the intent is redone; any other way, they are made with the rest.
        #[test]
        fn marks_are_made_only_when_the_intent_is_redone(group in write_set()) {
            let t = tree();
            prop_assert_eq!(group.persist(&t, usize::MAX, None).unwrap(), Persisted::Intent);
            let unmade = MARKS.iter().all(|k| t.get(k).unwrap().is_none());
            prop_assert!(unmade);
            let state = opened(&t);
            for key in MARKS {
                let made = state.iter().any(|(k, _)| &k[..] == key);
                prop_assert!(made);
            }
            let batched = tree();
            group.persist(&batched, 0, None).unwrap();
            prop_assert_eq!(contents(&batched), state);
        }

        /// Whatever prefix of a group's writes a crash left, redo gives the state the whole
        /// group would have; and redoing a finished group changes nothing.
        #[test]
        fn redo_finishes_a_group_cut_anywhere(
            before in write_set(), group in write_set(), cut in 0usize..42,
        ) {
            let whole = tree();
            before.persist(&whole, usize::MAX, None).unwrap();
            group.persist(&whole, usize::MAX, None).unwrap();
            let expected = opened(&whole);
            prop_assert_eq!(opened(&whole), expected.clone());

            let crashed = tree();
            before.persist(&crashed, usize::MAX, None).unwrap();
            let stopped = group.persist(&crashed, usize::MAX, Some(cut));
            prop_assert_eq!(stopped.is_err(), cut < made_inline(&group));
            prop_assert_eq!(opened(&crashed), expected.clone());

            // Past the inline limit, in parts: the same state, and no intent or part left;
            // cut anywhere, redo finishes it and leaves none either.
            let parted = tree();
            before.persist(&parted, usize::MAX, None).unwrap();
            group.persist(&parted, PART_LIMIT, None).unwrap();
            let in_parts = group.encode().len() > PART_LIMIT;
            prop_assert_eq!(parted.get(KEY_INTENT).unwrap().is_none(), in_parts);
            prop_assert_eq!(parted.scan_prefix(KEY_PARTS).count(), 0);
            if in_parts {
                // Made whole, marks included: nothing is left to redo.
                prop_assert_eq!(contents(&parted), expected.clone());
            }
            prop_assert_eq!(opened(&parted), expected.clone());
            let cut_parts = tree();
            before.persist(&cut_parts, usize::MAX, None).unwrap();
            let stopped = group.persist(&cut_parts, PART_LIMIT, Some(cut));
            let made = if in_parts { group.len() } else { made_inline(&group) };
            prop_assert_eq!(stopped.is_err(), cut < made);
            redo(&cut_parts, fresh).unwrap();
            prop_assert_eq!(cut_parts.get(KEY_INTENT).unwrap().is_none(), in_parts);
            prop_assert_eq!(cut_parts.scan_prefix(KEY_PARTS).count(), 0);
            prop_assert_eq!(contents(&cut_parts), expected.clone());

            // A write longer than the limit alone: one batch, the same state, no intent left.
            let batched = tree();
            before.persist(&batched, usize::MAX, None).unwrap();
            group.persist(&batched, 0, Some(0)).unwrap();
            prop_assert!(batched.get(KEY_INTENT).unwrap().is_none());
            prop_assert_eq!(contents(&batched), expected);
        }

        /// New keys come before the intent and are not in it. Cut among them, the group did
        /// not happen: redo leaves the group before, and the reader's own rule (here: new
        /// keys without the group's mark) removes what was written; cut after them, redo
        /// finishes the group, new keys included. Too large for an inline intent, they go
        /// in parts with the rest.
        #[test]
        fn new_keys_come_before_the_intent(
            before in write_set(), group in write_set(), new in 1u8..6, cut in 0usize..48,
        ) {
            const MARK: &[u8] = &[8];
            let with_new = |limit: usize, cut: Option<usize>| {
                let t = tree();
                before.persist(&t, usize::MAX, None).unwrap();
                let mut set = group.clone();
                for i in 0..new {
                    set.insert_new(vec![9, i], vec![i; 3]);
                }
                set.insert(MARK, &b"group"[..]);
                let stopped = set.persist(&t, limit, cut);
                redo(&t, fresh).unwrap();
                // The reader's rule: new keys of a group whose mark is not there go.
                if t.get(MARK).unwrap().as_deref() != Some(&b"group"[..]) {
                    for k in t.scan_prefix([9]).keys() {
                        t.remove(k.unwrap()).unwrap();
                    }
                }
                (t, stopped, set)
            };
            let (whole, _, set) = with_new(usize::MAX, None);
            let intent = WriteSet::decode(&whole.get(KEY_INTENT).unwrap().unwrap()).unwrap();
            prop_assert!(intent.ahead.is_empty());
            prop_assert!(intent.writes.iter().all(|(k, _)| k.first() != Some(&9)));
            prop_assert_eq!(whole.scan_prefix([9]).count(), new as usize);
            let expected = contents(&whole);

            let untouched = tree();
            before.persist(&untouched, usize::MAX, None).unwrap();
            let (crashed, stopped, _) = with_new(usize::MAX, Some(cut));
            prop_assert_eq!(stopped.is_err(), cut < made_inline(&set));
            if cut < new as usize {
                prop_assert_eq!(contents(&crashed), opened(&untouched));
            } else {
                prop_assert_eq!(contents(&crashed), expected.clone());
            }

            let (parted, _, _) = with_new(PART_LIMIT, None);
            prop_assert_eq!(parted.scan_prefix(KEY_PARTS).count(), 0);
            prop_assert_eq!(contents(&parted), expected);
        }

        /// A crash after some parts but before their head: nothing of the group happened, and
        /// open removes the parts (whichever intent the group before left).
        #[test]
        fn parts_without_their_head_are_dropped(
            before in write_set(), group in write_set(), keep in 0usize..4,
        ) {
            let t = tree();
            before.persist(&t, usize::MAX, None).unwrap();
            let expected = opened(&t);
            let parts = group.flattened().parts(part_limit(PART_LIMIT)).unwrap();
            for (n, part) in parts.iter().take(keep).enumerate() {
                t.insert(part_key(u64::MAX, n as u32), part.encode()).unwrap();
            }
            redo(&t, fresh).unwrap();
            prop_assert_eq!(t.scan_prefix(KEY_PARTS).count(), 0);
            prop_assert_eq!(contents(&t), expected);
        }

        #[test]
        fn garbage_is_refused_without_panicking(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = WriteSet::decode(&bytes);
        }
    }

    #[test]
    fn truncated_and_oversized_intents_are_corrupt() {
        let mut set = WriteSet::default();
        set.insert(&b"key"[..], &b"value"[..]);
        let bytes = set.encode();
        for cut in 0..bytes.len() {
            assert!(WriteSet::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(WriteSet::decode(&long).is_err());
        let mut huge = vec![FORMAT];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(WriteSet::decode(&huge).is_err());
        assert_eq!(redo(&tree(), fresh).unwrap(), 0);
    }

    /// A large group of small writes goes in parts (never sled's batch, whose lock spans the
    /// process): cut right after its head, the head names parts that are all there, and redo
    /// finishes the group and removes them.
    #[test]
    fn a_large_group_of_small_writes_is_stored_in_parts() {
        let t = tree();
        let mut set = WriteSet::default();
        for i in 0..500u32 {
            set.insert(i.to_be_bytes().to_vec(), b"value".to_vec());
        }
        let limit = 1024;
        assert!(set.encode().len() > limit);
        assert!(
            set.persist(&t, limit, Some(0)).is_err(),
            "cut after the head"
        );
        let head = t.get(KEY_INTENT).unwrap().expect("a head");
        assert_eq!(head[0], FORMAT_PARTS);
        assert!(t.scan_prefix(KEY_PARTS).count() > 1);
        assert_eq!(redo(&t, fresh).unwrap(), 500);
        assert!(t.get(KEY_INTENT).unwrap().is_none());
        assert_eq!(t.scan_prefix(KEY_PARTS).count(), 0);
        assert_eq!(
            t.get(7u32.to_be_bytes()).unwrap(),
            Some(IVec::from(b"value"))
        );
    }

    /// How a group was stored is reported: only a group with a write longer than a part goes
    /// to sled as one batch, where sled may put the long value in a blob file it does not sync,
    /// so the caller knows when to sync those.
    #[test]
    fn a_write_longer_than_a_part_makes_the_group_one_batch_and_says_so() {
        let t = tree();
        let limit = 1024;
        let mut small = WriteSet::default();
        small.insert(&b"a"[..], &b"1"[..]);
        assert_eq!(small.persist(&t, limit, None).unwrap(), Persisted::Intent);
        let mut many = WriteSet::default();
        for i in 0..500u32 {
            many.insert(i.to_be_bytes().to_vec(), b"value".to_vec());
        }
        assert_eq!(many.persist(&t, limit, None).unwrap(), Persisted::Parts);
        let mut long = WriteSet::default();
        long.insert(&b"b"[..], &b"2"[..]);
        long.insert(&b"c"[..], vec![7u8; 4 * limit]);
        assert_eq!(long.persist(&t, limit, None).unwrap(), Persisted::Batch);
        assert_eq!(t.get(b"c").unwrap().map(|v| v.len()), Some(4 * limit));
        assert_eq!(t.get(b"b").unwrap(), Some(IVec::from(b"2")));
        assert!(
            t.get(KEY_INTENT).unwrap().is_none(),
            "the batch removes the last intent"
        );
    }

    #[test]
    fn a_stale_intent_is_dropped_not_redone() {
        let t = tree();
        let mut set = WriteSet::default();
        set.insert(&b"mark"[..], &b"old"[..]);
        set.persist(&t, usize::MAX, None).unwrap();
        t.insert(b"mark", b"newer").unwrap();
        assert_eq!(set.last_write(b"mark"), Some(Some(&IVec::from(b"old"))));
        assert_eq!(set.last_write(b"other"), None);
        assert_eq!(redo(&t, |_| Ok(true)).unwrap(), 0);
        assert_eq!(t.get(b"mark").unwrap(), Some(IVec::from(b"newer")));
        assert!(t.get(KEY_INTENT).unwrap().is_none());
    }
}
