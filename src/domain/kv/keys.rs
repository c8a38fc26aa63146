//! The key changes of [`KvState`]: put and delete, with the bookkeeping that goes with them (the
//! key's lease attachment, its version counters, the bytes the quota counts).
//!
//! # Invariants
//! - A put or delete whose `prev_revision` does not match changes nothing, and neither does a
//!   put naming an unknown lease: both are checked before the first change.
//! - A key belongs to at most one lease: a put naming another lease (or none) detaches the key
//!   from its old one, and a delete detaches it, so `lease.keys` and `key.lease` always agree.
//! - Every change takes the request's revision and yields exactly one event; `data_bytes`
//!   follows the live keys and values.
//!
//! # What it must not do
//! Choose a revision itself: it asks `claim_revision`, so that every change of one request (a
//! transaction's, a lease's expiry) shares one. A delete of a missing key takes none.

use super::{Applied, KvState, StoredKey, Versioned, entry_bytes, rejected};
use crate::domain::command::{Cause, Event, EventKind, KvError, Response};
use crate::domain::types::Revision;

impl KvState {
    pub(in crate::domain) fn put(
        &mut self,
        key: &str,
        value: &str,
        lease: Option<&str>,
        prev_revision: Option<Revision>,
    ) -> Applied {
        if let Some(error) = self.check_prev(key, prev_revision) {
            return rejected(error);
        }
        if let Some(lease) = lease
            && !self.leases.contains_key(lease)
        {
            return rejected(KvError::LeaseNotFound {
                lease: lease.to_string(),
            });
        }
        // The key is looked up once: each walk of the map compares long keys along the way.
        let before = self
            .keys
            .get(key)
            .map(|v| (v.lease.clone(), v.create_revision, v.version));
        // A key belongs to at most one lease: detach it from its old one, attach to the new.
        let old_lease = before.as_ref().and_then(|(lease, _, _)| lease.clone());
        if old_lease.as_deref() != lease {
            if let Some(old) = old_lease {
                self.detach(key, &old);
            }
            if let Some(new) = lease
                && let Some(l) = self.leases.get_mut(new)
            {
                l.keys.insert(key.to_string());
                self.dirty_leases.insert(new.to_string());
            }
        }
        let revision = self.claim_revision();
        let entry = match &before {
            Some((_, create_revision, version)) => Versioned {
                value: value.to_string(),
                create_revision: *create_revision,
                mod_revision: revision,
                version: version + 1,
                lease: lease.map(str::to_string),
            },
            None => Versioned {
                value: value.to_string(),
                create_revision: revision,
                mod_revision: revision,
                version: 1,
                lease: lease.map(str::to_string),
            },
        };
        let (entry_create, entry_version) = (entry.create_revision, entry.version);
        self.data_bytes += entry_bytes(key, &entry);
        // An overwrite keeps the key's allocation (the key index shares it); a new key is
        // inserted without looking for it again.
        let old = match before {
            Some(_) => self
                .keys
                .get_mut(key)
                .map(|slot| std::mem::replace(slot, entry)),
            None => {
                let stored = StoredKey::from(key);
                if self.created.len() < super::CREATED_KEYS_KEPT {
                    self.created.push(stored.clone());
                }
                self.keys.insert(stored, entry)
            }
        };
        if let Some(old) = old {
            self.data_bytes = self.data_bytes.saturating_sub(entry_bytes(key, &old));
        }
        Applied {
            response: Response::Put { revision },
            events: vec![Event {
                create_revision: Some(entry_create),
                version: Some(entry_version),
                kind: EventKind::Put,
                key: key.to_string(),
                value: Some(value.to_string()),
                revision,
                lease: lease.map(str::to_string),
                cause: Cause::Client,
            }],
            lease_changes: vec![],
        }
    }

    fn detach(&mut self, key: &str, lease: &str) {
        if let Some(l) = self.leases.get_mut(lease) {
            l.keys.remove(key);
            self.dirty_leases.insert(lease.to_string());
        }
    }

    pub(super) fn delete(&mut self, key: &str, prev_revision: Option<Revision>) -> Applied {
        if let Some(error) = self.check_prev(key, prev_revision) {
            return rejected(error);
        }
        if let Some(lease) = self.keys.get(key).and_then(|v| v.lease.clone()) {
            self.detach(key, &lease);
        }
        match self.remove_key(key, Cause::Client) {
            Some(event) => Applied {
                response: Response::Delete {
                    revision: event.revision,
                    deleted: 1,
                },
                events: vec![event],
                lease_changes: vec![],
            },
            None => Applied {
                response: Response::Delete {
                    revision: self.revision,
                    deleted: 0,
                },
                events: vec![],
                lease_changes: vec![],
            },
        }
    }

    /// Delete a key (detached from its lease) at the request's revision; `None` if absent.
    pub(in crate::domain) fn delete_key(&mut self, key: &str) -> Option<Event> {
        if let Some(lease) = self.keys.get(key).and_then(|v| v.lease.clone()) {
            self.detach(key, &lease);
        }
        self.remove_key(key, Cause::Client)
    }

    /// Remove a key at a new revision, returning its delete event; `None` if absent.
    pub(super) fn remove_key(&mut self, key: &str, cause: Cause) -> Option<Event> {
        let old = self.keys.remove(key)?;
        self.data_bytes = self.data_bytes.saturating_sub(entry_bytes(key, &old));
        let revision = self.claim_revision();
        Some(Event {
            kind: EventKind::Delete,
            create_revision: None,
            version: None,
            key: key.to_string(),
            value: None,
            revision,
            lease: old.lease,
            cause,
        })
    }

    /// The compare-and-set check: `Some(error)` when `prev` is given and does not match.
    fn check_prev(&self, key: &str, prev: Option<Revision>) -> Option<KvError> {
        let expected = prev?;
        let actual = self
            .keys
            .get(key)
            .map(|v| v.mod_revision)
            .unwrap_or_default();
        (actual != expected).then(|| KvError::RevisionMismatch {
            key: key.to_string(),
            expected,
            actual,
        })
    }
}
