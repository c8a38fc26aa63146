//! Binary values in a text store: how the etcd API's byte values are kept in leasecore's
//! `String` values, and read back. Pure.
//!
//! etcd's values are bytes (Kubernetes stores protobuf, Go programs gob or compressed JSON);
//! leasecore's store keeps UTF-8 text. A stored value whose first char is U+0000 (NUL) is
//! *encoded*: NUL, then the standard base64 (with padding) of the raw bytes. [`store`] keeps
//! UTF-8 that does not begin with NUL as it is, so text written through the etcd API is
//! byte-identical in `/v1`, and encodes anything else; [`bytes`] gives the raw bytes back.
//!
//! # Invariants
//! - `bytes(&store(v)) == v` for every byte vector `v`; [`raw_len`] is `bytes(..).len()`
//!   without decoding.
//! - Text that does not begin with NUL is stored unchanged and read back unchanged: `/v1`
//!   values (which may not begin with NUL, [`is_encoded_form`]) mean the same to both APIs.
//! - [`store`] is injective, so two stored values are equal exactly when their bytes are
//!   (for values it wrote); [`cmp`] orders stored values as their bytes, etcd's order.
//! - A value that begins with NUL but is not valid canonical base64 after it (only possible
//!   for data written through `/v1` before encoded values existed) reads as its own UTF-8
//!   bytes.
//!
//! # What it must not do
//! Change a stored value's type or any stored format: an encoded value is an ordinary
//! `String` in the state, the log, snapshots and the history. It never decides who may write
//! an encoded value: the edges do (the etcd API stores through [`store`]; `/v1` refuses values
//! that begin with NUL).

use std::borrow::Cow;
use std::cmp::Ordering;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

/// The first char of an encoded value.
pub const MARK: char = '\0';

/// The stored form of `raw`: itself when it is UTF-8 that does not begin with NUL, else NUL
/// and its base64.
pub fn store(raw: Vec<u8>) -> String {
    match String::from_utf8(raw) {
        Ok(text) if !text.starts_with(MARK) => text,
        Ok(text) => encode(text.as_bytes()),
        Err(e) => encode(e.as_bytes()),
    }
}

fn encode(raw: &[u8]) -> String {
    let mut out = String::with_capacity(1 + raw.len().div_ceil(3) * 4);
    out.push(MARK);
    STANDARD.encode_string(raw, &mut out);
    out
}

/// Whether `value` has the form of an encoded value (it begins with NUL): what `/v1` may not
/// write.
pub fn is_encoded_form(value: &str) -> bool {
    value.starts_with(MARK)
}

/// The raw bytes of the stored value `stored`.
pub fn bytes(stored: &str) -> Cow<'_, [u8]> {
    raw(stored.as_bytes())
}

/// The raw bytes of a stored value given as bytes (a compare's target): as [`bytes`].
pub fn raw(stored: &[u8]) -> Cow<'_, [u8]> {
    match stored.split_first() {
        Some((0, b64)) => STANDARD
            .decode(b64)
            .map_or(Cow::Borrowed(stored), Cow::Owned),
        _ => Cow::Borrowed(stored),
    }
}

/// The length of `bytes(stored)`, without decoding.
pub fn raw_len(stored: &str) -> usize {
    raw_len_of(stored.as_bytes())
}

/// The length of `raw(stored)`, without decoding.
pub fn raw_len_of(stored: &[u8]) -> usize {
    match stored.split_first() {
        Some((0, b64)) => decoded_len(b64).unwrap_or(stored.len()),
        _ => stored.len(),
    }
}

/// Two stored values in the order of their raw bytes (etcd's order of values).
pub fn cmp(a: &[u8], b: &[u8]) -> Ordering {
    if a.first() != Some(&0) && b.first() != Some(&0) {
        return a.cmp(b);
    }
    raw(a).cmp(&raw(b))
}

/// The decoded length of `b64` if it is canonical padded standard base64 (what the decoder
/// accepts: whole groups of four, `=` only as the last one or two, no stray bits before
/// them), else `None`.
fn decoded_len(b64: &[u8]) -> Option<usize> {
    fn sextet(c: u8) -> Option<u8> {
        match c {
            b'A'..=b'Z' => Some(c - b'A'),
            b'a'..=b'z' => Some(c - b'a' + 26),
            b'0'..=b'9' => Some(c - b'0' + 52),
            b'+' => Some(62),
            b'/' => Some(63),
            _ => None,
        }
    }
    if !b64.len().is_multiple_of(4) {
        return None;
    }
    let pad = match b64 {
        [.., b'=', b'='] => 2,
        [.., b'='] => 1,
        _ => 0,
    };
    let data = &b64[..b64.len() - pad];
    let mut last = 0;
    for &c in data {
        last = sextet(c)?;
    }
    // The bits of the last sextet past the final byte must be zero.
    let stray = match pad {
        2 => last & 0b1111,
        1 => last & 0b11,
        _ => 0,
    };
    (stray == 0).then_some(b64.len() / 4 * 3 - pad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn text_is_kept_and_the_rest_encoded() {
        assert_eq!(store(b"hello".to_vec()), "hello");
        assert_eq!(store(Vec::new()), "");
        assert_eq!(store("héllo".as_bytes().to_vec()), "héllo");
        assert_eq!(store(vec![0x00, 0x01, 0xff]), "\0AAH/");
        assert_eq!(store(b"\0text".to_vec()), "\0AHRleHQ=");
        assert_eq!(store(vec![0xff]), "\0/w==");
        assert_eq!(&*bytes("\0/w=="), [0xff]);
        assert_eq!(raw_len("\0/w=="), 1);
        assert_eq!(raw_len("\0AHRleHQ="), 5);
    }

    #[test]
    fn a_nul_before_anything_but_base64_is_its_own_bytes() {
        for s in [
            "\0", "\0!", "\0abc", "\0AB=A", "\0/x==", "\0AAH/ ", "\0A===", "\0====",
        ] {
            let own = s.as_bytes();
            let decoded = STANDARD.decode(&own[1..]).ok();
            match decoded {
                Some(d) => assert_eq!(&*bytes(s), d.as_slice(), "{s:?}"),
                None => assert_eq!(&*bytes(s), own, "{s:?}"),
            }
            assert_eq!(raw_len(s), bytes(s).len(), "{s:?}");
        }
        // "\0" is NUL then no base64: no bytes.
        assert_eq!(&*bytes("\0"), b"");
    }

    #[test]
    fn order_is_the_order_of_the_bytes() {
        let s = |v: &[u8]| store(v.to_vec());
        let ord = |a: &[u8], b: &[u8]| cmp(s(a).as_bytes(), s(b).as_bytes());
        assert_eq!(ord(b"z", &[0xff]), Ordering::Less);
        assert_eq!(ord(&[0x01, 0x80], b"z"), Ordering::Less);
        assert_eq!(ord(&[0xff, 0x00], &[0xff]), Ordering::Greater);
        assert_eq!(ord(b"a", b"a"), Ordering::Equal);
    }

    proptest! {
        #[test]
        fn every_byte_vector_round_trips(v in proptest::collection::vec(any::<u8>(), 0..256)) {
            let stored = store(v.clone());
            prop_assert_eq!(&*bytes(&stored), v.as_slice());
            prop_assert_eq!(raw_len(&stored), v.len());
        }

        #[test]
        fn text_not_beginning_with_nul_is_stored_unchanged(t in "\\PC*|[a-z\u{0}-\u{7f}]{0,20}") {
            prop_assume!(!t.starts_with('\0'));
            prop_assert_eq!(&store(t.clone().into_bytes()), &t);
            prop_assert_eq!(&*bytes(&t), t.as_bytes());
            prop_assert_eq!(raw_len(&t), t.len());
        }

        #[test]
        fn the_length_without_decoding_is_the_decoded_length(
            tail in "[A-Za-z0-9+/=]{0,12}|[A-Za-z0-9+/]{0,9}[AQgw]==|[A-Za-z0-9+/]{0,10}[AEIMQUYcgkosw048]="
        ) {
            let s = format!("\0{tail}");
            let decodes = STANDARD.decode(tail.as_bytes()).is_ok();
            prop_assert_eq!(decoded_len(tail.as_bytes()).is_some(), decodes);
            prop_assert_eq!(raw_len(&s), bytes(&s).len());
        }

        #[test]
        fn order_agrees_with_the_bytes(
            a in proptest::collection::vec(any::<u8>(), 0..8),
            b in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let (sa, sb) = (store(a.clone()), store(b.clone()));
            prop_assert_eq!(cmp(sa.as_bytes(), sb.as_bytes()), a.cmp(&b));
            prop_assert_eq!(sa == sb, a == b);
        }
    }
}
