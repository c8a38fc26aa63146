//! HPACK (RFC 7541), as far as the shim needs it: a decoder that keeps the client's dynamic
//! table, and the one representation the shim writes, a literal that is never indexed.
//!
//! # Invariants
//! - The table never holds more than its size (at most [`MAX_TABLE_SIZE`], counted as the RFC
//!   counts: name + value + 32 per entry), so at most 128 entries.
//! - Any input ends in `Ok` or `Err`, never a panic; an `Err` leaves the table as the fields
//!   before the error left it (the caller then trusts it no more).
//! - Integers are at most 2^28 + 255 (four continuation bytes), as no sane encoder needs more.

use std::collections::VecDeque;

use super::huffman::{self, HuffmanError};

/// The largest dynamic table a client may ask for: the HTTP/2 default of
/// SETTINGS_HEADER_TABLE_SIZE, which hyper's server does not change (h2 refuses larger size
/// updates too).
pub const MAX_TABLE_SIZE: usize = 4096;

/// What RFC 7541 adds to each entry's name and value lengths.
const ENTRY_OVERHEAD: usize = 32;

/// Why a header block does not decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the header block ends inside a field")]
    Truncated,
    #[error("an integer over 2^28")]
    IntegerTooLarge,
    #[error("index {0} is in neither table")]
    BadIndex(usize),
    #[error(transparent)]
    Huffman(#[from] HuffmanError),
    #[error("a dynamic table size update to {0} bytes (the most is {MAX_TABLE_SIZE})")]
    TableTooLarge(usize),
    #[error("a dynamic table size update after a field")]
    LateSizeUpdate,
}

/// One decoded field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field<'a> {
    pub name: &'a [u8],
    pub value: &'a [u8],
    /// Sent as "never indexed" (a credential, say): re-encoded the same way.
    pub never_indexed: bool,
}

/// A dynamic table entry: name and value in one allocation.
struct Entry {
    bytes: Box<[u8]>,
    name_len: usize,
}

impl Entry {
    fn new(name: &[u8], value: &[u8]) -> Entry {
        let mut bytes = Vec::with_capacity(name.len() + value.len());
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(value);
        Entry {
            bytes: bytes.into_boxed_slice(),
            name_len: name.len(),
        }
    }

    fn split(&self) -> (&[u8], &[u8]) {
        self.bytes.split_at(self.name_len)
    }

    fn size(&self) -> usize {
        self.bytes.len() + ENTRY_OVERHEAD
    }
}

/// A client's HPACK state as seen by the server: the dynamic table, and two scratch buffers for
/// Huffman-coded strings.
pub struct Decoder {
    /// Newest first (index 62 is `table[0]`).
    table: VecDeque<Entry>,
    size: usize,
    max_size: usize,
    name_buf: Vec<u8>,
    value_buf: Vec<u8>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max_size: MAX_TABLE_SIZE,
            name_buf: Vec::new(),
            value_buf: Vec::new(),
        }
    }
}

/// Scratch buffers that grew past this are given back after a block.
const KEEP_SCRATCH: usize = 4096;

impl Decoder {
    /// Decode one whole header block, handing each field to `on_field` in order and updating
    /// the table as the client's encoder did. An error from `on_field` stops the decoding.
    pub fn decode<E: From<DecodeError>>(
        &mut self,
        block: &[u8],
        mut on_field: impl FnMut(Field<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let result = self.fields(block, &mut on_field);
        for buf in [&mut self.name_buf, &mut self.value_buf] {
            if buf.capacity() > KEEP_SCRATCH {
                *buf = Vec::new();
            }
        }
        result
    }

    fn fields<E: From<DecodeError>>(
        &mut self,
        mut block: &[u8],
        on_field: &mut impl FnMut(Field<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut fields_seen = false;
        while let Some(&first) = block.first() {
            if first & 0xe0 == 0x20 {
                // Dynamic table size update: only before the first field (RFC 7541 §4.2).
                if fields_seen {
                    return Err(DecodeError::LateSizeUpdate.into());
                }
                let (size, rest) = integer(block, 5)?;
                if size > MAX_TABLE_SIZE {
                    return Err(DecodeError::TableTooLarge(size).into());
                }
                block = rest;
                self.max_size = size;
                self.evict();
                continue;
            }
            fields_seen = true;
            if first & 0x80 != 0 {
                // Indexed field.
                let (index, rest) = integer(block, 7)?;
                block = rest;
                let (name, value) = get(&self.table, index)?;
                on_field(Field {
                    name,
                    value,
                    never_indexed: false,
                })?;
            } else if first & 0x40 != 0 {
                // Literal with incremental indexing: it enters the table.
                let (entry, rest) = self.literal(block, 6)?;
                block = rest;
                let (name, value) = entry.split();
                let handled = on_field(Field {
                    name,
                    value,
                    never_indexed: false,
                });
                self.insert(entry);
                handled?;
            } else {
                // Literal without indexing (0000) or never indexed (0001).
                let never_indexed = first & 0x10 != 0;
                let (index, rest) = integer(block, 4)?;
                let (name, rest) = match index {
                    0 => string(rest, &mut self.name_buf)?,
                    i => (get(&self.table, i)?.0, rest),
                };
                let (value, rest) = string(rest, &mut self.value_buf)?;
                block = rest;
                on_field(Field {
                    name,
                    value,
                    never_indexed,
                })?;
            }
        }
        Ok(())
    }

    /// A literal with incremental indexing (name index prefix `prefix` bits), as its entry.
    fn literal<'b>(
        &mut self,
        block: &'b [u8],
        prefix: u8,
    ) -> Result<(Entry, &'b [u8]), DecodeError> {
        let (index, rest) = integer(block, prefix)?;
        let (name, rest) = match index {
            0 => string(rest, &mut self.name_buf)?,
            i => (get(&self.table, i)?.0, rest),
        };
        let (value, rest) = string(rest, &mut self.value_buf)?;
        Ok((Entry::new(name, value), rest))
    }

    fn insert(&mut self, entry: Entry) {
        if entry.size() > self.max_size {
            // RFC 7541 §4.4: an entry larger than the table empties it and is not added.
            self.table.clear();
            self.size = 0;
            return;
        }
        self.size += entry.size();
        self.table.push_front(entry);
        self.evict();
    }

    fn evict(&mut self) {
        while self.size > self.max_size {
            match self.table.pop_back() {
                Some(old) => self.size -= old.size(),
                None => self.size = 0,
            }
        }
    }

    /// The entries, newest first (for the tests).
    #[cfg(test)]
    pub fn entries(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.table
            .iter()
            .map(|e| (e.split().0.to_vec(), e.split().1.to_vec()))
            .collect()
    }
}

/// Field `index` of the static table (1 to 61) or of `table` (62 on).
fn get(table: &VecDeque<Entry>, index: usize) -> Result<(&[u8], &[u8]), DecodeError> {
    match index {
        0 => Err(DecodeError::BadIndex(0)),
        i if i <= STATIC.len() => Ok(STATIC[i - 1]),
        i => table
            .get(i - STATIC.len() - 1)
            .map(Entry::split)
            .ok_or(DecodeError::BadIndex(i)),
    }
}

/// An integer with a `prefix`-bit prefix (RFC 7541 §5.1), and what follows it.
fn integer(src: &[u8], prefix: u8) -> Result<(usize, &[u8]), DecodeError> {
    let (&first, mut rest) = src.split_first().ok_or(DecodeError::Truncated)?;
    let max = (1usize << prefix) - 1;
    let mut value = usize::from(first) & max;
    if value < max {
        return Ok((value, rest));
    }
    for shift in [0, 7, 14, 21] {
        let (&b, r) = rest.split_first().ok_or(DecodeError::Truncated)?;
        rest = r;
        value += usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok((value, rest));
        }
    }
    Err(DecodeError::IntegerTooLarge)
}

/// A string literal (RFC 7541 §5.2), Huffman-decoded into `buf` if it is coded, and what
/// follows it.
fn string<'s: 'v, 'v>(
    src: &'s [u8],
    buf: &'v mut Vec<u8>,
) -> Result<(&'v [u8], &'s [u8]), DecodeError> {
    let coded = src.first().is_some_and(|b| b & 0x80 != 0);
    let (len, rest) = integer(src, 7)?;
    if len > rest.len() {
        return Err(DecodeError::Truncated);
    }
    let (raw, rest) = rest.split_at(len);
    if !coded {
        return Ok((raw, rest));
    }
    buf.clear();
    huffman::decode(raw, buf)?;
    Ok((buf.as_slice(), rest))
}

/// Append a field as a literal without indexing (or never indexed), name and value literal and
/// not Huffman-coded: a representation that leaves the receiver's dynamic table alone.
pub fn encode_literal(dst: &mut Vec<u8>, field: Field<'_>) {
    dst.push(if field.never_indexed { 0x10 } else { 0x00 });
    for s in [field.name, field.value] {
        encode_integer(dst, 0x00, 7, s.len());
        dst.extend_from_slice(s);
    }
}

/// An integer with a `prefix`-bit prefix whose other bits are `flags`.
fn encode_integer(dst: &mut Vec<u8>, flags: u8, prefix: u8, mut value: usize) {
    let max = (1usize << prefix) - 1;
    if value < max {
        dst.push(flags | value as u8);
        return;
    }
    dst.push(flags | max as u8);
    value -= max;
    while value >= 0x80 {
        dst.push(0x80 | (value & 0x7f) as u8);
        value >>= 7;
    }
    dst.push(value as u8);
}

/// The static table (RFC 7541 Appendix A), index 1 first.
const STATIC: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::authority::test_hex as hex;
    use proptest::prelude::*;

    type Fields = Vec<(String, String, bool)>;

    fn decode_all(d: &mut Decoder, block: &[u8]) -> Result<Fields, DecodeError> {
        let mut out = Vec::new();
        d.decode(block, |f: Field<'_>| {
            out.push((
                String::from_utf8_lossy(f.name).into_owned(),
                String::from_utf8_lossy(f.value).into_owned(),
                f.never_indexed,
            ));
            Ok::<(), DecodeError>(())
        })?;
        Ok(out)
    }

    fn fields(list: &[(&str, &str)]) -> Fields {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string(), false))
            .collect()
    }

    /// RFC 7541 C.3 (plain) and C.4 (Huffman-coded): three requests on one connection.
    #[test]
    fn decodes_the_rfcs_request_examples() {
        let expected = [
            fields(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ]),
            fields(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ]),
            fields(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ]),
        ];
        for blocks in [
            [
                "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
                "8286 84be 5808 6e6f 2d63 6163 6865",
                "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
            ],
            [
                "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
                "8286 84be 5886 a8eb 1064 9cbf",
                "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
            ],
        ] {
            let mut d = Decoder::default();
            for (block, want) in blocks.iter().zip(&expected) {
                assert_eq!(&decode_all(&mut d, &hex(block)).unwrap(), want);
            }
            assert_eq!(d.size, 164);
            assert_eq!(
                d.entries()[0],
                (b"custom-key".to_vec(), b"custom-value".to_vec())
            );
        }
    }

    #[test]
    fn size_updates_evict_and_are_bounded() {
        let mut d = Decoder::default();
        // Two entries of 32 + 2 bytes.
        decode_all(&mut d, &[0x40, 1, b'a', 1, b'b', 0x40, 1, b'c', 1, b'd']).unwrap();
        assert_eq!(d.entries().len(), 2);
        // A size update to 40 bytes keeps the newest only; index 63 is gone.
        assert_eq!(
            decode_all(&mut d, &[0x3f, 9, 0xbe]).unwrap(),
            vec![("c".into(), "d".into(), false)]
        );
        assert_eq!(decode_all(&mut d, &[0xbf]), Err(DecodeError::BadIndex(63)));
        // Over 4096, or after a field: refused.
        assert_eq!(
            decode_all(&mut d, &[0x3f, 0xe2, 0x1f]),
            Err(DecodeError::TableTooLarge(4097))
        );
        assert_eq!(
            decode_all(&mut d, &[0x82, 0x20]),
            Err(DecodeError::LateSizeUpdate)
        );
        // An entry larger than the table empties it.
        let mut d = Decoder::default();
        decode_all(&mut d, &[0x40, 1, b'a', 1, b'b']).unwrap();
        let mut big = vec![0x40, 1, b'x'];
        encode_integer(&mut big, 0, 7, 5000);
        big.extend(std::iter::repeat_n(b'y', 5000));
        decode_all(&mut d, &big).unwrap();
        assert!(d.entries().is_empty());
        assert_eq!(d.size, 0);
    }

    #[test]
    fn refuses_what_does_not_decode() {
        let mut d = Decoder::default();
        for (block, err) in [
            (&[0x80][..], DecodeError::BadIndex(0)),
            (&[0xbe][..], DecodeError::BadIndex(62)),
            (&[0x41, 0x05, b'a'][..], DecodeError::Truncated),
            (&[0xff][..], DecodeError::Truncated),
            (
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0x01][..],
                DecodeError::IntegerTooLarge,
            ),
            (
                &[0x00, 0x81, 0xff, 0x00][..],
                DecodeError::Huffman(HuffmanError::Padding),
            ),
        ] {
            assert_eq!(decode_all(&mut d, block), Err(err), "{block:?}");
        }
    }

    #[test]
    fn literals_round_trip_and_leave_the_table_alone() {
        let mut block = Vec::new();
        let long = "v".repeat(300);
        for (n, v, never) in [
            (":authority", "h:1", false),
            ("token", "s", true),
            ("x", long.as_str(), false),
        ] {
            encode_literal(
                &mut block,
                Field {
                    name: n.as_bytes(),
                    value: v.as_bytes(),
                    never_indexed: never,
                },
            );
        }
        let mut d = Decoder::default();
        assert_eq!(
            decode_all(&mut d, &block).unwrap(),
            vec![
                (":authority".into(), "h:1".into(), false),
                ("token".into(), "s".into(), true),
                ("x".into(), long.clone(), false),
            ]
        );
        assert!(d.entries().is_empty());
    }

    /// Random header lists, each encoded by an independent HPACK encoder (httlib-hpack) with
    /// random representations (indexed or not, Huffman-coded or not), on one connection: the
    /// decoder reads back every list, in order.
    fn header_list() -> impl Strategy<Value = Vec<(Vec<u8>, Vec<u8>, u8)>> {
        let name = prop_oneof![
            Just(b":authority".to_vec()),
            Just(b":path".to_vec()),
            Just(b"content-type".to_vec()),
            Just(b"grpc-timeout".to_vec()),
            proptest::collection::vec(b'a'..=b'z', 1..12),
        ];
        let value = proptest::collection::vec(any::<u8>(), 0..80);
        proptest::collection::vec((name, value, 0u8..32), 0..10)
    }

    proptest! {
        #[test]
        fn agrees_with_another_encoder(lists in proptest::collection::vec(header_list(), 1..8)) {
            let mut enc = httlib_hpack::Encoder::default();
            let mut d = Decoder::default();
            for list in lists {
                let mut block = Vec::new();
                for (n, v, flags) in &list {
                    // Random representation flags (Huffman name/value, with indexing, never
                    // indexed, best format).
                    let flags = flags & 0x1f;
                    let flags = if flags & 0x0c == 0x0c { flags & !0x08 } else { flags };
                    enc.encode((n.clone(), v.clone(), flags), &mut block).unwrap();
                }
                let got = {
                    let mut out = Vec::new();
                    d.decode(&block, |f: Field<'_>| {
                        out.push((f.name.to_vec(), f.value.to_vec()));
                        Ok::<(), DecodeError>(())
                    }).unwrap();
                    out
                };
                let want: Vec<_> = list.iter().map(|(n, v, _)| (n.clone(), v.clone())).collect();
                prop_assert_eq!(got, want);
                prop_assert!(d.size <= MAX_TABLE_SIZE);
            }
        }

        #[test]
        fn any_block_ends_without_panic(blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..100), 1..6)) {
            let mut d = Decoder::default();
            for block in blocks {
                let _ = decode_all(&mut d, &block);
                prop_assert!(d.size <= d.max_size);
            }
        }
    }
}
