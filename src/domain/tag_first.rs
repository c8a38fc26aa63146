//! Decoding internally tagged enums (`#[serde(tag = "op")]`) without serde's buffering, for
//! the log's vocabulary ([`Command`](super::command::Command), [`TxnOp`](super::txn::TxnOp)).
//!
//! serde's derived decoder for an internally tagged enum cannot know the variant before it
//! has seen the tag, so it first copies the whole value into a generic buffer and decodes it
//! again from there; a batch of commands is buffered once for the batch and once more for each
//! command in it. On a follower that was a tenth of its CPU under puts: every string of every
//! appended entry copied twice before it was used. serde's own encoder always writes the tag
//! first, so a decoder that reads the tag and then hands the rest of the map to the variant's
//! own derived decoder needs no buffer at all.
//!
//! # Invariants
//! - Whatever the derived encoder writes decodes to the value it was written from: a map (in
//!   any field order: tag first is the fast path, any other order is buffered as a JSON
//!   value, the slow path), or a sequence whose first element is the tag (MessagePack's
//!   compact form). Unknown fields are ignored, as the derived decoder ignores them; a tag
//!   repeated after the first field is one of them (the derived decoder refused it). The tests
//!   of each enum decode every variant from MessagePack, both forms, and JSON, in every order.
//! - The encoding is untouched: the derived encoder stays, so logs, snapshots and peers of
//!   every build read and write the same bytes.
//!
//! # What it must not do
//! Panic on malformed input: a peer's bytes end here.

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess};

/// An internally tagged enum decoded by [`decode`]: its tag's field name, the tag's values (a
/// derived enum of unit variants named as the variants are), and how each variant's fields
/// are decoded once the tag is known (a derived struct per variant, with the variant's fields
/// and attributes).
pub trait TagFirst: Sized {
    /// The tag's field name.
    const TAG: &'static str;
    /// What the enum is, for error messages.
    const EXPECTING: &'static str;
    /// The tag's values.
    type Tag: DeserializeOwned;
    /// The variant `tag` from the rest of the value (every field but the tag).
    fn from_fields<'de, D: Deserializer<'de>>(tag: Self::Tag, fields: D) -> Result<Self, D::Error>;
}

/// Decode `T` from `d` (the body of `T`'s `Deserialize::deserialize`).
pub fn decode<'de, T: TagFirst, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    d.deserialize_any(TagFirstVisitor(PhantomData))
}

struct TagFirstVisitor<T>(PhantomData<T>);

impl<'de, T: TagFirst> de::Visitor<'de> for TagFirstVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(T::EXPECTING)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        match map.next_key_seed(FirstKey(T::TAG))? {
            None => Err(de::Error::missing_field(T::TAG)),
            Some(FirstKeyIs::Tag) => {
                let tag = map.next_value::<T::Tag>()?;
                T::from_fields(tag, MapAccessDeserializer::new(map))
            }
            Some(FirstKeyIs::Other(first)) => {
                // Not as serde writes it: buffered, as the derived decoder always did.
                let mut fields = serde_json::Map::new();
                fields.insert(first, map.next_value::<serde_json::Value>()?);
                while let Some(key) = map.next_key::<String>()? {
                    let value = map.next_value::<serde_json::Value>()?;
                    if fields.insert(key.clone(), value).is_some() {
                        return Err(de::Error::custom(format_args!("duplicate field `{key}`")));
                    }
                }
                let tag = fields
                    .remove(T::TAG)
                    .ok_or_else(|| de::Error::missing_field(T::TAG))?;
                let tag =
                    <T::Tag as serde::Deserialize>::deserialize(tag).map_err(de::Error::custom)?;
                T::from_fields(tag, serde_json::Value::Object(fields)).map_err(de::Error::custom)
            }
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<T, A::Error> {
        let tag = seq
            .next_element::<T::Tag>()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        T::from_fields(tag, SeqAccessDeserializer::new(seq))
    }
}

/// The first key of a map: the tag, or another field (kept for the slow path).
enum FirstKeyIs {
    Tag,
    Other(String),
}

struct FirstKey(&'static str);

impl<'de> DeserializeSeed<'de> for FirstKey {
    type Value = FirstKeyIs;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<FirstKeyIs, D::Error> {
        d.deserialize_str(self)
    }
}

impl de::Visitor<'_> for FirstKey {
    type Value = FirstKeyIs;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<FirstKeyIs, E> {
        Ok(match key == self.0 {
            true => FirstKeyIs::Tag,
            false => FirstKeyIs::Other(key.to_string()),
        })
    }

    fn visit_bytes<E: de::Error>(self, key: &[u8]) -> Result<FirstKeyIs, E> {
        match std::str::from_utf8(key) {
            Ok(key) => self.visit_str(key),
            Err(_) => Err(de::Error::invalid_type(de::Unexpected::Bytes(key), &self)),
        }
    }
}

#[cfg(test)]
mod tests {

    use proptest::prelude::*;

    use crate::domain::auth::{AuthChange, KeyRange, Secret};
    use crate::domain::command::{Command, LeaseCheckpoint, LeaseRef};
    use crate::domain::range::RangeSpec;
    use crate::domain::txn::{Compare, CompareOp, CompareTarget, Txn, TxnOp};
    use crate::domain::types::Revision;

    fn text() -> impl Strategy<Value = String> {
        "[a-zé/\\\\\"\u{0}]{0,6}"
    }

    fn range() -> impl Strategy<Value = KeyRange> {
        (
            prop::collection::vec(any::<u8>(), 0..4),
            prop::option::of(prop::collection::vec(any::<u8>(), 0..4)),
        )
            .prop_map(|(start, end)| KeyRange { start, end })
    }

    fn txn_op(depth: u32) -> BoxedStrategy<TxnOp> {
        let leaf = prop_oneof![
            (
                text(),
                text(),
                prop::option::of(text()),
                any::<(bool, bool, bool)>()
            )
                .prop_map(|(key, value, lease, (iv, il, pk))| TxnOp::Put {
                    key,
                    value,
                    lease,
                    ignore_value: iv,
                    ignore_lease: il,
                    prev_kv: pk,
                }),
            (range(), any::<bool>())
                .prop_map(|(range, prev_kv)| TxnOp::DeleteRange { range, prev_kv }),
            (range(), 0u64..9, prop::option::of(0u64..9)).prop_map(|(r, limit, at)| {
                let mut spec = RangeSpec::all(r);
                spec.limit = limit;
                TxnOp::Range {
                    spec,
                    at: at.map(Revision),
                }
            }),
        ];
        match depth {
            0 => leaf.boxed(),
            _ => prop_oneof![leaf, txn(depth - 1).prop_map(|txn| TxnOp::Txn { txn })].boxed(),
        }
    }

    fn txn(depth: u32) -> BoxedStrategy<Txn> {
        let compare = (range(), 0u8..4, 0u64..5).prop_map(|(range, op, n)| Compare {
            range,
            op: [
                CompareOp::Equal,
                CompareOp::NotEqual,
                CompareOp::Greater,
                CompareOp::Less,
            ][op as usize],
            target: match n {
                0 => CompareTarget::Value(vec![n as u8; 2]),
                1 => CompareTarget::Version(n),
                2 => CompareTarget::CreateRevision(Revision(n)),
                3 => CompareTarget::ModRevision(Revision(n)),
                _ => CompareTarget::Lease(Some("l".into())),
            },
        });
        (
            prop::collection::vec(compare, 0..3),
            prop::collection::vec(txn_op(depth), 0..3),
            prop::collection::vec(txn_op(depth), 0..3),
        )
            .prop_map(|(compares, success, failure)| Txn {
                compares,
                success,
                failure,
            })
            .boxed()
    }

    fn command(depth: u32) -> BoxedStrategy<Command> {
        let rev = || prop::option::of((0u64..9).prop_map(Revision));
        let leaf = prop_oneof![
            (text(), text(), prop::option::of(text()), rev()).prop_map(
                |(key, value, lease, prev_revision)| Command::Put {
                    key,
                    value,
                    lease,
                    prev_revision,
                }
            ),
            (text(), rev()).prop_map(|(key, prev_revision)| Command::Delete { key, prev_revision }),
            txn(1).prop_map(|txn| Command::Txn { txn }),
            (0u64..9).prop_map(|r| Command::Compact {
                revision: Revision(r)
            }),
            (text(), 0u64..9, prop::option::of(0u64..9)).prop_map(|(name, ttl_ms, clock_ms)| {
                Command::RegisterLease {
                    name,
                    ttl_ms,
                    clock_ms,
                }
            }),
            text().prop_map(|name| Command::RevokeLease { name }),
            prop::collection::vec((text(), 0u64..9), 0..3).prop_map(|l| Command::ExpireLeases {
                leases: l
                    .into_iter()
                    .map(|(name, r)| LeaseRef {
                        name,
                        revision: Revision(r),
                    })
                    .collect(),
            }),
            prop::collection::vec(
                (text(), prop::option::of(0u64..9), prop::option::of(0u64..9)),
                0..3
            )
            .prop_map(|c| Command::CheckpointLeases {
                checkpoints: c
                    .into_iter()
                    .map(|(name, remaining_ms, clock_ms)| LeaseCheckpoint {
                        name,
                        revision: Revision(1),
                        remaining_ms,
                        clock_ms,
                    })
                    .collect(),
            }),
            (0u64..9).prop_map(|clock_ms| Command::LeaseClock { clock_ms }),
            (
                text(),
                text(),
                prop::collection::btree_map(text(), text(), 0..3),
                prop::option::of(0u64..9)
            )
                .prop_map(|(id, address, meta, clock_ms)| Command::RegisterMember {
                    id,
                    address,
                    ttl_ms: 5,
                    meta,
                    clock_ms,
                }),
            prop_oneof![
                Just(AuthChange::Disable),
                text().prop_map(|name| AuthChange::RoleAdd { name }),
                (text(), text()).prop_map(|(name, h)| AuthChange::UserAdd {
                    name,
                    password_hash: Secret(h),
                }),
            ]
            .prop_map(|change| Command::Auth { change }),
        ];
        match depth {
            0 => leaf.boxed(),
            _ => prop_oneof![
                leaf,
                prop::collection::vec(command(depth - 1), 0..4)
                    .prop_map(|commands| Command::Batch { commands }),
                (text(), command(depth - 1)).prop_map(|(user, c)| Command::Guarded {
                    user,
                    command: Box::new(c),
                }),
            ]
            .boxed(),
        }
    }

    /// The JSON object with its fields in reverse order (the tag last): the slow path.
    fn reversed(v: serde_json::Value) -> String {
        match v {
            serde_json::Value::Object(m) => {
                let fields: Vec<String> = m
                    .into_iter()
                    .rev()
                    .map(|(k, v)| format!("{}:{}", serde_json::Value::String(k), reversed(v)))
                    .collect();
                format!("{{{}}}", fields.join(","))
            }
            serde_json::Value::Array(a) => {
                let items: Vec<String> = a.into_iter().map(reversed).collect();
                format!("[{}]", items.join(","))
            }
            other => other.to_string(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Every command comes back from MessagePack (the log's and the peers' form), from
        /// JSON (forwarded proposals), and from JSON with every object's fields reversed.
        #[test]
        fn commands_decode_to_what_was_encoded(cmd in command(2)) {
            let named = rmp_serde::to_vec_named(&cmd).unwrap();
            prop_assert_eq!(rmp_serde::from_slice::<Command>(&named).unwrap(), cmd.clone());
            let json = serde_json::to_value(&cmd).unwrap();
            prop_assert_eq!(serde_json::from_value::<Command>(json.clone()).unwrap(), cmd.clone());
            let text = serde_json::to_string(&cmd).unwrap();
            prop_assert_eq!(serde_json::from_str::<Command>(&text).unwrap(), cmd.clone());
            let backwards = reversed(json);
            prop_assert_eq!(serde_json::from_str::<Command>(&backwards).unwrap(), cmd);
        }

        /// Whatever a peer sends, decoding answers (an error or a command) and never panics.
        #[test]
        fn any_bytes_decode_or_fail_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = rmp_serde::from_slice::<Command>(&bytes);
            let _ = serde_json::from_slice::<Command>(&bytes);
        }
    }

    /// MessagePack's compact form (structs as arrays, the tag first), which openraft's own
    /// tests and older tools use: every field present, since a skipped field shifts the
    /// others in that form (for the derived decoder too).
    #[test]
    fn the_compact_form_decodes() {
        let cmds = [
            Command::Put {
                key: "k".into(),
                value: "v".into(),
                lease: Some("l".into()),
                prev_revision: Some(Revision(3)),
            },
            Command::Batch {
                commands: vec![
                    Command::RevokeLease { name: "l".into() },
                    Command::LeaseClock { clock_ms: 7 },
                ],
            },
            Command::Txn {
                txn: Txn {
                    compares: vec![],
                    success: vec![TxnOp::Put {
                        key: "k".into(),
                        value: "v".into(),
                        lease: Some("l".into()),
                        ignore_value: true,
                        ignore_lease: false,
                        prev_kv: true,
                    }],
                    failure: vec![],
                },
            },
        ];
        for cmd in cmds {
            let compact = rmp_serde::to_vec(&cmd).unwrap();
            assert_eq!(rmp_serde::from_slice::<Command>(&compact).unwrap(), cmd);
        }
    }

    #[test]
    fn malformed_commands_are_refused_with_the_reason() {
        let err = |s: &str| serde_json::from_str::<Command>(s).unwrap_err().to_string();
        assert!(err(r#"{"key":"k","value":"v"}"#).contains("missing field `op`"));
        assert!(err(r#"{}"#).contains("missing field `op`"));
        assert!(err(r#"{"op":"frobnicate"}"#).contains("unknown variant `frobnicate`"));
        assert!(err(r#"{"op":"put","key":"k"}"#).contains("missing field `value`"));
        assert!(err(r#"{"key":"k","op":"put"}"#).contains("missing field `value`"));
        assert!(err(r#"{"key":"k","key":"j","op":"put","value":""}"#).contains("duplicate field"));
        assert!(err(r#""put""#).contains("a command"));
        // Fields a newer build added are ignored, in either order.
        let put = Command::Put {
            key: "k".into(),
            value: "v".into(),
            lease: None,
            prev_revision: None,
        };
        let newer = r#"{"op":"put","key":"k","value":"v","added":[1,{"x":2}]}"#;
        assert_eq!(serde_json::from_str::<Command>(newer).unwrap(), put);
        let newer = r#"{"added":[1,{"x":2}],"value":"v","key":"k","op":"put"}"#;
        assert_eq!(serde_json::from_str::<Command>(newer).unwrap(), put);
    }
}
