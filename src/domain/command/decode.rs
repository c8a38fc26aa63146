//! [`Command`]'s decoder: the tag first, then the variant's own fields
//! ([`crate::domain::tag_first`] says why). Each `*Fields` struct is its variant's fields with
//! the variant's attributes: a field added to a variant is added here too (the round-trip
//! tests of every variant fail otherwise).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

use super::{Command, LeaseCheckpoint, LeaseRef};
use crate::domain::auth::AuthChange;
use crate::domain::tag_first::{self, TagFirst};
use crate::domain::txn::Txn;
use crate::domain::types::Revision;

impl<'de> Deserialize<'de> for Command {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Command, D::Error> {
        tag_first::decode(d)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Put,
    Delete,
    Txn,
    Compact,
    RegisterLease,
    RevokeLease,
    ExpireLeases,
    CheckpointLeases,
    LeaseClock,
    Batch,
    RegisterMember,
    Auth,
    Guarded,
}

impl TagFirst for Command {
    const TAG: &'static str = "op";
    const EXPECTING: &'static str = "a command";
    type Tag = Op;

    fn from_fields<'de, D: Deserializer<'de>>(op: Op, d: D) -> Result<Command, D::Error> {
        Ok(match op {
            Op::Put => {
                let f = PutFields::deserialize(d)?;
                Command::Put {
                    key: f.key,
                    value: f.value,
                    lease: f.lease,
                    prev_revision: f.prev_revision,
                }
            }
            Op::Delete => {
                let f = DeleteFields::deserialize(d)?;
                Command::Delete {
                    key: f.key,
                    prev_revision: f.prev_revision,
                }
            }
            Op::Txn => Command::Txn {
                txn: TxnFields::deserialize(d)?.txn,
            },
            Op::Compact => Command::Compact {
                revision: CompactFields::deserialize(d)?.revision,
            },
            Op::RegisterLease => {
                let f = RegisterLeaseFields::deserialize(d)?;
                Command::RegisterLease {
                    name: f.name,
                    ttl_ms: f.ttl_ms,
                    clock_ms: f.clock_ms,
                }
            }
            Op::RevokeLease => Command::RevokeLease {
                name: NameFields::deserialize(d)?.name,
            },
            Op::ExpireLeases => Command::ExpireLeases {
                leases: ExpireFields::deserialize(d)?.leases,
            },
            Op::CheckpointLeases => Command::CheckpointLeases {
                checkpoints: CheckpointFields::deserialize(d)?.checkpoints,
            },
            Op::LeaseClock => Command::LeaseClock {
                clock_ms: LeaseClockFields::deserialize(d)?.clock_ms,
            },
            Op::Batch => Command::Batch {
                commands: BatchFields::deserialize(d)?.commands,
            },
            Op::RegisterMember => {
                let f = RegisterMemberFields::deserialize(d)?;
                Command::RegisterMember {
                    id: f.id,
                    address: f.address,
                    ttl_ms: f.ttl_ms,
                    meta: f.meta,
                    clock_ms: f.clock_ms,
                }
            }
            Op::Auth => Command::Auth {
                change: AuthFields::deserialize(d)?.change,
            },
            Op::Guarded => {
                let f = GuardedFields::deserialize(d)?;
                Command::Guarded {
                    user: f.user,
                    command: f.command,
                }
            }
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
    prev_revision: Option<Revision>,
}

#[derive(Deserialize)]
struct DeleteFields {
    key: String,
    #[serde(default)]
    prev_revision: Option<Revision>,
}

#[derive(Deserialize)]
struct TxnFields {
    txn: Txn,
}

#[derive(Deserialize)]
struct CompactFields {
    revision: Revision,
}

#[derive(Deserialize)]
struct RegisterLeaseFields {
    name: String,
    ttl_ms: u64,
    #[serde(default)]
    clock_ms: Option<u64>,
}

#[derive(Deserialize)]
struct NameFields {
    name: String,
}

#[derive(Deserialize)]
struct ExpireFields {
    leases: Vec<LeaseRef>,
}

#[derive(Deserialize)]
struct CheckpointFields {
    checkpoints: Vec<LeaseCheckpoint>,
}

#[derive(Deserialize)]
struct LeaseClockFields {
    clock_ms: u64,
}

#[derive(Deserialize)]
struct BatchFields {
    commands: Vec<Command>,
}

#[derive(Deserialize)]
struct RegisterMemberFields {
    id: String,
    address: String,
    ttl_ms: u64,
    #[serde(default)]
    meta: BTreeMap<String, String>,
    #[serde(default)]
    clock_ms: Option<u64>,
}

#[derive(Deserialize)]
struct AuthFields {
    change: AuthChange,
}

#[derive(Deserialize)]
struct GuardedFields {
    user: String,
    command: Box<Command>,
}
