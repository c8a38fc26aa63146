//! The edge validation of a transaction ([`check`], etcd's `checkTxnRequest` and
//! `checkIntervals`): what is refused before it is proposed, with etcd's messages.
//!
//! # Invariants
//! - At most `max_ops` compares and operations per branch, nested transactions included.
//! - No empty key; no value given with `ignore_value`, no lease given with `ignore_lease`.
//! - No key written twice on one path: two puts, or a put inside a range the path deletes. The
//!   two branches of a nested transaction may share keys, since only one of them runs.
//!
//! # What it must not do
//! Look at the state: the check is on the transaction alone, so it answers alike on every node.
//! The apply relies on it (no key written twice on a path).

use std::collections::BTreeSet;

use super::{Txn, TxnOp};
use crate::domain::auth::KeyRange;

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
    let in_deleted = |deleted: &[&KeyRange], k: &str| deleted.iter().any(|r| r.contains_stored(k));
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
