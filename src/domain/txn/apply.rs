//! The apply of a transaction, as an `impl KvState`: choose the path, check it, run it.
//!
//! # Invariants
//! - Every compare, nested ones included, is evaluated against the state before the
//!   transaction: the whole path is chosen before the first change.
//! - Everything that could refuse the transaction on that path (an unknown lease, `ignore_value`
//!   or `ignore_lease` on a missing key, a range at a compacted or future revision) is checked
//!   before the first change: a refused transaction changes nothing. That includes an answer
//!   too large to give: its ranges and `prev_kv`s are charged to one
//!   [`ResultBudget`] (counted on the state before the transaction, the same on every
//!   member) before anything is copied, so a small request cannot make every member copy the
//!   store.
//! - Every change shares the request's one revision; a transaction that changes nothing takes
//!   none.
//!
//! # What it must not do
//! Fail half-way, or read a past revision: the state holds only the present, so such a range is
//! marked deferred for the node that answers ([`super::fill_deferred`]).

use super::{OpResult, Txn, TxnOp, TxnResult, holds};
use crate::domain::command::{Event, KvError};
use crate::domain::kv::{KvState, Versioned};
use crate::domain::range::{self, RangeResult, ResultBudget, evaluate};
use crate::domain::types::Revision;

/// The branches a transaction takes, decided before any change: etcd evaluates every compare
/// of a transaction (nested ones included) against the state before it.
struct Path {
    succeeded: bool,
    /// One path per nested transaction of the chosen branch, in order.
    nested: Vec<Path>,
}

impl KvState {
    /// Apply a transaction: choose the path, check it, run it. One revision for every change.
    pub(in crate::domain) fn apply_txn(
        &mut self,
        txn: &Txn,
    ) -> Result<(TxnResult, Vec<Event>), KvError> {
        let path = self.choose(txn);
        self.precheck(txn, &path, &mut false, &mut ResultBudget::default())?;
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
    /// a range may read at the transaction's own revision, as in etcd). `budget`: what the
    /// answer may still take; ranges are charged as the state before the transaction holds
    /// them (the transaction's own puts, bounded by the request's size, are not counted).
    fn precheck(
        &self,
        txn: &Txn,
        path: &Path,
        changed: &mut bool,
        budget: &mut ResultBudget,
    ) -> Result<(), KvError> {
        let mut nested = path.nested.iter();
        for op in txn.branch(path.succeeded) {
            match op {
                TxnOp::Put {
                    key,
                    lease,
                    ignore_value,
                    ignore_lease,
                    prev_kv,
                    ..
                } => {
                    if *prev_kv && let Some(before) = self.get(key) {
                        budget.charge(key, Some(before))?;
                    }
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
                        self.precheck(txn, p, changed, budget)?;
                    }
                }
                // No key is written twice on a path (`check`): the state before the
                // transaction says whether this delete removes anything.
                TxnOp::DeleteRange { range, prev_kv } => {
                    *changed |= self.range(range).next().is_some();
                    if *prev_kv {
                        for (k, v) in self.range(range) {
                            budget.charge(k, Some(v))?;
                        }
                    }
                }
                TxnOp::Range { at: Some(at), spec } => {
                    let newest = Revision(self.revision().0 + u64::from(*changed));
                    if *at > newest {
                        return Err(KvError::FutureRevision {
                            revision: *at,
                            current: newest,
                        });
                    }
                    self.check_revision((*at).min(self.revision()))?;
                    // At the transaction's own revision it is read from the state (`run`);
                    // an earlier one is read from the history by the member that answers.
                    if *at >= self.revision() {
                        range::charge(spec, self.range(&spec.range), budget)?;
                    }
                }
                TxnOp::Range { at: None, spec } => {
                    range::charge(spec, self.range(&spec.range), budget)?;
                }
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
                    // The values only when asked for: a delete of a large range would
                    // otherwise copy every value it removes.
                    let doomed: Vec<(String, Option<Versioned>)> = self
                        .range(range)
                        .map(|(k, v)| (k.to_string(), prev_kv.then(|| v.clone())))
                        .collect();
                    for (k, _) in &doomed {
                        events.extend(self.delete_key(k));
                    }
                    OpResult::DeleteRange {
                        deleted: doomed.len() as u64,
                        prev: doomed
                            .into_iter()
                            .filter_map(|(k, v)| Some((k, v?)))
                            .collect(),
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
