//! MVCC history: the layout and the rules of the key versions kept until compaction. Pure.
//!
//! Every applied change is kept as its [`Event`] under two orderings, both in the state tree
//! and in the same atomic batch as the state itself (the storage adapter writes them):
//! - **by revision**: `h/ + revision (u64 BE) + sub (u32 BE)` → the event (JSON). A watch
//!   replays any span still held by scanning it in order; `sub` numbers the changes of one
//!   request.
//! - **by key**: `i/ + escaped key + revision (u64 BE)` → `sub` (u32 BE), pointing at the
//!   event. A range at an older revision takes, for each key, the newest version at or below
//!   it; the previous version of a change (`prev_kv`) is the one before it. Escaping keeps
//!   the key order (`0x00` → `0x00 0xFF`, terminator `0x00 0x01`), so a key range is a scan.
//!
//! # Invariants
//! - A request changes a key at most once (etcd's rule for transactions; a revoke deletes each
//!   key once), so `(key, revision)` names one version. Were one written twice, the later one
//!   wins, which is the state after the request.
//! - **The floor.** History is complete for every revision above `max(compact_revision,
//!   history_start)`: a watch may start only above it, a range may read at it or above.
//!   `history_start` is where this node's history began: a snapshot installed, or a store
//!   written before history was kept. There each live key is recorded once at its
//!   `mod_revision` (a *base* version), so ranges at the start are answered.
//! - **Compaction to C** keeps, for every key, the newest version at or below C unless it is
//!   a deletion, and drops every other version below C, along with its event. Nothing at or
//!   above C is touched, so reads at C or later and watches from C + 1 see no difference.
//!
//! # What it must not do
//! Touch storage: the adapter (`raft::mvcc_store`) scans and writes; this module encodes keys,
//! decodes records and decides what a compaction keeps.

use super::command::{Event, EventKind};
use super::kv::Versioned;
use super::types::Revision;

/// Prefix of the events by revision.
pub const EVENT_PREFIX: &[u8] = b"h/";
/// Prefix of the versions by key.
pub const INDEX_PREFIX: &[u8] = b"i/";

/// The key of the event at `(revision, sub)`.
pub fn event_key(revision: Revision, sub: u32) -> Vec<u8> {
    let mut k = Vec::with_capacity(EVENT_PREFIX.len() + 12);
    k.extend_from_slice(EVENT_PREFIX);
    k.extend_from_slice(&revision.0.to_be_bytes());
    k.extend_from_slice(&sub.to_be_bytes());
    k
}

/// `(revision, sub)` of an event key, if it is one.
pub fn parse_event_key(k: &[u8]) -> Option<(Revision, u32)> {
    let rest = k.strip_prefix(EVENT_PREFIX)?;
    if rest.len() != 12 {
        return None;
    }
    let rev = u64::from_be_bytes(rest[..8].try_into().ok()?);
    let sub = u32::from_be_bytes(rest[8..].try_into().ok()?);
    Some((Revision(rev), sub))
}

/// The first event key of `revision` (the start of a scan from it).
pub fn events_from(revision: Revision) -> Vec<u8> {
    event_key(revision, 0)
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

/// The sub of an index value.
pub fn parse_sub(v: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(v.try_into().ok()?))
}

/// The key's version that an event leaves (`None` for a deletion).
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

/// The base event of a live key: its version as it stands, at its `mod_revision`.
pub fn base_event(key: &str, v: &Versioned) -> Event {
    Event {
        kind: EventKind::Put,
        key: key.to_string(),
        value: Some(v.value.clone()),
        revision: v.mod_revision,
        lease: v.lease.clone(),
        cause: super::command::Cause::Client,
        create_revision: Some(v.create_revision),
        version: Some(v.version),
    }
}

/// The lowest revision a range may read at, and the highest a watch may not start from.
pub fn floor(compact_revision: Revision, history_start: Revision) -> Revision {
    compact_revision.max(history_start)
}

/// Whether compaction to `compact` keeps a version of a key at `revision` (below `compact`),
/// given the revision of that key's newest version at or below `compact`.
pub fn keeps(event: &Event, newest_at_or_below: Revision) -> bool {
    event.revision == newest_at_or_below && event.kind == EventKind::Put
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn event_keys_round_trip_in_revision_order() {
        let a = event_key(Revision(5), 2);
        let b = event_key(Revision(5), 3);
        let c = event_key(Revision(6), 0);
        assert!(a < b && b < c);
        assert_eq!(parse_event_key(&b), Some((Revision(5), 3)));
        assert_eq!(parse_event_key(b"k/x"), None);
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
    fn keeps_only_the_newest_put() {
        let mut e = base_event(
            "k",
            &Versioned {
                value: "v".into(),
                create_revision: Revision(1),
                mod_revision: Revision(3),
                version: 2,
                lease: None,
            },
        );
        assert!(keeps(&e, Revision(3)));
        assert!(!keeps(&e, Revision(4)));
        e.kind = EventKind::Delete;
        assert!(!keeps(&e, Revision(3)));
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
    }
}
