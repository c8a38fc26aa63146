//! `/v1/auth/...`: authenticate, the auth switch, users and roles; and the [`Caller`] extractor
//! and checks every other handler uses.
//!
//! - Every client route takes a [`Caller`] first: with auth on, a request without a valid token
//!   gets 401 before its body is read. `/health`, `/livez`, `/readyz`, `/metrics`,
//!   `GET /v1/auth/status` and `POST /v1/auth/authenticate` take none.
//! - Writes go through `guard`: checked here against the applied state (an early 403), then
//!   proposed as `Command::Guarded`, re-checked by apply against the state it applies to.
//! - Admin routes need the root role (anyone while auth is off, as in etcd: that is how the
//!   first users are made). Passwords are hashed here, before proposing: the log holds hashes.
//! - Answers never carry a password, hash, token (except the one issued) or the signing key.

use axum::Json;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use serde::Deserialize;

use super::AppState;
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath, ApiQuery};
use super::kv::{propose, unexpected};
use crate::domain::auth::{
    self, Access, AuthChange, KeyRange, Permission, RoleInfo, Secret, UserInfo,
};
use crate::domain::command::{Command, Response};
use crate::runtime::auth::{AccessError, Caller};
use crate::wire::{
    AuthChanged, AuthStatus, Credentials, PasswordRequest, RoleList, RoleRequest, TokenResponse,
    UserList,
};

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let header = parts
            .headers
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        Ok(state.auth.caller(header)?)
    }
}

/// 403 unless `caller` may `access` all of `range`.
pub(crate) fn check(
    state: &AppState,
    caller: &Caller,
    access: Access,
    range: &KeyRange,
) -> Result<(), ApiError> {
    if state.auth.with_auth(|a| caller.allowed(a, access, range)) {
        Ok(())
    } else {
        Err(AccessError::PermissionDenied.into())
    }
}

/// 403 unless `caller` may `access` `key`.
pub(crate) fn check_key(
    state: &AppState,
    caller: &Caller,
    access: Access,
    key: &str,
) -> Result<(), ApiError> {
    check(state, caller, access, &KeyRange::of_stored(key))
}

/// 403 unless `caller` may `access` every key attached to lease `name`.
pub(crate) fn check_lease(
    state: &AppState,
    caller: &Caller,
    name: &str,
    access: Access,
) -> Result<(), ApiError> {
    if lease_allowed(state, caller, name, access) {
        Ok(())
    } else {
        Err(AccessError::PermissionDenied.into())
    }
}

/// Whether `caller` may `access` every key attached to lease `name`.
pub(crate) fn lease_allowed(state: &AppState, caller: &Caller, name: &str, access: Access) -> bool {
    state.consensus.view().with_state(|kv| match caller {
        Caller::Anonymous => !kv.auth().enabled(),
        Caller::User(u) => auth::guard::lease_keys_allowed(kv, kv.auth(), u, name, access),
    })
}

/// Keep only the events `caller` may read now: checked at delivery against the current auth
/// state, so a role revoked while a watch is open stops its events at once.
pub(crate) fn keep_visible(
    state: &AppState,
    caller: &Caller,
    events: &mut Vec<crate::domain::command::Event>,
) {
    state.auth.with_auth(|a| {
        if caller.is_root(a) {
            return;
        }
        events.retain(|e| caller.allowed(a, Access::Read, &KeyRange::of_stored(&e.key)));
    });
}

/// Whether `caller` may read `key` now.
pub(crate) fn can_read(state: &AppState, caller: &Caller, key: &str) -> bool {
    state
        .auth
        .with_auth(|a| caller.allowed(a, Access::Read, &KeyRange::of_stored(key)))
}

/// 403 unless `caller` holds the root role.
pub(crate) fn require_root(state: &AppState, caller: &Caller) -> Result<(), ApiError> {
    if state.auth.with_auth(|a| caller.is_root(a)) {
        Ok(())
    } else {
        Err(AccessError::PermissionDenied.into())
    }
}

/// Check `cmd` for `caller` and wrap it for the re-check at apply. An anonymous write is
/// wrapped too (as user `""`, which no user can be): a node that has not yet applied an
/// `auth enable` lets it through here, and apply, which sees the enable, refuses it.
pub(crate) fn guard(state: &AppState, caller: &Caller, cmd: Command) -> Result<Command, ApiError> {
    let user = caller.user().unwrap_or_default();
    let allowed = state.consensus.view().with_state(|kv| match caller {
        Caller::Anonymous => !kv.auth().enabled(),
        Caller::User(u) => auth::guard::authorize(kv, u, &cmd),
    });
    if !allowed {
        return Err(AccessError::PermissionDenied.into());
    }
    Ok(Command::Guarded {
        user: user.to_string(),
        command: Box::new(cmd),
    })
}

pub async fn authenticate(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<Credentials>,
) -> Result<Json<TokenResponse>, ApiError> {
    if auth::check_name(&req.name).is_err() || auth::check_password(&req.password).is_err() {
        return Err(AccessError::Unauthenticated("wrong user name or password").into());
    }
    // Linearizable: a user (or an enable) acknowledged before this call is seen here, even
    // on a follower that had not applied it yet.
    state.consensus.read_barrier().await?;
    let (token, expires_at_ms) = state.auth.authenticate(&req.name, &req.password).await?;
    Ok(Json(TokenResponse {
        token,
        user: req.name,
        expires_at_ms,
    }))
}

pub async fn status(State(state): State<AppState>) -> Json<AuthStatus> {
    Json(state.auth.with_auth(|a| AuthStatus {
        enabled: a.enabled(),
        auth_revision: a.revision,
    }))
}

/// Propose an auth change (root only) and return the auth revision after it.
async fn change(state: &AppState, caller: &Caller, change: AuthChange) -> Result<u64, ApiError> {
    require_root(state, caller)?;
    // The same check a forwarded auth change passes at the leader (`Limits::check_command`).
    state.limits.check_auth_change(&change)?;
    let cmd = guard(state, caller, Command::Auth { change })?;
    match propose(state, cmd).await? {
        Response::AuthChanged { auth_revision } => Ok(auth_revision),
        other => Err(unexpected(other)),
    }
}

pub async fn enable(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<AuthStatus>, ApiError> {
    // The token key is drawn here and travels in the entry: apply draws nothing.
    let key: [u8; 32] = rand::random();
    let signing_key = Secret(base64_url(&key));
    let auth_revision = change(&state, &caller, AuthChange::Enable { signing_key }).await?;
    Ok(Json(AuthStatus {
        enabled: true,
        auth_revision,
    }))
}

pub async fn disable(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<AuthStatus>, ApiError> {
    let auth_revision = change(&state, &caller, AuthChange::Disable).await?;
    Ok(Json(AuthStatus {
        enabled: false,
        auth_revision,
    }))
}

fn base64_url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn invalid(e: auth::AuthError) -> ApiError {
    ApiError::invalid(e.to_string())
}

pub async fn user_add(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<Credentials>,
) -> Result<(StatusCode, Json<AuthChanged>), ApiError> {
    require_root(&state, &caller)?;
    auth::check_name(&req.name).map_err(invalid)?;
    auth::check_password(&req.password).map_err(invalid)?;
    let password_hash = state.auth.hash(req.password).await?;
    let change = AuthChange::UserAdd {
        name: req.name,
        password_hash,
    };
    let auth_revision = self::change(&state, &caller, change).await?;
    Ok((StatusCode::CREATED, Json(AuthChanged { auth_revision })))
}

pub async fn user_delete(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<AuthChanged>, ApiError> {
    let auth_revision = change(&state, &caller, AuthChange::UserDelete { name }).await?;
    Ok(Json(AuthChanged { auth_revision }))
}

pub async fn user_passwd(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<PasswordRequest>,
) -> Result<Json<AuthChanged>, ApiError> {
    require_root(&state, &caller)?;
    auth::check_password(&req.password).map_err(invalid)?;
    let password_hash = state.auth.hash(req.password).await?;
    let change = AuthChange::UserPasswd {
        name,
        password_hash,
    };
    let auth_revision = self::change(&state, &caller, change).await?;
    Ok(Json(AuthChanged { auth_revision }))
}

pub async fn user_grant_role(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath((name, role)): ApiPath<(String, String)>,
) -> Result<Json<AuthChanged>, ApiError> {
    let auth_revision = change(&state, &caller, AuthChange::UserGrantRole { name, role }).await?;
    Ok(Json(AuthChanged { auth_revision }))
}

pub async fn user_revoke_role(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath((name, role)): ApiPath<(String, String)>,
) -> Result<Json<AuthChanged>, ApiError> {
    let c = AuthChange::UserRevokeRole { name, role };
    let auth_revision = change(&state, &caller, c).await?;
    Ok(Json(AuthChanged { auth_revision }))
}

/// A linearizable read of the auth state, root only.
async fn admin_read<T>(
    state: &AppState,
    caller: &Caller,
    f: impl FnOnce(&auth::AuthState) -> T,
) -> Result<T, ApiError> {
    // Checked after the barrier: a node behind an `auth enable` must not answer as if off.
    state.consensus.read_barrier().await?;
    require_root(state, caller)?;
    Ok(state.auth.with_auth(f))
}

pub async fn user_get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<UserInfo>, ApiError> {
    admin_read(&state, &caller, |a| a.user_info(&name))
        .await?
        .map(Json)
        .ok_or_else(|| auth::AuthError::UserNotFound { name }.into())
}

pub async fn user_list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<UserList>, ApiError> {
    let users = admin_read(&state, &caller, |a| a.users.keys().cloned().collect()).await?;
    Ok(Json(UserList { users }))
}

pub async fn role_add(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<RoleRequest>,
) -> Result<(StatusCode, Json<AuthChanged>), ApiError> {
    auth::check_name(&req.name).map_err(invalid)?;
    let auth_revision = change(&state, &caller, AuthChange::RoleAdd { name: req.name }).await?;
    Ok((StatusCode::CREATED, Json(AuthChanged { auth_revision })))
}

pub async fn role_delete(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<AuthChanged>, ApiError> {
    let auth_revision = change(&state, &caller, AuthChange::RoleDelete { name }).await?;
    Ok(Json(AuthChanged { auth_revision }))
}

pub async fn role_get(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<RoleInfo>, ApiError> {
    admin_read(&state, &caller, |a| a.role_info(&name))
        .await?
        .map(Json)
        .ok_or_else(|| auth::AuthError::RoleNotFound { name }.into())
}

pub async fn role_list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<RoleList>, ApiError> {
    let roles = admin_read(&state, &caller, |a| a.role_names()).await?;
    Ok(Json(RoleList { roles }))
}

pub async fn role_grant(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(permission): ApiJson<Permission>,
) -> Result<Json<AuthChanged>, ApiError> {
    let auth_revision = change(&state, &caller, AuthChange::RoleGrant { name, permission }).await?;
    Ok(Json(AuthChanged { auth_revision }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevokeQuery {
    pub key: String,
    #[serde(default)]
    pub prefix: bool,
}

pub async fn role_revoke(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<RevokeQuery>,
) -> Result<Json<AuthChanged>, ApiError> {
    let c = AuthChange::RoleRevoke {
        name,
        key: q.key,
        prefix: q.prefix,
    };
    let auth_revision = change(&state, &caller, c).await?;
    Ok(Json(AuthChanged { auth_revision }))
}
