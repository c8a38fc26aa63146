//! The auth shell: password hashing and checking (argon2, bounded), token issue and caller
//! resolution against the applied auth state, with the clock read here and passed in.
//!
//! # Invariants
//! - At most `permits` argon2 computations run at once, each on a blocking thread; a request
//!   that waits longer than [`HASH_WAIT`] for a turn is refused (429) having done nothing, so
//!   `authenticate` cannot be used to occupy every core or the async workers.
//! - An unknown user costs a hash check too (against a fixed dummy hash): the answer's timing
//!   does not tell which user names exist.
//! - Nothing here logs or returns a password, hash, token or key.
//!
//! # What it must not do
//! Decide who may do what: that is `domain::auth` (rules) and the applied state (facts).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use argon2::Argon2;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use tokio::sync::Semaphore;

use crate::clock::Clock;
use crate::domain::auth::token::{self, TokenClaims, TokenError};
use crate::domain::auth::{Access, AuthState, KeyRange, Secret};
use crate::raft::state_machine::StateView;

/// How long a request waits for a free hashing slot.
pub const HASH_WAIT: Duration = Duration::from_secs(5);
/// The default token lifetime (etcd's `--auth-token-ttl`: 300 s).
pub const DEFAULT_TOKEN_TTL_MS: u64 = 300_000;

/// Why a request was refused before anything was done.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// No token, or one that does not verify, has expired, or names a deleted user.
    #[error("{0}")]
    Unauthenticated(&'static str),
    #[error("permission denied")]
    PermissionDenied,
    /// Every hashing slot stayed busy.
    #[error("too many password checks in progress; try again")]
    Busy,
    #[error("authentication is not enabled")]
    NotEnabled,
    #[error("{0}")]
    Invalid(String),
}

/// Who is calling: resolved from the `Authorization` header against the applied auth state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// No user (auth was off when the request arrived): allowed only while auth stays off.
    Anonymous,
    /// An authenticated user.
    User(String),
}

impl Caller {
    /// Whether this caller may `access` all of `range` under `auth`.
    pub fn allowed(&self, auth: &AuthState, access: Access, range: &KeyRange) -> bool {
        match self {
            Caller::Anonymous => !auth.enabled(),
            Caller::User(u) => auth.allowed(u, access, range),
        }
    }

    /// Whether this caller holds the root role (anyone, while auth is off).
    pub fn is_root(&self, auth: &AuthState) -> bool {
        match self {
            Caller::Anonymous => !auth.enabled(),
            Caller::User(u) => !auth.enabled() || auth.is_root(u),
        }
    }

    /// The user's name, if any.
    pub fn user(&self) -> Option<&str> {
        match self {
            Caller::Anonymous => None,
            Caller::User(u) => Some(u),
        }
    }
}

/// Password work and token checks for one node.
pub struct AuthService {
    clock: Arc<dyn Clock>,
    view: StateView,
    token_ttl_ms: u64,
    hashing: Arc<Semaphore>,
}

impl AuthService {
    /// `permits`: how many hashes may run at once (at least 1).
    pub fn new(clock: Arc<dyn Clock>, view: StateView, token_ttl_ms: u64, permits: usize) -> Self {
        AuthService {
            clock,
            view,
            token_ttl_ms: token_ttl_ms.max(1),
            hashing: Arc::new(Semaphore::new(permits.max(1))),
        }
    }

    /// Run `f` on the applied auth state (briefly: it holds the state's read lock).
    pub fn with_auth<T>(&self, f: impl FnOnce(&AuthState) -> T) -> T {
        self.view.with_state(|kv| f(kv.auth()))
    }

    /// Resolve the caller from an `Authorization` header value.
    pub fn caller(&self, authorization: Option<&[u8]>) -> Result<Caller, AccessError> {
        let now = self.clock.wall();
        self.with_auth(|auth| {
            let Some(key) = auth.key() else {
                return Ok(Caller::Anonymous);
            };
            let header = authorization.ok_or(AccessError::Unauthenticated(
                "authentication is enabled: send Authorization: Bearer <token>",
            ))?;
            let token = std::str::from_utf8(header)
                .ok()
                .and_then(|h| h.strip_prefix("Bearer "))
                .map(str::trim)
                .ok_or(AccessError::Unauthenticated(
                    "the Authorization header must be: Bearer <token>",
                ))?;
            let claims = token::verify(key, token, now).map_err(|e| {
                AccessError::Unauthenticated(match e {
                    TokenError::Malformed => "the token is malformed",
                    TokenError::BadSignature => {
                        "the token is not valid (forged, or auth was re-enabled)"
                    }
                    TokenError::Expired => "the token has expired",
                })
            })?;
            if !auth.users.contains_key(&claims.user) {
                return Err(AccessError::Unauthenticated(
                    "the token's user no longer exists",
                ));
            }
            Ok(Caller::User(claims.user))
        })
    }

    /// Check `name`'s password and issue a token: `(token, expiry unix ms)`.
    pub async fn authenticate(
        &self,
        name: &str,
        password: &str,
    ) -> Result<(String, u64), AccessError> {
        let (enabled, hash) = self.with_auth(|a| {
            (
                a.enabled(),
                a.users.get(name).map(|u| u.password_hash.clone()),
            )
        });
        if !enabled {
            return Err(AccessError::NotEnabled);
        }
        if !self.verify_password(hash, password.to_string()).await? {
            return Err(AccessError::Unauthenticated("wrong user name or password"));
        }
        let now = self.clock.wall();
        let exp = now.0.saturating_add(self.token_ttl_ms);
        // The key may have changed while we hashed: sign with the current one.
        let key = self.with_auth(|a| a.key().map(<[u8]>::to_vec));
        let key = key.ok_or(AccessError::NotEnabled)?;
        let token = token::encode(
            &key,
            &TokenClaims {
                user: name.to_string(),
                exp,
            },
        );
        Ok((token, exp))
    }

    /// Hash a password for the log (a random salt per hash).
    pub async fn hash(&self, password: String) -> Result<Secret, AccessError> {
        self.bounded(move || {
            let salt = SaltString::encode_b64(&rand::random::<[u8; 16]>())
                .map_err(|e| AccessError::Invalid(e.to_string()))?;
            Argon2::default()
                .hash_password(password.as_bytes(), &salt)
                .map(|h| Secret(h.to_string()))
                .map_err(|e| AccessError::Invalid(e.to_string()))
        })
        .await?
    }

    /// Whether `password` matches `hash`; `None` (no such user) checks a dummy hash and fails.
    async fn verify_password(
        &self,
        hash: Option<Secret>,
        password: String,
    ) -> Result<bool, AccessError> {
        self.bounded(move || {
            let known = hash.is_some();
            let hash = hash.map(|h| h.0);
            let hash = hash.as_deref().unwrap_or_else(|| dummy_hash());
            let matches = PasswordHash::new(hash).is_ok_and(|parsed| {
                Argon2::default()
                    .verify_password(password.as_bytes(), &parsed)
                    .is_ok()
            });
            known && matches
        })
        .await
    }

    /// Run `f` on a blocking thread once a hashing slot is free.
    async fn bounded<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, AccessError> {
        let permit = tokio::time::timeout(HASH_WAIT, self.hashing.clone().acquire_owned())
            .await
            .map_err(|_| AccessError::Busy)?
            .map_err(|_| AccessError::Busy)?;
        tokio::task::spawn_blocking(move || {
            let out = f();
            drop(permit);
            out
        })
        .await
        .map_err(|_| AccessError::Busy)
    }
}

/// A valid hash of a password nobody has, checked for unknown users.
fn dummy_hash() -> &'static str {
    static DUMMY: OnceLock<String> = OnceLock::new();
    DUMMY.get_or_init(|| {
        let salt = SaltString::encode_b64(b"leasecore-dummy!")
            .unwrap_or_else(|_| unreachable!("a 16-byte salt encodes"));
        Argon2::default()
            .hash_password(b"no user has this password", &salt)
            .map(|h| h.to_string())
            .unwrap_or_default()
    })
}
