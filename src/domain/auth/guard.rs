//! What a command needs, checked against the state it applies to: the one authorization rule
//! used both by the node that receives a request (to answer early) and by apply (the check
//! that counts, see `Command::Guarded`).
//!
//! Rules (etcd's): a put needs write on the key, and with a lease, write on every key already
//! attached to it; a delete needs write on the key; revoking a lease needs write on every key
//! attached to it; registering a lease needs only to be a user; registering member `id` needs
//! write on `members/<id>`; auth changes need the root role. Leader-internal commands (expiry,
//! checkpoints) are never a user's to send.

use super::{Access, AuthState};
use crate::domain::command::Command;
use crate::domain::kv::KvState;
use crate::domain::members::member_key;
use crate::domain::txn::{Txn, TxnOp};

/// Whether `user` may have `cmd` applied to `kv` (always, while auth is off).
pub fn authorize(kv: &KvState, user: &str, cmd: &Command) -> bool {
    let auth = kv.auth();
    if !auth.enabled() {
        return true;
    }
    if !auth.users.contains_key(user) {
        return false;
    }
    match cmd {
        Command::Put { key, lease, .. } => {
            auth.allowed_key(user, Access::Write, key)
                && lease
                    .as_deref()
                    .is_none_or(|l| lease_keys_allowed(kv, auth, user, l, Access::Write))
        }
        Command::Delete { key, .. } => auth.allowed_key(user, Access::Write, key),
        Command::Txn { txn } => txn_allowed(kv, user, txn),
        // As etcd: compaction needs no permission on keys (it changes none).
        Command::RegisterLease { .. } | Command::Compact { .. } => true,
        Command::RevokeLease { name } => lease_keys_allowed(kv, auth, user, name, Access::Write),
        Command::RegisterMember { id, .. } => {
            auth.allowed_key(user, Access::Write, &member_key(id))
        }
        Command::Batch { commands } => commands.iter().all(|c| authorize(kv, user, c)),
        Command::Auth { .. } => auth.is_root(user),
        Command::ExpireLeases { .. }
        | Command::CheckpointLeases { .. }
        | Command::LeaseClock { .. }
        | Command::Guarded { .. } => false,
    }
}

/// A transaction needs, as etcd's: read on every compared key or range, and on both branches
/// (whichever runs), what each operation needs: write on a put's key (and on its lease's keys),
/// write on a deleted range, read on a read range.
fn txn_allowed(kv: &KvState, user: &str, txn: &Txn) -> bool {
    let auth = kv.auth();
    txn.compares
        .iter()
        .all(|c| auth.allowed(user, Access::Read, &c.range))
        && txn.success.iter().chain(&txn.failure).all(|op| match op {
            TxnOp::Put { key, lease, .. } => {
                auth.allowed_key(user, Access::Write, key)
                    && lease
                        .as_deref()
                        .is_none_or(|l| lease_keys_allowed(kv, auth, user, l, Access::Write))
            }
            TxnOp::DeleteRange { range, .. } => auth.allowed(user, Access::Write, range),
            TxnOp::Range { spec, .. } => auth.allowed(user, Access::Read, &spec.range),
            TxnOp::Txn { txn } => txn_allowed(kv, user, txn),
        })
}

/// Whether `user` may `access` every key attached to lease `name` (true if it does not exist:
/// the command then fails on its own terms, leaking nothing but the lease's absence).
pub fn lease_keys_allowed(
    kv: &KvState,
    auth: &AuthState,
    user: &str,
    name: &str,
    access: Access,
) -> bool {
    kv.lease(name)
        .is_none_or(|l| l.keys.iter().all(|k| auth.allowed_key(user, access, k)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::auth::{AuthChange, PermKind, Permission, ROOT, Secret};
    use crate::domain::command::{KvError, Response};

    fn change(kv: &mut KvState, change: AuthChange) {
        let applied = kv.apply(&Command::Auth { change });
        assert!(matches!(applied.response, Response::AuthChanged { .. }));
    }

    /// Root, and user `u` with role `r` allowing write on prefix `a/`; auth on.
    fn state() -> KvState {
        let mut kv = KvState::new();
        let hash = || Secret("h".into());
        for c in [
            AuthChange::UserAdd {
                name: ROOT.into(),
                password_hash: hash(),
            },
            AuthChange::UserGrantRole {
                name: ROOT.into(),
                role: ROOT.into(),
            },
            AuthChange::UserAdd {
                name: "u".into(),
                password_hash: hash(),
            },
            AuthChange::RoleAdd { name: "r".into() },
            AuthChange::RoleGrant {
                name: "r".into(),
                permission: Permission {
                    kind: PermKind::Write,
                    key: "a/".into(),
                    prefix: true,
                },
            },
            AuthChange::UserGrantRole {
                name: "u".into(),
                role: "r".into(),
            },
            AuthChange::Enable {
                signing_key: Secret("k".into()),
            },
        ] {
            change(&mut kv, c);
        }
        kv
    }

    fn guarded(user: &str, key: &str) -> Command {
        Command::Guarded {
            user: user.into(),
            command: Box::new(Command::Put {
                key: key.into(),
                value: "v".into(),
                lease: None,
                prev_revision: None,
            }),
        }
    }

    #[test]
    fn apply_rechecks_a_guarded_command_against_the_state_it_applies_to() {
        let mut kv = state();
        assert!(matches!(
            kv.apply(&guarded("u", "a/1")).response,
            Response::Put { .. }
        ));
        // An anonymous write checked by a node that had not applied the enable yet.
        assert_eq!(
            kv.apply(&guarded("", "a/1")).response,
            Response::Rejected {
                error: KvError::PermissionDenied
            }
        );
        assert_eq!(
            kv.apply(&guarded("u", "b")).response,
            Response::Rejected {
                error: KvError::PermissionDenied
            }
        );
        // The role is revoked after the node checked the put and before it applied.
        change(
            &mut kv,
            AuthChange::UserRevokeRole {
                name: "u".into(),
                role: "r".into(),
            },
        );
        let before = kv.revision();
        assert_eq!(
            kv.apply(&guarded("u", "a/2")).response,
            Response::Rejected {
                error: KvError::PermissionDenied
            }
        );
        assert_eq!(kv.revision(), before, "a refused command changes nothing");
        assert!(kv.get("a/2").is_none());
    }

    #[test]
    fn revoking_a_lease_needs_write_on_every_attached_key() {
        let mut kv = state();
        let root = |c: Command| Command::Guarded {
            user: ROOT.into(),
            command: Box::new(c),
        };
        kv.apply(&root(Command::RegisterLease {
            name: "l".into(),
            ttl_ms: 1000,
            clock_ms: None,
        }));
        for key in ["a/1", "b/1"] {
            kv.apply(&root(Command::Put {
                key: key.into(),
                value: "v".into(),
                lease: Some("l".into()),
                prev_revision: None,
            }));
        }
        let revoke = Command::RevokeLease { name: "l".into() };
        assert!(!authorize(&kv, "u", &revoke));
        assert!(authorize(&kv, ROOT, &revoke));
        assert!(!authorize(
            &kv,
            "nobody",
            &Command::RegisterLease {
                name: "x".into(),
                ttl_ms: 1,
                clock_ms: None
            }
        ));
    }
}
