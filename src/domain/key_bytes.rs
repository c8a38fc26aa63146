//! Binary keys in a text store: how the etcd API's byte keys are kept in leasecore's `String`
//! keys, and how a range of byte keys is found among them. Pure.
//!
//! etcd's keys are bytes (`etcdctl check perf` writes varint-encoded ones; some clients pack
//! integers); leasecore's store keeps UTF-8 text, which `/v1` shows and writes as it is. A key
//! that is UTF-8 not beginning with NUL is stored as it is (a *text key*); any other is
//! *encoded*: NUL, then the lowercase hex of its raw bytes. Hex, unlike base64, keeps the raw
//! bytes' order and prefixes: `hex(a) < hex(b)` exactly when `a < b`, and `hex(p)` is a prefix
//! of `hex(k)` exactly when `p` is a prefix of `k`. So the encoded keys whose raw bytes lie in
//! `[s, e)` are one contiguous run of stored keys, `[NUL hex(s), NUL hex(e))`, and the text
//! keys among them another, `[s, e)` itself above NUL: [`spans`] gives both, and a reader that
//! walks the two and merges them by raw bytes ([`cmp`]) sees etcd's key order exactly.
//!
//! # Invariants
//! - `bytes(&store(k)) == k` for every byte string `k`, and [`store`] is injective.
//! - A text key is its own raw bytes; an encoded key begins with NUL, a text key never does.
//! - For every raw `k` and range `r`: `r.contains(k)` exactly when `store(k)` lies in one of
//!   `spans(r)` (proptested below). The two spans never overlap.
//! - [`KeyRange`]s are always raw bytes (etcd's); stored keys are compared with them through
//!   [`bytes`] ([`KeyRange::contains_stored`]).
//!
//! # What it must not do
//! Change a stored key's type or any stored format: an encoded key is an ordinary `String` in
//! the state, the log, snapshots and the history. It never decides who may write an encoded
//! key: the edges do (the etcd API stores through [`store`]; `/v1` refuses keys that begin
//! with NUL).

use std::borrow::Cow;
use std::cmp::Ordering;

use super::auth::KeyRange;

/// The first char of an encoded key.
pub const MARK: char = '\0';

/// The stored form of the raw key `raw`: itself when it is UTF-8 that does not begin with
/// NUL, else NUL and its lowercase hex.
pub fn store(raw: Vec<u8>) -> String {
    match String::from_utf8(raw) {
        Ok(text) if !text.starts_with(MARK) => text,
        Ok(text) => encode(text.as_bytes()),
        Err(e) => encode(e.as_bytes()),
    }
}

/// NUL and the lowercase hex of `raw`: the stored form of an encoded key, and the bound of
/// the encoded span for a raw bound.
fn encode(raw: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(1 + 2 * raw.len());
    out.push(MARK);
    for b in raw {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    out
}

/// Whether `stored` is an encoded key (it begins with NUL).
pub fn is_encoded(stored: &str) -> bool {
    stored.starts_with(MARK)
}

/// The raw bytes of the stored key `stored`. A key that begins with NUL but is not lowercase
/// hex after it (only possible for a key written through `/v1` before encoded keys existed)
/// reads as its own bytes.
pub fn bytes(stored: &str) -> Cow<'_, [u8]> {
    match stored.as_bytes().split_first() {
        Some((0, hex)) => decode(hex).map_or(Cow::Borrowed(stored.as_bytes()), Cow::Owned),
        _ => Cow::Borrowed(stored.as_bytes()),
    }
}

fn decode(hex: &[u8]) -> Option<Vec<u8>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    hex.chunks_exact(2)
        .map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

/// The length of `bytes(stored)`, without decoding (what a key's length limit counts).
pub fn raw_len(stored: &str) -> usize {
    match stored.as_bytes().split_first() {
        Some((0, hex)) if decode(hex).is_some() => hex.len() / 2,
        _ => stored.len(),
    }
}

/// Two stored keys in the order of their raw bytes (etcd's key order).
pub fn cmp(a: &str, b: &str) -> Ordering {
    if !is_encoded(a) && !is_encoded(b) {
        return a.cmp(b);
    }
    bytes(a).cmp(&bytes(b))
}

/// Whether the raw bytes of the stored key `stored` begin with `prefix`.
pub fn raw_starts_with(stored: &str, prefix: &[u8]) -> bool {
    if is_encoded(stored) {
        bytes(stored).starts_with(prefix)
    } else {
        stored.as_bytes().starts_with(prefix)
    }
}

/// The stored form of the one key `range` holds, when it is a single key (`[k, k NUL)`, as
/// etcd's point reads are): the one stored key whose raw bytes lie in it, found without
/// walking [`spans`].
pub fn single(range: &KeyRange) -> Option<Cow<'_, str>> {
    let end = range.end.as_deref()?;
    let (last, head) = end.split_last()?;
    if *last != 0 || head != range.start.as_slice() {
        return None;
    }
    Some(match std::str::from_utf8(&range.start) {
        Ok(text) if !text.starts_with(MARK) => Cow::Borrowed(text),
        _ => Cow::Owned(encode(&range.start)),
    })
}

/// The stored keys whose raw bytes lie in `range`: at most two spans of stored keys (as
/// byte bounds, `end = None` unbounded), the text keys' first, each empty one left out.
pub fn spans(range: &KeyRange) -> Vec<KeyRange> {
    let mut out = Vec::with_capacity(2);
    // Text keys are their raw bytes and never begin with NUL: the range itself, above NUL.
    let text_start = if range.start.first().is_none_or(|b| *b == 0) {
        vec![1]
    } else {
        range.start.clone()
    };
    if range
        .end
        .as_deref()
        .is_none_or(|e| e > text_start.as_slice())
    {
        out.push(KeyRange {
            start: text_start,
            end: range.end.clone(),
        });
    }
    // Encoded keys: the hex of the bounds, after NUL; an unbounded end is the end of the
    // encoded keys (every one is below "\x01").
    let start = encode(&range.start).into_bytes();
    let end = range
        .end
        .as_deref()
        .map_or(vec![1], |e| encode(e).into_bytes());
    if end > start {
        out.push(KeyRange {
            start,
            end: Some(end),
        });
    }
    out
}

impl KeyRange {
    /// Whether the stored key `stored` lies in this (raw) range.
    pub fn contains_stored(&self, stored: &str) -> bool {
        if is_encoded(stored) {
            self.contains(&bytes(stored))
        } else {
            self.contains(stored.as_bytes())
        }
    }

    /// The range of exactly the stored key `stored`, in raw bytes.
    pub fn of_stored(stored: &str) -> Self {
        let mut end = bytes(stored).into_owned();
        let start = end.clone();
        end.push(0);
        KeyRange {
            start,
            end: Some(end),
        }
    }
}

/// Merges two runs of stored keys, each in raw order, into one in raw order: what a reader of
/// [`spans`] does with what it found in each.
pub fn merge<T>(
    a: impl IntoIterator<Item = T>,
    b: impl IntoIterator<Item = T>,
    key: impl Fn(&T) -> &str,
) -> impl Iterator<Item = T> {
    let mut a = a.into_iter().peekable();
    let mut b = b.into_iter().peekable();
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(x), Some(y)) => {
            if cmp(key(x), key(y)) == Ordering::Greater {
                b.next()
            } else {
                a.next()
            }
        }
        (Some(_), None) => a.next(),
        (None, _) => b.next(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn text_is_kept_and_the_rest_encoded() {
        assert_eq!(store(b"hello".to_vec()), "hello");
        assert_eq!(store("héllo".as_bytes().to_vec()), "héllo");
        assert_eq!(store(vec![b'a', 0xff]), "\u{0}61ff");
        assert_eq!(store(vec![0, b'a']), "\u{0}0061");
        assert_eq!(bytes("\u{0}61ff").as_ref(), &[b'a', 0xff]);
        assert_eq!(raw_len("\u{0}61ff"), 2);
        assert_eq!(raw_len("abc"), 3);
        // Not hex after NUL: its own bytes.
        assert_eq!(bytes("\u{0}xyz").as_ref(), b"\0xyz");
    }

    #[test]
    fn a_prefix_range_finds_binary_keys_under_it() {
        let prefix = KeyRange::prefix("/etcdctl-check-perf/");
        let key = store(b"/etcdctl-check-perf/\x80\x01".to_vec());
        assert!(is_encoded(&key));
        assert!(prefix.contains_stored(&key));
        assert!(spans(&prefix).iter().any(|s| s.contains(key.as_bytes())));
        assert!(!prefix.contains_stored(&store(b"/etcdctl-check-perg\xff".to_vec())));
    }

    /// A raw key or bound (a key is never empty: the edges refuse it).
    fn raw_bytes(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u8>> {
        // Few distinct bytes, so that ranges, prefixes and text/binary mixes meet often.
        prop::collection::vec(
            prop::sample::select(vec![0u8, 1, b'a', b'b', 0x7f, 0x80, 0xc3, 0xa9, 0xff]),
            len,
        )
    }

    fn raw_key() -> impl Strategy<Value = Vec<u8>> {
        raw_bytes(1..5)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn stored_keys_round_trip_and_keep_raw_order(a in raw_key(), b in raw_key()) {
            let (sa, sb) = (store(a.clone()), store(b.clone()));
            prop_assert_eq!(bytes(&sa).into_owned(), a.clone());
            prop_assert_eq!(raw_len(&sa), a.len());
            prop_assert_eq!(sa == sb, a == b);
            prop_assert_eq!(cmp(&sa, &sb), a.cmp(&b));
            prop_assert_eq!(is_encoded(&sa), std::str::from_utf8(&a).is_err() || a.first() == Some(&0));
            prop_assert_eq!(raw_starts_with(&sa, &b), a.starts_with(&b));
        }

        #[test]
        fn spans_hold_exactly_the_keys_of_the_range(
            k in raw_key(), s in raw_bytes(0..5), e in prop::option::of(raw_bytes(0..5)),
        ) {
            let range = KeyRange { start: s, end: e };
            let stored = store(k.clone());
            let spans = spans(&range);
            let hits = spans.iter().filter(|sp| sp.contains(stored.as_bytes())).count();
            prop_assert_eq!(hits == 1, range.contains(&k));
            prop_assert!(hits <= 1);
            prop_assert_eq!(range.contains_stored(&stored), range.contains(&k));
        }

        /// A single-key range names exactly the stored form of its key; any other range none.
        #[test]
        fn a_single_key_range_is_its_keys_stored_form(
            k in raw_key(), other in raw_key(), e in prop::option::of(raw_bytes(0..5)),
        ) {
            let k_nul = [k.as_slice(), &[0]].concat();
            let point = KeyRange { start: k.clone(), end: Some(k_nul.clone()) };
            let stored = store(k.clone());
            let found = single(&point);
            prop_assert_eq!(found.as_deref(), Some(stored.as_str()));
            prop_assert!(point.contains_stored(&stored));
            prop_assert_eq!(point.contains_stored(&store(other.clone())), other == k);
            let range = KeyRange { start: k.clone(), end: e };
            if let Some(one) = single(&range) {
                prop_assert_eq!(range.end.as_deref(), Some(k_nul.as_slice()));
                prop_assert_eq!(one.as_ref(), stored.as_str());
            }
        }

        #[test]
        fn merged_runs_are_in_raw_order(mut keys in prop::collection::vec(raw_key(), 0..12)) {
            keys.sort();
            keys.dedup();
            let stored: Vec<String> = keys.iter().cloned().map(store).collect();
            let (mut enc, mut text): (Vec<String>, Vec<String>) =
                stored.into_iter().partition(|k| is_encoded(k));
            enc.sort();
            text.sort();
            let merged: Vec<Vec<u8>> =
                merge(text, enc, |k| k.as_str()).map(|k| bytes(&k).into_owned()).collect();
            prop_assert_eq!(merged, keys);
        }
    }
}
