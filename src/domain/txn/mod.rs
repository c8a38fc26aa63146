//! Transaction compares (etcd's `Compare`): the guard of a transaction, evaluated against the
//! state before the transaction. Pure.
//!
//! A transaction ([`Txn`]) is one command: its compares are evaluated against the state before
//! it, one branch of operations runs (put, delete-range, range, nested txn), and every change
//! shares one revision. [`check`] is the edge validation (etcd's `checkTxnRequest` and
//! `checkIntervals`); the apply lives here too, as an `impl KvState`.
//!
//! # Semantics (as etcd's `applyCompare`)
//! - A compare names a key, or a range `[key, range_end)`, a target (value, version, create
//!   revision, mod revision, lease) and an operator (`=`, `!=`, `>`, `<`).
//! - Over a range, every key present must satisfy it.
//! - A compare on the value is exact for `=` and `!=` and in the order of the raw bytes for `>`
//!   and `<` (a value stored as NUL and base64 by the etcd API compares as its bytes:
//!   [`super::value_bytes`]).
//! - When no key is present: a compare on the value fails (there is no value to compare), and
//!   the other targets compare against zero (version 0, revision 0, no lease), so
//!   `mod_revision == 0` means "does not exist", as etcd clients use it to create.
//! - A range at a past revision (`TxnOp::Range::at`) fails the whole transaction when it is
//!   below the compaction mark or after the transaction's own revision (etcd's `ErrCompacted`,
//!   `ErrFutureRev`); the state holds only the present, so the apply leaves the read to the node
//!   that answers ([`OpResult::Range::deferred`], [`fill_deferred`]).
//!
//! # What it must not do
//! [`holds`] never reads the state itself: the caller hands in the versions present in the
//! range. The apply never fails half-way: everything that could refuse a transaction (an
//! unknown lease, `ignore_value` on a missing key) is checked on the chosen path before the
//! first change.
//!
//! # Layout
//! - here: the vocabulary (compares, operations, results), [`holds`], and the helpers for
//!   building transactions.
//! - `validate`: [`check`], the edge validation.
//! - `apply`: the apply, as an `impl KvState`.
//! - `read`: the reads at a past revision, through the history: read-only transactions
//!   ([`evaluate_read_only`]) and the ranges a logged transaction deferred ([`fill_deferred`]).

use serde::{Deserialize, Serialize};

use super::auth::KeyRange;
use super::kv::Versioned;
use super::range::{RangeResult, RangeSpec};
use super::types::Revision;
use super::value_bytes;

mod apply;
mod decode;
mod read;
mod validate;

pub use read::{KeysAt, ReadFor, ReadOp, ReadTxn, evaluate_read_only, fill_deferred, has_deferred};
pub use validate::{TxnInvalid, check};

/// How a compare compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompareOp {
    Equal,
    NotEqual,
    Greater,
    Less,
}

/// What a compare looks at, and the value it compares with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompareTarget {
    /// A value in its stored form ([`super::value_bytes`]: the etcd API stores its bytes with
    /// `value_bytes::store`). `=` and `!=` compare the stored forms exactly; `>` and `<` compare
    /// the raw bytes (`value_bytes::cmp`), as etcd does: for text that does not begin with NUL
    /// both are the text's bytes.
    Value(Vec<u8>),
    Version(u64),
    CreateRevision(Revision),
    ModRevision(Revision),
    /// The lease a key is attached to (`None`: none).
    Lease(Option<String>),
}

/// One guard of a transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compare {
    /// The key, or every key of a range.
    pub range: KeyRange,
    pub op: CompareOp,
    pub target: CompareTarget,
}

fn ordered<T: Ord>(op: CompareOp, actual: T, expected: T) -> bool {
    match op {
        CompareOp::Equal => actual == expected,
        CompareOp::NotEqual => actual != expected,
        CompareOp::Greater => actual > expected,
        CompareOp::Less => actual < expected,
    }
}

/// Whether one key's version (`None`: the key does not exist) satisfies `c`.
fn holds_for(c: &Compare, v: Option<&Versioned>) -> bool {
    match &c.target {
        CompareTarget::Value(expected) => v.is_some_and(|v| {
            let actual = v.value.as_bytes();
            match c.op {
                CompareOp::Equal => actual == expected.as_slice(),
                CompareOp::NotEqual => actual != expected.as_slice(),
                CompareOp::Greater | CompareOp::Less => ordered(
                    c.op,
                    value_bytes::cmp(actual, expected),
                    std::cmp::Ordering::Equal,
                ),
            }
        }),
        CompareTarget::Version(expected) => ordered(c.op, v.map_or(0, |v| v.version), *expected),
        CompareTarget::CreateRevision(expected) => ordered(
            c.op,
            v.map_or(Revision(0), |v| v.create_revision),
            *expected,
        ),
        CompareTarget::ModRevision(expected) => {
            ordered(c.op, v.map_or(Revision(0), |v| v.mod_revision), *expected)
        }
        // No lease sorts before every lease name, as lease id 0 sorts before every id.
        CompareTarget::Lease(expected) => ordered(
            c.op,
            v.and_then(|v| v.lease.as_deref()),
            expected.as_deref(),
        ),
    }
}

/// Whether `c` holds, given the versions of the keys present in its key or range.
pub fn holds<'a>(c: &Compare, present: impl IntoIterator<Item = &'a Versioned>) -> bool {
    let mut any = false;
    for v in present {
        any = true;
        if !holds_for(c, Some(v)) {
            return false;
        }
    }
    any || holds_for(c, None)
}

/// One operation of a transaction. Decoded by `decode` (the tag first, without serde's
/// buffering); a variant or field added here is added there too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TxnOp {
    Put {
        key: String,
        value: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<String>,
        /// Keep the key's current value (the key must exist).
        #[serde(default)]
        ignore_value: bool,
        /// Keep the key's current lease (the key must exist).
        #[serde(default)]
        ignore_lease: bool,
        /// Return the key as it was before.
        #[serde(default)]
        prev_kv: bool,
    },
    DeleteRange {
        range: KeyRange,
        #[serde(default)]
        prev_kv: bool,
    },
    Range {
        spec: RangeSpec,
        /// Read at this revision rather than the transaction's (etcd's `RequestRange` with a
        /// `revision`). At or below the store revision before the transaction, the result is
        /// left to the serving node ([`OpResult::Range::deferred`]): a past revision is
        /// immutable history, which the state machine's in-memory state does not hold.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<Revision>,
    },
    Txn {
        txn: Txn,
    },
}

/// A transaction: if every compare holds, `success` runs, else `failure`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Txn {
    #[serde(default)]
    pub compares: Vec<Compare>,
    #[serde(default)]
    pub success: Vec<TxnOp>,
    #[serde(default)]
    pub failure: Vec<TxnOp>,
}

/// What one operation did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpResult {
    Put {
        /// The key before the put, when asked for and present.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prev: Option<(String, Versioned)>,
    },
    DeleteRange {
        deleted: u64,
        /// The deleted keys, when asked for.
        #[serde(default)]
        prev: Vec<(String, Versioned)>,
    },
    Range {
        result: RangeResult,
        /// The range reads this past revision, not yet read: [`fill_deferred`] does it from the
        /// history, on the node that answers (`result` is empty until then).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deferred: Option<Revision>,
    },
    Txn {
        result: TxnResult,
    },
}

/// What a transaction did: which branch ran, and each of its operations' results.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxnResult {
    pub succeeded: bool,
    pub results: Vec<OpResult>,
}

impl Txn {
    /// The revisions its ranges read at, other than the transaction's own (nested ones too).
    pub fn read_revisions(&self) -> Vec<Revision> {
        let mut out = Vec::new();
        for op in self.success.iter().chain(&self.failure) {
            match op {
                TxnOp::Range { at: Some(at), .. } => out.push(*at),
                TxnOp::Txn { txn } => out.extend(txn.read_revisions()),
                _ => {}
            }
        }
        out
    }

    /// Whether it may touch a number of keys nothing bounds: a compare, read or delete over a
    /// range rather than one key (nested transactions too).
    pub fn may_touch_many_keys(&self) -> bool {
        let many = |r: &KeyRange| r.single_key().is_none();
        self.compares.iter().any(|c| many(&c.range))
            || self.success.iter().chain(&self.failure).any(|op| match op {
                TxnOp::Put { .. } => false,
                TxnOp::DeleteRange { range, .. } => many(range),
                TxnOp::Range { spec, .. } => many(&spec.range),
                TxnOp::Txn { txn } => txn.may_touch_many_keys(),
            })
    }

    /// Whether either branch may run a put (nested transactions too): the only operation
    /// that can grow the store, so the one a full storage quota refuses.
    pub fn may_put(&self) -> bool {
        self.success.iter().chain(&self.failure).any(|op| match op {
            TxnOp::Put { .. } => true,
            TxnOp::Txn { txn } => txn.may_put(),
            TxnOp::DeleteRange { .. } | TxnOp::Range { .. } => false,
        })
    }

    /// The operations a path runs.
    fn branch(&self, succeeded: bool) -> &[TxnOp] {
        if succeeded {
            &self.success
        } else {
            &self.failure
        }
    }
}

/// The number of operations a transaction may run when no limit is configured (etcd's
/// `--max-txn-ops` default).
pub const DEFAULT_MAX_TXN_OPS: usize = 128;

/// A put of `value` at `key`, for building transactions.
pub fn put(key: &str, value: &str) -> TxnOp {
    TxnOp::Put {
        key: key.to_string(),
        value: value.to_string(),
        lease: None,
        ignore_value: false,
        ignore_lease: false,
        prev_kv: false,
    }
}

#[cfg(test)]
mod tests;
