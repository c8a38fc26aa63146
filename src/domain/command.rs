//! The Raft log vocabulary: [`Command`] in, [`Response`] and [`Event`] out.
//!
//! # Invariants
//! - A `Command` carries everything its apply needs: no apply reads a clock, a random source or
//!   local configuration, so every replica computes the same result from the same entry.
//! - Domain failures ([`KvError`]) are part of the applied result: an entry that fails a CAS is
//!   still applied (it changes nothing) and its error goes back to the client.
//! - The serialized form is the log format. Variants and fields may be added (with
//!   `#[serde(default)]`), never renamed or repurposed, because old entries stay in logs and
//!   snapshots.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::auth::{AuthChange, AuthError};
use super::txn::{Txn, TxnResult};
use super::types::Revision;

mod decode;

/// A state-machine command, proposed through Raft and applied on every replica. Decoded by
/// `decode` (the tag first, without serde's buffering); a variant or field added here is
/// added there too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Create or replace a key. With `prev_revision`, only if the key's current mod revision
    /// equals it (0: only if the key does not exist).
    Put {
        key: String,
        value: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prev_revision: Option<Revision>,
    },
    /// Delete a key. With `prev_revision`, only if its mod revision equals it.
    Delete {
        key: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prev_revision: Option<Revision>,
    },
    /// A transaction (see [`crate::domain::txn`]): compares, then one branch of operations,
    /// every change at one revision. etcd's `Put` and `DeleteRange` are transactions too.
    Txn { txn: Txn },
    /// Forget the key versions below `revision` (MVCC compaction, see
    /// [`crate::domain::mvcc`]): reads below it and watches from it answer `compacted`.
    /// Changes no key and no store revision.
    Compact { revision: Revision },
    /// Create a lease. The duplicate check happens here, at apply time. `clock_ms`: the
    /// leader's lease clock when it proposed the registration, which makes the registration a
    /// checkpoint (`remaining = ttl` at that clock; see [`crate::domain::lease`]).
    RegisterLease {
        name: String,
        ttl_ms: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clock_ms: Option<u64>,
    },
    /// Delete a lease and its keys (a client's decision).
    RevokeLease { name: String },
    /// Delete leases and their keys (the leader's decision). Each names the incarnation it
    /// means, so a late entry never removes a newer lease of the same name; a lease already gone
    /// is skipped.
    ExpireLeases { leases: Vec<LeaseRef> },
    /// Record (or clear, with `remaining_ms: None`) the remaining time of leases, so that a
    /// new leader does not restart their full TTL; each stamp also advances the lease clock.
    CheckpointLeases { checkpoints: Vec<LeaseCheckpoint> },
    /// The leader's lease clock, recorded while checkpoints are in force and nothing else
    /// stamped it lately: a node that restarts, and so dates the clock anew, then loses at most
    /// that interval (see [`crate::domain::lease::ClockWitness`]). Changes nothing else.
    LeaseClock { clock_ms: u64 },
    /// Several commands in one log entry (group commit), applied in order as if they were
    /// consecutive entries. A batch inside a batch is applied the same way.
    Batch { commands: Vec<Command> },
    /// Register member `id`: lease `members/{id}` and key `members/{id}` (value: the member
    /// record as JSON) attached to it, in one entry.
    RegisterMember {
        id: String,
        address: String,
        ttl_ms: u64,
        #[serde(default)]
        meta: BTreeMap<String, String>,
        /// As for `RegisterLease`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clock_ms: Option<u64>,
    },
    /// A change to users, roles or the auth switch (validated at apply, see
    /// [`crate::domain::auth`]). Changes no key and no store revision.
    Auth { change: AuthChange },
    /// `command` on behalf of `user`, while auth is on: apply checks the user's permission
    /// against the auth state as of this entry, and refuses with `permission_denied` if it no
    /// longer allows the command (a role revoked between the node's check and the commit).
    /// `user` is `""` for a request made without a token (allowed only while auth is off).
    Guarded { user: String, command: Box<Command> },
}

impl Command {
    /// The command under any [`Command::Guarded`] wrapper.
    pub fn inner_mut(&mut self) -> &mut Command {
        match self {
            Command::Guarded { command, .. } => command.inner_mut(),
            other => other,
        }
    }

    /// The highest lease clock stamp this command carries (registrations, checkpoints, and
    /// anything inside a batch or a guard), if any.
    pub fn lease_clock_stamp(&self) -> Option<u64> {
        match self {
            Command::RegisterLease { clock_ms, .. } | Command::RegisterMember { clock_ms, .. } => {
                *clock_ms
            }
            Command::LeaseClock { clock_ms } => Some(*clock_ms),
            Command::CheckpointLeases { checkpoints } => {
                checkpoints.iter().filter_map(|c| c.clock_ms).max()
            }
            Command::Batch { commands } => {
                commands.iter().filter_map(Self::lease_clock_stamp).max()
            }
            Command::Guarded { command, .. } => command.lease_clock_stamp(),
            Command::Put { .. }
            | Command::Delete { .. }
            | Command::Txn { .. }
            | Command::Compact { .. }
            | Command::RevokeLease { .. }
            | Command::ExpireLeases { .. }
            | Command::Auth { .. } => None,
        }
    }

    /// Whether applying this command may touch a number of keys that nothing bounds: a range
    /// delete or range read, or a lease's end (which deletes every key attached to it). Such
    /// an apply can take seconds; one that touches a known handful of keys cannot.
    pub fn may_touch_many_keys(&self) -> bool {
        match self {
            Command::Txn { txn } => txn.may_touch_many_keys(),
            Command::RevokeLease { .. } | Command::ExpireLeases { .. } => true,
            Command::Batch { commands } => commands.iter().any(Self::may_touch_many_keys),
            Command::Guarded { command, .. } => command.may_touch_many_keys(),
            Command::Put { .. }
            | Command::Delete { .. }
            | Command::Compact { .. }
            | Command::RegisterLease { .. }
            | Command::CheckpointLeases { .. }
            | Command::LeaseClock { .. }
            | Command::RegisterMember { .. }
            | Command::Auth { .. } => false,
        }
    }

    /// A cheap estimate of the encoded size, for batching and transport budgets.
    pub fn approx_bytes(&self) -> usize {
        const OVERHEAD: usize = 48;
        match self {
            Command::Put {
                key, value, lease, ..
            } => OVERHEAD + key.len() + value.len() + lease.as_ref().map_or(0, String::len),
            Command::Delete { key, .. } => OVERHEAD + key.len(),
            Command::Txn { txn } => OVERHEAD + txn_bytes(txn),
            Command::RegisterLease { name, .. } | Command::RevokeLease { name } => {
                OVERHEAD + name.len()
            }
            Command::ExpireLeases { leases } => {
                OVERHEAD + leases.iter().map(|l| l.name.len() + 16).sum::<usize>()
            }
            Command::CheckpointLeases { checkpoints } => {
                OVERHEAD + checkpoints.iter().map(|c| c.name.len() + 24).sum::<usize>()
            }
            Command::Batch { commands } => {
                OVERHEAD + commands.iter().map(Command::approx_bytes).sum::<usize>()
            }
            Command::RegisterMember {
                id, address, meta, ..
            } => {
                OVERHEAD
                    + id.len()
                    + address.len()
                    + meta
                        .iter()
                        .map(|(k, v)| k.len() + v.len() + 8)
                        .sum::<usize>()
            }
            Command::Auth { .. } => OVERHEAD + 256,
            Command::LeaseClock { .. } | Command::Compact { .. } => OVERHEAD,
            Command::Guarded { user, command } => user.len() + command.approx_bytes(),
        }
    }
}

/// A cheap estimate of a transaction's encoded size.
fn txn_bytes(txn: &Txn) -> usize {
    use super::txn::{CompareTarget, TxnOp};
    let range = |r: &super::auth::KeyRange| 8 + r.start.len() + r.end.as_ref().map_or(0, Vec::len);
    let compares: usize = txn
        .compares
        .iter()
        .map(|c| {
            16 + range(&c.range)
                + match &c.target {
                    CompareTarget::Value(v) => v.len(),
                    CompareTarget::Lease(l) => l.as_ref().map_or(0, String::len),
                    _ => 8,
                }
        })
        .sum();
    let ops: usize = txn
        .success
        .iter()
        .chain(&txn.failure)
        .map(|op| match op {
            TxnOp::Put {
                key, value, lease, ..
            } => 16 + key.len() + value.len() + lease.as_ref().map_or(0, String::len),
            TxnOp::DeleteRange { range: r, .. } => 16 + range(r),
            TxnOp::Range { spec, .. } => 64 + range(&spec.range),
            TxnOp::Txn { txn } => 16 + txn_bytes(txn),
        })
        .sum();
    compares + ops
}

/// One incarnation of a lease: its name and registration revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRef {
    pub name: String,
    pub revision: Revision,
}

/// A checkpoint of one lease incarnation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseCheckpoint {
    pub name: String,
    pub revision: Revision,
    pub remaining_ms: Option<u64>,
    /// The lease clock when `remaining_ms` was measured (see [`crate::domain::lease`]): a new
    /// leader ages the checkpoint by how far the clock has moved since. Absent in entries
    /// written before the lease clock existed (those checkpoints are not aged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_ms: Option<u64>,
}

/// The applied result of one log entry, returned to whoever proposed it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    /// An entry with no client payload (a leader's blank entry, a membership change).
    Empty,
    /// A put applied at `revision`.
    Put { revision: Revision },
    /// A delete; `deleted` is 0 when the key did not exist (the revision is then unchanged).
    Delete { revision: Revision, deleted: u32 },
    /// A transaction applied; `revision` is the store revision after it.
    Txn {
        revision: Revision,
        outcome: TxnResult,
    },
    /// A lease registered at `revision` (its fencing token).
    LeaseRegistered { revision: Revision },
    /// A lease revoked; its keys deleted in this order.
    LeaseRevoked {
        revision: Revision,
        deleted_keys: Vec<String>,
    },
    /// Leases expired (those still present), with the store revision after.
    LeasesExpired {
        revision: Revision,
        expired: Vec<String>,
    },
    /// The responses of a batch, in order.
    Batch { responses: Vec<Response> },
    /// A member registered: its lease at `lease_revision`, its key at `revision`.
    MemberRegistered {
        revision: Revision,
        lease_revision: Revision,
    },
    /// The history is compacted up to `compact_revision` (the store revision is unchanged).
    Compacted { compact_revision: Revision },
    /// An auth change applied; the auth revision after it.
    AuthChanged { auth_revision: u64 },
    /// The command was applied and changed nothing, for this reason.
    Rejected { error: KvError },
}

/// A deterministic domain failure decided at apply time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum KvError {
    /// A compare-and-set found another mod revision (0 when the key does not exist).
    #[error("key {key:?} is at revision {actual}, not {expected}")]
    RevisionMismatch {
        key: String,
        expected: Revision,
        actual: Revision,
    },
    /// A put or a revoke named a lease that does not exist when the entry applied.
    #[error("lease {lease:?} does not exist")]
    LeaseNotFound { lease: String },
    /// A put that keeps the key's value or lease (`ignore_value`, `ignore_lease`) found no key.
    #[error("key {key:?} does not exist")]
    KeyNotFound { key: String },
    /// A registration named a lease that already exists.
    #[error("lease {lease:?} already exists")]
    LeaseExists { lease: String },
    /// A member registration found a live registration of the same id.
    #[error("member {id:?} is already registered")]
    MemberExists { id: String },
    /// A compaction or a read at a revision that compaction has removed.
    #[error("revision {revision} is compacted: the oldest revision held is {compacted}")]
    Compacted {
        revision: Revision,
        compacted: Revision,
    },
    /// A compaction or a read at a revision the store has not reached.
    #[error("revision {revision} is in the future (the store is at {current})")]
    FutureRevision {
        revision: Revision,
        current: Revision,
    },
    /// A guarded command the user's permissions no longer allowed when it applied.
    #[error("permission denied")]
    PermissionDenied,
    /// An auth change refused by its validation.
    #[error("{error}")]
    Auth { error: AuthError },
    /// A transaction whose answer (its ranges and `prev_kv`s) would pass
    /// [`crate::domain::range::MAX_RESULT_BYTES`]: refused before it changes anything.
    #[error(
        "answer too large: the transaction's answer would take more than {limit} bytes (at least {bytes}): narrow its ranges, or use a limit, keys_only or count_only"
    )]
    ResultTooLarge { bytes: u64, limit: u64 },
}

impl From<crate::domain::range::ResultTooLarge> for KvError {
    fn from(e: crate::domain::range::ResultTooLarge) -> Self {
        KvError::ResultTooLarge {
            bytes: e.bytes,
            limit: e.limit,
        }
    }
}

/// A change to the set of leases, for the leader's tracker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseChange {
    Registered {
        name: String,
        revision: Revision,
        ttl_ms: u64,
        /// Registered with a clock stamp: a checkpoint is in force from the start.
        checkpointed: bool,
    },
    Removed {
        name: String,
        /// `LeaseRevoked` or `LeaseExpired`.
        cause: Cause,
    },
}

pub use leasecore_client::api::{Cause, Event, EventKind};
