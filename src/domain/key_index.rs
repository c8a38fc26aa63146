//! The key index: where every version of every key is kept, in memory (etcd's `treeIndex`).
//! Pure.
//!
//! An applied put no longer writes a version record of its own: its event record (one per
//! applied group, `h/` + last revision, [`super::mvcc`]) holds it, and this index says which
//! record. Versions that have no event record (a snapshot's or a restore's live keys, the
//! versions compaction keeps once their record goes) are *base* versions under their own
//! `v/` key. A history read takes the locations here and reads the records or bases.
//!
//! # Invariants
//! - A key's locations are sorted by revision, one per revision. When a version is both in
//!   a record and a base (a store of format 5 wrote both), the base is kept: it outlives
//!   the record.
//! - The index is a function of what is stored: rebuilt from the tree when a node opens,
//!   changed with the writes that make the change on disk (by the state machine under the
//!   state's write lock; by a history fill under its gate, once its records are all in).
//! - **Compaction through C** ([`KeyIndex::plan_fold`]) keeps, of the versions at or below
//!   C, only the newest, unless it is a tombstone (the rule of
//!   [`super::mvcc::dropped_by_compaction`]); a kept version whose record is being removed
//!   becomes a base (the caller writes it).
//!
//! # What it must not do
//! Touch storage, or decide what compaction keeps beyond that one rule.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

use smallvec::SmallVec;

use super::types::Revision;

/// Where one version of a key is kept: 16 bytes, as a million keys' worth adds up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    pub revision: Revision,
    /// The last revision of the event record holding it (0: a base version, under `v/`),
    /// and [`TOMBSTONE`].
    place: u64,
}

/// The bit of [`Loc::place`] that marks a deletion (revisions stay far below 2^63).
const TOMBSTONE: u64 = 1 << 63;

impl Loc {
    /// A version in the event record whose last revision is `record`.
    pub fn in_record(revision: Revision, record: Revision, tombstone: bool) -> Self {
        Loc::new(revision, (record.0 & !TOMBSTONE).max(1), tombstone)
    }

    /// A base version, under its own key.
    pub fn base(revision: Revision, tombstone: bool) -> Self {
        Loc::new(revision, 0, tombstone)
    }

    fn new(revision: Revision, record: u64, tombstone: bool) -> Self {
        let flag = if tombstone { TOMBSTONE } else { 0 };
        Loc {
            revision,
            place: record | flag,
        }
    }

    /// The event record holding it, or `None` for a base version.
    pub fn record(&self) -> Option<Revision> {
        let record = self.place & !TOMBSTONE;
        (record != 0).then_some(Revision(record))
    }

    /// Whether it is a deletion.
    pub fn tombstone(&self) -> bool {
        self.place & TOMBSTONE != 0
    }
}

/// A key of the index: the state's own allocation of a live key where it had one
/// ([`KeyIndex::add_shared`]), so that a million keys are not held twice.
pub type IndexKey = Arc<[u8]>;

/// A key and where one of its versions is.
pub type Located = (IndexKey, Loc);

/// A key's locations: most keys have one version, kept without an allocation of its own.
type Locs = SmallVec<[Loc; 1]>;

/// What compaction through a revision does to one key when one of its event records goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoldPlan {
    /// Base versions to remove: superseded, or a tombstone, at or below the mark.
    pub drop_bases: Vec<Revision>,
    /// The version compaction keeps, if it is in the record being removed: it must be
    /// written as a base.
    pub write_base: Option<Revision>,
    /// The index's change, once those writes are made ([`KeyIndex::apply_fold`]).
    pub edit: FoldEdit,
}

/// The index's side of a [`FoldPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoldEdit {
    through: Revision,
    keep: Option<Loc>,
}

/// Put `loc` among a key's locations, in revision order: how many versions that adds (0 or
/// 1). The same revision twice keeps a base over a record.
fn place(locs: &mut Locs, loc: Loc) -> usize {
    // Nearly always the newest: appended.
    if locs.last().is_none_or(|l| l.revision < loc.revision) {
        locs.push(loc);
        return 1;
    }
    match locs.binary_search_by_key(&loc.revision, |l| l.revision) {
        Ok(i) => {
            if loc.record().is_none() {
                locs[i] = loc;
            }
            0
        }
        Err(i) => {
            locs.insert(i, loc);
            1
        }
    }
}

/// Every key's versions.
#[derive(Clone, Debug, Default)]
pub struct KeyIndex {
    keys: BTreeMap<IndexKey, Locs>,
    versions: usize,
}

impl KeyIndex {
    /// How many versions are indexed.
    pub fn versions(&self) -> usize {
        self.versions
    }

    /// How many keys have a version.
    pub fn keys(&self) -> usize {
        self.keys.len()
    }

    /// Record a version. The same revision twice keeps a base over a record.
    pub fn add(&mut self, key: &[u8], loc: Loc) {
        self.add_shared(key, || key.into(), loc);
    }

    /// [`KeyIndex::add`], with `share` giving the key's allocation if the index has no
    /// version of it yet (the state's, when the key is live).
    pub fn add_shared(&mut self, key: &[u8], share: impl FnOnce() -> IndexKey, loc: Loc) {
        let locs = match self.keys.get_mut(key) {
            Some(l) => l,
            None => {
                let shared = share();
                debug_assert_eq!(&*shared, key);
                self.keys.entry(shared).or_default()
            }
        };
        self.versions += place(locs, loc);
    }

    /// [`KeyIndex::add_shared`] for a version that created its key (a put of version 1),
    /// given the key's allocation: the index seldom has such a key yet, so it is looked up
    /// once, to insert, rather than missed and looked up again (each lookup a walk of the
    /// tree comparing long keys: the second was about 3% of a put's instructions at 64
    /// connections, on every node).
    pub fn add_created(&mut self, key: IndexKey, loc: Loc) {
        let locs = self.keys.entry(key).or_default();
        self.versions += place(locs, loc);
    }

    /// `key`'s newest version at or below `at`.
    pub fn at(&self, key: &[u8], at: Revision) -> Option<Loc> {
        let locs = self.keys.get(key)?;
        let n = locs.partition_point(|l| l.revision <= at);
        n.checked_sub(1).map(|i| locs[i])
    }

    /// `key`'s newest version below `revision` (what a change at `revision` replaced).
    pub fn before(&self, key: &[u8], revision: Revision) -> Option<Loc> {
        self.at(key, Revision(revision.0.checked_sub(1)?))
    }

    /// The keys live at `at` within `(start, end)`, in key order, with where their version
    /// is: at most `limit` of them, looking at no more than `visit` keys (dead or alive). The
    /// key to go on after, when it stopped early (a long range is walked in pieces, the
    /// index's lock released between them).
    pub fn live_at(
        &self,
        start: Bound<&[u8]>,
        end: Bound<&[u8]>,
        at: Revision,
        limit: usize,
        visit: usize,
    ) -> (Vec<Located>, Option<IndexKey>) {
        if let (Bound::Included(s) | Bound::Excluded(s), Bound::Included(e) | Bound::Excluded(e)) =
            (start, end)
        {
            // BTreeMap::range panics on a reversed range; it is an empty one.
            if s > e
                || (s == e && !matches!((start, end), (Bound::Included(_), Bound::Included(_))))
            {
                return (Vec::new(), None);
            }
        }
        let mut out = Vec::new();
        for (visited, (key, locs)) in self.keys.range::<[u8], _>((start, end)).enumerate() {
            if out.len() >= limit || visited >= visit {
                return (out, Some(key.clone()));
            }
            let n = locs.partition_point(|l| l.revision <= at);
            if let Some(loc) = n.checked_sub(1).map(|i| locs[i])
                && !loc.tombstone()
            {
                out.push((key.clone(), loc));
            }
        }
        (out, None)
    }

    /// Add the versions of `older`, none newer than any version this index holds of its key
    /// (a history fill's; at the same revision a base wins), for at most `count` (at least
    /// one) keys after `after`: the key to go on after, if any is left. A key's versions are
    /// added at once.
    pub fn merge_older(
        &mut self,
        older: &KeyIndex,
        after: Option<&[u8]>,
        count: usize,
    ) -> Option<IndexKey> {
        let start = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut last = None;
        for (key, old) in older
            .keys
            .range::<[u8], _>((start, Bound::Unbounded))
            .take(count.max(1))
        {
            let locs = self.keys.entry(key.clone()).or_default();
            let before = locs.len();
            let mut merged: Locs = SmallVec::with_capacity(old.len() + locs.len());
            let (mut i, mut j) = (0, 0);
            loop {
                match (old.get(i), locs.get(j)) {
                    // The same version twice: a base wins.
                    (Some(x), Some(y)) if x.revision == y.revision => {
                        merged.push(if x.record().is_none() { *x } else { *y });
                        (i, j) = (i + 1, j + 1);
                    }
                    (Some(x), Some(y)) if x.revision < y.revision => {
                        merged.push(*x);
                        i += 1;
                    }
                    (Some(x), None) => {
                        merged.push(*x);
                        i += 1;
                    }
                    (_, Some(y)) => {
                        merged.push(*y);
                        j += 1;
                    }
                    (None, None) => break,
                }
            }
            self.versions = self.versions + merged.len() - before;
            *locs = merged;
            last = Some(key.clone());
        }
        let more = last.as_deref().is_some_and(|k| {
            older
                .keys
                .range::<[u8], _>((Bound::Excluded(k), Bound::Unbounded))
                .next()
                .is_some()
        });
        if more { last } else { None }
    }

    /// What compaction through `through` does to `key` as its event record `record` (wholly
    /// at or below `through`) is removed.
    pub fn plan_fold(&self, key: &[u8], through: Revision, record: Revision) -> FoldPlan {
        let locs = self.keys.get(key).map_or(&[][..], |l| l.as_slice());
        let n = locs.partition_point(|l| l.revision <= through);
        let held = &locs[..n];
        let newest = held.last().copied();
        let kept = newest.filter(|l| !l.tombstone());
        let drop_bases = held
            .iter()
            .filter(|l| l.record().is_none() && Some(**l) != kept)
            .map(|l| l.revision)
            .collect();
        let write_base = kept
            .filter(|l| l.record() == Some(record))
            .map(|l| l.revision);
        let keep = kept.map(|l| match write_base {
            Some(_) => Loc::base(l.revision, false),
            None => l,
        });
        FoldPlan {
            drop_bases,
            write_base,
            edit: FoldEdit { through, keep },
        }
    }

    /// Make a fold's change, once its writes are made.
    pub fn apply_fold(&mut self, key: &[u8], edit: FoldEdit) {
        let Some(locs) = self.keys.get_mut(key) else {
            return;
        };
        let before = locs.len();
        locs.retain(|l| l.revision > edit.through);
        if let Some(keep) = edit.keep {
            locs.insert(0, keep);
        }
        self.versions = self.versions + locs.len() - before;
        if locs.is_empty() {
            self.keys.remove(key);
        } else if locs.capacity() > 4 * locs.len() {
            // A key whose long history compaction dropped gives the memory back.
            locs.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rec(rev: u64, record: u64) -> Loc {
        Loc::in_record(Revision(rev), Revision(record), false)
    }

    #[test]
    fn newest_at_and_before_a_revision() {
        let mut ix = KeyIndex::default();
        ix.add(b"a", Loc::base(Revision(2), false));
        ix.add(b"a", rec(5, 6));
        ix.add(b"a", Loc::in_record(Revision(8), Revision(9), true));
        assert_eq!(ix.at(b"a", Revision(1)), None);
        assert_eq!(
            ix.at(b"a", Revision(4)),
            Some(Loc::base(Revision(2), false))
        );
        assert_eq!(ix.at(b"a", Revision(7)), Some(rec(5, 6)));
        assert!(ix.at(b"a", Revision(100)).unwrap().tombstone());
        assert_eq!(
            ix.before(b"a", Revision(5)),
            Some(Loc::base(Revision(2), false))
        );
        assert_eq!(ix.before(b"a", Revision(0)), None);
        assert_eq!(
            ix.live_at(Bound::Unbounded, Bound::Unbounded, Revision(9), 10, 10)
                .0,
            vec![]
        );
        assert_eq!(ix.versions(), 3);
    }

    #[test]
    fn a_location_is_small_and_keeps_its_parts() {
        assert_eq!(std::mem::size_of::<Loc>(), 16);
        let l = Loc::in_record(Revision(7), Revision(9), true);
        assert_eq!(
            (l.revision, l.record(), l.tombstone()),
            (Revision(7), Some(Revision(9)), true)
        );
        let b = Loc::base(Revision(3), false);
        assert_eq!((b.record(), b.tombstone()), (None, false));
    }

    #[test]
    fn a_base_wins_over_a_record_at_the_same_revision() {
        let mut ix = KeyIndex::default();
        ix.add(b"a", rec(5, 6));
        ix.add(b"a", Loc::base(Revision(5), false));
        ix.add(b"a", rec(5, 6));
        assert_eq!(
            ix.at(b"a", Revision(5)),
            Some(Loc::base(Revision(5), false))
        );
        assert_eq!(ix.versions(), 1);
    }

    /// A created key's version is placed as any other: beside the versions of an earlier life
    /// of the key (deleted, not yet compacted), and once for a revision seen twice.
    #[test]
    fn a_created_key_is_indexed_as_any_other() {
        let mut by_lookup = KeyIndex::default();
        let mut created = KeyIndex::default();
        for ix in [&mut by_lookup, &mut created] {
            ix.add(b"a", rec(2, 2));
            ix.add(b"a", Loc::in_record(Revision(3), Revision(3), true));
        }
        by_lookup.add(b"a", rec(7, 8));
        created.add_created(b"a".as_slice().into(), rec(7, 8));
        by_lookup.add(b"b", rec(7, 8));
        created.add_created(b"b".as_slice().into(), rec(7, 8));
        created.add_created(b"b".as_slice().into(), rec(7, 8));
        for ix in [&by_lookup, &created] {
            assert_eq!(ix.versions(), 4);
            assert_eq!(ix.keys(), 2);
            assert_eq!(ix.at(b"a", Revision(9)), Some(rec(7, 8)));
            assert_eq!(
                ix.before(b"a", Revision(7)).map(|l| l.tombstone()),
                Some(true)
            );
            assert_eq!(ix.at(b"b", Revision(7)), Some(rec(7, 8)));
        }
    }

    #[test]
    fn a_reversed_or_empty_range_is_empty() {
        let mut ix = KeyIndex::default();
        ix.add(b"b", rec(1, 1));
        let at = Revision(1);
        assert!(
            ix.live_at(Bound::Included(b"c"), Bound::Excluded(b"a"), at, 9, 9)
                .0
                .is_empty()
        );
        assert!(
            ix.live_at(Bound::Included(b"b"), Bound::Excluded(b"b"), at, 9, 9)
                .0
                .is_empty()
        );
        assert_eq!(
            ix.live_at(Bound::Included(b"b"), Bound::Included(b"b"), at, 9, 9)
                .0
                .len(),
            1
        );
    }

    /// A model: every (key, revision, tombstone) version, sorted.
    type Model = BTreeMap<(u8, u64), bool>;

    fn model_at(m: &Model, key: u8, at: u64) -> Option<(u64, bool)> {
        m.range((key, 0)..=(key, at))
            .next_back()
            .map(|(&(_, r), &t)| (r, t))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Versions split at a revision: the newer in one index and the older merged into it
        /// in pieces of any size give the index of them all; a range walked in pieces of
        /// any size gives the walk in one piece.
        #[test]
        fn older_versions_merge_and_ranges_walk_in_pieces(
            versions in proptest::collection::vec((0u8..6, 1u64..40, any::<bool>(), any::<bool>()), 0..60),
            split in 0u64..41,
            piece in 1usize..4,
            visit in 1usize..4,
            at in 0u64..45,
        ) {
            let (mut all, mut newer, mut older) = (KeyIndex::default(), KeyIndex::default(), KeyIndex::default());
            for (k, rev, tomb, base) in versions {
                let rev = Revision(rev);
                let loc = if base { Loc::base(rev, tomb) } else { Loc::in_record(rev, rev.next(), tomb) };
                all.add(&[k], loc);
                if rev.0 <= split { older.add(&[k], loc) } else { newer.add(&[k], loc) }
            }
            let mut after: Option<IndexKey> = None;
            while let Some(k) = newer.merge_older(&older, after.as_deref(), piece) {
                after = Some(k);
            }
            prop_assert_eq!(&newer.keys, &all.keys);
            prop_assert_eq!(newer.versions(), all.versions());
            let at = Revision(at);
            let (whole, rest) = all.live_at(Bound::Unbounded, Bound::Unbounded, at, usize::MAX, usize::MAX);
            prop_assert!(rest.is_none());
            let mut pieces = Vec::new();
            let mut start: Bound<IndexKey> = Bound::Unbounded;
            loop {
                let (found, next) = all.live_at(start.as_ref().map(|k| &k[..]), Bound::Unbounded, at, usize::MAX, visit);
                pieces.extend(found);
                match next {
                    Some(k) => start = Bound::Included(k),
                    None => break,
                }
            }
            prop_assert_eq!(pieces, whole);
        }

        /// Random histories, folded at random marks record by record: every read at or
        /// above the mark answers as the model does, from a base written or a record kept.
        #[test]
        fn folds_keep_every_read_at_or_above_the_mark(
            ops in proptest::collection::vec((0u8..5, proptest::bool::weighted(0.3)), 1..60),
            group in 1usize..6,
            marks in proptest::collection::vec(0u64..60, 1..4),
        ) {
            let mut ix = KeyIndex::default();
            let mut model = Model::new();
            // Revision i + 1 changes ops[i]; records hold `group` revisions each.
            let top = ops.len() as u64;
            let record_of = |rev: u64| ((rev - 1) / group as u64 + 1) * group as u64;
            for (i, (k, tomb)) in ops.iter().enumerate() {
                let rev = i as u64 + 1;
                ix.add(&[*k], Loc::in_record(Revision(rev), Revision(record_of(rev).min(top)), *tomb));
                model.insert((*k, rev), *tomb);
            }
            let mut bases: std::collections::BTreeSet<(u8, u64)> = Default::default();
            let mut records: std::collections::BTreeSet<u64> =
                (1..=top).map(|r| record_of(r).min(top)).collect();
            let mut marks = marks;
            marks.sort();
            for mark in marks {
                let mark = mark.min(top);
                // Records wholly at or below the mark go, oldest first.
                let gone: Vec<u64> = records.iter().copied().filter(|&r| r <= mark).collect();
                for r in gone {
                    let keys: std::collections::BTreeSet<u8> = ops
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| record_of(*i as u64 + 1).min(top) == r)
                        .map(|(_, (k, _))| *k)
                        .collect();
                    for k in keys {
                        let plan = ix.plan_fold(&[k], Revision(mark), Revision(r));
                        for d in &plan.drop_bases {
                            prop_assert!(bases.remove(&(k, d.0)));
                        }
                        if let Some(w) = plan.write_base {
                            bases.insert((k, w.0));
                        }
                        ix.apply_fold(&[k], plan.edit);
                    }
                    records.remove(&r);
                }
                for at in mark..=top {
                    for k in 0u8..5 {
                        let want = model_at(&model, k, at).filter(|(_, t)| !t).map(|(r, _)| r);
                        let got = ix.at(&[k], Revision(at)).filter(|l| !l.tombstone());
                        prop_assert_eq!(got.map(|l| l.revision.0), want);
                        // Where the index points is there: a base written, or a record kept.
                        if let Some(l) = got {
                            match l.record() {
                                None => prop_assert!(bases.contains(&(k, l.revision.0))),
                                Some(r) => prop_assert!(records.contains(&r.0)),
                            }
                        }
                    }
                }
                // Nothing points into a record that is gone, and compaction left at most one
                // base version per key.
                for locs in ix.keys.values() {
                    prop_assert!(locs.iter().filter(|l| l.record().is_none()).count() <= 1);
                    for l in locs {
                        if let Some(r) = l.record() {
                            prop_assert!(records.contains(&r.0));
                        }
                    }
                }
                prop_assert_eq!(bases.len(), ix.keys.values().flatten().filter(|l| l.record().is_none()).count());
                let counted: usize = ix.keys.values().map(|l| l.len()).sum();
                prop_assert_eq!(ix.versions(), counted);
            }
        }
    }
}
