//! Transaction compares (etcd's `Compare`): the guard of a transaction, evaluated against the
//! state before the transaction. Pure.
//!
//! This is the first piece of transactions (issue 14, `docs/etcd-api.md` section 3); the
//! operations and their atomic apply come next.
//!
//! # Semantics (as etcd's `applyCompare`)
//! - A compare names a key, or a range `[key, range_end)`, a target (value, version, create
//!   revision, mod revision, lease) and an operator (`=`, `!=`, `>`, `<`).
//! - Over a range, every key present must satisfy it.
//! - When no key is present: a compare on the value fails (there is no value to compare), and
//!   the other targets compare against zero (version 0, revision 0, no lease), so
//!   `mod_revision == 0` means "does not exist", as etcd clients use it to create.
//!
//! # What it must not do
//! Read the state itself: the caller hands in the versions present in the range.

use serde::{Deserialize, Serialize};

use super::kv::Versioned;
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
    Value(String),
    Version(u64),
    CreateRevision(Revision),
    ModRevision(Revision),
    /// The lease a key is attached to (`None`: none).
    Lease(Option<String>),
}

/// One guard of a transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compare {
    pub key: String,
    /// `Some(end)`: every key in `[key, end)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_end: Option<String>,
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
            v.is_some_and(|v| ordered(c.op, v.value.as_bytes(), expected.as_bytes()))
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
            key: "k".into(),
            range_end: None,
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
            assert!(!holds(&cmp(op, CompareTarget::Value(String::new())), none));
        }
    }

    #[test]
    fn each_target_and_operator() {
        let a = v("b", 3, 7, 2, Some("l1"));
        let one = [&a];
        let t = |op, target| holds(&cmp(op, target), one);
        assert!(t(CompareOp::Equal, CompareTarget::Value("b".into())));
        assert!(t(CompareOp::Greater, CompareTarget::Value("a".into())));
        assert!(t(CompareOp::Less, CompareTarget::Value("ba".into())));
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
        let mut c = cmp(CompareOp::Equal, CompareTarget::Value("x".into()));
        c.range_end = Some("z".into());
        assert!(holds(&c, both));
        c.target = CompareTarget::Version(1);
        assert!(!holds(&c, both), "b is at version 3");
        c.op = CompareOp::Greater;
        c.target = CompareTarget::ModRevision(Revision(0));
        assert!(holds(&c, both));
    }
}
