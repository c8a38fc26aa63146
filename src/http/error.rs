//! Every error a client can see, mapped to an HTTP status in ONE place.
//!
//! The body is always `{"error": {"code": "snake_case", "message": "...", ...details}}`. Codes
//! are part of the contract (DESIGN.md section 6); messages are for people. 503 answers carry a
//! `Retry-After` header: they are the retryable ones.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::domain::auth::AuthError;
use crate::domain::command::KvError;
use crate::domain::health::NotReady;
use crate::domain::limits::InvalidInput;
use crate::raft::consensus::ConsensusError;
use crate::runtime::auth::AccessError;
use crate::runtime::lease::LeaseError;
use crate::wire::{ErrorBody, ErrorDetail};

/// The detail of a 400 `invalid_argument` for a key (or a range bound) over the key limit: the
/// limit. The etcd API answers such a request as etcd answers one over its size limit.
pub const MAX_KEY_BYTES_DETAIL: &str = "max_key_bytes";

/// An error on its way to a client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub details: Map<String, Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: Map::new(),
        }
    }

    /// Add a machine-readable detail next to the code.
    pub fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.details.insert(name.to_string(), value.into());
        self
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
}

impl From<InvalidInput> for ApiError {
    fn from(e: InvalidInput) -> Self {
        match e {
            InvalidInput::Invalid(m) => ApiError::invalid(m),
            InvalidInput::KeyTooLong(m) => ApiError::invalid(m)
                .with(MAX_KEY_BYTES_DETAIL, crate::domain::limits::MAX_KEY_BYTES),
            InvalidInput::TooLarge(m) => ApiError::too_large(m),
            InvalidInput::TooManyLeases(m) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_leases", m)
            }
        }
    }
}

/// An answer too large to give (`domain::range::MAX_RESULT_BYTES`): the request asked for it,
/// so a 400 that says how to narrow it.
fn result_too_large(message: String, limit: u64) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "result_too_large", message).with("limit", limit)
}

impl From<crate::domain::range::ResultTooLarge> for ApiError {
    fn from(e: crate::domain::range::ResultTooLarge) -> Self {
        result_too_large(e.to_string(), e.limit)
    }
}

impl From<KvError> for ApiError {
    fn from(e: KvError) -> Self {
        let message = e.to_string();
        match e {
            KvError::RevisionMismatch {
                key,
                expected,
                actual,
            } => ApiError::new(StatusCode::CONFLICT, "revision_mismatch", message)
                .with("key", key)
                .with("expected", expected.0)
                .with("actual", actual.0),
            KvError::LeaseNotFound { lease } => {
                ApiError::not_found("lease_not_found", message).with("lease", lease)
            }
            KvError::MemberExists { id } => {
                ApiError::new(StatusCode::CONFLICT, "member_exists", message).with("id", id)
            }
            KvError::LeaseExists { lease } => {
                ApiError::new(StatusCode::CONFLICT, "lease_exists", message).with("lease", lease)
            }
            KvError::KeyNotFound { key } => {
                ApiError::not_found("key_not_found", message).with("key", key)
            }
            KvError::Compacted { compacted, .. } => {
                ApiError::new(StatusCode::GONE, "compacted", message)
                    .with("compact_revision", compacted.0)
            }
            KvError::FutureRevision { current, .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "future_revision", message)
                    .with("revision", current.0)
            }
            KvError::PermissionDenied => AccessError::PermissionDenied.into(),
            KvError::Auth { error } => error.into(),
            KvError::ResultTooLarge { limit, .. } => result_too_large(message, limit),
        }
    }
}

impl From<crate::raft::state_machine::HistoryError> for ApiError {
    fn from(e: crate::raft::state_machine::HistoryError) -> Self {
        use crate::raft::state_machine::HistoryError;
        let message = e.to_string();
        match e {
            HistoryError::Compacted { floor, .. } => {
                ApiError::new(StatusCode::GONE, "compacted", message)
                    .with("compact_revision", floor.0)
            }
            HistoryError::Future { current, .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "future_revision", message)
                    .with("revision", current.0)
            }
            HistoryError::Storage(e) => {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            }
            HistoryError::TooLarge(e) => e.into(),
        }
    }
}

impl From<AccessError> for ApiError {
    fn from(e: AccessError) -> Self {
        let message = e.to_string();
        match e {
            AccessError::Unauthenticated(_) => {
                ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
            }
            AccessError::PermissionDenied => {
                ApiError::new(StatusCode::FORBIDDEN, "permission_denied", message)
            }
            AccessError::Busy => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", message)
            }
            AccessError::NotEnabled => {
                ApiError::new(StatusCode::CONFLICT, "auth_not_enabled", message)
            }
            AccessError::Invalid(m) => ApiError::invalid(m),
        }
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> Self {
        let message = e.to_string();
        let conflict = StatusCode::CONFLICT;
        match e {
            AuthError::UserExists { name } => {
                ApiError::new(conflict, "user_exists", message).with("name", name)
            }
            AuthError::UserNotFound { name } => {
                ApiError::not_found("user_not_found", message).with("name", name)
            }
            AuthError::RoleExists { name } => {
                ApiError::new(conflict, "role_exists", message).with("name", name)
            }
            AuthError::RoleNotFound { name } => {
                ApiError::not_found("role_not_found", message).with("name", name)
            }
            AuthError::RoleNotGranted { name, role } => {
                ApiError::not_found("role_not_granted", message)
                    .with("name", name)
                    .with("role", role)
            }
            AuthError::PermissionNotGranted { name, key, .. } => {
                ApiError::not_found("permission_not_granted", message)
                    .with("name", name)
                    .with("key", key)
            }
            AuthError::RootUserRequired => ApiError::new(conflict, "root_user_required", message),
            AuthError::InvalidChange { .. } => ApiError::invalid(message),
        }
    }
}

#[cfg(test)]
mod auth_tests {
    use super::*;

    #[test]
    fn auth_failures_map_to_401_and_403() {
        let e: ApiError = AccessError::Unauthenticated("x").into();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::UNAUTHORIZED, "unauthenticated")
        );
        let e: ApiError = KvError::PermissionDenied.into();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::FORBIDDEN, "permission_denied")
        );
    }
}

impl From<crate::raft::durability::AnswerNotDurable> for ApiError {
    fn from(e: crate::raft::durability::AnswerNotDurable) -> Self {
        use crate::raft::durability::AnswerNotDurable;
        let code = match e {
            AnswerNotDurable::Timeout { .. } => "log_not_durable",
            AnswerNotDurable::SyncFailed => "log_sync_failed",
        };
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, e.to_string())
    }
}

impl From<ConsensusError> for ApiError {
    fn from(e: ConsensusError) -> Self {
        let message = e.to_string();
        let unavailable = StatusCode::SERVICE_UNAVAILABLE;
        match e {
            ConsensusError::NoLeader | ConsensusError::NotLeader => {
                ApiError::new(unavailable, "no_leader", message)
            }
            ConsensusError::NoQuorum => ApiError::new(unavailable, "no_quorum", message),
            ConsensusError::QuorumLost {
                heard,
                voters,
                needed,
            } => ApiError::new(unavailable, "no_quorum", message)
                .with("voters_heard", heard)
                .with("voters", voters)
                .with("voters_needed", needed),
            ConsensusError::OutcomeUnknown { .. } => {
                ApiError::new(unavailable, "outcome_unknown", message)
            }
            ConsensusError::Timeout { .. } => {
                ApiError::new(StatusCode::GATEWAY_TIMEOUT, "timeout", message)
            }
            ConsensusError::ShuttingDown => ApiError::new(unavailable, "shutting_down", message),
            // Nothing was done (the forwarding node falls back before a client sees this).
            ConsensusError::Unsupported { .. } => ApiError::new(unavailable, "no_leader", message),
            ConsensusError::InvalidMembership { .. } => ApiError::invalid(message),
            ConsensusError::NodeNotFound { id } => {
                ApiError::not_found("node_not_found", message).with("id", id)
            }
            // Nothing was done, and the same request may succeed later: a conflict with the
            // change in flight, retryable (it carries Retry-After too).
            ConsensusError::ChangeInProgress { .. } => ApiError::new(
                StatusCode::CONFLICT,
                "membership_change_in_progress",
                message,
            ),
            ConsensusError::StillAnswering { id } => {
                ApiError::new(StatusCode::CONFLICT, "node_still_answering", message).with("id", id)
            }
            ConsensusError::BadTransferee { id } => {
                ApiError::new(StatusCode::BAD_REQUEST, "bad_leader_transferee", message)
                    .with("id", id)
            }
            ConsensusError::TransferInProgress => {
                ApiError::new(StatusCode::CONFLICT, "leader_transfer_in_progress", message)
            }
            ConsensusError::TransferFailed { .. } => {
                ApiError::new(unavailable, "leader_transfer_failed", message)
            }
            ConsensusError::QuotaExceeded {
                used_bytes,
                quota_bytes,
            } => ApiError::new(StatusCode::INSUFFICIENT_STORAGE, "quota_exceeded", message)
                .with("used_bytes", used_bytes)
                .with("quota_bytes", quota_bytes),
        }
    }
}

impl From<NotReady> for ApiError {
    fn from(e: NotReady) -> Self {
        let message = match &e {
            NotReady::NoLeader => "no leader is known".to_string(),
            NotReady::NoQuorum { .. } => {
                "this node leads but no quorum acknowledged it within an election timeout".into()
            }
            NotReady::LeaderSilent { leader_id, .. } => {
                format!("nothing heard from leader {leader_id} within an election timeout")
            }
            NotReady::Applying {
                applied_index,
                commit_index,
            } => format!("applied up to {applied_index}, committed up to {commit_index}"),
        };
        let mut err = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", message);
        if let Ok(Value::Object(details)) = serde_json::to_value(&e) {
            err.details.extend(details);
        }
        err
    }
}

impl From<LeaseError> for ApiError {
    fn from(e: LeaseError) -> Self {
        match e {
            LeaseError::NotFound { name } => ApiError::not_found(
                "lease_not_found",
                format!("lease {name:?} does not exist (or has expired)"),
            )
            .with("lease", name),
            LeaseError::Consensus(c) => c.into(),
        }
    }
}

impl ApiError {
    /// The JSON document of the error (the body of its HTTP answer).
    pub fn body(self) -> serde_json::Value {
        json!(ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
                details: self.details,
            },
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retryable = self.status == StatusCode::SERVICE_UNAVAILABLE
            || self.code == "membership_change_in_progress"
            || self.code == "leader_transfer_in_progress";
        let status = self.status;
        let mut resp = (status, axum::Json(self.body())).into_response();
        if retryable {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_membership_change_at_a_time_is_a_retryable_409_not_a_400() {
        let e: ApiError = ConsensusError::ChangeInProgress {
            message: "m".into(),
        }
        .into();
        assert_eq!(e.status, StatusCode::CONFLICT);
        assert_eq!(e.code, "membership_change_in_progress");
        let resp = e.into_response();
        assert!(resp.headers().contains_key(header::RETRY_AFTER));
    }

    #[test]
    fn not_ready_is_a_503_with_its_reason() {
        let e: ApiError = NotReady::NoQuorum {
            quorum_ack_age_ms: Some(1500),
        }
        .into();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, "not_ready");
        assert_eq!(e.details["reason"], "no_quorum");
        assert_eq!(e.details["quorum_ack_age_ms"], 1500);
    }
}
