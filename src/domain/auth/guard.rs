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
        Command::RegisterLease { .. } => true,
        Command::RevokeLease { name } => lease_keys_allowed(kv, auth, user, name, Access::Write),
        Command::RegisterMember { id, .. } => {
            auth.allowed_key(user, Access::Write, &member_key(id))
        }
        Command::Batch { commands } => commands.iter().all(|c| authorize(kv, user, c)),
        Command::Auth { .. } => auth.is_root(user),
        Command::ExpireLeases { .. }
        | Command::CheckpointLeases { .. }
        | Command::Guarded { .. } => false,
    }
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
