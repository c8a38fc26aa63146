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
//!
//! # Layout
//! - here: the state and its types, snapshots, the canonical encoding, and what the storage
//!   adapter takes after each apply (the dirty leases and auth state, the created keys'
//!   allocations for the key index).
//! - `apply`: [`KvState::apply`], one command at a time, and the commands made of several
//!   changes (compaction, member registration, batches, guarded commands).
//! - `keys`: puts and deletes, with the key's lease attachment and counters.
//! - `leases`: lease registration, revocation, expiry and checkpoints.
//! - `read`: the reads (keys, prefixes, ranges, leases, revisions).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::auth::AuthState;
use super::command::{Event, KvError, LeaseChange, Response};
use super::types::Revision;

mod apply;
mod keys;
mod leases;
mod read;

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

/// A live key as the state holds it: shared, not copied, with the key index
/// ([`crate::domain::key_index`]), and cloned for a count when a write copies a node of the
/// persistent map that a snapshot still holds. Serialized as a string.
pub type StoredKey = std::sync::Arc<str>;

/// The live keys, in key order: a persistent map, so that a copy (a snapshot's) shares the
/// nodes until one side writes to them. Serialized as a plain map.
pub type KeyMap = imbl::OrdMap<StoredKey, Versioned>;
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

/// How many created keys [`KvState::take_created_keys`] remembers between two calls: more than
/// an applied group of puts usually creates, and a bound for a caller that never takes them
/// (the domain's own tests apply without taking).
pub const CREATED_KEYS_KEPT: usize = 4096;

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
    /// The allocations of keys created since the last [`KvState::take_created_keys`], in the
    /// order their puts were applied, at most [`CREATED_KEYS_KEPT`] of them. The key index
    /// shares them without looking each key up again (a cold walk of the map per new key).
    created: Vec<StoredKey>,
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
            created: Vec::new(),
            auth: snapshot.auth,
            dirty_auth: false,
            lease_clock_ms,
            compact_revision: snapshot.compact_revision,
            data_bytes,
            request: None,
        }
    }

    /// The allocations of the keys created since the last call, in the order of their puts
    /// (at most [`CREATED_KEYS_KEPT`]: beyond that a key is not remembered, and a caller
    /// that needs its allocation looks it up, [`KvState::stored_key`]).
    pub fn take_created_keys(&mut self) -> Vec<StoredKey> {
        std::mem::take(&mut self.created)
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
mod tests;
