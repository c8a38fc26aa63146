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

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::auth::KeyRange;
use super::command::{Event, KvError};
use super::kv::{KvState, Versioned};
use super::range::{RangeResult, RangeSpec, evaluate};
use super::types::Revision;

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
    /// Compared as bytes.
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
        CompareTarget::Value(expected) => {
            v.is_some_and(|v| ordered(c.op, v.value.as_bytes(), expected.as_slice()))
        }
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

/// One operation of a transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// A transaction refused at the edge (etcd's messages, without its `etcdserver: ` prefix).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TxnInvalid {
    #[error("too many operations in txn request")]
    TooManyOps,
    #[error("duplicate key given in txn request")]
    DuplicateKey,
    #[error("key is not provided")]
    EmptyKey,
    #[error("value is provided")]
    ValueProvided,
    #[error("lease is provided")]
    LeaseProvided,
}

/// Validate a transaction before it is proposed: at most `max_ops` compares and operations per
/// branch (nested transactions included), no empty key, no value or lease given with
/// `ignore_value` / `ignore_lease`, and no key written twice on one path (two puts, or a put
/// inside a deleted range; the two branches of a nested transaction may share keys).
pub fn check(txn: &Txn, max_ops: usize) -> Result<(), TxnInvalid> {
    check_shape(txn, max_ops)?;
    writes(&txn.success)?;
    writes(&txn.failure)?;
    Ok(())
}

fn check_shape(txn: &Txn, max_ops: usize) -> Result<(), TxnInvalid> {
    if txn
        .compares
        .len()
        .max(txn.success.len())
        .max(txn.failure.len())
        > max_ops
    {
        return Err(TxnInvalid::TooManyOps);
    }
    if txn.compares.iter().any(|c| c.range.start.is_empty()) {
        return Err(TxnInvalid::EmptyKey);
    }
    for op in txn.success.iter().chain(&txn.failure) {
        match op {
            TxnOp::Put {
                key,
                value,
                lease,
                ignore_value,
                ignore_lease,
                ..
            } => {
                if key.is_empty() {
                    return Err(TxnInvalid::EmptyKey);
                }
                if *ignore_value && !value.is_empty() {
                    return Err(TxnInvalid::ValueProvided);
                }
                if *ignore_lease && lease.is_some() {
                    return Err(TxnInvalid::LeaseProvided);
                }
            }
            TxnOp::DeleteRange { range, .. } if range.start.is_empty() => {
                return Err(TxnInvalid::EmptyKey);
            }
            TxnOp::Range { spec, .. } if spec.range.start.is_empty() => {
                return Err(TxnInvalid::EmptyKey);
            }
            TxnOp::Txn { txn } => check_shape(txn, max_ops)?,
            TxnOp::DeleteRange { .. } | TxnOp::Range { .. } => {}
        }
    }
    Ok(())
}

/// The keys `ops` put and the ranges they delete, refusing a key written twice.
fn writes(ops: &[TxnOp]) -> Result<(BTreeSet<&str>, Vec<&KeyRange>), TxnInvalid> {
    let mut deleted: Vec<&KeyRange> = ops
        .iter()
        .filter_map(|op| match op {
            TxnOp::DeleteRange { range, .. } => Some(range),
            _ => None,
        })
        .collect();
    let in_deleted =
        |deleted: &[&KeyRange], k: &str| deleted.iter().any(|r| r.contains(k.as_bytes()));
    let mut puts: BTreeSet<&str> = BTreeSet::new();
    for op in ops {
        let TxnOp::Txn { txn } = op else { continue };
        let (then_puts, then_dels) = writes(&txn.success)?;
        let (else_puts, else_dels) = writes(&txn.failure)?;
        for k in &then_puts {
            if puts.contains(k) || in_deleted(&deleted, k) {
                return Err(TxnInvalid::DuplicateKey);
            }
        }
        for k in &else_puts {
            // Only one branch runs: a key both branches put is written once.
            if (puts.contains(k) && !then_puts.contains(k)) || in_deleted(&deleted, k) {
                return Err(TxnInvalid::DuplicateKey);
            }
        }
        puts.extend(then_puts);
        puts.extend(else_puts);
        deleted.extend(then_dels);
        deleted.extend(else_dels);
    }
    for op in ops {
        let TxnOp::Put { key, .. } = op else { continue };
        if !puts.insert(key.as_str()) || in_deleted(&deleted, key) {
            return Err(TxnInvalid::DuplicateKey);
        }
    }
    Ok((puts, deleted))
}

/// The branches a transaction takes, decided before any change: etcd evaluates every compare
/// of a transaction (nested ones included) against the state before it.
struct Path {
    succeeded: bool,
    /// One path per nested transaction of the chosen branch, in order.
    nested: Vec<Path>,
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

    /// The operations a path runs.
    fn branch(&self, succeeded: bool) -> &[TxnOp] {
        if succeeded {
            &self.success
        } else {
            &self.failure
        }
    }
}

impl KvState {
    /// Apply a transaction: choose the path, check it, run it. One revision for every change.
    pub(super) fn apply_txn(&mut self, txn: &Txn) -> Result<(TxnResult, Vec<Event>), KvError> {
        let path = self.choose(txn);
        self.precheck(txn, &path, &mut false)?;
        let begin = self.revision();
        let mut events = Vec::new();
        let result = self.run(txn, &path, begin, &mut events);
        Ok((result, events))
    }

    fn choose(&self, txn: &Txn) -> Path {
        let succeeded = txn
            .compares
            .iter()
            .all(|c| holds(c, self.range(&c.range).map(|(_, v)| v)));
        let nested = txn
            .branch(succeeded)
            .iter()
            .filter_map(|op| match op {
                TxnOp::Txn { txn } => Some(self.choose(txn)),
                _ => None,
            })
            .collect();
        Path { succeeded, nested }
    }

    /// What could refuse the transaction, on its path, against the state before it.
    /// `changed`: whether an operation before this point of the path changes the store (then
    /// a range may read at the transaction's own revision, as in etcd).
    fn precheck(&self, txn: &Txn, path: &Path, changed: &mut bool) -> Result<(), KvError> {
        let mut nested = path.nested.iter();
        for op in txn.branch(path.succeeded) {
            match op {
                TxnOp::Put {
                    key,
                    lease,
                    ignore_value,
                    ignore_lease,
                    ..
                } => {
                    if (*ignore_value || *ignore_lease) && self.get(key).is_none() {
                        return Err(KvError::KeyNotFound { key: key.clone() });
                    }
                    if let Some(lease) = lease
                        && self.lease(lease).is_none()
                    {
                        return Err(KvError::LeaseNotFound {
                            lease: lease.clone(),
                        });
                    }
                    *changed = true;
                }
                TxnOp::Txn { txn } => {
                    if let Some(p) = nested.next() {
                        self.precheck(txn, p, changed)?;
                    }
                }
                // No key is written twice on a path (`check`): the state before the
                // transaction says whether this delete removes anything.
                TxnOp::DeleteRange { range, .. } => {
                    *changed |= self.range(range).next().is_some();
                }
                TxnOp::Range { at: Some(at), .. } => {
                    let newest = Revision(self.revision().0 + u64::from(*changed));
                    if *at > newest {
                        return Err(KvError::FutureRevision {
                            revision: *at,
                            current: newest,
                        });
                    }
                    self.check_revision((*at).min(self.revision()))?;
                }
                TxnOp::Range { at: None, .. } => {}
            }
        }
        Ok(())
    }

    /// Run the path; `begin` is the store revision before the transaction.
    fn run(
        &mut self,
        txn: &Txn,
        path: &Path,
        begin: Revision,
        events: &mut Vec<Event>,
    ) -> TxnResult {
        let mut nested = path.nested.iter();
        let mut results = Vec::new();
        for op in txn.branch(path.succeeded) {
            let result = match op {
                TxnOp::Put {
                    key,
                    value,
                    lease,
                    ignore_value,
                    ignore_lease,
                    prev_kv,
                } => {
                    let before = self.get(key).cloned();
                    let value = match (&before, ignore_value) {
                        (Some(b), true) => b.value.clone(),
                        _ => value.clone(),
                    };
                    let lease = match (&before, ignore_lease) {
                        (Some(b), true) => b.lease.clone(),
                        _ => lease.clone(),
                    };
                    let applied = self.put(key, &value, lease.as_deref(), None);
                    events.extend(applied.events);
                    OpResult::Put {
                        prev: before.filter(|_| *prev_kv).map(|v| (key.clone(), v)),
                    }
                }
                TxnOp::DeleteRange { range, prev_kv } => {
                    let doomed: Vec<(String, Versioned)> = self
                        .range(range)
                        .map(|(k, v)| (k.to_string(), v.clone()))
                        .collect();
                    for (k, _) in &doomed {
                        events.extend(self.delete_key(k));
                    }
                    OpResult::DeleteRange {
                        deleted: doomed.len() as u64,
                        prev: if *prev_kv { doomed } else { Vec::new() },
                    }
                }
                // Before the transaction's own changes, at its start or earlier: history.
                TxnOp::Range { at: Some(at), .. }
                    if *at < begin || (*at == begin && !events.is_empty()) =>
                {
                    OpResult::Range {
                        result: RangeResult::default(),
                        deferred: Some(*at),
                    }
                }
                TxnOp::Range { spec, .. } => OpResult::Range {
                    result: evaluate(spec, self.range(&spec.range)),
                    deferred: None,
                },
                TxnOp::Txn { txn } => match nested.next() {
                    Some(p) => OpResult::Txn {
                        result: self.run(txn, p, begin, events),
                    },
                    None => OpResult::Txn {
                        result: TxnResult::default(),
                    },
                },
            };
            results.push(result);
        }
        TxnResult {
            succeeded: path.succeeded,
            results,
        }
    }
}

/// A transaction that only reads, whose ranges may ask for a past revision (etcd's Txn with a
/// `RequestRange` at `revision`). It is served where reads are, not through the log (a logged
/// transaction's past ranges are only checked where it applies, then read by the node that
/// answers: [`fill_deferred`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadTxn {
    pub compares: Vec<Compare>,
    pub success: Vec<ReadOp>,
    pub failure: Vec<ReadOp>,
}

/// One operation of a [`ReadTxn`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadOp {
    /// A range at `at` (`None`: the transaction's revision).
    Range {
        spec: RangeSpec,
        at: Option<Revision>,
    },
    Txn {
        txn: ReadTxn,
    },
}

impl ReadTxn {
    /// Every key range it reads (compares and ranges, nested ones too): what the caller must
    /// be allowed to read.
    pub fn ranges(&self) -> Vec<&KeyRange> {
        let mut out: Vec<&KeyRange> = self.compares.iter().map(|c| &c.range).collect();
        for op in self.success.iter().chain(&self.failure) {
            match op {
                ReadOp::Range { spec, .. } => out.push(&spec.range),
                ReadOp::Txn { txn } => out.extend(txn.ranges()),
            }
        }
        out
    }

    /// As a logged transaction (ranges at the present): for the checks on shape and size that
    /// every transaction passes.
    pub fn as_txn(&self) -> Txn {
        fn ops(ops: &[ReadOp]) -> Vec<TxnOp> {
            ops.iter()
                .map(|op| match op {
                    ReadOp::Range { spec, at } => TxnOp::Range {
                        spec: spec.clone(),
                        at: *at,
                    },
                    ReadOp::Txn { txn } => TxnOp::Txn { txn: txn.as_txn() },
                })
                .collect()
        }
        Txn {
            compares: self.compares.clone(),
            success: ops(&self.success),
            failure: ops(&self.failure),
        }
    }
}

/// The live keys of a range at a revision, as a read-only transaction reads them.
pub type KeysAt = Vec<(String, Versioned)>;

/// Evaluate a read-only transaction at revision `now`: compares and present ranges at `now`,
/// the others at their own revision, every read through `read(range, revision)` (the live keys
/// of `range` at `revision`, from the MVCC history), so that all of it is one consistent view
/// whatever is applied meanwhile.
pub fn evaluate_read_only<E>(
    txn: &ReadTxn,
    now: Revision,
    read: &mut dyn FnMut(&KeyRange, Revision) -> Result<KeysAt, E>,
) -> Result<TxnResult, E> {
    let mut succeeded = true;
    for c in &txn.compares {
        let present = read(&c.range, now)?;
        if !holds(c, present.iter().map(|(_, v)| v)) {
            succeeded = false;
            break;
        }
    }
    let branch = if succeeded {
        &txn.success
    } else {
        &txn.failure
    };
    let mut results = Vec::with_capacity(branch.len());
    for op in branch {
        results.push(match op {
            ReadOp::Range { spec, at } => {
                let kvs = read(&spec.range, at.unwrap_or(now))?;
                OpResult::Range {
                    result: evaluate(spec, kvs.iter().map(|(k, v)| (k.as_str(), v))),
                    deferred: None,
                }
            }
            ReadOp::Txn { txn } => OpResult::Txn {
                result: evaluate_read_only(txn, now, read)?,
            },
        });
    }
    Ok(TxnResult { succeeded, results })
}

/// Whether a logged transaction's result still has ranges at a past revision to read.
pub fn has_deferred(result: &TxnResult) -> bool {
    result.results.iter().any(|r| match r {
        OpResult::Range { deferred, .. } => deferred.is_some(),
        OpResult::Txn { result } => has_deferred(result),
        _ => false,
    })
}

/// Read the ranges a logged transaction deferred ([`OpResult::Range::deferred`]) through
/// `read(range, revision)` (the live keys of `range` at `revision`, from the history), so that
/// `result` answers as if the state machine had read them.
pub fn fill_deferred<E>(
    txn: &Txn,
    result: &mut TxnResult,
    read: &mut dyn FnMut(&KeyRange, Revision) -> Result<KeysAt, E>,
) -> Result<(), E> {
    for (op, r) in txn.branch(result.succeeded).iter().zip(&mut result.results) {
        match (op, r) {
            (TxnOp::Range { spec, .. }, OpResult::Range { result, deferred }) => {
                if let Some(at) = deferred.take() {
                    let kvs = read(&spec.range, at)?;
                    *result = evaluate(spec, kvs.iter().map(|(k, v)| (k.as_str(), v)));
                }
            }
            (TxnOp::Txn { txn }, OpResult::Txn { result }) => fill_deferred(txn, result, read)?,
            _ => {}
        }
    }
    Ok(())
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
mod tests {
    use super::*;

    fn v(value: &str, create: u64, modr: u64, version: u64, lease: Option<&str>) -> Versioned {
        Versioned {
            value: value.into(),
            create_revision: Revision(create),
            mod_revision: Revision(modr),
            version,
            lease: lease.map(str::to_string),
        }
    }

    fn cmp(op: CompareOp, target: CompareTarget) -> Compare {
        Compare {
            range: KeyRange::key("k"),
            op,
            target,
        }
    }

    #[test]
    fn a_missing_key_is_zero_for_counters_and_fails_every_value_compare() {
        let none: [&Versioned; 0] = [];
        assert!(holds(
            &cmp(CompareOp::Equal, CompareTarget::ModRevision(Revision(0))),
            none
        ));
        assert!(holds(
            &cmp(CompareOp::Equal, CompareTarget::Version(0)),
            none
        ));
        assert!(holds(
            &cmp(CompareOp::Equal, CompareTarget::Lease(None)),
            none
        ));
        for op in [
            CompareOp::Equal,
            CompareOp::NotEqual,
            CompareOp::Greater,
            CompareOp::Less,
        ] {
            assert!(!holds(&cmp(op, CompareTarget::Value(vec![])), none));
        }
    }

    #[test]
    fn each_target_and_operator() {
        let a = v("b", 3, 7, 2, Some("l1"));
        let one = [&a];
        let t = |op, target| holds(&cmp(op, target), one);
        assert!(t(CompareOp::Equal, CompareTarget::Value(b"b".to_vec())));
        assert!(t(CompareOp::Greater, CompareTarget::Value(b"a".to_vec())));
        assert!(t(CompareOp::Less, CompareTarget::Value(b"ba".to_vec())));
        assert!(t(CompareOp::NotEqual, CompareTarget::Version(1)));
        assert!(t(
            CompareOp::Less,
            CompareTarget::CreateRevision(Revision(4))
        ));
        assert!(t(CompareOp::Equal, CompareTarget::ModRevision(Revision(7))));
        assert!(!t(
            CompareOp::Greater,
            CompareTarget::ModRevision(Revision(7))
        ));
        assert!(t(CompareOp::Equal, CompareTarget::Lease(Some("l1".into()))));
        assert!(t(CompareOp::Greater, CompareTarget::Lease(None)));
    }

    #[test]
    fn over_a_range_every_present_key_must_hold() {
        let a = v("x", 1, 1, 1, None);
        let b = v("x", 2, 5, 3, None);
        let both = [&a, &b];
        let mut c = cmp(CompareOp::Equal, CompareTarget::Value(b"x".to_vec()));
        c.range = KeyRange::from_etcd(b"k", b"z");
        assert!(holds(&c, both));
        c.target = CompareTarget::Version(1);
        assert!(!holds(&c, both), "b is at version 3");
        c.op = CompareOp::Greater;
        c.target = CompareTarget::ModRevision(Revision(0));
        assert!(holds(&c, both));
    }

    fn apply(kv: &mut KvState, txn: Txn) -> (Revision, TxnResult, Vec<Event>) {
        let applied = kv.apply(&crate::domain::command::Command::Txn { txn });
        match applied.response {
            crate::domain::command::Response::Txn { revision, outcome } => {
                (revision, outcome, applied.events)
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    fn del(range: KeyRange, prev_kv: bool) -> TxnOp {
        TxnOp::DeleteRange { range, prev_kv }
    }

    /// A range at `at` (None: the txn's own revision) of one key.
    fn get_at(key: &str, at: Option<u64>) -> TxnOp {
        TxnOp::Range {
            spec: RangeSpec::all(KeyRange::key(key)),
            at: at.map(Revision),
        }
    }

    #[test]
    fn ranges_at_a_past_revision_in_a_writing_txn_are_checked_on_apply_and_read_after() {
        let mut kv = KvState::new();
        for v in ["v1", "v2", "v3"] {
            apply(
                &mut kv,
                Txn {
                    success: vec![put("k", v)],
                    ..Txn::default()
                },
            );
        }
        // The store is at 3. A past range is left to the answering node, checked; the txn's
        // own revision (after its put) and its start (before any change) read the present.
        let t = Txn {
            success: vec![
                get_at("k", Some(1)),
                get_at("k", Some(3)),
                put("other", "x"),
                get_at("k", Some(3)),
                get_at("other", Some(4)),
            ],
            ..Txn::default()
        };
        let (rev, mut out, _) = apply(&mut kv, t.clone());
        assert_eq!(rev, Revision(4));
        assert!(has_deferred(&out));
        let value = |r: &OpResult| match r {
            OpResult::Range { result, deferred } => {
                (result.kvs.first().map(|(_, v)| v.value.clone()), *deferred)
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(value(&out.results[0]), (None, Some(Revision(1))));
        assert_eq!(value(&out.results[1]), (Some("v3".into()), None));
        assert_eq!(value(&out.results[3]), (None, Some(Revision(3))));
        assert_eq!(value(&out.results[4]), (Some("x".into()), None));
        // The answering node reads the deferred ones from its history.
        let mut asked = Vec::new();
        fill_deferred(&t, &mut out, &mut |range, at| {
            asked.push(at);
            let value = if at == Revision(1) { "v1" } else { "v3" };
            let key = String::from_utf8(range.start.clone()).unwrap();
            Ok::<_, ()>(vec![(key, v(value, 1, at.0, at.0, None))])
        })
        .unwrap();
        assert_eq!(asked, [Revision(1), Revision(3)]);
        assert!(!has_deferred(&out));
        assert_eq!(value(&out.results[0]), (Some("v1".into()), None));
        assert_eq!(value(&out.results[3]), (Some("v3".into()), None));

        // The store is at 4. A future revision fails the txn whole (6 is ahead even after its
        // put, which makes 5), as does a revision below the compaction mark; nothing changes.
        let before = kv.revision();
        for (at, refused) in [(6, "after a put"), (7, "after a put")] {
            let applied = kv.apply(&crate::domain::command::Command::Txn {
                txn: Txn {
                    success: vec![put("z", "1"), get_at("k", Some(at))],
                    ..Txn::default()
                },
            });
            assert!(
                matches!(
                    applied.response,
                    crate::domain::command::Response::Rejected {
                        error: KvError::FutureRevision { .. }
                    }
                ),
                "{refused}: {:?}",
                applied.response
            );
        }
        // Without a change before it, the txn's own revision is the store's: 5 is ahead.
        let applied = kv.apply(&crate::domain::command::Command::Txn {
            txn: Txn {
                success: vec![get_at("k", Some(5)), put("z", "1")],
                ..Txn::default()
            },
        });
        assert!(matches!(
            applied.response,
            crate::domain::command::Response::Rejected {
                error: KvError::FutureRevision { .. }
            }
        ));
        kv.apply(&crate::domain::command::Command::Compact {
            revision: Revision(2),
        });
        let applied = kv.apply(&crate::domain::command::Command::Txn {
            txn: Txn {
                success: vec![put("z", "1"), get_at("k", Some(1))],
                ..Txn::default()
            },
        });
        assert!(matches!(
            applied.response,
            crate::domain::command::Response::Rejected {
                error: KvError::Compacted { .. }
            }
        ));
        assert_eq!(kv.revision(), before);
        assert!(kv.get("z").is_none());
    }

    #[test]
    fn one_revision_for_every_change_and_one_event_per_key() {
        let mut kv = KvState::new();
        apply(
            &mut kv,
            Txn {
                success: vec![put("a", "1"), put("b", "2")],
                ..Txn::default()
            },
        );
        assert_eq!(kv.revision(), Revision(1));
        let (rev, out, events) = apply(
            &mut kv,
            Txn {
                success: vec![put("c", "3"), del(KeyRange::from_etcd(b"a", b"c"), true)],
                ..Txn::default()
            },
        );
        assert_eq!(rev, Revision(2));
        assert!(out.succeeded);
        assert_eq!(events.len(), 3);
        assert!(events.iter().all(|e| e.revision == Revision(2)));
        let OpResult::DeleteRange { deleted, prev } = &out.results[1] else {
            panic!()
        };
        assert_eq!(*deleted, 2);
        assert_eq!(
            prev.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(kv.len(), 1);
    }

    #[test]
    fn compares_choose_the_branch_and_nested_compares_see_the_state_before() {
        let mut kv = KvState::new();
        let create = |key: &str| Txn {
            compares: vec![Compare {
                range: KeyRange::key(key),
                op: CompareOp::Equal,
                target: CompareTarget::ModRevision(Revision(0)),
            }],
            success: vec![put(key, "new")],
            failure: vec![TxnOp::Range {
                spec: RangeSpec::all(KeyRange::key(key)),
                at: None,
            }],
        };
        let (_, out, _) = apply(&mut kv, create("k"));
        assert!(out.succeeded);
        let (rev, out, events) = apply(&mut kv, create("k"));
        assert!(!out.succeeded);
        assert!(events.is_empty());
        assert_eq!(
            rev,
            Revision(1),
            "a txn that changes nothing takes no revision"
        );
        let OpResult::Range { result, .. } = &out.results[0] else {
            panic!()
        };
        assert_eq!(result.kvs[0].1.value, "new");
        // The nested compare is evaluated before the outer put of "n" runs.
        let outer = Txn {
            success: vec![put("n", "x"), TxnOp::Txn { txn: create("n") }],
            ..Txn::default()
        };
        assert_eq!(check(&outer, 128), Err(TxnInvalid::DuplicateKey));
        let outer = Txn {
            success: vec![put("m", "x"), TxnOp::Txn { txn: create("z") }],
            ..Txn::default()
        };
        let (_, out, events) = apply(&mut kv, outer);
        let OpResult::Txn { result } = &out.results[1] else {
            panic!()
        };
        assert!(result.succeeded);
        assert_eq!(events.len(), 2);
    }

    #[test]
    fn a_put_that_keeps_a_missing_key_refuses_the_whole_txn() {
        let mut kv = KvState::new();
        let keep = TxnOp::Put {
            key: "gone".into(),
            value: String::new(),
            lease: None,
            ignore_value: true,
            ignore_lease: false,
            prev_kv: false,
        };
        let applied = kv.apply(&crate::domain::command::Command::Txn {
            txn: Txn {
                success: vec![put("a", "1"), keep],
                ..Txn::default()
            },
        });
        assert_eq!(
            applied.response,
            crate::domain::command::Response::Rejected {
                error: KvError::KeyNotFound { key: "gone".into() }
            }
        );
        assert!(kv.is_empty() && kv.revision() == Revision(0));
    }

    /// A read-only transaction reads its compares and present ranges at its revision and the
    /// others at theirs, nested ones too, from the history.
    #[test]
    fn a_read_only_txn_reads_each_range_at_its_revision() {
        // The history of key `a`: "1" at revision 1, "2" at revision 2, deleted at 3.
        let history = |range: &KeyRange, at: Revision| -> Result<Vec<(String, Versioned)>, ()> {
            let a = match at.0 {
                1 => Some(v("1", 1, 1, 1, None)),
                2 => Some(v("2", 1, 2, 2, None)),
                _ => None,
            };
            Ok(a.filter(|_| range.contains(b"a"))
                .map(|v| ("a".to_string(), v))
                .into_iter()
                .collect())
        };
        let get = |at: Option<u64>| ReadOp::Range {
            spec: RangeSpec::all(KeyRange::key("a")),
            at: at.map(Revision),
        };
        let value_is = |value: &str| Compare {
            range: KeyRange::key("a"),
            op: CompareOp::Equal,
            target: CompareTarget::Value(value.as_bytes().to_vec()),
        };
        let values = |r: &OpResult| match r {
            OpResult::Range { result, .. } => result
                .kvs
                .iter()
                .map(|(_, v)| v.value.clone())
                .collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        let txn = ReadTxn {
            compares: vec![value_is("2")],
            success: vec![
                get(Some(1)),
                get(None),
                ReadOp::Txn {
                    txn: ReadTxn {
                        compares: vec![value_is("1")],
                        success: vec![get(None)],
                        failure: vec![get(Some(1))],
                    },
                },
            ],
            failure: vec![get(Some(3))],
        };
        let out = evaluate_read_only(&txn, Revision(2), &mut |r, at| history(r, at)).unwrap();
        assert!(out.succeeded);
        assert_eq!(values(&out.results[0]), ["1"]);
        assert_eq!(values(&out.results[1]), ["2"]);
        match &out.results[2] {
            OpResult::Txn { result } => {
                assert!(!result.succeeded, "the nested compare reads revision 2 too");
                assert_eq!(values(&result.results[0]), ["1"]);
            }
            other => panic!("{other:?}"),
        }
        // At revision 3 the key is gone: the failure branch runs.
        let out = evaluate_read_only(&txn, Revision(3), &mut |r, at| history(r, at)).unwrap();
        assert!(!out.succeeded);
        assert!(values(&out.results[0]).is_empty());
        assert_eq!(txn.ranges().len(), 7);
        assert_eq!(txn.as_txn().success.len(), 3);
    }

    #[test]
    fn the_edge_refuses_what_etcd_refuses() {
        let twice = Txn {
            success: vec![put("a", "1"), put("a", "2")],
            ..Txn::default()
        };
        assert_eq!(check(&twice, 128), Err(TxnInvalid::DuplicateKey));
        let in_deleted = Txn {
            success: vec![del(KeyRange::prefix("a"), false), put("ab", "2")],
            ..Txn::default()
        };
        assert_eq!(check(&in_deleted, 128), Err(TxnInvalid::DuplicateKey));
        // The two branches of a nested txn may put the same key, once.
        let branches = Txn {
            success: vec![TxnOp::Txn {
                txn: Txn {
                    success: vec![put("a", "1")],
                    failure: vec![put("a", "2")],
                    ..Txn::default()
                },
            }],
            ..Txn::default()
        };
        assert_eq!(check(&branches, 128), Ok(()));
        let many = Txn {
            success: (0..3).map(|i| put(&i.to_string(), "")).collect(),
            ..Txn::default()
        };
        assert_eq!(check(&many, 2), Err(TxnInvalid::TooManyOps));
        let empty = Txn {
            success: vec![put("", "")],
            ..Txn::default()
        };
        assert_eq!(check(&empty, 128), Err(TxnInvalid::EmptyKey));
    }
}
