//! Authentication and authorization (etcd-style RBAC), the pure part: users, roles and
//! permissions as replicated facts, the validated transitions between them, and the question
//! "may this user do this".
//!
//! # Model (as etcd's)
//! - A user has a password hash (argon2, made by the node that received the request: the log
//!   never holds a password) and a set of roles. A role has permissions ([`perm::Permission`]).
//! - The role named `root` is built in: it needs no `role add` and allows everything. It exists
//!   while it was added or a user holds it; deleting it removes both, so it exists no more
//!   (etcd's root role exists once added: granting it needs no `role add` there either).
//!   Enabling auth needs a user named `root` holding it; while auth is on, that user cannot be
//!   deleted or lose the role, and the role cannot be deleted (no way to lock everyone out).
//! - While auth is off, everything is allowed to everyone (so the first users can be made).
//! - Every applied change advances the auth `revision`; a write checked at one revision is
//!   re-checked at apply if the revision moved (see `Command::Guarded`).
//!
//! # Invariants
//! - [`AuthState::apply`] is total and deterministic: it validates, and either changes the state
//!   (revision + 1) or returns an [`AuthError`] and changes nothing.
//! - A user's roles all exist (deleting a role removes it from every user), `root` aside.
//! - Secrets (password hashes, the signing key) are [`Secret`]s: never printed by `Debug`, never
//!   in an error. Read answers are built from [`AuthState::user_info`] and friends, which leave
//!   them out.
//!
//! # What it must not do
//! Hash, draw random numbers or read a clock: the signing key and the hashes arrive in the
//! change; token checks take `now`.

pub mod guard;
pub mod perm;
pub mod token;

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

pub use perm::{Access, KeyRange, PermKind, Permission};

/// The built-in role that allows everything, and the user that must hold it.
pub const ROOT: &str = "root";
/// The longest user or role name.
pub const MAX_NAME_BYTES: usize = 128;
/// The longest password (argon2 takes any length; this bounds the work per request).
pub const MAX_PASSWORD_BYTES: usize = 1024;
/// The most permissions one role may hold.
pub const MAX_PERMISSIONS: usize = 1000;

/// A secret string: serialized as itself (it is replicated), never shown by `Debug`.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// One user.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub password_hash: Secret,
    #[serde(default)]
    pub roles: BTreeSet<String>,
}

/// One role.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Role {
    #[serde(default)]
    pub permissions: BTreeSet<Permission>,
}

/// The replicated auth state (part of every snapshot; absent in old ones: auth off).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthState {
    #[serde(default)]
    pub enabled: bool,
    /// Advances on every applied change.
    #[serde(default)]
    pub revision: u64,
    #[serde(default)]
    pub users: BTreeMap<String, User>,
    #[serde(default)]
    pub roles: BTreeMap<String, Role>,
    /// The token signing key (base64url), set while auth is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_key: Option<Secret>,
}

/// A change to the auth state: the payload of `Command::Auth`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum AuthChange {
    /// Turn auth on with this token key (drawn by the proposing node).
    Enable {
        signing_key: Secret,
    },
    Disable,
    UserAdd {
        name: String,
        password_hash: Secret,
    },
    UserDelete {
        name: String,
    },
    UserPasswd {
        name: String,
        password_hash: Secret,
    },
    UserGrantRole {
        name: String,
        role: String,
    },
    UserRevokeRole {
        name: String,
        role: String,
    },
    RoleAdd {
        name: String,
    },
    RoleDelete {
        name: String,
    },
    RoleGrant {
        name: String,
        permission: Permission,
    },
    /// Remove the permission on exactly (`key`, `prefix`), whatever its kind.
    RoleRevoke {
        name: String,
        key: String,
        #[serde(default)]
        prefix: bool,
    },
}

/// Why an auth change or check was refused (decided at apply time, part of the result).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum AuthError {
    #[error("user {name:?} already exists")]
    UserExists { name: String },
    #[error("user {name:?} does not exist")]
    UserNotFound { name: String },
    #[error("role {name:?} already exists")]
    RoleExists { name: String },
    #[error("role {name:?} does not exist")]
    RoleNotFound { name: String },
    #[error("user {name:?} does not have role {role:?}")]
    RoleNotGranted { name: String, role: String },
    #[error("role {name:?} has no permission on {key:?} (prefix: {prefix})")]
    PermissionNotGranted {
        name: String,
        key: String,
        prefix: bool,
    },
    #[error("auth needs a user named \"root\" with the role \"root\" before it can be enabled")]
    RootUserRequired,
    #[error("{message}")]
    InvalidChange { message: String },
}

impl AuthState {
    /// Whether requests must authenticate.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The signing key, while auth is on.
    pub fn key(&self) -> Option<&[u8]> {
        self.signing_key
            .as_ref()
            .filter(|_| self.enabled)
            .map(|k| k.0.as_bytes())
    }

    /// Apply one change: validated here, on every replica alike.
    pub fn apply(&mut self, change: &AuthChange) -> Result<(), AuthError> {
        self.change(change)?;
        self.revision += 1;
        Ok(())
    }

    fn change(&mut self, change: &AuthChange) -> Result<(), AuthError> {
        use AuthChange as C;
        match change {
            C::Enable { signing_key } => {
                let root = self.users.get(ROOT).ok_or(AuthError::RootUserRequired)?;
                if !root.roles.contains(ROOT) {
                    return Err(AuthError::RootUserRequired);
                }
                if !self.enabled {
                    self.signing_key = Some(signing_key.clone());
                }
                self.enabled = true;
            }
            C::Disable => {
                self.enabled = false;
                self.signing_key = None;
            }
            C::UserAdd {
                name,
                password_hash,
            } => {
                check_name(name)?;
                if self.users.contains_key(name) {
                    return Err(AuthError::UserExists { name: name.clone() });
                }
                self.users.insert(
                    name.clone(),
                    User {
                        password_hash: password_hash.clone(),
                        roles: BTreeSet::new(),
                    },
                );
            }
            C::UserDelete { name } => {
                if self.enabled && name == ROOT {
                    return Err(invalid("the root user cannot be deleted while auth is on"));
                }
                self.users
                    .remove(name)
                    .ok_or_else(|| AuthError::UserNotFound { name: name.clone() })?;
            }
            C::UserPasswd {
                name,
                password_hash,
            } => self.user_mut(name)?.password_hash = password_hash.clone(),
            C::UserGrantRole { name, role } => {
                if role != ROOT && !self.roles.contains_key(role) {
                    return Err(AuthError::RoleNotFound { name: role.clone() });
                }
                self.user_mut(name)?.roles.insert(role.clone());
            }
            C::UserRevokeRole { name, role } => {
                if self.enabled && name == ROOT && role == ROOT {
                    return Err(invalid(
                        "the root user cannot lose the root role while auth is on",
                    ));
                }
                if !self.user_mut(name)?.roles.remove(role) {
                    return Err(AuthError::RoleNotGranted {
                        name: name.clone(),
                        role: role.clone(),
                    });
                }
            }
            C::RoleAdd { name } => {
                check_name(name)?;
                if self.roles.contains_key(name) {
                    return Err(AuthError::RoleExists { name: name.clone() });
                }
                self.roles.insert(name.clone(), Role::default());
            }
            C::RoleDelete { name } => {
                if self.enabled && name == ROOT {
                    return Err(invalid("the root role cannot be deleted while auth is on"));
                }
                let existed = self.roles.remove(name).is_some();
                let held = self.users.values().any(|u| u.roles.contains(name));
                // `root` is built in: deleting it (auth off) takes it from its holders.
                if !(existed || (name == ROOT && held)) {
                    return Err(AuthError::RoleNotFound { name: name.clone() });
                }
                for u in self.users.values_mut() {
                    u.roles.remove(name);
                }
            }
            C::RoleGrant { name, permission } => {
                let role = self.role_mut(name)?;
                // One permission per (key, prefix): a new kind replaces the old one.
                role.permissions
                    .retain(|p| !(p.key == permission.key && p.prefix == permission.prefix));
                if role.permissions.len() >= MAX_PERMISSIONS {
                    return Err(invalid(format!(
                        "a role holds at most {MAX_PERMISSIONS} permissions"
                    )));
                }
                role.permissions.insert(permission.clone());
            }
            C::RoleRevoke { name, key, prefix } => {
                let role = self.role_mut(name)?;
                let before = role.permissions.len();
                role.permissions
                    .retain(|p| !(&p.key == key && p.prefix == *prefix));
                if role.permissions.len() == before {
                    return Err(AuthError::PermissionNotGranted {
                        name: name.clone(),
                        key: key.clone(),
                        prefix: *prefix,
                    });
                }
            }
        }
        Ok(())
    }

    fn user_mut(&mut self, name: &str) -> Result<&mut User, AuthError> {
        self.users
            .get_mut(name)
            .ok_or_else(|| AuthError::UserNotFound { name: name.into() })
    }

    fn role_mut(&mut self, name: &str) -> Result<&mut Role, AuthError> {
        if name == ROOT {
            return Err(invalid("the root role allows everything already"));
        }
        self.roles
            .get_mut(name)
            .ok_or_else(|| AuthError::RoleNotFound { name: name.into() })
    }

    /// Whether `user` holds the root role (false for unknown users).
    pub fn is_root(&self, user: &str) -> bool {
        self.users.get(user).is_some_and(|u| u.roles.contains(ROOT))
    }

    /// Whether `user` may `access` every key of `range` (always, while auth is off).
    pub fn allowed(&self, user: &str, access: Access, range: &KeyRange) -> bool {
        if !self.enabled {
            return true;
        }
        let Some(u) = self.users.get(user) else {
            return false;
        };
        if u.roles.contains(ROOT) {
            return true;
        }
        let grants = u
            .roles
            .iter()
            .filter_map(|r| self.roles.get(r))
            .flat_map(|r| r.permissions.iter());
        perm::covers(grants, access, range)
    }

    /// Whether `user` may `access` one stored key (a binary one by its raw bytes).
    pub fn allowed_key(&self, user: &str, access: Access, key: &str) -> bool {
        self.allowed(user, access, &KeyRange::of_stored(key))
    }

    /// A user's public record (no hash).
    pub fn user_info(&self, name: &str) -> Option<UserInfo> {
        self.users.get(name).map(|u| UserInfo {
            name: name.to_string(),
            roles: u.roles.iter().cloned().collect(),
        })
    }

    /// Whether the built-in `root` role exists: added, or held by a user.
    fn root_exists(&self) -> bool {
        self.roles.contains_key(ROOT) || self.users.values().any(|u| u.roles.contains(ROOT))
    }

    /// A role's record (`root` is built in and has no listed permissions), if it exists.
    pub fn role_info(&self, name: &str) -> Option<RoleInfo> {
        if name == ROOT && !self.roles.contains_key(ROOT) && self.root_exists() {
            return Some(RoleInfo {
                name: ROOT.into(),
                permissions: vec![],
            });
        }
        self.roles.get(name).map(|r| RoleInfo {
            name: name.to_string(),
            permissions: r.permissions.iter().cloned().collect(),
        })
    }

    /// Every role name, `root` included while it exists.
    pub fn role_names(&self) -> Vec<String> {
        let mut names: BTreeSet<String> = self.roles.keys().cloned().collect();
        if self.root_exists() {
            names.insert(ROOT.into());
        }
        names.into_iter().collect()
    }
}

pub use leasecore_client::api::{RoleInfo, UserInfo};

fn invalid(message: impl Into<String>) -> AuthError {
    AuthError::InvalidChange {
        message: message.into(),
    }
}

/// A user or role name: 1 to [`MAX_NAME_BYTES`] bytes, no control characters, no `:` (the
/// CLI's `--user name:password` splits on it).
pub fn check_name(name: &str) -> Result<(), AuthError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(invalid(format!(
            "a name must be 1 to {MAX_NAME_BYTES} bytes"
        )));
    }
    if name.chars().any(|c| c.is_control() || c == ':') {
        return Err(invalid("a name must not contain control characters or ':'"));
    }
    Ok(())
}

/// A password: 1 to [`MAX_PASSWORD_BYTES`] bytes.
pub fn check_password(password: &str) -> Result<(), AuthError> {
    if password.is_empty() || password.len() > MAX_PASSWORD_BYTES {
        return Err(invalid(format!(
            "a password must be 1 to {MAX_PASSWORD_BYTES} bytes"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash() -> Secret {
        Secret("h".into())
    }

    fn with_root() -> AuthState {
        let mut a = AuthState::default();
        a.apply(&AuthChange::UserAdd {
            name: ROOT.into(),
            password_hash: hash(),
        })
        .unwrap();
        a.apply(&AuthChange::UserGrantRole {
            name: ROOT.into(),
            role: ROOT.into(),
        })
        .unwrap();
        a
    }

    fn enable(a: &mut AuthState) -> Result<(), AuthError> {
        a.apply(&AuthChange::Enable {
            signing_key: Secret("key".into()),
        })
    }

    #[test]
    fn enabling_needs_a_root_user_with_the_root_role() {
        let mut a = AuthState::default();
        assert_eq!(enable(&mut a), Err(AuthError::RootUserRequired));
        a.apply(&AuthChange::UserAdd {
            name: ROOT.into(),
            password_hash: hash(),
        })
        .unwrap();
        assert_eq!(enable(&mut a), Err(AuthError::RootUserRequired));
        let mut a = with_root();
        let before = a.revision;
        enable(&mut a).unwrap();
        assert!(a.enabled());
        assert_eq!(a.revision, before + 1);
        assert_eq!(a.key(), Some(&b"key"[..]));
    }

    #[test]
    fn root_cannot_be_removed_while_auth_is_on() {
        let mut a = with_root();
        enable(&mut a).unwrap();
        let rev = a.revision;
        for c in [
            AuthChange::UserDelete { name: ROOT.into() },
            AuthChange::UserRevokeRole {
                name: ROOT.into(),
                role: ROOT.into(),
            },
            AuthChange::RoleDelete { name: ROOT.into() },
        ] {
            assert!(matches!(a.apply(&c), Err(AuthError::InvalidChange { .. })));
        }
        assert_eq!(a.revision, rev, "a refused change changes nothing");
        a.apply(&AuthChange::Disable).unwrap();
        assert_eq!(a.key(), None);
        a.apply(&AuthChange::UserDelete { name: ROOT.into() })
            .unwrap();
    }

    #[test]
    fn the_root_role_exists_until_deleted_with_auth_off() {
        let mut a = AuthState::default();
        assert_eq!(
            a.role_names(),
            Vec::<String>::new(),
            "neither added nor held"
        );
        assert_eq!(a.role_info(ROOT), None);
        assert!(matches!(
            a.apply(&AuthChange::RoleDelete { name: ROOT.into() }),
            Err(AuthError::RoleNotFound { .. })
        ));
        let mut a = with_root();
        assert_eq!(a.role_names(), [ROOT], "held by the root user");
        assert!(a.role_info(ROOT).is_some());
        a.apply(&AuthChange::RoleAdd { name: ROOT.into() }).unwrap();
        enable(&mut a).unwrap();
        assert!(
            a.apply(&AuthChange::RoleDelete { name: ROOT.into() })
                .is_err()
        );
        a.apply(&AuthChange::Disable).unwrap();
        a.apply(&AuthChange::RoleDelete { name: ROOT.into() })
            .unwrap();
        assert_eq!(
            a.role_names(),
            Vec::<String>::new(),
            "deleted: listed no more"
        );
        assert_eq!(a.role_info(ROOT), None);
        assert_eq!(a.user_info(ROOT).unwrap().roles, Vec::<String>::new());
        assert!(matches!(
            a.apply(&AuthChange::RoleDelete { name: ROOT.into() }),
            Err(AuthError::RoleNotFound { .. })
        ));
    }

    #[test]
    fn permissions_follow_roles_and_deleting_a_role_revokes_it() {
        let mut a = with_root();
        a.apply(&AuthChange::UserAdd {
            name: "u".into(),
            password_hash: hash(),
        })
        .unwrap();
        a.apply(&AuthChange::RoleAdd { name: "r".into() }).unwrap();
        a.apply(&AuthChange::RoleGrant {
            name: "r".into(),
            permission: Permission {
                kind: PermKind::Read,
                key: "a/".into(),
                prefix: true,
            },
        })
        .unwrap();
        a.apply(&AuthChange::UserGrantRole {
            name: "u".into(),
            role: "r".into(),
        })
        .unwrap();
        assert!(
            a.allowed_key("u", Access::Write, "zzz"),
            "auth off: all allowed"
        );
        enable(&mut a).unwrap();
        assert!(a.allowed_key("u", Access::Read, "a/1"));
        assert!(!a.allowed_key("u", Access::Write, "a/1"));
        assert!(!a.allowed_key("u", Access::Read, "b"));
        assert!(!a.allowed_key("nobody", Access::Read, "a/1"));
        assert!(a.allowed_key(ROOT, Access::Write, "anything"));
        a.apply(&AuthChange::RoleDelete { name: "r".into() })
            .unwrap();
        assert!(!a.allowed_key("u", Access::Read, "a/1"));
        assert_eq!(a.user_info("u").unwrap().roles, Vec::<String>::new());
    }

    #[test]
    fn changes_are_validated() {
        let mut a = with_root();
        assert!(matches!(
            a.apply(&AuthChange::UserAdd {
                name: ROOT.into(),
                password_hash: hash()
            }),
            Err(AuthError::UserExists { .. })
        ));
        assert!(matches!(
            a.apply(&AuthChange::UserGrantRole {
                name: ROOT.into(),
                role: "nope".into()
            }),
            Err(AuthError::RoleNotFound { .. })
        ));
        assert!(matches!(
            a.apply(&AuthChange::RoleRevoke {
                name: "nope".into(),
                key: "k".into(),
                prefix: false
            }),
            Err(AuthError::RoleNotFound { .. })
        ));
        assert!(matches!(
            a.apply(&AuthChange::UserAdd {
                name: "a:b".into(),
                password_hash: hash()
            }),
            Err(AuthError::InvalidChange { .. })
        ));
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let mut a = with_root();
        enable(&mut a).unwrap();
        let shown = format!("{a:?}");
        assert!(
            !shown.contains("\"h\"") && !shown.contains("key\""),
            "{shown}"
        );
    }
}
