//! The reads of transactions at a past revision, through the MVCC history: read-only
//! transactions ([`ReadTxn`], [`evaluate_read_only`]), served where reads are, and the ranges a
//! logged transaction deferred ([`fill_deferred`]), read by the node that answers.
//!
//! # Invariants
//! - A read-only transaction evaluates its compares and its present ranges at one revision
//!   (`now`) and its other ranges at their own, every read through the one `read` it is given:
//!   one consistent view, whatever is applied meanwhile.
//! - [`fill_deferred`] reads only the ranges the apply deferred, on the branch that ran, and
//!   leaves every other result as the apply made it.
//!
//! # What it must not do
//! Read the state or the history itself, or change either: every read goes through the caller's
//! `read(what, revision)`.

use super::{Compare, OpResult, Txn, TxnOp, TxnResult, holds};
use crate::domain::auth::KeyRange;
use crate::domain::kv::Versioned;
use crate::domain::range::{RangeSpec, ResultBudget, ResultTooLarge, evaluate_within};
use crate::domain::types::Revision;

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

/// What a transaction's read of a range at a revision is for.
#[derive(Clone, Copy, Debug)]
pub enum ReadFor<'a> {
    /// A compare: every key of the range, whole.
    Compare(&'a KeyRange),
    /// A range's answer, within `budget` (what is left of the request's): the reader may
    /// drop the values the answer cannot hold and stop once over it
    /// ([`crate::domain::range::ReadBound`]), so that a range at a past revision is not read
    /// whole before the budget applies.
    Answer(&'a RangeSpec, ResultBudget),
}

impl ReadFor<'_> {
    /// The keys read.
    pub fn range(&self) -> &KeyRange {
        match self {
            ReadFor::Compare(range) => range,
            ReadFor::Answer(spec, _) => &spec.range,
        }
    }
}

/// Evaluate a read-only transaction at revision `now`: compares and present ranges at `now`,
/// the others at their own revision, every read through `read(what, revision)` (the live keys
/// of `range` at `revision`, from the MVCC history), so that all of it is one consistent view
/// whatever is applied meanwhile.
///
/// Every range's answer is charged to `budget` before it is copied: one that would pass it
/// fails the whole read ([`ResultTooLarge`]).
pub fn evaluate_read_only<E: From<ResultTooLarge>>(
    txn: &ReadTxn,
    now: Revision,
    read: &mut dyn FnMut(ReadFor<'_>, Revision) -> Result<KeysAt, E>,
    budget: &mut ResultBudget,
) -> Result<TxnResult, E> {
    let mut succeeded = true;
    for c in &txn.compares {
        let present = read(ReadFor::Compare(&c.range), now)?;
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
                let kvs = read(ReadFor::Answer(spec, *budget), at.unwrap_or(now))?;
                OpResult::Range {
                    result: evaluate_within(
                        spec,
                        kvs.iter().map(|(k, v)| (k.as_str(), v)),
                        budget,
                    )?,
                    deferred: None,
                }
            }
            ReadOp::Txn { txn } => OpResult::Txn {
                result: evaluate_read_only(txn, now, read, budget)?,
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
/// `read(what, revision)` (the live keys of `range` at `revision`, from the history), so that
/// `result` answers as if the state machine had read them, each charged to `budget` before it
/// is copied.
pub fn fill_deferred<E: From<ResultTooLarge>>(
    txn: &Txn,
    result: &mut TxnResult,
    read: &mut dyn FnMut(ReadFor<'_>, Revision) -> Result<KeysAt, E>,
    budget: &mut ResultBudget,
) -> Result<(), E> {
    for (op, r) in txn.branch(result.succeeded).iter().zip(&mut result.results) {
        match (op, r) {
            (TxnOp::Range { spec, .. }, OpResult::Range { result, deferred }) => {
                if let Some(at) = deferred.take() {
                    let kvs = read(ReadFor::Answer(spec, *budget), at)?;
                    *result =
                        evaluate_within(spec, kvs.iter().map(|(k, v)| (k.as_str(), v)), budget)?;
                }
            }
            (TxnOp::Txn { txn }, OpResult::Txn { result }) => {
                fill_deferred(txn, result, read, budget)?
            }
            _ => {}
        }
    }
    Ok(())
}
