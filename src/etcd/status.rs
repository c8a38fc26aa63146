//! Every error the etcd API answers, mapped to etcd's gRPC code and message in ONE place.
//!
//! etcd clients match errors on their code and message (`etcdserver: requested lease not
//! found`, `mvcc: required revision has been compacted`, ...): the Go client turns known
//! messages back into typed errors, and tools compare them. So the messages here are etcd's,
//! word for word, wherever etcd has one; leasecore's own detail follows where it helps.
//!
//! Errors arrive as the `/v1` API's [`ApiError`] (so both APIs classify failures the same
//! way) and leave as a [`tonic::Status`].

use tonic::{Code, Status};

use crate::domain::history::Compacted;
use crate::http::error::{ApiError, MAX_KEY_BYTES_DETAIL};

/// An error on its way to an etcd client.
#[derive(Debug)]
pub enum EtcdError {
    /// A failure the `/v1` API would answer too.
    Api(ApiError),
    /// A failure only the etcd API has.
    Status(Status),
}

impl EtcdError {
    pub fn invalid(message: impl Into<String>) -> Self {
        EtcdError::Status(Status::invalid_argument(format!(
            "etcdserver: {}",
            message.into()
        )))
    }

    /// A read or watch below what the store still holds.
    pub fn compacted(_c: Compacted) -> Self {
        EtcdError::Status(Status::out_of_range(
            "etcdserver: mvcc: required revision has been compacted",
        ))
    }

    /// A read at a revision the store has not reached.
    pub fn future_revision() -> Self {
        EtcdError::Status(Status::out_of_range(
            "etcdserver: mvcc: required revision is a future revision",
        ))
    }

    pub fn lease_not_found() -> Self {
        EtcdError::Status(Status::not_found("etcdserver: requested lease not found"))
    }
}

impl<E: Into<ApiError>> From<E> for EtcdError {
    fn from(e: E) -> Self {
        EtcdError::Api(e.into())
    }
}

impl From<EtcdError> for Status {
    fn from(e: EtcdError) -> Self {
        match e {
            EtcdError::Status(s) => s,
            EtcdError::Api(e) => from_api(e),
        }
    }
}

/// The `/v1` classification, in etcd's words.
fn from_api(e: ApiError) -> Status {
    let (code, message): (Code, String) = match e.code {
        // etcd bounds a key only by the request's size: a key longer than leasecore holds is,
        // to etcd's clients, a request too large (etcd's own answer, which they recognise).
        "invalid_argument" if e.details.contains_key(MAX_KEY_BYTES_DETAIL) => {
            (Code::InvalidArgument, "request is too large".into())
        }
        "invalid_argument" => (Code::InvalidArgument, e.message),
        "too_large" => (Code::InvalidArgument, "request is too large".into()),
        "lease_not_found" => (Code::NotFound, "requested lease not found".into()),
        "lease_exists" => (Code::FailedPrecondition, "lease already exists".into()),
        "key_not_found" => (Code::InvalidArgument, "key not found".into()),
        "compacted" => (
            Code::OutOfRange,
            "mvcc: required revision has been compacted".into(),
        ),
        "future_revision" => (
            Code::OutOfRange,
            "mvcc: required revision is a future revision".into(),
        ),
        "permission_denied" => (Code::PermissionDenied, "permission denied".into()),
        "unauthenticated" => (Code::Unauthenticated, "invalid auth token".into()),
        "auth_failed" => (
            Code::InvalidArgument,
            "authentication failed, invalid user ID or password".into(),
        ),
        "auth_not_enabled" => (
            Code::FailedPrecondition,
            "authentication is not enabled".into(),
        ),
        "quota_exceeded" | "over_quota" | "insufficient_storage" => (
            Code::ResourceExhausted,
            "mvcc: database space exceeded".into(),
        ),
        // etcd has no such limit (it answers up to 2 GiB); gRPC's own code for a message
        // over a size limit is ResourceExhausted.
        "result_too_large" => (Code::ResourceExhausted, e.message),
        "too_many_requests" | "too_many_leases" => {
            (Code::ResourceExhausted, "too many requests".into())
        }
        // etcd's ErrNoLeader, also where leasecore knows more (a lost quorum, with how many
        // voters this node hears): clientv3 recognises its errors by their text.
        "no_leader" | "no_quorum" => (Code::Unavailable, "no leader".into()),
        "shutting_down" => (Code::Unavailable, "server stopped".into()),
        "bad_leader_transferee" => (Code::FailedPrecondition, "bad leader transferee".into()),
        "leader_transfer_failed" => (
            Code::Unavailable,
            "request timed out, leader transfer took too long".into(),
        ),
        // etcd's ErrTimeout: the request may or may not have taken effect.
        "outcome_unknown" | "timeout" => (Code::Unavailable, "request timed out".into()),
        "user_not_found" => (Code::FailedPrecondition, "user name not found".into()),
        "user_exists" => (Code::FailedPrecondition, "user name already exists".into()),
        "role_not_found" => (Code::FailedPrecondition, "role name not found".into()),
        "role_exists" => (Code::FailedPrecondition, "role name already exists".into()),
        "root_user_required" => (Code::FailedPrecondition, "root user does not exist".into()),
        "role_not_granted" => (
            Code::FailedPrecondition,
            "role is not granted to the user".into(),
        ),
        "permission_not_granted" => (
            Code::FailedPrecondition,
            "permission is not granted to the role".into(),
        ),
        _ if e.status.is_client_error() => (Code::FailedPrecondition, e.message),
        _ if e.status == axum::http::StatusCode::SERVICE_UNAVAILABLE => {
            (Code::Unavailable, e.message)
        }
        _ => (Code::Internal, e.message),
    };
    Status::new(code, format!("etcdserver: {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::KvError;
    use crate::raft::consensus::ConsensusError;

    #[test]
    fn etcd_messages_for_what_clients_match_on() {
        let s: Status = EtcdError::from(KvError::LeaseNotFound { lease: "x".into() }).into();
        assert_eq!(s.code(), Code::NotFound);
        assert_eq!(s.message(), "etcdserver: requested lease not found");
        let s: Status = EtcdError::from(KvError::PermissionDenied).into();
        assert_eq!(s.code(), Code::PermissionDenied);
        let s: Status = EtcdError::compacted(Compacted {
            compacted: crate::domain::types::Revision(3),
        })
        .into();
        assert_eq!(
            (s.code(), s.message()),
            (
                Code::OutOfRange,
                "etcdserver: mvcc: required revision has been compacted"
            )
        );
        // etcd's ErrNoSpace, ErrNoLeader and ErrStopped, which clientv3 recognises by their
        // text, whatever detail leasecore's own error carries.
        for (e, code, message) in [
            (
                ConsensusError::QuotaExceeded {
                    used_bytes: 2,
                    quota_bytes: 1,
                },
                Code::ResourceExhausted,
                "etcdserver: mvcc: database space exceeded",
            ),
            (
                ConsensusError::QuorumLost {
                    heard: 1,
                    voters: 3,
                    needed: 2,
                },
                Code::Unavailable,
                "etcdserver: no leader",
            ),
            (
                ConsensusError::NoQuorum,
                Code::Unavailable,
                "etcdserver: no leader",
            ),
            (
                ConsensusError::NoLeader,
                Code::Unavailable,
                "etcdserver: no leader",
            ),
            (
                ConsensusError::ShuttingDown,
                Code::Unavailable,
                "etcdserver: server stopped",
            ),
        ] {
            let s: Status = EtcdError::from(ApiError::from(e)).into();
            assert_eq!((s.code(), s.message()), (code, message));
        }
        let long = crate::domain::limits::InvalidInput::KeyTooLong("key is 1025 bytes".into());
        let s: Status = EtcdError::from(long).into();
        assert_eq!(
            (s.code(), s.message()),
            (Code::InvalidArgument, "etcdserver: request is too large")
        );
    }
}
