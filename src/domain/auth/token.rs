//! Bearer tokens: `base64url(payload) "." base64url(HMAC-SHA256(key, base64url(payload)))`,
//! payload `{"user": .., "exp": unix ms}`.
//!
//! Any node can check a token: the key is part of the replicated auth state (made at random by
//! the node that enabled auth). Re-enabling auth makes a new key, which voids every token.
//!
//! # Invariants
//! - Verification is pure: `now` is an argument. A token is valid strictly before `exp`.
//! - The MAC is checked (in constant time) before the payload is decoded: an attacker's bytes
//!   never reach the JSON decoder unless they were signed with the key.
//! - Tokens are bounded ([`MAX_TOKEN_BYTES`]) before any work is done on them.
//!
//! # What it must not do
//! Put a secret in an error: [`TokenError`] says what failed, never the token or the key.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::domain::types::WallMillis;

type HmacSha256 = Hmac<Sha256>;

/// The longest token accepted (a user name is at most 128 bytes).
pub const MAX_TOKEN_BYTES: usize = 1024;

/// What a token says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenClaims {
    pub user: String,
    /// Expiry, unix milliseconds.
    pub exp: u64,
}

/// Why a token was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the token is malformed")]
    Malformed,
    #[error("the token's signature does not match (auth was re-enabled, or it is forged)")]
    BadSignature,
    #[error("the token has expired")]
    Expired,
}

fn mac(key: &[u8]) -> HmacSha256 {
    // HMAC accepts keys of any length.
    HmacSha256::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC takes any key length"))
}

/// Sign `claims` with `key`.
pub fn encode(key: &[u8], claims: &TokenClaims) -> String {
    let payload = B64.encode(serde_json::to_vec(claims).unwrap_or_default());
    let mut m = mac(key);
    m.update(payload.as_bytes());
    let sig = B64.encode(m.finalize().into_bytes());
    format!("{payload}.{sig}")
}

/// Check `token` against `key` at `now`.
pub fn verify(key: &[u8], token: &str, now: WallMillis) -> Result<TokenClaims, TokenError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::Malformed);
    }
    let (payload, sig) = token.split_once('.').ok_or(TokenError::Malformed)?;
    let sig = B64.decode(sig).map_err(|_| TokenError::Malformed)?;
    let mut m = mac(key);
    m.update(payload.as_bytes());
    m.verify_slice(&sig).map_err(|_| TokenError::BadSignature)?;
    let bytes = B64.decode(payload).map_err(|_| TokenError::Malformed)?;
    let claims: TokenClaims = serde_json::from_slice(&bytes).map_err(|_| TokenError::Malformed)?;
    if now.0 >= claims.exp {
        return Err(TokenError::Expired);
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(exp: u64) -> TokenClaims {
        TokenClaims {
            user: "alice".into(),
            exp,
        }
    }

    #[test]
    fn a_token_verifies_until_it_expires() {
        let t = encode(b"k", &claims(1000));
        assert_eq!(verify(b"k", &t, WallMillis(999)), Ok(claims(1000)));
        assert_eq!(verify(b"k", &t, WallMillis(1000)), Err(TokenError::Expired));
    }

    #[test]
    fn another_key_or_a_changed_payload_is_refused() {
        let t = encode(b"k", &claims(1000));
        assert_eq!(
            verify(b"other", &t, WallMillis(0)),
            Err(TokenError::BadSignature)
        );
        let (_, sig) = t.split_once('.').unwrap();
        let forged = format!("{}.{sig}", B64.encode(br#"{"user":"root","exp":1000}"#));
        assert_eq!(
            verify(b"k", &forged, WallMillis(0)),
            Err(TokenError::BadSignature)
        );
        assert_eq!(
            verify(b"k", "junk", WallMillis(0)),
            Err(TokenError::Malformed)
        );
        assert_eq!(
            verify(b"k", "a.b!", WallMillis(0)),
            Err(TokenError::Malformed)
        );
        let long = "a".repeat(MAX_TOKEN_BYTES + 1);
        assert_eq!(
            verify(b"k", &long, WallMillis(0)),
            Err(TokenError::Malformed)
        );
    }
}
