//! `KvState`: the replicated key-value state machine, applied identically on every replica.
//!
//! # Invariants
//! - `apply` is a pure function of the current state and the command: no clock, no randomness,
//!   no configuration. The same log applied twice gives byte-identical state ([`KvState::encode`]).
//! - The store revision advances by exactly one for every request that changes something, as
//!   etcd's main revision: a put, a delete, a lease registration, a lease's revoke or expiry
//!   (all of its keys and the lease itself), a member registration (its lease and its key).
//!   Every change one request makes carries that one revision. A rejected command (CAS
//!   mismatch, unknown lease) or a delete of a missing key changes nothing, revision included.
//! - Each key carries `create_revision` (the revision that created this incarnation),
//!   `mod_revision` (the last change) and `version` (changes since creation, starting at 1).
//!   Deleting a key ends its incarnation: a later put starts again at version 1.
//! - Every change produces exactly one [`Event`], carrying the key's new revision.
//! - Leases are facts, never deadlines: `{ttl, revision, keys, checkpoint}`. A key belongs to at
//!   most one lease, and `lease.keys` and `key.lease` always agree. Registering a lease advances
//!   the revision (the lease's revision is its fencing token); revoking or expiring one deletes
//!   its keys (events in key order) and the lease itself, all at one revision.
//!   Checkpoints change no revision: they are bookkeeping of the leader's timer, not data.
//!
//! # What it must not do
//! It never persists anything. The storage adapter persists every change's event as the key's
//! new version (and the leases touched since its last write, [`KvState::take_dirty_leases`])
//! in the same atomic batch as the applied log index, so a restart never sees a half-applied
//! entry. Every change to a key therefore yields an event.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::auth::{AuthState, KeyRange};
use super::command::{
    Cause, Command, Event, EventKind, KvError, LeaseChange, LeaseCheckpoint, LeaseRef, Response,
};
use super::lease::LeaseFacts;
use super::members::{MemberRecord, member_key};
use super::types::Revision;

pub use leasecore_client::api::Versioned;

/// A lease as replicated: facts only, no deadline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub ttl_ms: u64,
    /// The revision that registered this incarnation (its fencing token).
    pub revision: Revision,
    /// The attached keys, in key order.
    #[serde(default)]
    pub keys: BTreeSet<String>,
    /// The remaining time last checkpointed by a leader, if in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_ms: Option<u64>,
    /// The lease clock at that checkpoint (`None` for checkpoints older than the clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_clock_ms: Option<u64>,
}

/// The outcome of applying one command: the client's answer, the watchers' events and the
/// tracker's lease changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub response: Response,
    pub events: Vec<Event>,
    pub lease_changes: Vec<LeaseChange>,
}

/// The live keys, in key order: a persistent map, so that a copy (a snapshot's) shares the
/// nodes until one side writes to them. Serialized as a plain map.
pub type KeyMap = imbl::OrdMap<String, Versioned>;
/// Every lease, by name: persistent for the same reason.
pub type LeaseMap = imbl::OrdMap<String, LeaseRecord>;

/// The whole replicated state, as written in snapshots.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSnapshot {
    pub revision: Revision,
    pub keys: KeyMap,
    #[serde(default)]
    pub leases: LeaseMap,
    /// Users, roles and the auth switch (absent in snapshots older than auth: auth off).
    #[serde(default)]
    pub auth: AuthState,
    /// The lease clock: the highest lease clock stamp applied (absent in older snapshots:
    /// rebuilt from the leases' checkpoints, see [`KvState::from_snapshot`]).
    #[serde(default)]
    pub lease_clock_ms: u64,
    /// The MVCC compaction mark: versions below it are gone (absent in older snapshots: 0).
    #[serde(default)]
    pub compact_revision: Revision,
}

/// The replicated key-value state.
#[derive(Debug, Default)]
pub struct KvState {
    /// The store revision: the revision of the latest change.
    revision: Revision,
    /// Every live key, in key order.
    keys: KeyMap,
    /// Every lease, by name.
    leases: LeaseMap,
    /// Leases changed since the last [`KvState::take_dirty_leases`].
    dirty_leases: BTreeSet<String>,
    /// Users, roles and the auth switch.
    auth: AuthState,
    /// The auth state changed since the last [`KvState::take_dirty_auth`].
    dirty_auth: bool,
    /// The lease clock: the highest lease clock stamp applied (see
    /// [`crate::domain::lease::ClockWitness`]). Part of the replicated state, snapshots and
    /// restarts included: a node that came back with a lower value would start a clock ahead
    /// of the leader that wrote the newest stamps, and age their checkpoints too fast.
    lease_clock_ms: u64,
    /// The MVCC compaction mark (see [`crate::domain::mvcc`]): the store keeps every key's
    /// versions from here on. Replicated, so every replica answers `compacted` alike.
    compact_revision: Revision,
    /// Bytes of every live key and value (what the storage quota counts of the state).
    data_bytes: u64,
    /// The revision of the request being applied, once it has changed something (every
    /// change of one request shares it). Reset at the start of each request.
    request: Option<Revision>,
}

/// The bytes a live key counts for.
fn entry_bytes(key: &str, v: &Versioned) -> u64 {
    (key.len() + v.value.len()) as u64
}

impl KvState {
    /// An empty store at revision 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuild a state from a snapshot (or from the persisted keys).
    pub fn from_snapshot(snapshot: KvSnapshot) -> Self {
        // Stores written before the clock was persisted rebuild it from the checkpoints left.
        let lease_clock_ms = snapshot
            .leases
            .values()
            .filter_map(|l| l.checkpoint_clock_ms)
            .fold(snapshot.lease_clock_ms, u64::max);
        let data_bytes = snapshot.keys.iter().map(|(k, v)| entry_bytes(k, v)).sum();
        KvState {
            revision: snapshot.revision,
            keys: snapshot.keys,
            leases: snapshot.leases,
            dirty_leases: BTreeSet::new(),
            auth: snapshot.auth,
            dirty_auth: false,
            lease_clock_ms,
            compact_revision: snapshot.compact_revision,
            data_bytes,
            request: None,
        }
    }

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

    /// Keys starting with `prefix`, in key order, at most `limit` of them.
    pub fn list(&self, prefix: &str, limit: usize) -> Vec<(&str, &Versioned)> {
        self.keys
            .range::<_, str>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(k, _)| k.starts_with(prefix))
            .take(limit)
            .map(|(k, v)| (k.as_str(), v))
            .collect()
    }

    /// The live keys in `range`, in key order.
    pub fn range<'a>(
        &'a self,
        range: &'a KeyRange,
    ) -> impl Iterator<Item = (&'a str, &'a Versioned)> + 'a {
        // Keys are UTF-8 and the range's bounds any bytes: start at the longest UTF-8 prefix of
        // the start (it sorts at or before it) and skip what lies below the start.
        let start = match std::str::from_utf8(&range.start) {
            Ok(s) => s,
            Err(e) => std::str::from_utf8(&range.start[..e.valid_up_to()]).unwrap_or_default(),
        };
        self.keys
            .range::<_, str>((std::ops::Bound::Included(start), std::ops::Bound::Unbounded))
            .skip_while(|(k, _)| k.as_bytes() < range.start.as_slice())
            .take_while(|(k, _)| range.end.as_deref().is_none_or(|e| k.as_bytes() < e))
            .map(|(k, v)| (k.as_str(), v))
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

    /// Apply one command. Total: any well-formed command applies, no input panics.
    pub fn apply(&mut self, cmd: &Command) -> Applied {
        // Each command is a request of its own (a batch's commands and each expired lease
        // start their own again).
        self.request = None;
        // Every stamp a committed entry carries advances the clock, whether or not its command
        // takes effect (a duplicate registration, a guard that refuses): a stamp is a leader's
        // reading all the same, and the clock then follows the log's latest stamp exactly.
        if let Some(stamp) = cmd.lease_clock_stamp() {
            self.lease_clock_ms = self.lease_clock_ms.max(stamp);
        }
        match cmd {
            Command::Put {
                key,
                value,
                lease,
                prev_revision,
            } => self.put(key, value, lease.as_deref(), *prev_revision),
            Command::Delete { key, prev_revision } => self.delete(key, *prev_revision),
            Command::Txn { txn } => match self.apply_txn(txn) {
                Ok((result, events)) => Applied {
                    response: Response::Txn {
                        revision: self.revision,
                        outcome: result,
                    },
                    events,
                    lease_changes: vec![],
                },
                Err(error) => rejected(error),
            },
            Command::RegisterLease {
                name,
                ttl_ms,
                clock_ms,
            } => self.register_lease(name, *ttl_ms, *clock_ms),
            Command::RevokeLease { name } => self.revoke_lease(name),
            Command::Compact { revision } => self.compact(*revision),
            Command::ExpireLeases { leases } => self.expire_leases(leases),
            Command::CheckpointLeases { checkpoints } => self.checkpoint_leases(checkpoints),
            // Its stamp advanced the clock above; nothing else changes.
            Command::LeaseClock { .. } => Applied {
                response: Response::Empty,
                events: vec![],
                lease_changes: vec![],
            },
            Command::RegisterMember {
                id,
                address,
                ttl_ms,
                meta,
                clock_ms,
            } => self.register_member(id, address, *ttl_ms, meta, *clock_ms),
            Command::Auth { change } => match self.auth.apply(change) {
                Ok(()) => {
                    self.dirty_auth = true;
                    Applied {
                        response: Response::AuthChanged {
                            auth_revision: self.auth.revision,
                        },
                        events: vec![],
                        lease_changes: vec![],
                    }
                }
                Err(error) => rejected(KvError::Auth { error }),
            },
            Command::Guarded { user, command } => {
                if super::auth::guard::authorize(self, user, command) {
                    self.apply(command)
                } else {
                    rejected(KvError::PermissionDenied)
                }
            }
            Command::Batch { commands } => {
                let mut out = Applied {
                    response: Response::Empty,
                    events: vec![],
                    lease_changes: vec![],
                };
                let mut responses = Vec::with_capacity(commands.len());
                for c in commands {
                    let one = self.apply(c);
                    out.events.extend(one.events);
                    out.lease_changes.extend(one.lease_changes);
                    responses.push(one.response);
                }
                out.response = Response::Batch { responses };
                out
            }
        }
    }

    /// etcd's rules: compacting to the current revision is allowed, to a revision at or below
    /// the mark (nothing to do) answers `compacted`, past the current one `future`.
    fn compact(&mut self, revision: Revision) -> Applied {
        let refused = if revision <= self.compact_revision {
            Some(KvError::Compacted {
                revision,
                compacted: self.compact_revision,
            })
        } else if revision > self.revision {
            Some(KvError::FutureRevision {
                revision,
                current: self.revision,
            })
        } else {
            None
        };
        if let Some(error) = refused {
            return rejected(error);
        }
        self.compact_revision = revision;
        Applied {
            response: Response::Compacted {
                compact_revision: revision,
            },
            events: vec![],
            lease_changes: vec![],
        }
    }

    fn register_member(
        &mut self,
        id: &str,
        address: &str,
        ttl_ms: u64,
        meta: &BTreeMap<String, String>,
        clock_ms: Option<u64>,
    ) -> Applied {
        let name = member_key(id);
        if self.leases.contains_key(&name) {
            return rejected(KvError::MemberExists { id: id.to_string() });
        }
        let mut registered = self.register_lease(&name, ttl_ms, clock_ms);
        let Response::LeaseRegistered {
            revision: lease_revision,
        } = registered.response
        else {
            return registered;
        };
        let record = MemberRecord {
            id: id.to_string(),
            address: address.to_string(),
            meta: meta.clone(),
        };
        let put = self.put(&name, &record.encode(), Some(&name), None);
        let Response::Put { revision } = put.response else {
            return put;
        };
        registered.events.extend(put.events);
        Applied {
            response: Response::MemberRegistered {
                revision,
                lease_revision,
            },
            events: registered.events,
            lease_changes: registered.lease_changes,
        }
    }

    /// A stamped registration is also a checkpoint: the full TTL, at the leader's lease clock.
    fn register_lease(&mut self, name: &str, ttl_ms: u64, clock_ms: Option<u64>) -> Applied {
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

    fn revoke_lease(&mut self, name: &str) -> Applied {
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

    fn expire_leases(&mut self, leases: &[LeaseRef]) -> Applied {
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

    fn checkpoint_leases(&mut self, checkpoints: &[LeaseCheckpoint]) -> Applied {
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

    pub(super) fn put(
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
        // A key belongs to at most one lease: detach it from its old one, attach to the new.
        let old_lease = self.keys.get(key).and_then(|v| v.lease.clone());
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
        let entry = match self.keys.get(key) {
            Some(old) => Versioned {
                value: value.to_string(),
                create_revision: old.create_revision,
                mod_revision: revision,
                version: old.version + 1,
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
        if let Some(old) = self.keys.insert(key.to_string(), entry) {
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

    fn delete(&mut self, key: &str, prev_revision: Option<Revision>) -> Applied {
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
    pub(super) fn delete_key(&mut self, key: &str) -> Option<Event> {
        if let Some(lease) = self.keys.get(key).and_then(|v| v.lease.clone()) {
            self.detach(key, &lease);
        }
        self.remove_key(key, Cause::Client)
    }

    /// Remove a key at a new revision, returning its delete event; `None` if absent.
    fn remove_key(&mut self, key: &str, cause: Cause) -> Option<Event> {
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

    /// The revision of the request being applied: the next one at its first change, the same
    /// one for every later change of that request.
    fn claim_revision(&mut self) -> Revision {
        match self.request {
            Some(r) => r,
            None => {
                let r = self.revision.next();
                self.revision = r;
                self.request = Some(r);
                r
            }
        }
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

    /// The leases changed since the last call, with their current record (`None`: removed).
    pub fn take_dirty_leases(&mut self) -> Vec<(String, Option<&LeaseRecord>)> {
        let dirty = std::mem::take(&mut self.dirty_leases);
        dirty
            .into_iter()
            .map(|n| {
                let l = self.leases.get(&n);
                (n, l)
            })
            .collect()
    }

    /// The auth state if it changed since the last call (for the storage adapter).
    pub fn take_dirty_auth(&mut self) -> Option<&AuthState> {
        std::mem::take(&mut self.dirty_auth).then_some(&self.auth)
    }

    /// A copy of the whole state, for a snapshot: O(1), the maps share their nodes.
    pub fn snapshot(&self) -> KvSnapshot {
        KvSnapshot {
            revision: self.revision,
            keys: self.keys.clone(),
            leases: self.leases.clone(),
            auth: self.auth.clone(),
            lease_clock_ms: self.lease_clock_ms,
            compact_revision: self.compact_revision,
        }
    }

    /// The canonical encoding of the state: equal states give equal bytes.
    pub fn encode(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct View<'a> {
            revision: Revision,
            keys: &'a KeyMap,
            leases: &'a LeaseMap,
            auth: &'a AuthState,
            compact_revision: Revision,
        }
        serde_json::to_vec(&View {
            revision: self.revision,
            keys: &self.keys,
            leases: &self.leases,
            auth: &self.auth,
            compact_revision: self.compact_revision,
        })
        .expect("serializing plain data cannot fail")
    }
}

fn rejected(error: KvError) -> Applied {
    Applied {
        response: Response::Rejected { error },
        events: vec![],
        lease_changes: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn put(key: &str, value: &str) -> Command {
        Command::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
            prev_revision: None,
        }
    }

    fn cas_put(key: &str, value: &str, prev: u64) -> Command {
        Command::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
            prev_revision: Some(Revision(prev)),
        }
    }

    fn del(key: &str) -> Command {
        Command::Delete {
            key: key.into(),
            prev_revision: None,
        }
    }

    #[test]
    fn compaction_follows_etcds_rules_and_changes_no_revision() {
        let mut kv = KvState::new();
        kv.apply(&put("a", "1"));
        kv.apply(&put("a", "2"));
        let compact = |kv: &mut KvState, r| {
            kv.apply(&Command::Compact {
                revision: Revision(r),
            })
        };
        assert_eq!(
            compact(&mut kv, 3).response,
            rejected(KvError::FutureRevision {
                revision: Revision(3),
                current: Revision(2)
            })
            .response
        );
        let done = compact(&mut kv, 2);
        assert_eq!(
            done.response,
            Response::Compacted {
                compact_revision: Revision(2)
            }
        );
        assert!(done.events.is_empty());
        assert_eq!(
            (kv.revision(), kv.compact_revision()),
            (Revision(2), Revision(2))
        );
        // Again at or below the mark: compacted, as etcd answers.
        assert!(matches!(
            compact(&mut kv, 1).response,
            Response::Rejected {
                error: KvError::Compacted { .. }
            }
        ));
        assert!(kv.check_revision(Revision(1)).is_err());
        assert!(kv.check_revision(Revision(2)).is_ok());
        // Replicated: a snapshot carries the mark.
        let restored = KvState::from_snapshot(kv.snapshot());
        assert_eq!(restored.compact_revision(), Revision(2));
        assert_eq!(restored.encode(), kv.encode());
    }

    #[test]
    fn data_bytes_follow_live_keys_and_values_and_survive_a_snapshot() {
        let mut kv = KvState::new();
        kv.apply(&put("ab", "123"));
        assert_eq!(kv.data_bytes(), 5);
        // An overwrite replaces the old value's bytes; it does not add to them.
        kv.apply(&put("ab", "1"));
        kv.apply(&put("c", ""));
        assert_eq!(kv.data_bytes(), 4);
        assert_eq!(KvState::from_snapshot(kv.snapshot()).data_bytes(), 4);
        kv.apply(&del("ab"));
        kv.apply(&del("missing"));
        assert_eq!(kv.data_bytes(), 1);
    }

    #[test]
    fn put_get_delete_track_revisions_and_versions() {
        let mut kv = KvState::new();
        assert_eq!(
            kv.apply(&put("a", "1")).response,
            Response::Put {
                revision: Revision(1)
            }
        );
        assert_eq!(
            kv.apply(&put("b", "x")).response,
            Response::Put {
                revision: Revision(2)
            }
        );
        kv.apply(&put("a", "2"));
        let a = kv.get("a").unwrap();
        assert_eq!(
            (
                a.value.as_str(),
                a.create_revision,
                a.mod_revision,
                a.version
            ),
            ("2", Revision(1), Revision(3), 2)
        );
        let deleted = kv.apply(&del("a"));
        assert_eq!(
            deleted.response,
            Response::Delete {
                revision: Revision(4),
                deleted: 1
            }
        );
        assert_eq!(deleted.events[0].kind, EventKind::Delete);
        assert_eq!(kv.get("a"), None);
        // A new incarnation starts over at version 1.
        kv.apply(&put("a", "3"));
        let a = kv.get("a").unwrap();
        assert_eq!((a.create_revision, a.version), (Revision(5), 1));
    }

    #[test]
    fn deleting_a_missing_key_changes_nothing() {
        let mut kv = KvState::new();
        kv.apply(&put("a", "1"));
        let out = kv.apply(&del("zzz"));
        assert_eq!(
            out.response,
            Response::Delete {
                revision: Revision(1),
                deleted: 0
            }
        );
        assert!(out.events.is_empty());
        assert_eq!(kv.revision(), Revision(1));
    }

    #[test]
    fn compare_and_set_succeeds_on_match_and_rejects_on_mismatch() {
        let mut kv = KvState::new();
        // 0 means "must not exist".
        assert_eq!(
            kv.apply(&cas_put("a", "1", 0)).response,
            Response::Put {
                revision: Revision(1)
            }
        );
        let mismatch = kv.apply(&cas_put("a", "2", 0));
        assert_eq!(
            mismatch.response,
            Response::Rejected {
                error: KvError::RevisionMismatch {
                    key: "a".into(),
                    expected: Revision(0),
                    actual: Revision(1)
                }
            }
        );
        assert!(mismatch.events.is_empty());
        assert_eq!(kv.revision(), Revision(1));
        assert_eq!(kv.get("a").unwrap().value, "1");
        assert_eq!(
            kv.apply(&cas_put("a", "2", 1)).response,
            Response::Put {
                revision: Revision(2)
            }
        );
        // CAS delete.
        let stale = kv.apply(&Command::Delete {
            key: "a".into(),
            prev_revision: Some(Revision(1)),
        });
        assert!(matches!(stale.response, Response::Rejected { .. }));
        let ok = kv.apply(&Command::Delete {
            key: "a".into(),
            prev_revision: Some(Revision(2)),
        });
        assert_eq!(
            ok.response,
            Response::Delete {
                revision: Revision(3),
                deleted: 1
            }
        );
    }

    #[test]
    fn put_with_unknown_lease_is_rejected_and_changes_nothing() {
        let mut kv = KvState::new();
        let out = kv.apply(&Command::Put {
            key: "a".into(),
            value: "v".into(),
            lease: Some("nope".into()),
            prev_revision: None,
        });
        assert_eq!(
            out.response,
            Response::Rejected {
                error: KvError::LeaseNotFound {
                    lease: "nope".into()
                }
            }
        );
        assert!(kv.is_empty());
        assert_eq!(kv.revision(), Revision(0));
    }

    #[test]
    fn prefix_listing_is_sorted_bounded_and_exact() {
        let mut kv = KvState::new();
        for k in ["b/2", "a", "b/1", "b", "c", "b/3", "b0"] {
            kv.apply(&put(k, k));
        }
        let keys: Vec<&str> = kv.list("b/", 100).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["b/1", "b/2", "b/3"]);
        let keys: Vec<&str> = kv.list("b/", 2).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["b/1", "b/2"]);
        assert_eq!(kv.list("", 100).len(), 7);
        assert!(kv.list("zz", 100).is_empty());
    }

    #[test]
    fn snapshot_round_trip_preserves_state() {
        let mut kv = KvState::new();
        kv.apply(&put("a", "1"));
        kv.apply(&put("b", "2"));
        kv.apply(&del("a"));
        let restored = KvState::from_snapshot(kv.snapshot());
        assert_eq!(restored.encode(), kv.encode());
        assert_eq!(restored.revision(), Revision(3));
    }

    fn lease_put(key: &str, lease: &str) -> Command {
        Command::Put {
            key: key.into(),
            value: "v".into(),
            lease: Some(lease.into()),
            prev_revision: None,
        }
    }

    fn register(name: &str) -> Command {
        Command::RegisterLease {
            name: name.into(),
            ttl_ms: 1000,
            clock_ms: None,
        }
    }

    fn expire(name: &str, revision: u64) -> Command {
        Command::ExpireLeases {
            leases: vec![LeaseRef {
                name: name.into(),
                revision: Revision(revision),
            }],
        }
    }

    fn lease_keys(kv: &KvState, name: &str) -> Vec<String> {
        kv.lease(name).unwrap().keys.iter().cloned().collect()
    }

    #[test]
    fn a_member_is_a_lease_and_an_attached_key_in_one_entry() {
        let mut kv = KvState::new();
        let reg = Command::RegisterMember {
            id: "n1".into(),
            address: "h:1".into(),
            ttl_ms: 3000,
            meta: BTreeMap::new(),
            clock_ms: None,
        };
        let out = kv.apply(&reg);
        assert_eq!(
            out.response,
            Response::MemberRegistered {
                revision: Revision(1),
                lease_revision: Revision(1)
            }
        );
        assert_eq!(out.events.len(), 1);
        assert_eq!(lease_keys(&kv, "members/n1"), ["members/n1"]);
        let v = kv.get("members/n1").unwrap();
        assert_eq!(MemberRecord::decode(&v.value).unwrap().address, "h:1");
        // A live registration blocks another of the same id.
        assert_eq!(
            kv.apply(&reg).response,
            Response::Rejected {
                error: KvError::MemberExists { id: "n1".into() }
            }
        );
        // Expiry takes the key with it.
        let gone = kv.apply(&expire("members/n1", 1));
        assert_eq!(gone.events[0].key, "members/n1");
        assert_eq!(gone.events[0].cause, Cause::LeaseExpired);
        assert!(kv.get("members/n1").is_none());
    }

    #[test]
    fn a_batch_applies_like_consecutive_entries() {
        let cmds = vec![
            put("a", "1"),
            cas_put("a", "2", 0),
            register("l"),
            lease_put("b", "l"),
        ];
        let mut one_by_one = KvState::new();
        let singles: Vec<Response> = cmds.iter().map(|c| one_by_one.apply(c).response).collect();
        let mut batched = KvState::new();
        let out = batched.apply(&Command::Batch {
            commands: cmds.clone(),
        });
        assert_eq!(out.response, Response::Batch { responses: singles });
        assert_eq!(batched.encode(), one_by_one.encode());
        assert_eq!(out.events.len(), 2);
        assert_eq!(out.lease_changes.len(), 1);
    }

    #[test]
    fn register_and_duplicate_registration() {
        let mut kv = KvState::new();
        let out = kv.apply(&register("l"));
        assert_eq!(
            out.response,
            Response::LeaseRegistered {
                revision: Revision(1)
            }
        );
        assert_eq!(
            out.lease_changes,
            vec![LeaseChange::Registered {
                name: "l".into(),
                revision: Revision(1),
                ttl_ms: 1000,
                checkpointed: false,
            }]
        );
        let dup = kv.apply(&register("l"));
        assert_eq!(
            dup.response,
            Response::Rejected {
                error: KvError::LeaseExists { lease: "l".into() }
            }
        );
        assert!(dup.lease_changes.is_empty());
        assert_eq!(kv.revision(), Revision(1));
    }

    #[test]
    fn attach_reattach_and_detach() {
        let mut kv = KvState::new();
        kv.apply(&register("l1"));
        kv.apply(&register("l2"));
        kv.apply(&lease_put("k", "l1"));
        assert_eq!(lease_keys(&kv, "l1"), ["k"]);
        assert_eq!(kv.get("k").unwrap().lease.as_deref(), Some("l1"));
        // Re-attach to another lease: it leaves the first.
        kv.apply(&lease_put("k", "l2"));
        assert!(lease_keys(&kv, "l1").is_empty());
        assert_eq!(lease_keys(&kv, "l2"), ["k"]);
        // A put without a lease detaches.
        kv.apply(&put("k", "plain"));
        assert!(lease_keys(&kv, "l2").is_empty());
        assert_eq!(kv.get("k").unwrap().lease, None);
        // Deleting a key detaches it.
        kv.apply(&lease_put("k", "l2"));
        kv.apply(&del("k"));
        assert!(lease_keys(&kv, "l2").is_empty());
    }

    #[test]
    fn expiry_deletes_keys_in_order_and_expiring_twice_is_a_no_op() {
        let mut kv = KvState::new();
        kv.apply(&register("l")); // revision 1
        kv.apply(&lease_put("b", "l")); // 2
        kv.apply(&lease_put("a", "l")); // 3
        kv.apply(&put("other", "x")); // 4
        let out = kv.apply(&expire("l", 1));
        let deleted: Vec<(&str, u64, Cause)> = out
            .events
            .iter()
            .map(|e| (e.key.as_str(), e.revision.0, e.cause))
            .collect();
        assert_eq!(
            deleted,
            [("a", 5, Cause::LeaseExpired), ("b", 5, Cause::LeaseExpired)],
            "one revision for the lease and all its keys"
        );
        assert_eq!(
            out.response,
            Response::LeasesExpired {
                revision: Revision(5),
                expired: vec!["l".into()]
            }
        );
        assert_eq!(
            out.lease_changes,
            vec![LeaseChange::Removed {
                name: "l".into(),
                cause: Cause::LeaseExpired
            }]
        );
        assert!(kv.lease("l").is_none() && kv.get("a").is_none() && kv.get("b").is_none());
        assert!(kv.get("other").is_some());
        // Again: nothing happens.
        let again = kv.apply(&expire("l", 1));
        assert!(again.events.is_empty() && again.lease_changes.is_empty());
        assert_eq!(kv.revision(), Revision(5));
    }

    #[test]
    fn a_late_expiry_never_removes_a_newer_incarnation() {
        let mut kv = KvState::new();
        kv.apply(&register("l")); // 1
        kv.apply(&expire("l", 1)); // 2
        kv.apply(&register("l")); // 3: a new incarnation
        let stale = kv.apply(&expire("l", 1));
        assert!(stale.lease_changes.is_empty());
        assert_eq!(kv.lease("l").unwrap().revision, Revision(3));
    }

    #[test]
    fn revoke_reports_deleted_keys_and_unknown_leases_are_rejected() {
        let mut kv = KvState::new();
        kv.apply(&register("l"));
        kv.apply(&lease_put("x", "l"));
        let out = kv.apply(&Command::RevokeLease { name: "l".into() });
        assert_eq!(
            out.response,
            Response::LeaseRevoked {
                revision: Revision(3),
                deleted_keys: vec!["x".into()]
            }
        );
        assert_eq!(out.events[0].cause, Cause::LeaseRevoked);
        let missing = kv.apply(&Command::RevokeLease { name: "l".into() });
        assert!(matches!(
            missing.response,
            Response::Rejected {
                error: KvError::LeaseNotFound { .. }
            }
        ));
    }

    #[test]
    fn checkpoints_record_and_clear_without_a_revision() {
        let mut kv = KvState::new();
        kv.apply(&register("l"));
        let cp = |remaining| Command::CheckpointLeases {
            checkpoints: vec![LeaseCheckpoint {
                name: "l".into(),
                revision: Revision(1),
                remaining_ms: remaining,
                clock_ms: None,
            }],
        };
        kv.apply(&cp(Some(400)));
        assert_eq!(kv.lease("l").unwrap().checkpoint_ms, Some(400));
        assert_eq!(kv.lease_facts()[0].checkpoint_ms, Some(400));
        kv.apply(&cp(None));
        assert_eq!(kv.lease("l").unwrap().checkpoint_ms, None);
        assert_eq!(kv.revision(), Revision(1));
        // A checkpoint of another incarnation is ignored.
        kv.apply(&Command::CheckpointLeases {
            checkpoints: vec![LeaseCheckpoint {
                name: "l".into(),
                revision: Revision(9),
                remaining_ms: Some(1),
                clock_ms: None,
            }],
        });
        assert_eq!(kv.lease("l").unwrap().checkpoint_ms, None);
    }

    fn command_strategy() -> impl Strategy<Value = Command> {
        let key = prop::sample::select(vec!["a", "b", "c", "a/1", "a/2", "é"]);
        let lease = prop::sample::select(vec!["l1", "l2"]);
        prop_oneof![
            (
                key.clone(),
                "[a-z]{0,4}",
                prop::option::of(lease.clone()),
                prop::option::of(0u64..8)
            )
                .prop_map(|(k, v, l, prev)| Command::Put {
                    key: k.to_string(),
                    value: v,
                    lease: l.map(str::to_string),
                    prev_revision: prev.map(Revision),
                }),
            (key, prop::option::of(0u64..8)).prop_map(|(k, prev)| Command::Delete {
                key: k.to_string(),
                prev_revision: prev.map(Revision),
            }),
            lease.clone().prop_map(register),
            lease
                .clone()
                .prop_map(|l| Command::RevokeLease { name: l.into() }),
            (lease, 0u64..20).prop_map(|(l, r)| expire(l, r)),
        ]
    }

    /// `lease.keys` and `key.lease` describe the same relation.
    fn attachments_agree(kv: &KvState) -> bool {
        let by_key = kv
            .list("", usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| v.lease.clone().map(|l| (l, k.to_string())));
        let by_key: BTreeSet<(String, String)> = by_key.collect();
        let by_lease: BTreeSet<(String, String)> = kv
            .leases()
            .iter()
            .flat_map(|(n, l)| l.keys.iter().map(move |k| (n.clone(), k.clone())))
            .collect();
        by_key == by_lease
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The same log applied twice gives byte-identical state and identical results.
        #[test]
        fn apply_is_deterministic(log in prop::collection::vec(command_strategy(), 0..60)) {
            let mut a = KvState::new();
            let mut b = KvState::new();
            for cmd in &log {
                prop_assert_eq!(a.apply(cmd), b.apply(cmd));
                prop_assert!(attachments_agree(&a));
            }
            prop_assert_eq!(a.encode(), b.encode());
        }

        /// Revisions: one step per request that changes something (its changes share the
        /// revision), events in non-decreasing revision order within the span the command
        /// advanced, and each key's counters consistent.
        #[test]
        fn revisions_advance_once_per_request(log in prop::collection::vec(command_strategy(), 0..60)) {
            let mut kv = KvState::new();
            for cmd in &log {
                let before = kv.revision();
                let out = kv.apply(cmd);
                let advance = kv.revision().0 - before.0;
                let changes = (out.events.len() + out.lease_changes.len()) as u64;
                let mut distinct = std::collections::BTreeSet::new();
                let mut last = before;
                for e in &out.events {
                    prop_assert!(e.revision > before && e.revision >= last && e.revision <= kv.revision());
                    last = e.revision;
                    distinct.insert(e.revision);
                }
                prop_assert!(advance <= changes, "a revision without a change");
                prop_assert!(distinct.len() as u64 <= advance);
                prop_assert_eq!(changes > 0, advance > 0);
                let mut inner = cmd;
                while let Command::Guarded { command, .. } = inner {
                    inner = command;
                }
                if !matches!(inner, Command::Batch { .. } | Command::ExpireLeases { .. }) {
                    prop_assert!(advance <= 1, "one request, one revision: {:?}", inner);
                }
                for (_, v) in kv.list("", usize::MAX) {
                    prop_assert!(v.create_revision <= v.mod_revision);
                    prop_assert!(v.mod_revision <= kv.revision());
                    prop_assert!(v.version >= 1);
                }
            }
            // The snapshot restores the same bytes.
            prop_assert_eq!(KvState::from_snapshot(kv.snapshot()).encode(), kv.encode());
        }
    }
}
