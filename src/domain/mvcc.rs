//! MVCC history: the layout, the encoding and the rules of the key versions kept until
//! compaction. Pure.
//!
//! The store keeps two kinds of records in the state tree, in the same atomic write as the
//! rest of the applied state (the storage adapter, `raft::mvcc_store`, writes them), and an
//! index of every version in memory ([`super::key_index`], etcd's `treeIndex`):
//! - **events by batch**: `h/ + last revision of the record (u64 BE)` → every event of a run
//!   of whole revisions of an applied batch, in order. An applied change is written once,
//!   here: the index says which record holds each key's version at each revision. A watch
//!   replays any span still held by scanning from the first record whose last revision is at
//!   or above where it starts. Records partition the revisions (none is split between two).
//!   One record per applied batch (not per change) keeps the write path's record count down
//!   under load; a large batch is cut into several, each small enough for sled to keep inline
//!   (`raft::mvcc_store::EVENT_RECORD_BYTES`).
//! - **base versions**: `v/ + escaped key + revision (u64 BE)` → a key's version that has no
//!   event record: a snapshot's live keys, and the versions compaction keeps once their
//!   record goes. (Format 5 wrote one for every change too, tombstones included; such a store
//!   reads the same.) Escaping keeps the key order (`0x00` → `0x00 0xFF`, terminator
//!   `0x00 0x01`).
//!
//! A range at an older revision takes, for each key, the newest version at or below it;
//! `prev_kv` is the version before a change.
//!
//! # Invariants
//! - A request changes a key at most once (etcd's rule for transactions; a revoke deletes each
//!   key once), so `(key, revision)` names one version.
//! - **The floor.** History is complete for every revision above `max(compact_revision,
//!   history_start)`: a watch may start only above it, a range may read at it or above.
//!   `history_start` is where this node's history began: a snapshot installed, or a store
//!   written before history was kept. There each live key is recorded once at its
//!   `mod_revision` (a *base* version, with no event), so ranges at the start are answered.
//! - **Compaction to C** keeps, for every key, the newest version at or below C unless it is
//!   a tombstone, and drops every other version below C, and every event record wholly at or
//!   below C. Nothing above C is touched, so reads at C or later and watches from C + 1 see
//!   no difference.
//! - Decoding never panics: a record that does not parse is an error for the caller to report
//!   as corruption.
//!
//! # What it must not do
//! Touch storage: the adapter scans and writes; this module encodes keys and records and
//! decides what a compaction keeps.

use super::command::{Cause, Event, EventKind};
use super::history::Resume;
use super::kv::Versioned;
use super::types::Revision;

/// Prefix of the event records (one per applied batch, or a few for a large one).
pub const EVENT_PREFIX: &[u8] = b"h/";
/// Prefix of the base versions (those without an event record).
pub const INDEX_PREFIX: &[u8] = b"v/";
/// Prefixes of storage format 2 (values under `k/`, a version index under `i/`, one JSON
/// event per change under `h/` + revision + sub), converted when such a store is opened.
pub const LEGACY_PREFIXES: [&[u8]; 2] = [b"k/", b"i/"];

/// The key of the event record of a batch whose last revision is `last`.
pub fn event_key(last: Revision) -> Vec<u8> {
    let mut k = Vec::with_capacity(EVENT_PREFIX.len() + 8);
    k.extend_from_slice(EVENT_PREFIX);
    k.extend_from_slice(&last.0.to_be_bytes());
    k
}

/// The last revision of an event record's key, if it is one (of this format).
pub fn parse_event_key(k: &[u8]) -> Option<Revision> {
    let rest = k.strip_prefix(EVENT_PREFIX)?;
    Some(Revision(u64::from_be_bytes(rest.try_into().ok()?)))
}

/// Where a scan for the events from `revision` on starts: the first record whose last
/// revision is at or above it holds it, if it is held.
pub fn events_from(revision: Revision) -> Vec<u8> {
    event_key(revision)
}

/// `key`, escaped so that byte order is kept and no escaped key is a prefix of another.
fn escape_into(out: &mut Vec<u8>, key: &[u8]) {
    for &b in key {
        out.push(b);
        if b == 0 {
            out.push(0xFF);
        }
    }
}

/// The index prefix of every version of `key`.
pub fn key_versions(key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(INDEX_PREFIX.len() + key.len() + 2);
    k.extend_from_slice(INDEX_PREFIX);
    escape_into(&mut k, key.as_bytes());
    k.extend_from_slice(&[0, 1]);
    k
}

/// The index key of `key`'s version at `revision`.
pub fn index_key(key: &str, revision: Revision) -> Vec<u8> {
    let mut k = key_versions(key);
    k.extend_from_slice(&revision.0.to_be_bytes());
    k
}

/// The index bound of keys from `key` on (every version of every key `>= key`); any bytes,
/// as a range's bounds are.
pub fn index_from(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(INDEX_PREFIX.len() + key.len());
    k.extend_from_slice(INDEX_PREFIX);
    escape_into(&mut k, key);
    k
}

/// The end of the whole index (exclusive).
pub fn index_end() -> Vec<u8> {
    let mut k = INDEX_PREFIX.to_vec();
    *k.last_mut().expect("non-empty prefix") += 1;
    k
}

/// `(key, revision)` of an index key, if it is one.
pub fn parse_index_key(k: &[u8]) -> Option<(String, Revision)> {
    let rest = k.strip_prefix(INDEX_PREFIX)?;
    if rest.len() < 10 {
        return None;
    }
    let (escaped, rev) = rest.split_at(rest.len() - 8);
    let escaped = escaped.strip_suffix(&[0, 1])?;
    let mut key = Vec::with_capacity(escaped.len());
    let mut bytes = escaped.iter();
    while let Some(&b) = bytes.next() {
        key.push(b);
        if b == 0 && bytes.next() != Some(&0xFF) {
            return None;
        }
    }
    let key = String::from_utf8(key).ok()?;
    Some((key, Revision(u64::from_be_bytes(rev.try_into().ok()?))))
}

/// A record that does not decode (the adapter reports it as corruption).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed history record: {0}")]
pub struct Malformed(&'static str);

/// The record of a version: `0` (a tombstone), or `1`, create revision, version, the lease
/// (flag, length, bytes) and the value (length, bytes). Lengths and numbers are big-endian.
pub fn encode_version(version: Option<&Versioned>) -> Vec<u8> {
    match version {
        None => vec![0],
        Some(v) => encode_live(v.create_revision, v.version, v.lease.as_deref(), &v.value),
    }
}

/// The record of the version an event leaves, as [`encode_version`] of [`version_of`] but
/// without copying the value first (the apply path encodes every change).
pub fn encode_version_of(event: &Event) -> Vec<u8> {
    match event.kind {
        EventKind::Delete => vec![0],
        EventKind::Put => encode_live(
            event.create_revision.unwrap_or(event.revision),
            event.version.unwrap_or(1),
            event.lease.as_deref(),
            event.value.as_deref().unwrap_or_default(),
        ),
    }
}

fn encode_live(create: Revision, version: u64, lease: Option<&str>, value: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 16 + 5 + lease.map_or(0, str::len) + 4 + value.len());
    out.push(1);
    out.extend_from_slice(&create.0.to_be_bytes());
    out.extend_from_slice(&version.to_be_bytes());
    put_opt_str(&mut out, lease);
    put_str(&mut out, value);
    out
}

/// The version a record holds at `revision` (`None`: a tombstone).
pub fn decode_version(revision: Revision, bytes: &[u8]) -> Result<Option<Versioned>, Malformed> {
    let mut r = Reader(bytes);
    let version = match r.u8()? {
        0 => None,
        1 => Some(Versioned {
            create_revision: Revision(r.u64()?),
            version: r.u64()?,
            lease: r.opt_str()?,
            value: r.str()?,
            mod_revision: revision,
        }),
        _ => return Err(Malformed("unknown version tag")),
    };
    r.end()?;
    Ok(version)
}

/// Whether a version record is a tombstone (without decoding the rest).
pub fn is_tombstone(bytes: &[u8]) -> bool {
    bytes.first() == Some(&0)
}

/// The first byte of an event record with an offset table. A record without one (written
/// before format 6) starts with its count's high byte, always 0 (a record never holds
/// 2^24 events).
const TABLE_TAG: u8 = 0xE1;

/// An event record (a run of whole revisions of an applied batch): [`TABLE_TAG`], a count,
/// the offset of each event (u32, from the end of the table: a read finds one event by
/// revision without decoding the others), then each event (revision, kind, cause, key,
/// then the optional fields behind a flag byte).
pub fn encode_events(events: &[Event]) -> Vec<u8> {
    let size: usize = events
        .iter()
        .map(|e| 44 + e.key.len() + e.value.as_ref().map_or(0, String::len))
        .sum();
    let mut out = Vec::with_capacity(5 + size);
    out.push(TABLE_TAG);
    out.extend_from_slice(&(events.len() as u32).to_be_bytes());
    let table = out.len();
    out.resize(table + 4 * events.len(), 0);
    let start = out.len();
    for (i, e) in events.iter().enumerate() {
        let offset = (out.len() - start) as u32;
        out[table + 4 * i..table + 4 * i + 4].copy_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(&e.revision.0.to_be_bytes());
        out.push(match e.kind {
            EventKind::Put => 0,
            EventKind::Delete => 1,
        });
        out.push(match e.cause {
            Cause::Client => 0,
            Cause::LeaseExpired => 1,
            Cause::LeaseRevoked => 2,
        });
        put_str(&mut out, &e.key);
        put_opt_str(&mut out, e.value.as_deref());
        put_opt_str(&mut out, e.lease.as_deref());
        put_opt_u64(&mut out, e.create_revision.map(|r| r.0));
        put_opt_u64(&mut out, e.version);
    }
    out
}

/// Whether an event record has an offset table (one written before format 6 has not).
pub fn has_offsets(bytes: &[u8]) -> bool {
    bytes.first() == Some(&TABLE_TAG)
}

/// A record's event count, its offset table (empty in a record without one) and a reader
/// at its first event.
fn open_record(bytes: &[u8]) -> Result<(usize, &[u8], Reader<'_>), Malformed> {
    let tagged = has_offsets(bytes);
    let mut r = Reader(if tagged { &bytes[1..] } else { bytes });
    let count = r.u32()? as usize;
    let table = if tagged {
        r.take(count.checked_mul(4).ok_or(Malformed("count"))?)?
    } else {
        &[]
    };
    Ok((count, table, r))
}

/// Read one event at `r`: decoded whole if `wanted(revision, deleted, key)`, else skipped.
fn read_event(
    r: &mut Reader<'_>,
    wanted: impl FnOnce(Revision, bool, &str) -> bool,
) -> Result<Option<Event>, Malformed> {
    let revision = Revision(r.u64()?);
    let kind = match r.u8()? {
        0 => EventKind::Put,
        1 => EventKind::Delete,
        _ => return Err(Malformed("unknown event kind")),
    };
    let cause = match r.u8()? {
        0 => Cause::Client,
        1 => Cause::LeaseExpired,
        2 => Cause::LeaseRevoked,
        _ => return Err(Malformed("unknown event cause")),
    };
    let key = r.str_ref()?;
    if !wanted(revision, kind == EventKind::Delete, key) {
        r.skip_opt_str()?;
        r.skip_opt_str()?;
        r.opt_u64()?;
        r.opt_u64()?;
        return Ok(None);
    }
    Ok(Some(Event {
        revision,
        kind,
        cause,
        key: key.to_string(),
        value: r.opt_str()?,
        lease: r.opt_str()?,
        create_revision: r.opt_u64()?.map(Revision),
        version: r.opt_u64()?,
    }))
}

/// The events of a batch record, in order.
pub fn decode_events(bytes: &[u8]) -> Result<Vec<Event>, Malformed> {
    let (count, _, mut r) = open_record(bytes)?;
    // Never trust a count for an allocation: each event takes at least 19 bytes.
    let mut events = Vec::with_capacity(count.min(bytes.len() / 19));
    for _ in 0..count {
        if let Some(e) = read_event(&mut r, |_, _, _| true)? {
            events.push(e);
        }
    }
    r.end()?;
    Ok(events)
}

/// Each event of a batch record as `(revision, deleted, key)`, without copying values: how
/// the key index is rebuilt from the records when a node opens.
pub fn skim_events(
    bytes: &[u8],
    mut each: impl FnMut(Revision, bool, &str),
) -> Result<(), Malformed> {
    let (count, _, mut r) = open_record(bytes)?;
    for _ in 0..count {
        read_event(&mut r, |revision, deleted, key| {
            each(revision, deleted, key);
            false
        })?;
    }
    r.end()
}

/// The event of `key` at `revision` in a batch record, if it holds one. Through the offset
/// table, a binary search by revision, decoding only that event (a record without a table
/// is skimmed whole).
pub fn find_event(bytes: &[u8], revision: Revision, key: &str) -> Result<Option<Event>, Malformed> {
    let (count, table, r) = open_record(bytes)?;
    let wanted = |rev: Revision, _: bool, k: &str| rev == revision && k == key;
    if table.is_empty() {
        let mut r = r;
        for _ in 0..count {
            if let Some(e) = read_event(&mut r, wanted)? {
                return Ok(Some(e));
            }
        }
        return Ok(None);
    }
    let area = r.0;
    let at = |i: usize| -> Result<Reader<'_>, Malformed> {
        let offset = u32::from_be_bytes([
            table[4 * i],
            table[4 * i + 1],
            table[4 * i + 2],
            table[4 * i + 3],
        ]);
        area.get(offset as usize..)
            .map(Reader)
            .ok_or(Malformed("offset out of the record"))
    };
    // The first event at or after `revision` (events are in revision order).
    let (mut lo, mut hi) = (0, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if Revision(at(mid)?.u64()?) < revision {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    for i in lo..count {
        let mut r = at(i)?;
        let mut past = false;
        let found = read_event(&mut r, |rev, deleted, k| {
            past = rev != revision;
            wanted(rev, deleted, k)
        })?;
        if found.is_some() || past {
            return Ok(found);
        }
    }
    Ok(None)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => out.push(0),
        Some(s) => {
            out.push(1);
            put_str(out, s);
        }
    }
}

fn put_opt_u64(out: &mut Vec<u8>, n: Option<u64>) {
    match n {
        None => out.push(0),
        Some(n) => {
            out.push(1);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

/// A cursor over a record; every read checks the length left.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Malformed> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }

    fn str(&mut self) -> Result<String, Malformed> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| Malformed("not UTF-8"))
    }

    fn str_ref(&mut self) -> Result<&'a str, Malformed> {
        let n = self.u32()? as usize;
        std::str::from_utf8(self.take(n)?).map_err(|_| Malformed("not UTF-8"))
    }

    fn skip_opt_str(&mut self) -> Result<(), Malformed> {
        if self.flag()? {
            let n = self.u32()? as usize;
            self.take(n)?;
        }
        Ok(())
    }

    fn flag(&mut self) -> Result<bool, Malformed> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(Malformed("bad flag")),
        }
    }

    fn opt_str(&mut self) -> Result<Option<String>, Malformed> {
        if self.flag()? {
            self.str().map(Some)
        } else {
            Ok(None)
        }
    }

    fn opt_u64(&mut self) -> Result<Option<u64>, Malformed> {
        if self.flag()? {
            self.u64().map(Some)
        } else {
            Ok(None)
        }
    }

    fn end(&self) -> Result<(), Malformed> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed("trailing bytes"))
        }
    }
}

/// The version of a key that an event leaves (`None` for a deletion).
pub fn version_of(event: &Event) -> Option<Versioned> {
    match event.kind {
        EventKind::Delete => None,
        EventKind::Put => Some(Versioned {
            value: event.value.clone().unwrap_or_default(),
            create_revision: event.create_revision.unwrap_or(event.revision),
            mod_revision: event.revision,
            version: event.version.unwrap_or(1),
            lease: event.lease.clone(),
        }),
    }
}

/// The lowest revision a range may read at, and the highest a `/v1` watch may not start from
/// ([`Resume::AfterMark`]).
pub fn floor(compact_revision: Revision, history_start: Revision) -> Revision {
    compact_revision.max(history_start)
}

/// The highest revision a watch may not start from under `resume`. A compaction to `C` keeps
/// `C`'s event records (the sweep removes those below it), so an etcd watch
/// ([`Resume::AtMark`]) may start at `C`, unless the history starts later, or `C`'s records
/// were removed all the same (`mark_swept`: a store an older version swept through `C`).
pub fn watch_floor(
    compact_revision: Revision,
    history_start: Revision,
    mark_swept: Revision,
    resume: Resume,
) -> Revision {
    let compacted = match resume {
        Resume::AfterMark => compact_revision,
        Resume::AtMark => sweep_mark(compact_revision).max(mark_swept),
    };
    compacted.max(history_start)
}

/// How far the compaction sweep may remove event records for a compaction to `C`: the
/// records below `C` (`C`'s own stay, for etcd watches from `C`).
pub fn sweep_mark(compact_revision: Revision) -> Revision {
    Revision(compact_revision.0.saturating_sub(1))
}

/// What compaction to C does with the versions of one key at or below C (oldest first, each
/// a tombstone or not): the indexes of the versions it drops. Every version but the newest
/// is superseded; the newest goes too if it is a tombstone (the key did not exist at C).
pub fn dropped_by_compaction(tombstones: &[bool]) -> impl Iterator<Item = usize> + '_ {
    let last = tombstones.len().checked_sub(1);
    tombstones
        .iter()
        .enumerate()
        .filter(move |&(i, &tomb)| Some(i) != last || tomb)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn versioned() -> impl Strategy<Value = Option<Versioned>> {
        proptest::option::of((
            ".{0,8}",
            0u64..u64::MAX,
            0u64..u64::MAX,
            0u64..u64::MAX,
            proptest::option::of(".{0,6}"),
        ))
        .prop_map(|o| {
            o.map(|(value, c, m, version, lease)| Versioned {
                value,
                create_revision: Revision(c),
                mod_revision: Revision(m),
                version,
                lease,
            })
        })
    }

    fn event() -> impl Strategy<Value = Event> {
        (
            any::<bool>(),
            0u8..3,
            ".{0,8}",
            proptest::option::of(".{0,8}"),
            any::<u64>(),
            proptest::option::of(".{0,4}"),
            proptest::option::of(any::<u64>()),
            proptest::option::of(any::<u64>()),
        )
            .prop_map(
                |(put, cause, key, value, rev, lease, create, version)| Event {
                    kind: if put {
                        EventKind::Put
                    } else {
                        EventKind::Delete
                    },
                    cause: [Cause::Client, Cause::LeaseExpired, Cause::LeaseRevoked]
                        [cause as usize],
                    key,
                    value,
                    revision: Revision(rev),
                    lease,
                    create_revision: create.map(Revision),
                    version,
                },
            )
    }

    #[test]
    fn event_keys_round_trip_in_revision_order() {
        let a = event_key(Revision(5));
        let b = event_key(Revision(6));
        assert!(a < b);
        assert_eq!(parse_event_key(&b), Some(Revision(6)));
        assert_eq!(parse_event_key(b"k/x"), None);
        assert_eq!(parse_event_key(b"h/\0\0\0\0\0\0\0\x05\0\0\0\0"), None);
    }

    #[test]
    fn a_key_is_never_a_prefix_of_another_in_the_index() {
        // "a" and "a\0b": without escaping, every version of "a" would sort inside "a\0...".
        let a = index_key("a", Revision(u64::MAX));
        let ab = index_key("a\0b", Revision(0));
        assert!(a < ab);
        assert!(!ab.starts_with(&key_versions("a")));
    }

    #[test]
    fn compaction_keeps_only_the_newest_live_version() {
        let dropped = |t: &[bool]| dropped_by_compaction(t).collect::<Vec<_>>();
        assert_eq!(dropped(&[false, false, false]), [0, 1]);
        assert_eq!(dropped(&[false, true]), [0, 1]);
        assert_eq!(dropped(&[true, false]), [0]);
        assert!(dropped(&[]).is_empty());
        assert!(dropped(&[false]).is_empty());
    }

    proptest! {
        #[test]
        fn index_keys_round_trip_and_keep_key_then_revision_order(
            k1 in "[a\\x00\\x01\\u{ff}]{0,6}", r1 in 0u64..1000,
            k2 in "[a\\x00\\x01\\u{ff}]{0,6}", r2 in 0u64..1000,
        ) {
            let (x, y) = (index_key(&k1, Revision(r1)), index_key(&k2, Revision(r2)));
            prop_assert_eq!(parse_index_key(&x), Some((k1.clone(), Revision(r1))));
            prop_assert_eq!(x.cmp(&y), (k1.as_bytes(), r1).cmp(&(k2.as_bytes(), r2)));
            // A key range [k1, k2) is the index span [index_from(k1), index_from(k2)).
            prop_assert_eq!(
                x >= index_from(k2.as_bytes()),
                k1.as_bytes() >= k2.as_bytes()
            );
            prop_assert!(x < index_end());
        }

        #[test]
        fn versions_round_trip(v in versioned(), at in any::<u64>()) {
            let at = Revision(at);
            let bytes = encode_version(v.as_ref());
            prop_assert_eq!(is_tombstone(&bytes), v.is_none());
            let expected = v.map(|v| Versioned { mod_revision: at, ..v });
            prop_assert_eq!(decode_version(at, &bytes), Ok(expected));
        }

        #[test]
        fn an_event_encodes_the_version_it_leaves(e in event()) {
            prop_assert_eq!(encode_version_of(&e), encode_version(version_of(&e).as_ref()));
        }

        #[test]
        fn events_round_trip(events in proptest::collection::vec(event(), 0..8), few_revisions in any::<bool>()) {
            // Records hold events in revision order, often several at one revision.
            let mut events = events;
            if few_revisions {
                for e in &mut events {
                    e.revision = Revision(e.revision.0 % 3);
                }
            }
            events.sort_by_key(|e| e.revision);
            let bytes = encode_events(&events);
            let mut skimmed = Vec::new();
            skim_events(&bytes, |r, deleted, k| skimmed.push((r, deleted, k.to_string()))).unwrap();
            let expected: Vec<_> = events
                .iter()
                .map(|e| (e.revision, e.kind == EventKind::Delete, e.key.clone()))
                .collect();
            prop_assert_eq!(skimmed, expected);
            // A record as format 5 wrote it (no offset table) reads the same.
            let n = events.len();
            let mut untagged = bytes[1..5].to_vec();
            untagged.extend_from_slice(&bytes[5 + 4 * n..]);
            prop_assert_eq!(decode_events(&untagged), Ok(events.clone()));
            for record in [&bytes, &untagged] {
                for e in &events {
                    let first = events.iter().find(|x| x.revision == e.revision && x.key == e.key);
                    prop_assert_eq!(find_event(record, e.revision, &e.key), Ok(first.cloned()));
                }
                prop_assert_eq!(find_event(record, Revision(u64::MAX), "none"), Ok(None));
            }
            prop_assert_eq!(decode_events(&bytes), Ok(events));
        }

        /// Any bytes at all decode to a value or an error, never a panic (nor a huge
        /// allocation from a forged count).
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_events(&bytes);
            let _ = skim_events(&bytes, |_, _, _| {});
            let _ = find_event(&bytes, Revision(1), "k");
            let mut tagged = vec![0xE1];
            tagged.extend_from_slice(&bytes);
            let _ = decode_events(&tagged);
            let _ = find_event(&tagged, Revision(1), "k");
            let _ = decode_version(Revision(1), &bytes);
        }

        #[test]
        fn a_truncated_record_is_an_error(events in proptest::collection::vec(event(), 1..4), cut in 1usize..16) {
            let bytes = encode_events(&events);
            let cut = cut.min(bytes.len());
            prop_assert!(decode_events(&bytes[..bytes.len() - cut]).is_err());
        }
    }
}
