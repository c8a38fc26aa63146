//! An AppendEntries request on the wire, both ways, around the entries' own encodings.
//!
//! The body is the request's MessagePack encoding with field names (`rmp_serde`'s
//! `write_named`): a map of `vote`, `prev_log_id`, `entries`, `leader_commit`. MessagePack is
//! context-free, so an entry inside it is exactly the bytes the log store writes for that entry
//! ([`log_store::encode_entry`]). Both directions use that:
//! - [`write_append`] (the leader) copies each entry's kept encoding into the body instead of
//!   encoding the entries again for every follower;
//! - [`read_append`] (a follower) notes where each entry lies in the body and keeps a copy of
//!   those bytes with the entry's command, so that its log store writes them instead of
//!   encoding the entry once more.
//!
//! # Invariants
//! - What [`write_append`] writes is byte for byte `rmp_serde::to_vec_named(&request)`: a node
//!   of any build decodes it.
//! - [`read_append`] decodes as `rmp_serde::from_slice` does (it is that call); what it adds is
//!   only the bytes it keeps for an entry, which are the very bytes that decoded to it: storing
//!   them stores that entry. When it cannot tell where an entry lies, it keeps nothing.
//!
//! # What it must not do
//! Trust the body. It comes from a peer: every length is checked against what is left of the
//! body before it is used.

use openraft::EntryPayload;
use openraft::raft::AppendEntriesRequest;

use crate::raft::{Entry, TypeConfig, log_store};

/// Room for an append's field names, vote and log ids (211 bytes with every number at
/// its largest: `the_fixed_part_fits_its_room`).
const FIELDS_AND_IDS: usize = 256;

/// The room [`write_append`] needs for `rpc`: exact for the entries whose encoding is kept,
/// `estimate` for the others. A frame allocated this large is not grown while it is written
/// (growing a buffer of tens of KiB is a large reallocation each time: 1% of the leader's
/// instructions per put when the estimate alone sized it).
pub fn append_size_hint(
    rpc: &AppendEntriesRequest<TypeConfig>,
    estimate: impl Fn(&Entry) -> usize,
) -> usize {
    rpc.entries
        .iter()
        .map(|e| log_store::kept_entry_bytes(e).map_or_else(|| estimate(e), |b| b.len()))
        .sum::<usize>()
        + FIELDS_AND_IDS
}

/// An append request as `rmp_serde::encode::write_named` writes it (a map of its fields by
/// name, in their declared order), each entry as the bytes the log store wrote for it (kept
/// with the entry's command on the leader, [`log_store::entry_bytes`]), without encoding the
/// entries again for each follower (two thirds of the leader's encoding work per put).
pub fn write_append(
    out: &mut Vec<u8>,
    rpc: &AppendEntriesRequest<TypeConfig>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let entries = u32::try_from(rpc.entries.len())?;
    rmp::encode::write_map_len(out, 4)?;
    rmp::encode::write_str(out, "vote")?;
    rmp_serde::encode::write_named(out, &rpc.vote)?;
    rmp::encode::write_str(out, "prev_log_id")?;
    rmp_serde::encode::write_named(out, &rpc.prev_log_id)?;
    rmp::encode::write_str(out, "entries")?;
    rmp::encode::write_array_len(out, entries)?;
    for entry in &rpc.entries {
        // One the log store did not keep (read back from its files, a blank or membership
        // entry) is encoded in place, as the whole request's encoding would.
        match log_store::kept_entry_bytes(entry) {
            Some(bytes) => out.extend_from_slice(&bytes),
            None => rmp_serde::encode::write_named(out, entry)?,
        }
    }
    rmp::encode::write_str(out, "leader_commit")?;
    rmp_serde::encode::write_named(out, &rpc.leader_commit)?;
    Ok(())
}

/// Decode an append request from `body` (as `rmp_serde` does), then keep each normal entry's
/// bytes with its command ([`crate::raft::LogCommand::keep_encoded_entry`]) for the log store.
pub fn read_append(body: &[u8]) -> Result<AppendEntriesRequest<TypeConfig>, String> {
    let rpc: AppendEntriesRequest<TypeConfig> =
        rmp_serde::from_slice(body).map_err(|e| e.to_string())?;
    if let Some(spans) = entry_spans(body, rpc.entries.len()) {
        for (entry, span) in rpc.entries.iter().zip(spans) {
            if let EntryPayload::Normal(cmd) = &entry.payload {
                cmd.keep_encoded_entry(entry.log_id, bytes::Bytes::copy_from_slice(&body[span]));
            }
        }
    }
    Ok(rpc)
}

/// Where each of the `count` entries lies in `body`: the elements of the array under the map's
/// `entries` key. `None` when the body is not in the form every build writes (a map with
/// string keys), or the array is not `count` long: then nothing is kept, which is always safe
/// (the log store encodes the entry itself). The body decoded already, so `rmp_serde` took
/// these very elements as the entries, in order (a repeated field is an error there).
fn entry_spans(body: &[u8], count: usize) -> Option<Vec<std::ops::Range<usize>>> {
    let mut at = 0;
    let fields = map_len(body, &mut at)?;
    for _ in 0..fields {
        let key_start = at;
        at += value_len(&body[at..])?;
        let key = str_contents(&body[key_start..at]);
        if key == Some(b"entries".as_slice()) {
            if array_len(body, &mut at)? != count {
                return None;
            }
            let mut spans = Vec::with_capacity(count);
            for _ in 0..count {
                let len = value_len(&body[at..])?;
                spans.push(at..at + len);
                at += len;
            }
            return Some(spans);
        }
        at += value_len(&body[at..])?;
    }
    None
}

/// A header read by `read` (rmp's decoders) at `*at`, advanced past it.
fn header<T>(
    body: &[u8],
    at: &mut usize,
    read: impl FnOnce(&mut &[u8]) -> Result<T, rmp::decode::ValueReadError>,
) -> Option<T> {
    let mut rest = body.get(*at..)?;
    let value = read(&mut rest).ok()?;
    *at = body.len() - rest.len();
    Some(value)
}

/// A map header at `*at` (advanced past it): its number of pairs.
fn map_len(body: &[u8], at: &mut usize) -> Option<usize> {
    header(body, at, |rd| rmp::decode::read_map_len(rd)).map(|n| n as usize)
}

/// An array header at `*at` (advanced past it): its number of elements.
fn array_len(body: &[u8], at: &mut usize) -> Option<usize> {
    header(body, at, |rd| rmp::decode::read_array_len(rd)).map(|n| n as usize)
}

/// The bytes of the string `value` (one whole MessagePack value), if it is a string.
fn str_contents(value: &[u8]) -> Option<&[u8]> {
    let mut at = 0;
    header(value, &mut at, |rd| rmp::decode::read_str_len(rd))?;
    value.get(at..)
}

/// A big-endian length of 1, 2 or 4 bytes.
fn be(bytes: &[u8]) -> usize {
    bytes.iter().fold(0, |n, &b| (n << 8) | usize::from(b))
}

/// The length in bytes of the one MessagePack value `buf` starts with; `None` when `buf` does
/// not hold a whole one. Iterative (a count of values still to pass), so nesting costs no stack,
/// and a container may not announce more elements than bytes are left (each takes one at least).
fn value_len(buf: &[u8]) -> Option<usize> {
    let mut at = 0usize;
    let mut pending = 1usize;
    while pending > 0 {
        pending -= 1;
        let marker = *buf.get(at)?;
        let sized = |head: usize, len_bytes: usize| -> Option<usize> {
            let len = be(buf.get(at + 1..at + 1 + len_bytes)?);
            head.checked_add(len)
        };
        let (step, items) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (1, 0),
            0x80..=0x8f => (1, 2 * usize::from(marker & 0x0f)),
            0x90..=0x9f => (1, usize::from(marker & 0x0f)),
            0xa0..=0xbf => (1 + usize::from(marker & 0x1f), 0),
            0xc1 => return None,
            0xc4 | 0xd9 => (sized(2, 1)?, 0),
            0xc5 | 0xda => (sized(3, 2)?, 0),
            0xc6 | 0xdb => (sized(5, 4)?, 0),
            0xc7 => (sized(3, 1)?, 0),
            0xc8 => (sized(4, 2)?, 0),
            0xc9 => (sized(6, 4)?, 0),
            0xca | 0xce | 0xd2 => (5, 0),
            0xcb | 0xcf | 0xd3 => (9, 0),
            0xcc | 0xd0 => (2, 0),
            0xcd | 0xd1 => (3, 0),
            0xd4 => (3, 0),
            0xd5 => (4, 0),
            0xd6 => (6, 0),
            0xd7 => (10, 0),
            0xd8 => (18, 0),
            0xdc => (3, be(buf.get(at + 1..at + 3)?)),
            0xdd => (5, be(buf.get(at + 1..at + 5)?)),
            0xde => (3, 2 * be(buf.get(at + 1..at + 3)?)),
            0xdf => (5, 2 * be(buf.get(at + 1..at + 5)?)),
        };
        at = at.checked_add(step)?;
        if at > buf.len() {
            return None;
        }
        pending = pending.checked_add(items)?;
        if pending > buf.len() - at {
            return None;
        }
    }
    Some(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::Command;
    use openraft::{CommittedLeaderId, LogId, Membership, Vote};
    use proptest::prelude::*;

    fn put(key: String, value: String) -> Command {
        Command::Put {
            key,
            value,
            lease: None,
            prev_revision: None,
        }
    }

    fn entry(index: u64, kind: u8, keys: Vec<(String, String)>) -> Entry {
        let log_id = LogId::new(CommittedLeaderId::new(3, 1), index);
        let payload = match kind {
            0 => EntryPayload::Blank,
            1 => EntryPayload::Membership(Membership::new(
                vec![[1, 2, 3].into_iter().collect()],
                None,
            )),
            2 => {
                let (k, v) = keys.into_iter().next().unwrap_or_default();
                EntryPayload::Normal(put(k, v).into())
            }
            _ => EntryPayload::Normal(
                Command::Batch {
                    commands: keys.into_iter().map(|(k, v)| put(k, v)).collect(),
                }
                .into(),
            ),
        };
        Entry { log_id, payload }
    }

    /// An entry's kind (blank, membership, put, batch), its keys and values, and whether a
    /// leader's log store kept its encoding.
    type EntrySpec = (u8, Vec<(String, String)>, bool);

    fn request(
        kinds: Vec<EntrySpec>,
        prev: Option<u64>,
        commit: Option<u64>,
    ) -> AppendEntriesRequest<TypeConfig> {
        let id = |i| LogId::new(CommittedLeaderId::new(3, 1), i);
        let entries: Vec<Entry> = kinds
            .into_iter()
            .enumerate()
            .map(|(i, (kind, keys, kept))| {
                let e = entry(10 + i as u64, kind, keys);
                // Some kept by a leader's log store first, some not.
                if kept {
                    log_store::entry_bytes(&e, true).unwrap();
                }
                e
            })
            .collect();
        AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(3, 1),
            prev_log_id: prev.map(id),
            entries,
            leader_commit: commit.map(id),
        }
    }

    fn same(a: &AppendEntriesRequest<TypeConfig>, b: &AppendEntriesRequest<TypeConfig>) -> bool {
        a.vote == b.vote
            && a.prev_log_id == b.prev_log_id
            && a.entries == b.entries
            && a.leader_commit == b.leader_commit
    }

    proptest! {
        /// An append written around the entries' own encodings (kept by the log store, or
        /// made on the spot) is, byte for byte, the whole request's MessagePack encoding: what
        /// every follower, of this build or an older one, decodes.
        #[test]
        fn an_append_is_the_requests_own_encoding(
            kinds in prop::collection::vec((0u8..4, prop::collection::vec((".{0,12}", ".{0,40}"), 0..5), any::<bool>()), 0..6),
            prev in prop::option::of(0u64..1 << 40),
            commit in prop::option::of(0u64..1 << 40),
        ) {
            let rpc = request(kinds, prev, commit);
            let mut ours = Vec::new();
            write_append(&mut ours, &rpc).unwrap();
            prop_assert_eq!(&ours, &rmp_serde::to_vec_named(&rpc).unwrap());
            let back: AppendEntriesRequest<TypeConfig> = rmp_serde::from_slice(&ours).unwrap();
            prop_assert_eq!(&back.entries, &rpc.entries);
            // Given the others' exact sizes, the hint leaves room for the whole body.
            let hint = append_size_hint(&rpc, |e| log_store::encode_entry(e).unwrap().len());
            prop_assert!(hint >= ours.len(), "hint {} for {} bytes", hint, ours.len());
        }

        /// A follower reads back what the leader wrote, and keeps for each normal entry exactly
        /// the bytes its log store would have written.
        #[test]
        fn a_follower_reads_an_append_and_keeps_each_entrys_bytes(
            kinds in prop::collection::vec((0u8..4, prop::collection::vec((".{0,12}", ".{0,40}"), 0..5), any::<bool>()), 0..6),
            prev in prop::option::of(0u64..1 << 40),
            commit in prop::option::of(0u64..1 << 40),
        ) {
            let rpc = request(kinds, prev, commit);
            let mut body = Vec::new();
            write_append(&mut body, &rpc).unwrap();
            let back = read_append(&body).unwrap();
            prop_assert!(same(&back, &rpc));
            for e in &back.entries {
                let kept = log_store::kept_entry_bytes(e);
                match &e.payload {
                    EntryPayload::Normal(_) => {
                        prop_assert_eq!(&kept.unwrap()[..], &log_store::encode_entry(e).unwrap()[..])
                    }
                    _ => prop_assert!(kept.is_none()),
                }
            }
        }

        /// Whatever bytes arrive, reading them answers (never panics), and what it keeps for
        /// an entry decodes to that very entry.
        #[test]
        fn any_body_is_answered_and_what_is_kept_is_the_entry(
            kinds in prop::collection::vec((0u8..4, prop::collection::vec((".{0,12}", ".{0,40}"), 0..3), any::<bool>()), 0..4),
            cut in any::<prop::sample::Index>(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        ) {
            let mut body = Vec::new();
            write_append(&mut body, &request(kinds, Some(3), None)).unwrap();
            for (at, byte) in flips {
                let i = at.index(body.len());
                body[i] = byte;
            }
            body.truncate(cut.index(body.len() + 1));
            if let Ok(rpc) = read_append(&body) {
                for e in &rpc.entries {
                    if let Some(kept) = log_store::kept_entry_bytes(e) {
                        prop_assert_eq!(&log_store::decode_entry(&kept).unwrap(), e);
                    }
                }
            }
        }

        /// The length of a MessagePack value is found whatever follows it, and a value cut
        /// short has none.
        #[test]
        fn a_values_length_is_found_and_a_cut_value_has_none(
            value in json_value(),
            tail in prop::collection::vec(any::<u8>(), 0..8),
        ) {
            let encoded = rmp_serde::to_vec(&value).unwrap();
            let mut buf = encoded.clone();
            buf.extend_from_slice(&tail);
            prop_assert_eq!(value_len(&buf), Some(encoded.len()));
            prop_assert_eq!(value_len(&encoded[..encoded.len() - 1]), None);
        }

        /// Any bytes: an answer, never a panic, and never beyond the buffer.
        #[test]
        fn any_bytes_get_a_length_within_them_or_none(buf in prop::collection::vec(any::<u8>(), 0..64)) {
            if let Some(n) = value_len(&buf) {
                prop_assert!(n >= 1 && n <= buf.len());
            }
        }
    }

    /// Values of every MessagePack kind serde writes: integers of each width, floats, strings
    /// and byte strings of each length class, arrays and maps, nested.
    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            (-40i64..300).prop_map(Value::from),
            (0usize..300).prop_map(|n| Value::String("s".repeat(n))),
        ];
        leaf.prop_recursive(4, 64, 20, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..20).prop_map(serde_json::Value::Array),
                prop::collection::btree_map(".{0,8}", inner, 0..20)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Strings and byte strings of every length class (the generated values keep to short
    /// ones), and the extension forms, which serde does not write.
    #[test]
    fn byte_strings_and_extensions_have_their_lengths() {
        for n in [0usize, 1, 31, 32, 255, 256, 65_535, 65_536] {
            let encoded = rmp_serde::to_vec(&serde_bytes_like(n)).unwrap();
            assert_eq!(value_len(&encoded), Some(encoded.len()), "bin of {n}");
            let encoded = rmp_serde::to_vec(&"x".repeat(n)).unwrap();
            assert_eq!(value_len(&encoded), Some(encoded.len()), "str of {n}");
        }
        for (marker, data) in [
            (0xd4u8, 1usize),
            (0xd5, 2),
            (0xd6, 4),
            (0xd7, 8),
            (0xd8, 16),
        ] {
            let mut ext = vec![marker, 7];
            ext.extend(std::iter::repeat_n(0u8, data));
            assert_eq!(value_len(&ext), Some(ext.len()));
        }
        let mut ext8 = vec![0xc7, 3, 7, 1, 2, 3];
        assert_eq!(value_len(&ext8), Some(6));
        ext8.pop();
        assert_eq!(value_len(&ext8), None);
        assert_eq!(value_len(&[0xc1]), None);
        // An array announcing more elements than bytes left.
        assert_eq!(value_len(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0]), None);
    }

    fn serde_bytes_like(n: usize) -> impl serde::Serialize {
        struct Raw(Vec<u8>);
        impl serde::Serialize for Raw {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(&self.0)
            }
        }
        Raw(vec![1u8; n])
    }

    /// Fields in another order and a field this build does not know are read as `rmp_serde`
    /// reads them (and the entries' bytes still found); a missing field is refused.
    #[test]
    fn field_order_is_free_unknown_fields_are_skipped_missing_ones_refused() {
        let rpc = request(
            vec![(2, vec![("k".into(), "v".into())], false)],
            Some(1),
            Some(2),
        );
        let mut body = Vec::new();
        rmp::encode::write_map_len(&mut body, 5).unwrap();
        rmp::encode::write_str(&mut body, "leader_commit").unwrap();
        rmp_serde::encode::write_named(&mut body, &rpc.leader_commit).unwrap();
        rmp::encode::write_str(&mut body, "a_field_from_a_later_build").unwrap();
        rmp_serde::encode::write_named(&mut body, &vec![1u8, 2, 3]).unwrap();
        rmp::encode::write_str(&mut body, "entries").unwrap();
        rmp_serde::encode::write_named(&mut body, &rpc.entries).unwrap();
        rmp::encode::write_str(&mut body, "vote").unwrap();
        rmp_serde::encode::write_named(&mut body, &rpc.vote).unwrap();
        rmp::encode::write_str(&mut body, "prev_log_id").unwrap();
        rmp_serde::encode::write_named(&mut body, &rpc.prev_log_id).unwrap();
        let back = read_append(&body).unwrap();
        assert!(same(&back, &rpc));
        let kept = log_store::kept_entry_bytes(&back.entries[0]).expect("kept");
        assert_eq!(
            &kept[..],
            &log_store::encode_entry(&back.entries[0]).unwrap()[..]
        );

        let mut short = Vec::new();
        rmp::encode::write_map_len(&mut short, 1).unwrap();
        rmp::encode::write_str(&mut short, "vote").unwrap();
        rmp_serde::encode::write_named(&mut short, &rpc.vote).unwrap();
        assert!(read_append(&short).unwrap_err().contains("missing field"));
    }

    /// The part of an append that is not entries fits [`FIELDS_AND_IDS`] with every number at
    /// its largest.
    #[test]
    fn the_fixed_part_fits_its_room() {
        let id = LogId::new(CommittedLeaderId::new(u64::MAX, u64::MAX), u64::MAX);
        let rpc = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(u64::MAX, u64::MAX),
            prev_log_id: Some(id),
            entries: Vec::new(),
            leader_commit: Some(id),
        };
        let mut body = Vec::new();
        write_append(&mut body, &rpc).unwrap();
        assert!(body.len() <= FIELDS_AND_IDS, "{} bytes", body.len());
        assert_eq!(append_size_hint(&rpc, |_| 0), FIELDS_AND_IDS);
    }

    /// A kept encoding is used only for the entry it was made for.
    #[test]
    fn a_kept_encoding_is_used_only_at_its_log_id() {
        let e = entry(7, 2, vec![("k".into(), "v".into())]);
        let kept = log_store::entry_bytes(&e, true).unwrap();
        let EntryPayload::Normal(cmd) = &e.payload else {
            unreachable!()
        };
        assert_eq!(cmd.encoded_entry(e.log_id), Some(kept));
        let moved = Entry {
            log_id: LogId::new(CommittedLeaderId::new(4, 1), 7),
            payload: e.payload.clone(),
        };
        assert_eq!(cmd.encoded_entry(moved.log_id), None);
        assert_eq!(
            &log_store::entry_bytes(&moved, false).unwrap()[..],
            &rmp_serde::to_vec_named(&moved).unwrap()[..]
        );
    }

    /// An entry count far beyond the body's size is refused without allocating for it.
    #[test]
    fn a_lying_entry_count_is_refused() {
        let mut body = Vec::new();
        rmp::encode::write_map_len(&mut body, 1).unwrap();
        rmp::encode::write_str(&mut body, "entries").unwrap();
        rmp::encode::write_array_len(&mut body, u32::MAX).unwrap();
        assert!(read_append(&body).is_err());
    }
}
