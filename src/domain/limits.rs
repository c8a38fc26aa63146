//! Input validation: what a client may send, decided before anything is proposed.
//!
//! Validation happens at the edge (HTTP, CLI) so that bad input never reaches the log. Apply
//! itself stays total: it accepts any well-formed command, so an entry written under other
//! limits (a changed configuration, an older version) still applies the same everywhere.

use thiserror::Error;

use super::auth::{self, AuthChange};
use super::command::Command;
use super::members::{MemberRecord, check_member_id};
use super::{key_bytes, value_bytes};

/// The longest member address, in bytes.
pub const MAX_MEMBER_ADDRESS_BYTES: usize = 1024;

/// The largest key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 1024;
/// The default largest value, in bytes (its raw bytes: a binary value the etcd API stored as
/// NUL and base64 counts as its decoded length, [`value_bytes::raw_len`]).
pub const DEFAULT_MAX_VALUE_BYTES: usize = 1 << 20;
/// The largest lease name, in bytes.
pub const MAX_LEASE_NAME_BYTES: usize = 1024;

/// The default largest number of leases (members included): about 0.5 GB of state and tracker
/// on each node, and an expiry of all of them at once still paced within an election timeout
/// per batch.
pub const DEFAULT_MAX_LEASES: usize = 200_000;

/// Size limits in force on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_value_bytes: usize,
    /// Registrations are refused once the state holds this many leases.
    pub max_leases: usize,
    /// The most compares, or operations per branch, of one transaction (etcd's
    /// `--max-txn-ops`).
    pub max_txn_ops: usize,
    /// The most a read's answer through the etcd API may hold (a Range, or a transaction that
    /// only reads), in [`super::range::ResultBudget`]'s count.
    pub max_read_answer_bytes: usize,
}

/// The default of [`Limits::max_read_answer_bytes`]. etcd sets no limit on its answers (its
/// clients take up to 2 GiB), and Kubernetes lists in pages of 500 to 10,000 objects, which
/// pass 4 MiB as soon as its objects are a few KiB. A transaction that writes keeps
/// [`super::range::MAX_RESULT_BYTES`] for its answer: every replica checks that bound when it
/// applies, so it must be one constant for all of them.
pub const DEFAULT_MAX_READ_ANSWER_BYTES: usize = 256 << 20;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_value_bytes: DEFAULT_MAX_VALUE_BYTES,
            max_leases: DEFAULT_MAX_LEASES,
            max_txn_ops: super::txn::DEFAULT_MAX_TXN_OPS,
            max_read_answer_bytes: DEFAULT_MAX_READ_ANSWER_BYTES,
        }
    }
}

/// The TTLs a lease may have on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TtlBounds {
    pub min_ms: u64,
    pub max_ms: u64,
}

impl TtlBounds {
    pub fn check(&self, ttl_ms: u64) -> Result<(), InvalidInput> {
        if ttl_ms < self.min_ms || ttl_ms > self.max_ms {
            return Err(InvalidInput::Invalid(format!(
                "ttl_ms must be between {} and {} (got {ttl_ms})",
                self.min_ms, self.max_ms
            )));
        }
        Ok(())
    }
}

/// Why input was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum InvalidInput {
    /// Malformed input: the client must change the request.
    #[error("{0}")]
    Invalid(String),
    /// Input over a size limit.
    #[error("{0}")]
    TooLarge(String),
    /// A key, or a range bound, longer than [`MAX_KEY_BYTES`]: malformed input to `/v1` (as
    /// `Invalid`), and to etcd's clients a request over its size limit (etcd bounds keys only
    /// by the request size).
    #[error("{0}")]
    KeyTooLong(String),
    /// The cluster holds as many leases as it may: retry after some were removed.
    #[error("{0}")]
    TooManyLeases(String),
}

impl Limits {
    /// One more lease fits beside `current` ones. Checked at the edge against the node's view
    /// of the state, so concurrent registrations may pass it by a few: the limit protects the
    /// cluster from runaway clients, it is not an exact quota.
    pub fn check_lease_count(&self, current: usize) -> Result<(), InvalidInput> {
        if current >= self.max_leases {
            return Err(InvalidInput::TooManyLeases(format!(
                "the cluster holds {current} leases; the limit is {} (--max-leases): revoke \
                 unused leases, or raise the limit",
                self.max_leases
            )));
        }
        Ok(())
    }

    /// A key is non-empty and at most [`MAX_KEY_BYTES`] bytes, counted as its raw bytes
    /// ([`key_bytes::raw_len`]: a binary key written through the etcd API, stored as NUL and
    /// hex, may be as long as a text key).
    pub fn check_key(&self, key: &str) -> Result<(), InvalidInput> {
        if key.is_empty() {
            return Err(InvalidInput::Invalid("key must not be empty".into()));
        }
        let len = key_bytes::raw_len(key);
        if len > MAX_KEY_BYTES {
            return Err(InvalidInput::KeyTooLong(format!(
                "key is {len} bytes; the limit is {MAX_KEY_BYTES}"
            )));
        }
        Ok(())
    }

    /// A value is at most `max_value_bytes` bytes (it may be empty), counted as its raw bytes
    /// ([`value_bytes::raw_len`]): a binary value written through the etcd API (stored as NUL
    /// and base64, a third longer) may be as long as a text value.
    pub fn check_value(&self, value: &str) -> Result<(), InvalidInput> {
        let len = value_bytes::raw_len(value);
        if len > self.max_value_bytes {
            return Err(InvalidInput::TooLarge(format!(
                "value is {len} bytes; the limit is {}",
                self.max_value_bytes
            )));
        }
        Ok(())
    }

    /// A value a `/v1` client writes may not begin with U+0000: that marks a binary value
    /// written through the etcd API ([`value_bytes`]), which `/v1` reads in that stored form.
    /// (Not part of [`Limits::check_command`]: the etcd API and forwarded proposals write such
    /// values.)
    pub fn check_text_value(value: &str) -> Result<(), InvalidInput> {
        if value_bytes::is_encoded_form(value) {
            return Err(InvalidInput::Invalid(
                "a value may not begin with U+0000: that marks a binary value written through \
                 the etcd API (NUL, then its base64)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// A key a `/v1` client writes may not begin with U+0000: that marks a binary key written
    /// through the etcd API ([`key_bytes`]), which `/v1` reads in that stored form.
    pub fn check_text_key(key: &str) -> Result<(), InvalidInput> {
        if key_bytes::is_encoded(key) {
            return Err(InvalidInput::Invalid(
                "a key may not begin with U+0000: that marks a binary key written through the \
                 etcd API (NUL, then the hex of its bytes)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Every key and value `cmd` puts (a put's, those of a transaction's puts) passes
    /// [`Limits::check_text_key`] and [`Limits::check_text_value`]: the check of a `/v1`
    /// client's command. (A delete may name a binary key by its stored form.)
    pub fn check_text_writes(cmd: &Command) -> Result<(), InvalidInput> {
        fn txn(t: &super::txn::Txn) -> Result<(), InvalidInput> {
            use super::txn::TxnOp;
            for op in t.success.iter().chain(&t.failure) {
                match op {
                    TxnOp::Put { key, value, .. } => {
                        Limits::check_text_key(key)?;
                        Limits::check_text_value(value)?
                    }
                    TxnOp::Txn { txn: inner } => txn(inner)?,
                    TxnOp::DeleteRange { .. } | TxnOp::Range { .. } => {}
                }
            }
            Ok(())
        }
        match cmd {
            Command::Put { key, value, .. } => {
                Self::check_text_key(key)?;
                Self::check_text_value(value)
            }
            Command::Txn { txn: t } => txn(t),
            Command::Guarded { command, .. } => Self::check_text_writes(command),
            _ => Ok(()),
        }
    }

    /// A lease name is a non-empty string of at most [`MAX_LEASE_NAME_BYTES`] bytes.
    /// Every key, value and lease name of a transaction within the limits.
    fn check_txn_sizes(&self, txn: &super::txn::Txn) -> Result<(), InvalidInput> {
        use super::txn::{CompareTarget, TxnOp};
        let bound = |b: &[u8]| {
            if b.len() > MAX_KEY_BYTES + 1 {
                return Err(InvalidInput::KeyTooLong(format!(
                    "a range bound is {} bytes; keys are at most {MAX_KEY_BYTES}",
                    b.len()
                )));
            }
            Ok(())
        };
        let range = |r: &super::auth::KeyRange| {
            bound(&r.start)?;
            r.end.as_deref().map_or(Ok(()), bound)
        };
        for c in &txn.compares {
            range(&c.range)?;
            match &c.target {
                CompareTarget::Value(v) if value_bytes::raw_len_of(v) > self.max_value_bytes => {
                    return Err(InvalidInput::TooLarge(format!(
                        "a compared value is {} bytes; the limit is {}",
                        value_bytes::raw_len_of(v),
                        self.max_value_bytes
                    )));
                }
                CompareTarget::Lease(Some(l)) => self.check_lease_name(l)?,
                _ => {}
            }
        }
        for op in txn.success.iter().chain(&txn.failure) {
            match op {
                TxnOp::Put {
                    key, value, lease, ..
                } => {
                    self.check_key(key)?;
                    self.check_value(value)?;
                    if let Some(lease) = lease {
                        self.check_lease_name(lease)?;
                    }
                }
                TxnOp::DeleteRange { range: r, .. } => range(r)?,
                TxnOp::Range { spec, .. } => range(&spec.range)?,
                TxnOp::Txn { txn } => self.check_txn_sizes(txn)?,
            }
        }
        Ok(())
    }

    pub fn check_lease_name(&self, name: &str) -> Result<(), InvalidInput> {
        if name.is_empty() {
            return Err(InvalidInput::Invalid("lease name must not be empty".into()));
        }
        if name.len() > MAX_LEASE_NAME_BYTES {
            return Err(InvalidInput::Invalid(format!(
                "lease name is {} bytes; the limit is {MAX_LEASE_NAME_BYTES}",
                name.len()
            )));
        }
        Ok(())
    }

    /// A command a client may cause, within this node's limits: the one check of a command
    /// before it is proposed, used by the client handlers and by the peer route that receives
    /// forwarded proposals alike (which must never accept more than a client could send).
    ///
    /// The leader's own commands (`ExpireLeases`, `CheckpointLeases`, `LeaseClock`, `Batch`)
    /// and the lease
    /// clock stamp (`clock_ms`, which the leader adds when it submits a registration) are never
    /// a client's: they are refused. (The lease count is state, checked by the caller with
    /// [`Limits::check_lease_count`].)
    pub fn check_command(&self, cmd: &Command, ttl: TtlBounds) -> Result<(), InvalidInput> {
        let unstamped = |clock_ms: &Option<u64>| {
            if clock_ms.is_some() {
                return Err(InvalidInput::Invalid(
                    "clock_ms is stamped by the leader, never sent".into(),
                ));
            }
            Ok(())
        };
        match cmd {
            Command::Put {
                key, value, lease, ..
            } => {
                self.check_key(key)?;
                self.check_value(value)?;
                if let Some(lease) = lease {
                    self.check_lease_name(lease)?;
                }
                Ok(())
            }
            Command::Delete { key, .. } => self.check_key(key),
            Command::Txn { txn } => {
                super::txn::check(txn, self.max_txn_ops)
                    .map_err(|e| InvalidInput::Invalid(e.to_string()))?;
                self.check_txn_sizes(txn)
            }
            Command::RegisterLease {
                name,
                ttl_ms,
                clock_ms,
            } => {
                self.check_lease_name(name)?;
                ttl.check(*ttl_ms)?;
                unstamped(clock_ms)
            }
            Command::RevokeLease { name } => self.check_lease_name(name),
            // Whether the revision is held is decided at apply, against the replicated state.
            Command::Compact { .. } => Ok(()),
            Command::RegisterMember {
                id,
                address,
                ttl_ms,
                meta,
                clock_ms,
            } => {
                check_member_id(id)?;
                ttl.check(*ttl_ms)?;
                if address.is_empty() || address.len() > MAX_MEMBER_ADDRESS_BYTES {
                    return Err(InvalidInput::Invalid(format!(
                        "address must be 1 to {MAX_MEMBER_ADDRESS_BYTES} bytes"
                    )));
                }
                let record = MemberRecord {
                    id: id.clone(),
                    address: address.clone(),
                    meta: meta.clone(),
                };
                self.check_value(&record.encode())?;
                unstamped(clock_ms)
            }
            Command::ExpireLeases { .. }
            | Command::CheckpointLeases { .. }
            | Command::LeaseClock { .. }
            | Command::Batch { .. } => Err(InvalidInput::Invalid(
                "expiries, checkpoints, lease clocks and batches are the leader's own commands"
                    .into(),
            )),
            // A client's command on behalf of a user (`""`: no token). Apply re-checks the
            // user's permission; here, its shape and limits.
            Command::Guarded { user, command } => {
                if !user.is_empty() {
                    auth::check_name(user).map_err(|e| InvalidInput::Invalid(e.to_string()))?;
                }
                match command.as_ref() {
                    Command::Guarded { .. } => Err(InvalidInput::Invalid(
                        "a guarded command cannot hold another".into(),
                    )),
                    Command::Auth { change } => self.check_auth_change(change),
                    inner => self.check_command(inner, ttl),
                }
            }
            Command::Auth { .. } => Err(InvalidInput::Invalid(
                "auth changes are proposed on behalf of a user (guarded)".into(),
            )),
        }
    }

    /// An auth change within the limits a client request for it passes: names, a granted
    /// key (a prefix may be empty: every key), and secrets of a sane size (argon2 hashes and
    /// signing keys are well under a KiB).
    pub fn check_auth_change(&self, change: &AuthChange) -> Result<(), InvalidInput> {
        const MAX_SECRET_BYTES: usize = 1024;
        let name = |n: &str| auth::check_name(n).map_err(|e| InvalidInput::Invalid(e.to_string()));
        let secret = |s: &auth::Secret| {
            if s.0.is_empty() || s.0.len() > MAX_SECRET_BYTES {
                return Err(InvalidInput::Invalid(format!(
                    "a hash or key must be 1 to {MAX_SECRET_BYTES} bytes"
                )));
            }
            Ok(())
        };
        let key = |k: &str, prefix: bool| {
            if prefix && k.is_empty() {
                Ok(())
            } else {
                self.check_key(k)
            }
        };
        use AuthChange as C;
        match change {
            C::Enable { signing_key } => secret(signing_key),
            C::Disable => Ok(()),
            C::UserAdd {
                name: n,
                password_hash,
            }
            | C::UserPasswd {
                name: n,
                password_hash,
            } => {
                name(n)?;
                secret(password_hash)
            }
            C::UserDelete { name: n } | C::RoleAdd { name: n } | C::RoleDelete { name: n } => {
                name(n)
            }
            C::UserGrantRole { name: n, role } | C::UserRevokeRole { name: n, role } => {
                name(n)?;
                name(role)
            }
            C::RoleGrant {
                name: n,
                permission,
            } => {
                name(n)?;
                key(&permission.key, permission.prefix)
            }
            C::RoleRevoke {
                name: n,
                key: k,
                prefix,
            } => {
                name(n)?;
                key(k, *prefix)
            }
        }
    }

    /// The largest request body worth reading: a value may be JSON-escaped (up to six bytes
    /// per byte for control characters), plus room for the rest of the document.
    pub fn max_body_bytes(&self) -> usize {
        self.max_value_bytes
            .saturating_mul(6)
            .saturating_add(64 * 1024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_at_and_over_the_limit() {
        let l = Limits::default();
        assert!(l.check_key("a").is_ok());
        assert!(l.check_key(&"k".repeat(MAX_KEY_BYTES)).is_ok());
        assert!(matches!(
            l.check_key(&"k".repeat(MAX_KEY_BYTES + 1)),
            Err(InvalidInput::KeyTooLong(_))
        ));
        assert!(matches!(l.check_key(""), Err(InvalidInput::Invalid(_))));
        // Multi-byte characters count in bytes, not characters.
        assert!(l.check_key(&"é".repeat(MAX_KEY_BYTES / 2 + 1)).is_err());
    }

    #[test]
    fn values_at_and_over_the_limit() {
        let l = Limits {
            max_value_bytes: 4,
            ..Limits::default()
        };
        assert!(l.check_value("").is_ok());
        assert!(l.check_value("abcd").is_ok());
        assert!(matches!(
            l.check_value("abcde"),
            Err(InvalidInput::TooLarge(_))
        ));
        // A binary value counts as its raw bytes, not its longer stored form.
        let four = value_bytes::store(vec![0xff; 4]);
        assert!(four.len() > 4);
        assert!(l.check_value(&four).is_ok());
        let five = value_bytes::store(vec![0xff; 5]);
        assert!(matches!(
            l.check_value(&five),
            Err(InvalidInput::TooLarge(_))
        ));
        // A compared value too.
        let compare = |v: &str| {
            let txn = crate::domain::txn::Txn {
                compares: vec![crate::domain::txn::Compare {
                    range: crate::domain::auth::KeyRange::key("k"),
                    op: crate::domain::txn::CompareOp::Equal,
                    target: crate::domain::txn::CompareTarget::Value(v.as_bytes().to_vec()),
                }],
                ..Default::default()
            };
            l.check_command(&Command::Txn { txn }, TTL)
        };
        assert!(compare(&four).is_ok());
        assert!(matches!(compare(&five), Err(InvalidInput::TooLarge(_))));
    }

    #[test]
    fn v1_values_may_not_begin_with_nul() {
        assert!(Limits::check_text_value("").is_ok());
        assert!(Limits::check_text_value("a\0").is_ok());
        assert!(matches!(
            Limits::check_text_value("\0AAH/"),
            Err(InvalidInput::Invalid(_))
        ));
        let put_op = |k: &str, v: &str| crate::domain::txn::TxnOp::Put {
            key: k.into(),
            value: v.into(),
            lease: None,
            ignore_value: false,
            ignore_lease: false,
            prev_kv: false,
        };
        let txn = Command::Txn {
            txn: crate::domain::txn::Txn {
                failure: vec![crate::domain::txn::TxnOp::Txn {
                    txn: crate::domain::txn::Txn {
                        success: vec![put_op("a", "ok"), put_op("b", "\0x")],
                        ..Default::default()
                    },
                }],
                ..Default::default()
            },
        };
        assert!(Limits::check_text_writes(&txn).is_err());
        assert!(Limits::check_text_writes(&put("k", "\0")).is_err());
        assert!(Limits::check_text_writes(&put("k", "v")).is_ok());
        // The same command passes the shared check: the etcd API writes such values.
        assert!(Limits::default().check_command(&txn, TTL).is_ok());
    }

    const TTL: TtlBounds = TtlBounds {
        min_ms: 1000,
        max_ms: 60_000,
    };

    fn put(key: &str, value: &str) -> Command {
        Command::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
            prev_revision: None,
        }
    }

    #[test]
    fn client_commands_within_limits_pass() {
        let l = Limits::default();
        assert!(l.check_command(&put("k", "v"), TTL).is_ok());
        let reg = Command::RegisterLease {
            name: "l".into(),
            ttl_ms: 5000,
            clock_ms: None,
        };
        assert!(l.check_command(&reg, TTL).is_ok());
        let member = Command::RegisterMember {
            id: "a".into(),
            address: "10.0.0.1:80".into(),
            ttl_ms: 5000,
            meta: Default::default(),
            clock_ms: None,
        };
        assert!(l.check_command(&member, TTL).is_ok());
        let revoke = Command::RevokeLease { name: "l".into() };
        assert!(l.check_command(&revoke, TTL).is_ok());
    }

    #[test]
    fn commands_over_limits_or_from_the_leader_are_refused() {
        let l = Limits::default();
        let big_key = "k".repeat(100 * 1024);
        assert!(matches!(
            l.check_command(&put(&big_key, "v"), TTL),
            Err(InvalidInput::KeyTooLong(_))
        ));
        let big_value = "v".repeat(32 << 20);
        assert!(matches!(
            l.check_command(&put("k", &big_value), TTL),
            Err(InvalidInput::TooLarge(_))
        ));
        for (ttl_ms, clock_ms) in [(u64::MAX, None), (0, None), (5000, Some(1))] {
            let reg = Command::RegisterLease {
                name: "l".into(),
                ttl_ms,
                clock_ms,
            };
            assert!(l.check_command(&reg, TTL).is_err(), "{ttl_ms} {clock_ms:?}");
        }
        let member = Command::RegisterMember {
            id: "a/b".into(),
            address: "x:1".into(),
            ttl_ms: 5000,
            meta: Default::default(),
            clock_ms: None,
        };
        assert!(l.check_command(&member, TTL).is_err());
        let leader_only = [
            Command::ExpireLeases { leases: vec![] },
            Command::CheckpointLeases {
                checkpoints: vec![],
            },
            Command::LeaseClock { clock_ms: 1 },
            Command::Batch {
                commands: vec![put("k", "v")],
            },
        ];
        for cmd in leader_only {
            assert!(l.check_command(&cmd, TTL).is_err(), "{cmd:?}");
        }
    }

    #[test]
    fn lease_count_at_and_over_the_limit() {
        let l = Limits {
            max_leases: 2,
            ..Limits::default()
        };
        assert!(l.check_lease_count(1).is_ok());
        assert!(matches!(
            l.check_lease_count(2),
            Err(InvalidInput::TooManyLeases(_))
        ));
    }
}
