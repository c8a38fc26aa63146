//! The reads of [`KvState`]: one key, a prefix or a range of live keys, the leases, the auth
//! state, and the revisions and counters that the storage quota and the lease tracker ask for.
//!
//! # Invariants
//! - Every answer is the present state, at the store revision. Older revisions are the MVCC
//!   history's ([`crate::domain::mvcc`]); [`KvState::check_revision`] only says whether one may
//!   be asked for.
//! - Listings and ranges come in the order of the keys' raw bytes (etcd's), binary keys
//!   ([`key_bytes`]) among the text ones.
//!
//! # What it must not do
//! Change the state: every method here takes `&self`.

use super::{KvState, LeaseMap, LeaseRecord, StoredKey, Versioned};
use crate::domain::auth::{AuthState, KeyRange};
use crate::domain::command::KvError;
use crate::domain::key_bytes;
use crate::domain::lease::LeaseFacts;
use crate::domain::types::Revision;

impl KvState {
    /// The MVCC compaction mark.
    pub fn compact_revision(&self) -> Revision {
        self.compact_revision
    }

    /// Whether the state at `revision` can be asked for: not compacted, not in the future.
    /// (Whether this node still holds it is the history's floor, a storage matter.)
    pub fn check_revision(&self, revision: Revision) -> Result<(), KvError> {
        if revision < self.compact_revision {
            Err(KvError::Compacted {
                revision,
                compacted: self.compact_revision,
            })
        } else if revision > self.revision {
            Err(KvError::FutureRevision {
                revision,
                current: self.revision,
            })
        } else {
            Ok(())
        }
    }

    /// The lease clock: the highest checkpoint stamp applied.
    pub fn lease_clock_ms(&self) -> u64 {
        self.lease_clock_ms
    }

    /// Bytes of every live key and value.
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// The store revision.
    pub fn revision(&self) -> Revision {
        self.revision
    }

    /// The number of live keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// One key.
    pub fn get(&self, key: &str) -> Option<&Versioned> {
        self.keys.get(key)
    }

    /// The state's allocation of a live key, to share rather than copy.
    pub fn stored_key(&self, key: &str) -> Option<StoredKey> {
        self.keys.get_key_value(key).map(|(k, _)| k.clone())
    }

    /// Keys whose raw bytes start with `prefix` (binary keys written through the etcd API
    /// among them, in their stored form), in raw key order, at most `limit` of them.
    pub fn list(&self, prefix: &str, limit: usize) -> Vec<(&str, &Versioned)> {
        let range = KeyRange::prefix(prefix);
        self.range(&range).take(limit).collect()
    }

    /// The live keys in `range` (raw bytes, etcd's), in the order of their raw bytes: the
    /// text keys and the encoded ones ([`key_bytes`]) each walked in their span, and merged.
    pub fn range<'a>(
        &'a self,
        range: &KeyRange,
    ) -> impl Iterator<Item = (&'a str, &'a Versioned)> + use<'a> {
        // A point read (most of them) is one lookup, not two spans walked and merged.
        if let Some(stored) = key_bytes::single(range) {
            let found = self.keys.get_key_value(&*stored).map(|(k, v)| (&**k, v));
            return KeysIn::Single(found.into_iter());
        }
        let mut spans = key_bytes::spans(range).into_iter();
        let first = spans.next().map(|s| self.span(s));
        let second = spans.next().map(|s| self.span(s));
        KeysIn::Spans(key_bytes::merge(
            first.into_iter().flatten(),
            second.into_iter().flatten(),
            |(k, _)| k,
        ))
    }

    /// The stored keys in `span` (stored bytes), in stored order.
    fn span(&self, span: KeyRange) -> impl Iterator<Item = (&str, &Versioned)> + use<'_> {
        // Keys are UTF-8 and the span's bounds any bytes: start at the longest UTF-8 prefix of
        // the start (it sorts at or before it) and skip what lies below the start.
        // (The map's range keeps no borrow of its bound, so `span` moves on below.)
        let from = {
            let text = match std::str::from_utf8(&span.start) {
                Ok(s) => s,
                Err(e) => std::str::from_utf8(&span.start[..e.valid_up_to()]).unwrap_or_default(),
            };
            self.keys
                .range::<_, str>((std::ops::Bound::Included(text), std::ops::Bound::Unbounded))
        };
        from.skip_while(move |(k, _)| k.as_bytes() < span.start.as_slice())
            .take_while(move |(k, _)| span.end.as_deref().is_none_or(|e| k.as_bytes() < e))
            .map(|(k, v)| (&**k, v))
    }

    /// Users, roles and the auth switch.
    pub fn auth(&self) -> &AuthState {
        &self.auth
    }

    /// One lease.
    pub fn lease(&self, name: &str) -> Option<&LeaseRecord> {
        self.leases.get(name)
    }

    /// Every lease, by name.
    pub fn leases(&self) -> &LeaseMap {
        &self.leases
    }

    /// What a newly promoted leader needs to track every lease.
    pub fn lease_facts(&self) -> Vec<LeaseFacts> {
        self.leases
            .iter()
            .map(|(name, l)| LeaseFacts {
                name: name.clone(),
                revision: l.revision,
                ttl_ms: l.ttl_ms,
                checkpoint_ms: l.checkpoint_ms,
                checkpoint_clock_ms: l.checkpoint_clock_ms,
            })
            .collect()
    }
}

/// The keys of a range: the one key of a point read, or the merged spans of any other.
enum KeysIn<S, M> {
    Single(S),
    Spans(M),
}

impl<'a, S, M> Iterator for KeysIn<S, M>
where
    S: Iterator<Item = (&'a str, &'a Versioned)>,
    M: Iterator<Item = (&'a str, &'a Versioned)>,
{
    type Item = (&'a str, &'a Versioned);

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            KeysIn::Single(one) => one.next(),
            KeysIn::Spans(merged) => merged.next(),
        }
    }
}
