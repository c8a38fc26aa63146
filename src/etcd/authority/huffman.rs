//! HPACK's Huffman code (RFC 7541 §5.2 and Appendix B), decoding only: the shim never writes
//! Huffman-coded strings.
//!
//! The code is canonical: its codes follow from their lengths alone, assigned in order of
//! length and then of symbol (the tests check a few against the RFC's table and decode the
//! RFC's examples). So the table below is the RFC's code lengths, and [`decode`] walks the
//! input bit by bit, keeping only the code read so far and its length.
//!
//! # Invariants
//! Any input ends in `Ok` or `Err`, never a panic, and the output is at most 8/5 the input's
//! length (no code is shorter than 5 bits).

/// Every symbol's code length in bits (RFC 7541 Appendix B): bytes 0 to 255, then EOS (256).
const LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
];

/// The longest code (EOS and three rare bytes).
const MAX_LEN: usize = 30;

/// The symbol that ends a string: never sent, its leading bits pad a string's last byte.
const EOS: u16 = 256;

/// The canonical code, derived from [`LENGTHS`] at compile time.
struct Canonical {
    /// The first code of each length.
    first: [u32; MAX_LEN + 1],
    /// How many codes have each length.
    count: [u32; MAX_LEN + 1],
    /// Where each length's symbols start in `symbols`.
    offset: [u32; MAX_LEN + 1],
    /// The symbols in code order (by length, then symbol).
    symbols: [u16; 257],
}

const CODE: Canonical = canonical();

const fn canonical() -> Canonical {
    let mut count = [0u32; MAX_LEN + 1];
    let mut s = 0;
    while s < LENGTHS.len() {
        count[LENGTHS[s] as usize] += 1;
        s += 1;
    }
    let mut first = [0u32; MAX_LEN + 1];
    let mut offset = [0u32; MAX_LEN + 1];
    let mut symbols = [0u16; 257];
    let (mut code, mut at, mut len) = (0u32, 0usize, 1usize);
    while len <= MAX_LEN {
        first[len] = code;
        offset[len] = at as u32;
        let mut s = 0;
        while s < LENGTHS.len() {
            if LENGTHS[s] as usize == len {
                symbols[at] = s as u16;
                at += 1;
            }
            s += 1;
        }
        code = (code + count[len]) << 1;
        len += 1;
    }
    Canonical {
        first,
        count,
        offset,
        symbols,
    }
}

/// Why a Huffman-coded string is invalid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HuffmanError {
    #[error("a Huffman-coded string holds the EOS symbol")]
    Eos,
    #[error("a Huffman-coded string's padding is not a prefix of EOS shorter than 8 bits")]
    Padding,
}

/// Append the decoding of `src` to `dst`.
pub fn decode(src: &[u8], dst: &mut Vec<u8>) -> Result<(), HuffmanError> {
    dst.reserve(src.len() * 8 / 5);
    // The bits read since the last symbol, and how many.
    let (mut code, mut len) = (0u32, 0usize);
    for &byte in src {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((byte >> shift) & 1);
            len += 1;
            let rank = code.wrapping_sub(CODE.first[len]);
            if rank < CODE.count[len] {
                match CODE.symbols[(CODE.offset[len] + rank) as usize] {
                    EOS => return Err(HuffmanError::Eos),
                    symbol => dst.push(symbol as u8),
                }
                (code, len) = (0, 0);
            } else if len == MAX_LEN {
                // Unreachable (the code is complete: 30 bits always end a symbol); kept so
                // that no input can index past the tables.
                return Err(HuffmanError::Eos);
            }
        }
    }
    // At most 7 bits of padding, all ones (the start of EOS).
    if len > 7 || code != (1 << len) - 1 {
        return Err(HuffmanError::Padding);
    }
    Ok(())
}

/// The code of `symbol` as (bits, length): for the tests' encoder.
#[cfg(test)]
fn code_of(symbol: usize) -> (u32, usize) {
    let len = LENGTHS[symbol] as usize;
    let start = CODE.offset[len] as usize;
    let rank = CODE.symbols[start..start + CODE.count[len] as usize]
        .iter()
        .position(|s| usize::from(*s) == symbol)
        .expect("every symbol has a code");
    (CODE.first[len] + rank as u32, len)
}

/// Huffman-code `src` (padding with ones), as an encoder would.
#[cfg(test)]
pub fn encode(src: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u64, 0usize);
    for &b in src {
        let (code, len) = code_of(usize::from(b));
        acc = (acc << len) | u64::from(code);
        bits += len;
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd::authority::test_hex as hex;
    use proptest::prelude::*;

    fn decoded(src: &[u8]) -> Result<Vec<u8>, HuffmanError> {
        let mut out = Vec::new();
        decode(src, &mut out).map(|()| out)
    }

    #[test]
    fn codes_are_the_rfcs() {
        // RFC 7541 Appendix B, a few rows.
        assert_eq!(code_of(0), (0x1ff8, 13));
        assert_eq!(code_of(usize::from(b' ')), (0x14, 6));
        assert_eq!(code_of(usize::from(b'0')), (0x0, 5));
        assert_eq!(code_of(usize::from(b'a')), (0x3, 5));
        assert_eq!(code_of(usize::from(b'~')), (0x1ffd, 13));
        assert_eq!(code_of(10), (0x3ffffffc, 30));
        assert_eq!(code_of(255), (0x3ffffee, 26));
        assert_eq!(code_of(256), (0x3fffffff, 30));
    }

    #[test]
    fn decodes_the_rfcs_examples() {
        // RFC 7541 C.4 and C.6.
        for (coded, text) in [
            ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
            ("a8eb 1064 9cbf", "no-cache"),
            ("25a8 49e9 5ba9 7d7f", "custom-key"),
            ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
            ("6402", "302"),
            ("aec3 771a 4b", "private"),
            (
                "d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff",
                "Mon, 21 Oct 2013 20:13:21 GMT",
            ),
            (
                "9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3",
                "https://www.example.com",
            ),
            ("9bd9 ab", "gzip"),
            (
                "94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed 4ee5 b106 3d50 07",
                "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1",
            ),
        ] {
            assert_eq!(decoded(&hex(coded)).unwrap(), text.as_bytes(), "{text}");
            assert_eq!(encode(text.as_bytes()), hex(coded), "{text}");
        }
    }

    #[test]
    fn refuses_eos_and_bad_padding() {
        // EOS whole (30 ones, then 2 bits of padding).
        assert_eq!(decoded(&[0xff, 0xff, 0xff, 0xff]), Err(HuffmanError::Eos));
        // 8 bits of padding.
        let mut long = encode(b"a");
        long.push(0xff);
        assert_eq!(decoded(&long), Err(HuffmanError::Padding));
        // Padding with a zero: 'a' is 00011, then 110.
        assert_eq!(decoded(&[0b0001_1110]), Err(HuffmanError::Padding));
        assert_eq!(decoded(&[]), Ok(Vec::new()));
    }

    #[test]
    fn every_byte_round_trips() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decoded(&encode(&all)).unwrap(), all);
    }

    proptest! {
        #[test]
        fn round_trips(text in proptest::collection::vec(any::<u8>(), 0..200)) {
            let coded = encode(&text);
            prop_assert_eq!(decoded(&coded).unwrap(), text.clone());
            prop_assert!(text.len() * 5 / 8 <= coded.len());
        }

        #[test]
        fn any_input_ends_without_panic(src in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(out) = decoded(&src) {
                prop_assert!(out.len() <= src.len() * 8 / 5);
            }
        }
    }
}
