//! `leasecore auth|user|role ...`, and how every client command authenticates: the global
//! `--user name[:password]` (the password is asked for, without echo, only on a terminal) or
//! a ready token in `LEASECORE_TOKEN` (`--token`).
//!
//! New passwords (`user add`, `user passwd`) are never taken from the command line, where other
//! users of the machine could read them: they are asked for on a terminal, or read as one line
//! from standard input otherwise (for scripts).

use std::io::{BufRead, IsTerminal};

use clap::Subcommand;
use leasecore::client::{Client, ClientError};
use leasecore::domain::auth::PermKind;
use serde::Serialize;

/// Build the client of a command: endpoints, plus a token or credentials when given.
pub fn client(
    endpoints: &[String],
    user: Option<&str>,
    token: Option<&str>,
) -> Result<Client, ClientError> {
    let client = Client::new(endpoints)?;
    match (user, token) {
        (Some(user), _) => {
            let (name, password) = match user.split_once(':') {
                Some((n, p)) => (n.to_string(), p.to_string()),
                None => (
                    user.to_string(),
                    ask_password(&format!("password of {user}: "))?,
                ),
            };
            Ok(client.with_credentials(name, password))
        }
        (None, Some(token)) => Ok(client.with_token(token)),
        (None, None) => Ok(client),
    }
}

/// A token for calls made outside [`Client`] (snapshot save), if the command authenticates.
pub async fn token(
    endpoints: &[String],
    user: Option<&str>,
    token: Option<&str>,
) -> Result<Option<String>, ClientError> {
    let c = client(endpoints, user, token)?;
    if user.is_some() {
        // Any call authenticates first; the status route is open and cheap.
        c.auth_status().await?;
    }
    Ok(c.token())
}

/// Ask for a password on the terminal, without echo; refuse without a terminal.
fn ask_password(prompt: &str) -> Result<String, ClientError> {
    if !std::io::stdin().is_terminal() {
        return Err(ClientError::Usage(
            "no terminal to ask for the password on: give --user name:password or LEASECORE_TOKEN"
                .into(),
        ));
    }
    rpassword::prompt_password(prompt).map_err(|e| ClientError::Usage(e.to_string()))
}

/// A new password: asked twice on a terminal, else one line of standard input.
fn new_password(user: &str) -> Result<String, ClientError> {
    if std::io::stdin().is_terminal() {
        let first = ask_password(&format!("new password of {user}: "))?;
        let again = ask_password("again: ")?;
        if first != again {
            return Err(ClientError::Usage("the passwords differ".into()));
        }
        return Ok(first);
    }
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| ClientError::Usage(e.to_string()))?;
    let password = line.trim_end_matches(['\r', '\n']).to_string();
    if password.is_empty() {
        return Err(ClientError::Usage(
            "give the new password on standard input".into(),
        ));
    }
    Ok(password)
}

#[derive(Subcommand)]
pub enum AuthCmd {
    /// Turn authentication on (needs user root with role root).
    Enable,
    /// Turn authentication off.
    Disable,
    /// Whether authentication is on.
    Status,
}

#[derive(Subcommand)]
pub enum UserCmd {
    /// Add a user (the password is asked for, or read from standard input).
    Add {
        /// The user's name.
        name: String,
    },
    /// Delete a user.
    Delete {
        /// The user's name.
        name: String,
    },
    /// Change a user's password (asked for, or read from standard input).
    Passwd {
        /// The user's name.
        name: String,
    },
    /// Give a user a role.
    GrantRole {
        /// The user's name.
        name: String,
        /// The role's name.
        role: String,
    },
    /// Take a role from a user.
    RevokeRole {
        /// The user's name.
        name: String,
        /// The role's name.
        role: String,
    },
    /// List the users.
    List,
    /// Show a user and their roles.
    Get {
        /// The user's name.
        name: String,
    },
}

#[derive(Subcommand)]
pub enum RoleCmd {
    /// Add a role.
    Add {
        /// The role's name.
        name: String,
    },
    /// Delete a role (and take it from every user).
    Delete {
        /// The role's name.
        name: String,
    },
    /// Grant a permission: KIND is read, write or readwrite.
    Grant {
        /// The role's name.
        name: String,
        /// read, write or readwrite.
        #[arg(value_parser = parse_kind)]
        kind: PermKind,
        /// The key (or with --prefix, the key prefix) the permission covers.
        key: String,
        /// On every key starting with KEY ("" with --prefix: every key).
        #[arg(long)]
        prefix: bool,
    },
    /// Revoke the permission on KEY (with --prefix: the prefix grant).
    Revoke {
        /// The role's name.
        name: String,
        /// The key (or with --prefix, the key prefix) of the permission to revoke.
        key: String,
        /// Revoke the prefix grant on KEY rather than the single-key one.
        #[arg(long)]
        prefix: bool,
    },
    /// List the roles.
    List,
    /// Show a role and its permissions.
    Get {
        /// The role's name.
        name: String,
    },
}

fn parse_kind(s: &str) -> Result<PermKind, String> {
    match s {
        "read" => Ok(PermKind::Read),
        "write" => Ok(PermKind::Write),
        "readwrite" => Ok(PermKind::Readwrite),
        _ => Err(format!("{s:?} is not read, write or readwrite")),
    }
}

fn show<T: Serialize>(json: bool, v: &T, text: impl FnOnce(&T) -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        println!("{}", text(v));
    }
}

pub async fn auth(cmd: AuthCmd, c: &Client, json: bool) -> Result<(), ClientError> {
    let status = match cmd {
        AuthCmd::Enable => c.auth_enable().await?,
        AuthCmd::Disable => c.auth_disable().await?,
        AuthCmd::Status => c.auth_status().await?,
    };
    show(json, &status, |s| {
        format!(
            "authentication {} (auth revision {})",
            if s.enabled { "enabled" } else { "disabled" },
            s.auth_revision
        )
    });
    Ok(())
}

pub async fn user(cmd: UserCmd, c: &Client, json: bool) -> Result<(), ClientError> {
    let changed = match cmd {
        UserCmd::Add { name } => c.user_add(&name, &new_password(&name)?).await?,
        UserCmd::Delete { name } => c.user_delete(&name).await?,
        UserCmd::Passwd { name } => c.user_passwd(&name, &new_password(&name)?).await?,
        UserCmd::GrantRole { name, role } => c.user_grant_role(&name, &role).await?,
        UserCmd::RevokeRole { name, role } => c.user_revoke_role(&name, &role).await?,
        UserCmd::List => {
            let list = c.user_list().await?;
            show(json, &list, |l| l.users.join("\n"));
            return Ok(());
        }
        UserCmd::Get { name } => {
            let u = c.user_get(&name).await?;
            show(json, &u, |u| {
                format!("user {}\nroles: {}", u.name, u.roles.join(", "))
            });
            return Ok(());
        }
    };
    show(json, &changed, |c| {
        format!("ok (auth revision {})", c.auth_revision)
    });
    Ok(())
}

pub async fn role(cmd: RoleCmd, c: &Client, json: bool) -> Result<(), ClientError> {
    let changed = match cmd {
        RoleCmd::Add { name } => c.role_add(&name).await?,
        RoleCmd::Delete { name } => c.role_delete(&name).await?,
        RoleCmd::Grant {
            name,
            kind,
            key,
            prefix,
        } => c.role_grant(&name, kind, &key, prefix).await?,
        RoleCmd::Revoke { name, key, prefix } => c.role_revoke(&name, &key, prefix).await?,
        RoleCmd::List => {
            let list = c.role_list().await?;
            show(json, &list, |l| l.roles.join("\n"));
            return Ok(());
        }
        RoleCmd::Get { name } => {
            let r = c.role_get(&name).await?;
            show(json, &r, |r| {
                let mut out = format!("role {}", r.name);
                for p in &r.permissions {
                    let kind = match p.kind {
                        PermKind::Read => "read",
                        PermKind::Write => "write",
                        PermKind::Readwrite => "readwrite",
                    };
                    let what = if p.prefix { "prefix" } else { "key" };
                    out.push_str(&format!("\n  {kind} {what} {:?}", p.key));
                }
                out
            });
            return Ok(());
        }
    };
    show(json, &changed, |c| {
        format!("ok (auth revision {})", c.auth_revision)
    });
    Ok(())
}
