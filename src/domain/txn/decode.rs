//! [`TxnOp`]'s decoder: the tag first, then the operation's own fields
//! ([`crate::domain::tag_first`] says why: an etcd `Put` is a transaction of one operation,
//! and a follower decodes every one it appends). Each `*Fields` struct is its variant's fields
//! with the variant's attributes: a field added to a variant is added here too.

use serde::{Deserialize, Deserializer};

use super::{Txn, TxnOp};
use crate::domain::auth::KeyRange;
use crate::domain::range::RangeSpec;
use crate::domain::tag_first::{self, TagFirst};
use crate::domain::types::Revision;

impl<'de> Deserialize<'de> for TxnOp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TxnOp, D::Error> {
        tag_first::decode(d)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Put,
    DeleteRange,
    Range,
    Txn,
}

impl TagFirst for TxnOp {
    const TAG: &'static str = "op";
    const EXPECTING: &'static str = "a transaction operation";
    type Tag = Op;

    fn from_fields<'de, D: Deserializer<'de>>(op: Op, d: D) -> Result<TxnOp, D::Error> {
        Ok(match op {
            Op::Put => {
                let f = PutFields::deserialize(d)?;
                TxnOp::Put {
                    key: f.key,
                    value: f.value,
                    lease: f.lease,
                    ignore_value: f.ignore_value,
                    ignore_lease: f.ignore_lease,
                    prev_kv: f.prev_kv,
                }
            }
            Op::DeleteRange => {
                let f = DeleteRangeFields::deserialize(d)?;
                TxnOp::DeleteRange {
                    range: f.range,
                    prev_kv: f.prev_kv,
                }
            }
            Op::Range => {
                let f = RangeFields::deserialize(d)?;
                TxnOp::Range {
                    spec: f.spec,
                    at: f.at,
                }
            }
            Op::Txn => TxnOp::Txn {
                txn: TxnFields::deserialize(d)?.txn,
            },
        })
    }
}

#[derive(Deserialize)]
struct PutFields {
    key: String,
    value: String,
    #[serde(default)]
    lease: Option<String>,
    #[serde(default)]
    ignore_value: bool,
    #[serde(default)]
    ignore_lease: bool,
    #[serde(default)]
    prev_kv: bool,
}

#[derive(Deserialize)]
struct DeleteRangeFields {
    range: KeyRange,
    #[serde(default)]
    prev_kv: bool,
}

#[derive(Deserialize)]
struct RangeFields {
    spec: RangeSpec,
    #[serde(default)]
    at: Option<Revision>,
}

#[derive(Deserialize)]
struct TxnFields {
    txn: Txn,
}
