//! Compaction's sweep: bounded steps that remove the event records wholly at or below the
//! compaction mark, oldest first, keeping of each key they name only what compaction keeps,
//! with the index's changes to make with those writes.
//!
//! # Invariants
//! - A step stops once it has looked at its budget of events (whole records), so it never
//!   stalls an apply; it runs inside `apply`, never concurrently with an install.
//! - Of each key a removed record names, the newest version at or below the mark survives (as
//!   a base when its record goes); superseded bases go. Reads at the mark or later, and
//!   watches from after it, see no difference.
//! - A step is planned against the index as it was before the step, in record order: every
//!   replica writes the same.
//!
//! # What it must not do
//! Decide what is kept (`KeyIndex::plan_fold` does), or change the index before the caller
//! makes the step's writes.

use std::collections::HashMap;

use super::{History, corrupt, malformed};
use crate::domain::key_index::FoldEdit;
use crate::domain::mvcc::{
    EVENT_PREFIX, decode_events, encode_version_of, event_key, index_key, parse_event_key,
};
use crate::domain::types::Revision;
use crate::raft::state_writes::Writes;
use crate::storage::StorageError;

/// One step of the sweep ([`History::sweep`]).
#[derive(Debug, Default)]
pub struct Swept {
    /// Whether records at or below the mark are left.
    pub more: bool,
    /// The index's changes, to make with the step's writes ([`History::apply_folds`]).
    pub folds: Vec<(Box<[u8]>, FoldEdit)>,
    /// Whether the step removes anything.
    pub removes: bool,
}

impl History {
    /// One bounded step of the sweep towards `compact` (in `batch`): takes the event records
    /// wholly at or below it, oldest first, until `budget` events are looked at; for each key
    /// they name, keeps only what compaction keeps (a base written for a kept version whose
    /// record goes, superseded bases removed); then removes the records. The index is changed
    /// by the caller with the writes ([`History::apply_folds`]).
    pub fn sweep(
        &self,
        batch: &mut impl Writes,
        compact: Revision,
        budget: usize,
    ) -> Result<Swept, StorageError> {
        let index = self.index();
        let mut step = Swept::default();
        let mut seen = 0;
        for item in self.tree.range(EVENT_PREFIX.to_vec()..=event_key(compact)) {
            let (k, v) = item?;
            if seen >= budget {
                step.more = true;
                return Ok(step);
            }
            let record = parse_event_key(&k).ok_or_else(|| corrupt("history event", "bad key"))?;
            let events = decode_events(&v).map_err(malformed("history event"))?;
            seen += events.len().max(1);
            // Each key's last event here: the version compaction keeps, if it is in this
            // record (the record is wholly at or below the mark).
            let mut last: HashMap<&str, usize> = HashMap::new();
            for (i, e) in events.iter().enumerate() {
                last.insert(&e.key, i);
            }
            // Planned against the index as it was before this step: a key in two records of
            // one step is planned twice, the later record's plan last (and right). In the
            // record's order, so that every replica writes the same.
            for (i, e) in events.iter().enumerate() {
                if last.get(e.key.as_str()) != Some(&i) {
                    continue;
                }
                let plan = index.plan_fold(e.key.as_bytes(), compact, record);
                for dropped in plan.drop_bases {
                    batch.remove(index_key(&e.key, dropped));
                }
                if let Some(kept) = plan.write_base {
                    if e.revision != kept {
                        return Err(corrupt(
                            "history event",
                            "the version the index places in it is not its last of the key",
                        ));
                    }
                    batch.insert(index_key(&e.key, kept), encode_version_of(e));
                }
                step.folds.push((e.key.as_bytes().into(), plan.edit));
            }
            batch.remove(k);
            step.removes = true;
        }
        Ok(step)
    }

    /// Make a sweep step's changes to the index (with its writes, under the state's lock).
    pub fn apply_folds(&self, folds: Vec<(Box<[u8]>, FoldEdit)>) {
        if folds.is_empty() {
            return;
        }
        let mut index = self.index_mut();
        for (key, edit) in folds {
            index.apply_fold(&key, edit);
        }
    }
}
