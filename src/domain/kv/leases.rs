//! The lease changes of [`KvState`]: registration, revocation, expiry and checkpoints.
//!
//! # Invariants
//! - Registering a lease takes a revision (its fencing token). Revoking or expiring one deletes
//!   its keys (events in key order) and the lease itself, all at one revision.
//! - An expiry names the incarnation it means (its revision): a lease already gone, or
//!   registered again since, is left alone. Each lease expired is a request of its own.
//! - A checkpoint changes no revision and yields no event; a checkpoint of another incarnation
//!   is ignored.
//! - Every lease touched is marked dirty, for the storage adapter.
//!
//! # What it must not do
//! Keep or compare deadlines: a lease here is facts only. When a lease expires is the leader's
//! tracker's decision ([`crate::domain::lease`]), which arrives as an `ExpireLeases` command.

use std::collections::BTreeSet;

use super::{Applied, KvState, LeaseRecord, rejected};
use crate::domain::command::{Cause, KvError, LeaseChange, LeaseCheckpoint, LeaseRef, Response};

impl KvState {
    /// A stamped registration is also a checkpoint: the full TTL, at the leader's lease clock.
    pub(super) fn register_lease(
        &mut self,
        name: &str,
        ttl_ms: u64,
        clock_ms: Option<u64>,
    ) -> Applied {
        if self.leases.contains_key(name) {
            return rejected(KvError::LeaseExists {
                lease: name.to_string(),
            });
        }
        let revision = self.claim_revision();
        self.leases.insert(
            name.to_string(),
            LeaseRecord {
                ttl_ms,
                revision,
                keys: BTreeSet::new(),
                checkpoint_ms: clock_ms.map(|_| ttl_ms),
                checkpoint_clock_ms: clock_ms,
            },
        );
        self.dirty_leases.insert(name.to_string());
        Applied {
            response: Response::LeaseRegistered { revision },
            events: vec![],
            lease_changes: vec![LeaseChange::Registered {
                name: name.to_string(),
                revision,
                ttl_ms,
                checkpointed: clock_ms.is_some(),
            }],
        }
    }

    pub(super) fn revoke_lease(&mut self, name: &str) -> Applied {
        match self.remove_lease(name, Cause::LeaseRevoked) {
            Some((deleted_keys, mut applied)) => {
                applied.response = Response::LeaseRevoked {
                    revision: self.revision,
                    deleted_keys,
                };
                applied
            }
            None => rejected(KvError::LeaseNotFound {
                lease: name.to_string(),
            }),
        }
    }

    pub(super) fn expire_leases(&mut self, leases: &[LeaseRef]) -> Applied {
        let mut out = Applied {
            response: Response::Empty,
            events: vec![],
            lease_changes: vec![],
        };
        let mut expired = Vec::new();
        for l in leases {
            // Only the incarnation the leader meant; a lease already gone is a no-op.
            if self.leases.get(&l.name).map(|r| r.revision) != Some(l.revision) {
                continue;
            }
            // Each lease's expiry is a request of its own, as etcd revokes each one.
            self.request = None;
            if let Some((_, applied)) = self.remove_lease(&l.name, Cause::LeaseExpired) {
                out.events.extend(applied.events);
                out.lease_changes.extend(applied.lease_changes);
                expired.push(l.name.clone());
            }
        }
        out.response = Response::LeasesExpired {
            revision: self.revision,
            expired,
        };
        out
    }

    pub(super) fn checkpoint_leases(&mut self, checkpoints: &[LeaseCheckpoint]) -> Applied {
        for c in checkpoints {
            if let Some(l) = self.leases.get_mut(&c.name)
                && l.revision == c.revision
            {
                l.checkpoint_ms = c.remaining_ms;
                l.checkpoint_clock_ms = c.remaining_ms.and(c.clock_ms);
                self.dirty_leases.insert(c.name.clone());
            }
        }
        Applied {
            response: Response::Empty,
            events: vec![],
            lease_changes: vec![],
        }
    }

    /// Delete a lease's keys (events in key order) and the lease, at one revision. `None` if
    /// there is no such lease.
    fn remove_lease(&mut self, name: &str, cause: Cause) -> Option<(Vec<String>, Applied)> {
        let lease = self.leases.remove(name)?;
        self.dirty_leases.insert(name.to_string());
        let mut events = Vec::with_capacity(lease.keys.len());
        let mut deleted = Vec::with_capacity(lease.keys.len());
        for key in &lease.keys {
            if let Some(event) = self.remove_key(key, cause) {
                events.push(event);
                deleted.push(key.clone());
            }
        }
        // The lease's removal is a change of the same request (the revision, if no key went).
        self.claim_revision();
        Some((
            deleted,
            Applied {
                response: Response::Empty,
                events,
                lease_changes: vec![LeaseChange::Removed {
                    name: name.to_string(),
                    cause,
                }],
            },
        ))
    }
}
