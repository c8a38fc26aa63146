//! Range reads with etcd's options: a pure evaluation over the keys of a range, shared by the
//! read path (a `Range` served from a node's state) and by transactions (a `Range` inside a
//! `Txn`, evaluated at apply time).
//!
//! # Semantics (as etcd's `Range`)
//! - `count` is the number of keys in the range, before the revision filters and the limit.
//! - The revision filters (`min/max_mod_revision`, `min/max_create_revision`, 0 = none) drop
//!   keys; then the keys are sorted; then `limit` (0 = none) cuts, and `more` says whether it
//!   did.
//! - A sort target other than the key with no order sorts ascending, as etcd does; the key
//!   target with no order keeps key order.
//! - `keys_only` drops values; `count_only` returns no keys at all.
//! - A sort by value is in the order of the raw bytes: a value the etcd API stored as NUL and
//!   base64 sorts as its bytes ([`super::value_bytes`]).
//!
//! # Bounded answers
//! A request's answer (a Range, every range and `prev_kv` of a Txn) is at most
//! [`MAX_RESULT_BYTES`], counted by [`ResultBudget`] on the selected keys *before* any value is
//! copied: a request of a few hundred bytes could otherwise make a node (every node, for a Txn
//! applied through the log) copy the whole store, many times over. The count is the stored
//! size plus [`KV_OVERHEAD_BYTES`] per key, so it is the same on every member (a Txn's
//! refusal is decided where it applies) and an answer within it encodes within the etcd API's
//! message limit.
//!
//! [`keys_hash`] is etcd's `HashKV` over the keys live at one revision: a CRC-32 of each key
//! and its version, in key order. The same revision hashes the same on every member, and a
//! past revision as it hashed when it was the present (the keys live at a revision never
//! change). etcd hashes the versions between its compaction mark and the revision instead, so
//! the numbers are leasecore's own: members compare with each other, not with etcd.
//!
//! # What it must not do
//! Read the store itself: the caller hands in the range's keys in key order.

use serde::{Deserialize, Serialize};

use super::auth::KeyRange;
use super::key_bytes;
use super::kv::Versioned;
use super::types::Revision;

/// The hash of `keys` (in key order), each with its version: [`keys_hash`] in the module docs.
/// Every field is length-prefixed or fixed-width, so no two different inputs run together.
pub fn keys_hash<'a>(keys: impl IntoIterator<Item = (&'a str, &'a Versioned)>) -> u32 {
    let mut h = crc32fast::Hasher::new();
    let mut bytes = |b: &[u8]| {
        h.update(&(b.len() as u64).to_be_bytes());
        h.update(b);
    };
    for (key, v) in keys {
        bytes(key.as_bytes());
        bytes(v.value.as_bytes());
        bytes(&v.create_revision.0.to_be_bytes());
        bytes(&v.mod_revision.0.to_be_bytes());
        bytes(&v.version.to_be_bytes());
        match &v.lease {
            Some(lease) => bytes(lease.as_bytes()),
            None => bytes(&[]),
        }
    }
    h.finalize()
}

/// The order of a range's result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SortOrder {
    #[default]
    None,
    Ascend,
    Descend,
}

/// What a range's result is sorted by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SortTarget {
    #[default]
    Key,
    Version,
    Create,
    Mod,
    Value,
}

/// A range read and its options (etcd's `RangeRequest`, less the revision to read at).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeSpec {
    pub range: KeyRange,
    /// At most this many keys (0: no limit).
    #[serde(default)]
    pub limit: u64,
    #[serde(default)]
    pub sort_order: SortOrder,
    #[serde(default)]
    pub sort_target: SortTarget,
    #[serde(default)]
    pub keys_only: bool,
    #[serde(default)]
    pub count_only: bool,
    #[serde(default)]
    pub min_mod_revision: u64,
    #[serde(default)]
    pub max_mod_revision: u64,
    #[serde(default)]
    pub min_create_revision: u64,
    #[serde(default)]
    pub max_create_revision: u64,
}

impl RangeSpec {
    /// Every key of `range`, in key order, with values.
    pub fn all(range: KeyRange) -> Self {
        RangeSpec {
            range,
            limit: 0,
            sort_order: SortOrder::None,
            sort_target: SortTarget::Key,
            keys_only: false,
            count_only: false,
            min_mod_revision: 0,
            max_mod_revision: 0,
            min_create_revision: 0,
            max_create_revision: 0,
        }
    }

    fn filtered(&self) -> bool {
        self.min_mod_revision != 0
            || self.max_mod_revision != 0
            || self.min_create_revision != 0
            || self.max_create_revision != 0
    }

    fn keeps(&self, v: &Versioned) -> bool {
        let within = |rev: Revision, min: u64, max: u64| {
            (min == 0 || rev.0 >= min) && (max == 0 || rev.0 <= max)
        };
        within(v.mod_revision, self.min_mod_revision, self.max_mod_revision)
            && within(
                v.create_revision,
                self.min_create_revision,
                self.max_create_revision,
            )
    }

    /// The order to sort in, if any (key order is the order keys arrive in).
    fn order(&self) -> Option<(SortTarget, bool)> {
        match (self.sort_order, self.sort_target) {
            (SortOrder::None, SortTarget::Key) | (SortOrder::Ascend, SortTarget::Key) => None,
            (SortOrder::Descend, t) => Some((t, true)),
            (_, t) => Some((t, false)),
        }
    }
}

/// The result of a range read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeResult {
    /// The keys, in the order asked for (values emptied with `keys_only`).
    pub kvs: Vec<(String, Versioned)>,
    /// Whether `limit` cut the result.
    pub more: bool,
    /// Keys in the range (before the filters and the limit).
    pub count: u64,
}

/// The most the answer of a transaction that writes may hold, in [`ResultBudget`]'s count,
/// and the default budget: every replica checks it when it applies, so it is one constant for
/// all of them. (etcd bounds no answer; a read through the etcd API has a budget of its own,
/// `Limits::max_read_answer_bytes`, never below this.)
pub const MAX_RESULT_BYTES: usize = 4 << 20;

/// What one key costs in an answer besides its key and value: its revisions, version, lease
/// and framing (an etcd `KeyValue` spends at most about 60 bytes on them).
pub const KV_OVERHEAD_BYTES: usize = 64;

/// An answer that would pass [`MAX_RESULT_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "answer too large: more than {limit} bytes (at least {bytes}): narrow the range, or \
     use a limit, keys_only or count_only"
)]
pub struct ResultTooLarge {
    /// What the answer had reached when it passed the limit.
    pub bytes: u64,
    pub limit: u64,
}

/// The bytes one request's answers may still take: every range and `prev_kv` of a request
/// charges the same budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResultBudget {
    used: usize,
    limit: usize,
}

impl Default for ResultBudget {
    fn default() -> Self {
        ResultBudget::new(MAX_RESULT_BYTES)
    }
}

impl ResultBudget {
    pub fn new(limit: usize) -> Self {
        ResultBudget { used: 0, limit }
    }

    /// Charge one key of an answer (its value, unless `keys_only`).
    pub fn charge(&mut self, key: &str, value: Option<&Versioned>) -> Result<(), ResultTooLarge> {
        let bytes = key.len() + value.map_or(0, |v| v.value.len()) + KV_OVERHEAD_BYTES;
        self.used = self.used.saturating_add(bytes);
        if self.used > self.limit {
            return Err(ResultTooLarge {
                bytes: self.used as u64,
                limit: self.limit as u64,
            });
        }
        Ok(())
    }
}

/// Bounds a read of a range's keys from storage (a Range at a past revision) by what the
/// answer may hold, as the keys are read: each key's value is dropped as soon as it is read
/// when the answer cannot hold it (`count_only`, `keys_only`, a key a revision filter drops,
/// a key past the limit when nothing sorts), and the keys the answer may hold are charged
/// to a copy of the request's budget, so that the read stops with [`ResultTooLarge`] once
/// over it, before the rest of the range is in memory.
///
/// It charges at least what [`evaluate_within`] then charges on the same keys (the same key,
/// value and overhead for every key that evaluation may answer), so a read it lets through is
/// never refused by the evaluation, and one it refuses would have been; except with a sort
/// and a limit, where any key may end up in the answer (all of them are charged), and with a
/// sort by value and `keys_only`, where the values are held to sort (and charged).
#[derive(Clone, Debug)]
pub struct ReadBound<'s> {
    spec: &'s RangeSpec,
    budget: ResultBudget,
    /// Keys admitted that the answer may hold (counted for the limit).
    kept: usize,
}

impl<'s> ReadBound<'s> {
    /// A bound for reading `spec`'s keys, given what is left of the request's `budget`.
    pub fn new(spec: &'s RangeSpec, budget: ResultBudget) -> Self {
        ReadBound {
            spec,
            budget,
            kept: 0,
        }
    }

    /// Admit the next key read, in key order: whether the answer may hold its value (if
    /// not, the reader drops it), with its share charged; an error once the answer would
    /// pass the budget.
    pub fn admit(&mut self, key: &str, v: &Versioned) -> Result<bool, ResultTooLarge> {
        let spec = self.spec;
        if spec.count_only || !spec.keeps(v) {
            return Ok(false);
        }
        // Without a sort, the answer is the first `limit` keys the filters keep (a key after
        // them only says `more`, and is cut): the rest need no value and no charge.
        let limit = usize::try_from(spec.limit).unwrap_or(usize::MAX);
        if spec.order().is_none() && limit != 0 && self.kept >= limit {
            return Ok(false);
        }
        self.kept += 1;
        // A sort by value needs the values even with `keys_only`: what is held is charged.
        let sorts_by_value = matches!(spec.order(), Some((SortTarget::Value, _)));
        let holds_value = !spec.keys_only || sorts_by_value;
        self.budget.charge(key, holds_value.then_some(v))?;
        Ok(holds_value)
    }

    /// [`ReadBound::admit`] on a version the reader owns: its value dropped if the answer
    /// cannot hold it.
    pub fn admit_owned(&mut self, key: &str, v: &mut Versioned) -> Result<(), ResultTooLarge> {
        if !self.admit(key, v)? {
            v.value = String::new();
        }
        Ok(())
    }
}

/// Evaluate `spec` over the keys of its range, given in key order, with no bound on the
/// answer (tests, and callers that bound it otherwise).
pub fn evaluate<'a>(
    spec: &RangeSpec,
    in_range: impl Iterator<Item = (&'a str, &'a Versioned)>,
) -> RangeResult {
    let mut unbounded = ResultBudget::new(usize::MAX);
    // A budget of usize::MAX saturates, never passes.
    evaluate_within(spec, in_range, &mut unbounded).unwrap_or_default()
}

/// Evaluate `spec` as [`evaluate`] does, charging the answer to `budget` before any value is
/// copied.
pub fn evaluate_within<'a>(
    spec: &RangeSpec,
    in_range: impl Iterator<Item = (&'a str, &'a Versioned)>,
    budget: &mut ResultBudget,
) -> Result<RangeResult, ResultTooLarge> {
    let selected = select(spec, in_range);
    selected.charge(spec, budget)?;
    Ok(selected.into_result(spec))
}

/// Charge to `budget` what evaluating `spec` would answer, copying nothing (a Txn's check
/// before it applies).
pub fn charge<'a>(
    spec: &RangeSpec,
    in_range: impl Iterator<Item = (&'a str, &'a Versioned)>,
    budget: &mut ResultBudget,
) -> Result<(), ResultTooLarge> {
    select(spec, in_range).charge(spec, budget)
}

/// The keys an evaluation answers, not yet copied.
struct Selected<'a> {
    kept: Vec<(&'a str, &'a Versioned)>,
    more: bool,
    count: u64,
}

impl Selected<'_> {
    fn charge(&self, spec: &RangeSpec, budget: &mut ResultBudget) -> Result<(), ResultTooLarge> {
        for (k, v) in &self.kept {
            budget.charge(k, (!spec.keys_only).then_some(*v))?;
        }
        Ok(())
    }

    fn into_result(self, spec: &RangeSpec) -> RangeResult {
        let kvs = self
            .kept
            .into_iter()
            .map(|(k, v)| {
                let mut v = v.clone();
                if spec.keys_only {
                    v.value = String::new();
                }
                (k.to_string(), v)
            })
            .collect();
        RangeResult {
            kvs,
            more: self.more,
            count: self.count,
        }
    }
}

fn select<'a>(
    spec: &RangeSpec,
    in_range: impl Iterator<Item = (&'a str, &'a Versioned)>,
) -> Selected<'a> {
    let mut count = 0u64;
    let limit = usize::try_from(spec.limit).unwrap_or(usize::MAX);
    let order = spec.order();
    // Without a sort, a filter or count_only, keys past the limit are only counted.
    let keep_all = order.is_some() || spec.filtered();
    let mut kept: Vec<(&str, &Versioned)> = Vec::new();
    for (k, v) in in_range {
        count += 1;
        if spec.count_only {
            continue;
        }
        if !keep_all && limit != 0 && kept.len() > limit {
            continue;
        }
        if spec.keeps(v) {
            kept.push((k, v));
        }
    }
    if let Some((target, descending)) = order {
        // Stable: equal targets stay in key order, as etcd's sort leaves them.
        kept.sort_by(|a, b| {
            let o = match target {
                SortTarget::Key => key_bytes::cmp(a.0, b.0),
                SortTarget::Version => a.1.version.cmp(&b.1.version),
                SortTarget::Create => a.1.create_revision.cmp(&b.1.create_revision),
                SortTarget::Mod => a.1.mod_revision.cmp(&b.1.mod_revision),
                // In the order of the raw bytes (etcd's), encoded values decoded.
                SortTarget::Value => {
                    super::value_bytes::cmp(a.1.value.as_bytes(), b.1.value.as_bytes())
                }
            };
            if descending { o.reverse() } else { o }
        });
    }
    let more = limit != 0 && kept.len() > limit;
    if limit != 0 {
        kept.truncate(limit);
    }
    Selected { kept, more, count }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(value: &str, create: u64, modr: u64, version: u64) -> Versioned {
        Versioned {
            value: value.into(),
            create_revision: Revision(create),
            mod_revision: Revision(modr),
            version,
            lease: None,
        }
    }

    #[test]
    fn the_hash_of_keys_changes_with_any_field_and_with_where_a_key_ends() {
        let hash = |kvs: &[(&str, Versioned)]| keys_hash(kvs.iter().map(|(k, v)| (*k, v)));
        let base = [("a", v("1", 1, 1, 1)), ("b", v("2", 2, 2, 1))];
        assert_eq!(hash(&base), hash(&base.clone()), "deterministic");
        let mut leased = base.clone();
        leased[1].1.lease = Some("l".into());
        let variants = [
            [("a", v("1", 1, 1, 1)), ("b", v("3", 2, 2, 1))],
            [("a", v("1", 1, 1, 1)), ("b", v("2", 1, 2, 1))],
            [("a", v("1", 1, 1, 1)), ("b", v("2", 2, 3, 1))],
            [("a", v("1", 1, 1, 1)), ("b", v("2", 2, 2, 2))],
            leased,
            // The same bytes, split between key and value differently.
            [("a", v("1", 1, 1, 1)), ("b2", v("", 2, 2, 1))],
        ];
        for other in &variants {
            assert_ne!(hash(&base), hash(other), "{other:?}");
        }
        assert_ne!(hash(&[]), hash(&base[..1]));
    }

    fn data() -> Vec<(String, Versioned)> {
        vec![
            ("a".into(), v("3", 1, 9, 4)),
            ("b".into(), v("1", 2, 2, 1)),
            ("c".into(), v("2", 3, 5, 2)),
        ]
    }

    fn run(spec: &RangeSpec) -> RangeResult {
        let d = data();
        evaluate(spec, d.iter().map(|(k, v)| (k.as_str(), v)))
    }

    fn keys(r: &RangeResult) -> Vec<&str> {
        r.kvs.iter().map(|(k, _)| k.as_str()).collect()
    }

    fn spec() -> RangeSpec {
        RangeSpec::all(KeyRange::from_etcd(b"a", b"\0"))
    }

    #[test]
    fn limit_counts_everything_and_says_more() {
        let mut s = spec();
        s.limit = 2;
        let r = run(&s);
        assert_eq!((keys(&r), r.more, r.count), (vec!["a", "b"], true, 3));
        s.limit = 3;
        assert!(!run(&s).more);
        s.count_only = true;
        let r = run(&s);
        assert_eq!((r.kvs.len(), r.count, r.more), (0, 3, false));
    }

    #[test]
    fn sorts_by_each_target_and_a_target_alone_sorts_ascending() {
        let mut s = spec();
        s.sort_target = SortTarget::Value;
        assert_eq!(keys(&run(&s)), ["b", "c", "a"]);
        s.sort_order = SortOrder::Descend;
        assert_eq!(keys(&run(&s)), ["a", "c", "b"]);
        s.sort_target = SortTarget::Key;
        assert_eq!(keys(&run(&s)), ["c", "b", "a"]);
        s.sort_target = SortTarget::Mod;
        s.sort_order = SortOrder::Ascend;
        s.limit = 1;
        let r = run(&s);
        assert_eq!((keys(&r), r.more), (vec!["b"], true));
    }

    #[test]
    fn a_sort_by_value_is_in_the_order_of_the_raw_bytes() {
        use crate::domain::value_bytes::store;
        let d = [
            ("a".to_string(), v(&store(vec![0xff]), 1, 1, 1)),
            ("b".to_string(), v("z", 2, 2, 1)),
            ("c".to_string(), v(&store(vec![0x01, 0x80]), 3, 3, 1)),
        ];
        let mut s = spec();
        s.sort_target = SortTarget::Value;
        let r = evaluate(&s, d.iter().map(|(k, v)| (k.as_str(), v)));
        assert_eq!(keys(&r), ["c", "b", "a"]);
    }

    #[test]
    fn revision_filters_apply_before_the_limit_and_keys_only_drops_values() {
        let mut s = spec();
        s.min_mod_revision = 3;
        s.max_create_revision = 2;
        s.keys_only = true;
        let r = run(&s);
        assert_eq!((keys(&r), r.count), (vec!["a"], 3));
        assert_eq!(r.kvs[0].1.value, "");
        assert_eq!(r.kvs[0].1.version, 4);
    }

    proptest::proptest! {
        /// A read bounded by [`ReadBound`] answers exactly what evaluating the whole range
        /// answers, within the same budget; it refuses only what the evaluation refuses
        /// (or, with a sort and a limit, what it might).
        #[test]
        fn a_bounded_read_answers_as_the_whole_range_does(
            values in proptest::collection::vec((0usize..50, 1u64..6, 1u64..6), 0..12),
            limit in 0u64..5,
            keys_only in proptest::bool::ANY,
            count_only in proptest::bool::ANY,
            min_mod in 0u64..4,
            sort in 0usize..3,
            budget in 0usize..600,
        ) {
            let data: Vec<(String, Versioned)> = values
                .iter()
                .enumerate()
                .map(|(i, (len, create, modr))| (format!("k{i:02}"), v(&"x".repeat(*len), *create, *modr, 1)))
                .collect();
            let mut spec = spec();
            spec.limit = limit;
            spec.keys_only = keys_only;
            spec.count_only = count_only;
            spec.min_mod_revision = min_mod;
            (spec.sort_order, spec.sort_target) = [
                (SortOrder::None, SortTarget::Key),
                (SortOrder::Descend, SortTarget::Mod),
                (SortOrder::Ascend, SortTarget::Value),
            ][sort];
            let whole = evaluate_within(
                &spec,
                data.iter().map(|(k, v)| (k.as_str(), v)),
                &mut ResultBudget::new(budget),
            );
            let mut bound = ReadBound::new(&spec, ResultBudget::new(budget));
            let mut read = Vec::new();
            let mut refused = None;
            for (k, v) in &data {
                let mut v = v.clone();
                if let Err(e) = bound.admit_owned(k, &mut v) {
                    refused = Some(e);
                    break;
                }
                read.push((k.clone(), v));
            }
            match refused {
                None => {
                    let answer = evaluate_within(
                        &spec,
                        read.iter().map(|(k, v)| (k.as_str(), v)),
                        &mut ResultBudget::new(budget),
                    );
                    proptest::prop_assert_eq!(answer, whole);
                }
                Some(_) => {
                    let sorted_with_limit = spec.order().is_some() && limit != 0;
                    let keys_by_value = keys_only && sort == 2;
                    proptest::prop_assert!(
                        whole.is_err() || sorted_with_limit || keys_by_value,
                        "refused what fits: {:?}", whole
                    );
                }
            }
        }
    }
}
