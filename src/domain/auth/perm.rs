//! Permissions over keys: a grant covers one key or every key under a prefix, and a request
//! is allowed only if the caller's grants cover the WHOLE range it touches (as etcd checks a
//! range against the union of the user's permission intervals).
//!
//! # Invariants
//! - Ranges are half-open byte intervals `[start, end)`, `end = None` meaning unbounded. A key
//!   `k` is `[k, k\0)`; a prefix `p` is `[p, prefix_end(p))` (`""` is every key).
//! - A range is covered iff the sorted union of the granted intervals leaves no gap over it:
//!   two grants that together span a range allow it even if neither does alone.
//! - A prefix grant never allows a key outside the prefix (proptested below).
//!
//! # What it must not do
//! Read any state: callers hand in the grants that apply (the user's roles, already resolved).

pub use leasecore_client::api::{PermKind, Permission};

/// Whether a grant of `kind` allows `access`.
pub fn allows(kind: PermKind, access: Access) -> bool {
    matches!(
        (kind, access),
        (PermKind::Readwrite, _)
            | (PermKind::Read, Access::Read)
            | (PermKind::Write, Access::Write)
    )
}

/// What a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// The interval a grant covers.
pub fn range_of(p: &Permission) -> KeyRange {
    if p.prefix {
        KeyRange::prefix(&p.key)
    } else {
        KeyRange::key(&p.key)
    }
}

/// A half-open interval of keys, as bytes: `[start, end)`, `end = None` is unbounded.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeyRange {
    pub start: Vec<u8>,
    pub end: Option<Vec<u8>>,
}

impl KeyRange {
    /// Exactly one key.
    pub fn key(key: &str) -> Self {
        let mut end = key.as_bytes().to_vec();
        end.push(0);
        KeyRange {
            start: key.as_bytes().to_vec(),
            end: Some(end),
        }
    }

    /// Every key starting with `prefix`.
    pub fn prefix(prefix: &str) -> Self {
        KeyRange {
            start: prefix.as_bytes().to_vec(),
            end: prefix_end(prefix.as_bytes()),
        }
    }

    /// The range etcd means by `key` and `range_end`: an empty `range_end` names `key` alone,
    /// `"\0"` every key from `key` on, anything else `[key, range_end)`. (A `key` of `"\0"`
    /// with a `range_end` of `"\0"` is every key.)
    pub fn from_etcd(key: &[u8], range_end: &[u8]) -> Self {
        let end = match range_end {
            [] => {
                let mut end = key.to_vec();
                end.push(0);
                Some(end)
            }
            [0] => None,
            end => Some(end.to_vec()),
        };
        KeyRange {
            start: key.to_vec(),
            end,
        }
    }

    /// Whether this range names exactly one key (and which).
    pub fn single_key(&self) -> Option<&[u8]> {
        let end = self.end.as_deref()?;
        (end.len() == self.start.len() + 1
            && end.starts_with(&self.start)
            && end.last() == Some(&0))
        .then_some(self.start.as_slice())
    }

    /// Whether `key` lies in this range.
    pub fn contains(&self, key: &[u8]) -> bool {
        key >= self.start.as_slice() && self.end.as_deref().is_none_or(|e| key < e)
    }
}

/// The first byte string after every string starting with `prefix` (`None`: no such string,
/// the range is unbounded).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// Whether the union of `grants` (those allowing `access`) covers all of `want`.
pub fn covers<'a>(
    grants: impl IntoIterator<Item = &'a Permission>,
    access: Access,
    want: &KeyRange,
) -> bool {
    let mut ranges: Vec<KeyRange> = grants
        .into_iter()
        .filter(|p| allows(p.kind, access))
        .map(range_of)
        .collect();
    ranges.sort_by(|a, b| a.start.cmp(&b.start));
    // Walk the sorted intervals, extending how far from `want.start` is covered without a gap.
    let mut reached: Vec<u8> = want.start.clone();
    for r in &ranges {
        if r.start.as_slice() > reached.as_slice() {
            break; // a gap before this interval (later ones start later still)
        }
        match &r.end {
            None => return true,
            Some(end) if end.as_slice() > reached.as_slice() => reached = end.clone(),
            Some(_) => {}
        }
        if let Some(want_end) = &want.end
            && reached.as_slice() >= want_end.as_slice()
        {
            return true;
        }
    }
    match &want.end {
        Some(want_end) => reached.as_slice() >= want_end.as_slice(),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn grant(kind: PermKind, key: &str, prefix: bool) -> Permission {
        Permission {
            kind,
            key: key.into(),
            prefix,
        }
    }

    #[test]
    fn a_key_grant_allows_that_key_only() {
        let g = [grant(PermKind::Read, "a", false)];
        assert!(covers(&g, Access::Read, &KeyRange::key("a")));
        assert!(!covers(&g, Access::Read, &KeyRange::key("ab")));
        assert!(!covers(&g, Access::Write, &KeyRange::key("a")));
        assert!(!covers(&g, Access::Read, &KeyRange::prefix("a")));
    }

    #[test]
    fn a_prefix_grant_allows_keys_and_sub_prefixes() {
        let g = [grant(PermKind::Readwrite, "app/", true)];
        assert!(covers(&g, Access::Write, &KeyRange::key("app/x")));
        assert!(covers(&g, Access::Read, &KeyRange::prefix("app/x/")));
        assert!(covers(&g, Access::Read, &KeyRange::prefix("app/")));
        assert!(!covers(&g, Access::Read, &KeyRange::prefix("app")));
        assert!(!covers(&g, Access::Read, &KeyRange::prefix("")));
        assert!(!covers(&g, Access::Read, &KeyRange::key("app")));
    }

    #[test]
    fn grants_that_together_span_a_range_allow_it() {
        // "a" + every key after "a" and before "b" = prefix "a".
        let g = [
            grant(PermKind::Read, "a", false),
            grant(PermKind::Read, "a", true),
        ];
        assert!(covers(&g, Access::Read, &KeyRange::prefix("a")));
        let split = [
            grant(PermKind::Read, "a", true),
            grant(PermKind::Read, "b", true),
        ];
        assert!(!covers(&split, Access::Read, &KeyRange::prefix("")));
    }

    #[test]
    fn the_empty_prefix_is_everything() {
        let g = [grant(PermKind::Read, "", true)];
        assert!(covers(&g, Access::Read, &KeyRange::prefix("")));
        assert!(covers(&g, Access::Read, &KeyRange::key("\u{10ffff}")));
        assert_eq!(prefix_end(b"a\xff\xff"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(b"\xff"), None);
    }

    proptest! {
        #[test]
        fn a_prefix_grant_never_allows_a_key_outside_the_prefix(
            prefix in "[ab/]{0,4}",
            key in "[ab/]{0,6}",
        ) {
            let g = [grant(PermKind::Readwrite, &prefix, true)];
            let allowed = covers(&g, Access::Read, &KeyRange::key(&key));
            prop_assert_eq!(allowed, key.starts_with(&prefix));
        }

        #[test]
        fn a_range_is_covered_iff_every_key_in_it_is(
            grants in proptest::collection::vec(("[ab]{0,3}", any::<bool>()), 0..4),
            want in "[ab]{0,3}",
        ) {
            let g: Vec<Permission> =
                grants.iter().map(|(k, p)| grant(PermKind::Read, k, *p)).collect();
            let range = KeyRange::prefix(&want);
            // Over keys of the alphabet {a, b} up to a bounded length, a prefix range is
            // covered iff every key in it is; check the direction that matters: covered
            // implies every sample key is allowed by some single grant.
            if covers(&g, Access::Read, &range) {
                for k in ["", "a", "b", "aa", "ab", "ba", "bb", "aab", "bba", "abab"] {
                    let k = format!("{want}{k}");
                    prop_assert!(g.iter().any(|p| range_of(p).contains(k.as_bytes())), "{k}");
                }
            }
        }
    }
}
