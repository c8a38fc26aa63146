//! The leases' journal: what an applied group changed of the leases, stored as one record per
//! group, beside the base records (`l/<name>`, one per lease) that a restart reads first.
//!
//! Why: a lease registered (or changed) was one sled insert of its own, and a new key in sled
//! 0.34 costs a clone of its leaf and, every so often, a split: about 10 µs of CPU on every
//! node, a fifth of a registration's whole cost over three nodes. A group's changes in one
//! record cost one insert. This is what the MVCC history does for keys (one event record per
//! group, folded into base versions only by compaction); the journal is folded into the base
//! records only once it holds more than [`FOLD_AT`] (changes or bytes), oldest first, so a
//! lease that is revoked or expires before then never reaches the base at all. The bytes
//! matter: a change is the lease's whole record, attached keys included, so a lease with
//! thousands of keys journals all of them again with each key attached.
//!
//! # Invariants
//! - A record is keyed by its group's last applied log index (then a part number): the key
//!   order is the apply order. The leases are the base records with every journal record
//!   applied over them in key order; a change is a whole lease record or its removal, so a
//!   record applied over a base that already holds it changes nothing.
//! - A record is a new key written before its group's intent ([`Writes::insert_new`]); a crash
//!   before the intent leaves records above the stored applied index, which [`drop_above`]
//!   removes on open before anything reads the leases.
//! - A fold writes each named lease's *current* state to its base record (or removes it) and
//!   removes the record, all in the applying group: every later record that names the lease
//!   ends, replayed, at that same current state, so the base may run ahead of a record that
//!   stays.
//! - A snapshot install writes every base record and removes the whole journal.
//!
//! # What it must not do
//! Decide anything about leases (`domain::kv` does), or write outside the caller's group.

use std::collections::BTreeMap;

use crate::domain::kv::{LeaseMap, LeaseRecord};
use crate::raft::state_writes::Writes;
use crate::storage::StorageError;

/// The journal's records: then the group's last log index (u64) and a part number (u32),
/// big-endian.
pub(super) const JOURNAL_PREFIX: &[u8] = b"j/";

/// How much the journal holds: changes, and the bytes of its records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Size {
    pub changes: u64,
    pub bytes: u64,
}

impl Size {
    /// By how much `self` is over `limit`, in each measure (zero where it is not).
    pub(super) fn over(self, limit: Size) -> Size {
        Size {
            changes: self.changes.saturating_sub(limit.changes),
            bytes: self.bytes.saturating_sub(limit.bytes),
        }
    }

    pub(super) fn is_zero(self) -> bool {
        self == Size::default()
    }

    pub(super) fn add(&mut self, other: Size) {
        self.changes += other.changes;
        self.bytes += other.bytes;
    }

    pub(super) fn sub(&mut self, other: Size) {
        self.changes = self.changes.saturating_sub(other.changes);
        self.bytes = self.bytes.saturating_sub(other.bytes);
    }
}

/// The journal is folded into the base records once it holds more than this, in changes or
/// in bytes. It bounds what a restart replays (decoding 100,000 changes takes a fraction of
/// a second) and the journal's size on disk, while leaving room for bursts of registrations
/// and for leases that live for less than that many changes.
pub(super) const FOLD_AT: Size = Size {
    changes: 100_000,
    bytes: 64 << 20,
};

/// The most bytes of changes in one record (more are cut into parts): under sled's inline
/// value size, so a record is never a blob file sled does not sync.
const RECORD_BYTES: usize = 256 << 10;

fn corrupt(detail: impl std::fmt::Display) -> StorageError {
    StorageError::Corrupt {
        what: "lease journal".into(),
        detail: detail.to_string(),
    }
}

fn record_key(index: u64, part: u32) -> Vec<u8> {
    let mut k = Vec::with_capacity(JOURNAL_PREFIX.len() + 12);
    k.extend_from_slice(JOURNAL_PREFIX);
    k.extend_from_slice(&index.to_be_bytes());
    k.extend_from_slice(&part.to_be_bytes());
    k
}

fn record_index(key: &[u8]) -> Result<u64, StorageError> {
    key.get(JOURNAL_PREFIX.len()..JOURNAL_PREFIX.len() + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_be_bytes)
        .ok_or_else(|| corrupt("a record key without its index"))
}

/// One change: the lease's whole record, or `None` once it is gone.
type Change<'a> = (&'a str, Option<&'a LeaseRecord>);
type OwnedChange = (String, Option<LeaseRecord>);

/// Journal `changes` (the group's dirty leases, in any order: each name once) as the records
/// of the group whose last applied entry is `index`. Returns what was written.
pub(super) fn record(
    batch: &mut impl Writes,
    index: u64,
    changes: &[(String, Option<&LeaseRecord>)],
) -> Result<Size, StorageError> {
    let mut part = 0u32;
    let mut chunk: Vec<Change<'_>> = Vec::new();
    let mut bytes = 0;
    let mut written = 0;
    let mut flush = |chunk: &mut Vec<Change<'_>>, part: &mut u32| -> Result<(), StorageError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let value = serde_json::to_vec(&chunk).map_err(corrupt)?;
        written += value.len() as u64;
        batch.insert_new(record_key(index, *part), value);
        *part += 1;
        chunk.clear();
        Ok(())
    };
    for (name, lease) in changes {
        // An estimate: the attached keys dominate a large record.
        let size = 64
            + name.len()
            + lease.map_or(0, |l| l.keys.iter().map(|k| k.len() + 3).sum::<usize>());
        if bytes + size > RECORD_BYTES {
            flush(&mut chunk, &mut part)?;
            bytes = 0;
        }
        chunk.push((name, *lease));
        bytes += size;
    }
    flush(&mut chunk, &mut part)?;
    Ok(Size {
        changes: changes.len() as u64,
        bytes: written,
    })
}

/// Apply the journal over `leases` (the base records), in order. Returns what it holds.
pub(super) fn replay(state: &sled::Tree, leases: &mut LeaseMap) -> Result<Size, StorageError> {
    let mut size = Size::default();
    for item in state.scan_prefix(JOURNAL_PREFIX) {
        let (_, value) = item?;
        size.bytes += value.len() as u64;
        let record: Vec<OwnedChange> = serde_json::from_slice(&value).map_err(corrupt)?;
        for (name, lease) in record {
            size.changes += 1;
            match lease {
                Some(l) => {
                    leases.insert(name, l);
                }
                None => {
                    leases.remove(&name);
                }
            }
        }
    }
    Ok(size)
}

/// Remove the records above `applied` (the stored applied index): on open, before the leases
/// are read. A crash between a group's records and its intent leaves them; the log applies
/// the group again. Returns how many were removed.
pub(super) fn drop_above(state: &sled::Tree, applied: u64) -> Result<usize, StorageError> {
    let Some(next) = applied.checked_add(1) else {
        return Ok(0);
    };
    let mut end = JOURNAL_PREFIX.to_vec();
    end.push(0xff);
    let mut removed = 0;
    for item in state.range(record_key(next, 0)..end) {
        state.remove(item?.0)?;
        removed += 1;
    }
    Ok(removed)
}

/// Fold the oldest records into the base records, whole records until they held at least
/// `need` in both measures, or the journal ends: each named lease's base becomes `current`'s
/// state of it, and the record goes. Returns what the folded records held.
pub(super) fn fold(
    state: &sled::Tree,
    batch: &mut impl Writes,
    current: &LeaseMap,
    need: Size,
    base_key: impl Fn(&str) -> Vec<u8>,
) -> Result<Size, StorageError> {
    let mut folded = Size::default();
    // The names once each, in the order the base records are written (any is right).
    let mut names = BTreeMap::new();
    for item in state.scan_prefix(JOURNAL_PREFIX) {
        if folded.changes >= need.changes && folded.bytes >= need.bytes {
            break;
        }
        let (key, value) = item?;
        record_index(&key)?;
        let record: Vec<OwnedChange> = serde_json::from_slice(&value).map_err(corrupt)?;
        folded.add(Size {
            changes: record.len() as u64,
            bytes: value.len() as u64,
        });
        for (name, _) in record {
            names.insert(name, ());
        }
        batch.remove(key);
    }
    for name in names.into_keys() {
        match current.get(&name) {
            Some(lease) => {
                batch.insert(base_key(&name), serde_json::to_vec(lease).map_err(corrupt)?)
            }
            None => batch.remove(base_key(&name)),
        }
    }
    Ok(folded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::types::Revision;
    use crate::raft::state_writes::WriteSet;

    fn lease(ttl_ms: u64) -> LeaseRecord {
        LeaseRecord {
            ttl_ms,
            revision: Revision(ttl_ms),
            keys: ["k".to_string()].into_iter().collect(),
            checkpoint_ms: None,
            checkpoint_clock_ms: None,
        }
    }

    fn base_key(name: &str) -> Vec<u8> {
        [b"l/".as_slice(), name.as_bytes()].concat()
    }

    fn tree() -> sled::Tree {
        let db = sled::Config::new().temporary(true).open().unwrap();
        db.open_tree("s").unwrap()
    }

    fn base(state: &sled::Tree) -> LeaseMap {
        state
            .scan_prefix(b"l/")
            .map(|i| {
                let (k, v) = i.unwrap();
                (
                    String::from_utf8(k[2..].to_vec()).unwrap(),
                    serde_json::from_slice(&v).unwrap(),
                )
            })
            .collect()
    }

    fn loaded(state: &sled::Tree) -> LeaseMap {
        let mut leases = base(state);
        replay(state, &mut leases).unwrap();
        leases
    }

    /// Random groups of registrations, changes and removals, folded at random budgets: what
    /// a reopen loads is always the model's state, and a fold never changes it.
    #[test]
    fn replayed_over_the_base_the_journal_gives_the_current_leases() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _case in 0..40 {
            let state = tree();
            let mut model = LeaseMap::new();
            for group in 1..60u64 {
                let mut dirty = BTreeMap::new();
                for _ in 0..next(6) {
                    let name = format!("l{}", next(12));
                    if next(3) == 0 {
                        model.remove(&name);
                    } else {
                        model.insert(name.clone(), lease(1 + next(1000)));
                    }
                    dirty.insert(name, ());
                }
                let changes: Vec<_> = dirty
                    .into_keys()
                    .map(|n| {
                        let l = model.get(&n);
                        (n, l)
                    })
                    .collect();
                let mut w = WriteSet::default();
                record(&mut w, group * 10, &changes).unwrap();
                if next(4) == 0 {
                    let need = Size {
                        changes: next(8),
                        bytes: next(3000),
                    };
                    fold(&state, &mut w, &model, need, base_key).unwrap();
                }
                w.persist(&state, 1 << 20, None).unwrap();
                assert_eq!(loaded(&state), model, "after group {group}");
            }
            let mut w = WriteSet::default();
            let all = Size {
                changes: u64::MAX,
                bytes: 0,
            };
            fold(&state, &mut w, &model, all, base_key).unwrap();
            w.persist(&state, 1 << 20, None).unwrap();
            assert_eq!(state.scan_prefix(JOURNAL_PREFIX).count(), 0);
            assert_eq!(base(&state), model, "everything folded");
        }
    }

    #[test]
    fn records_above_the_applied_index_are_dropped() {
        let state = tree();
        let a = lease(5);
        for index in [3u64, 7, 9] {
            let mut w = WriteSet::default();
            record(&mut w, index, &[(format!("n{index}"), Some(&a))]).unwrap();
            w.persist(&state, 1 << 20, None).unwrap();
        }
        assert_eq!(drop_above(&state, 7).unwrap(), 1);
        let names: Vec<_> = loaded(&state).keys().cloned().collect();
        assert_eq!(names, ["n3", "n7"]);
        assert_eq!(drop_above(&state, u64::MAX).unwrap(), 0);
    }

    #[test]
    fn a_large_group_is_cut_into_records_that_replay_in_order() {
        let state = tree();
        let mut big = lease(1);
        big.keys = (0..20_000).map(|i| format!("key/{i:08}")).collect();
        let names: Vec<String> = (0..4).map(|i| format!("n{i}")).collect();
        let changes: Vec<_> = names.iter().map(|n| (n.clone(), Some(&big))).collect();
        let mut w = WriteSet::default();
        let size = record(&mut w, 1, &changes).unwrap();
        assert_eq!(size.changes, 4);
        assert!(size.bytes > 4 * 20_000 * 12, "{size:?}");
        w.persist(&state, 1 << 20, None).unwrap();
        assert!(state.scan_prefix(JOURNAL_PREFIX).count() > 1);
        assert_eq!(loaded(&state).len(), 4);
        let mut w = WriteSet::default();
        crate::raft::state_writes::remove_prefix(&state, &mut w, JOURNAL_PREFIX).unwrap();
        w.persist(&state, 1 << 20, None).unwrap();
        assert!(loaded(&state).is_empty());
    }

    #[test]
    fn a_malformed_record_is_an_error_not_a_panic() {
        let state = tree();
        state
            .insert(record_key(1, 0), b"not json".as_slice())
            .unwrap();
        assert!(replay(&state, &mut LeaseMap::new()).is_err());
        state.insert(b"j/x".as_slice(), b"[]".as_slice()).unwrap();
        let mut w = WriteSet::default();
        let need = Size {
            changes: 10,
            bytes: 0,
        };
        assert!(fold(&state, &mut w, &LeaseMap::new(), need, base_key).is_err());
    }
}
