//! The JSON documents of the client API, shared by the HTTP server and the Rust client.
//!
//! `api/openapi.yaml` describes these shapes; a test checks that the document and the router
//! agree. Request documents reject unknown fields, so a misspelt field is an error, not a
//! silently ignored option.

use serde::{Deserialize, Serialize};

use crate::domain::kv::Versioned;
use crate::domain::types::{NodeId, Revision};

/// Body of `PUT /v1/kv/{key}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PutRequest {
    pub value: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
}

/// Answer to a successful put.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PutResponse {
    pub revision: Revision,
}

/// One key with its counters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyValue {
    pub key: String,
    pub value: String,
    pub create_revision: Revision,
    pub mod_revision: Revision,
    pub version: u64,
    pub lease: Option<String>,
}

impl KeyValue {
    pub fn new(key: String, v: Versioned) -> Self {
        KeyValue {
            key,
            value: v.value,
            create_revision: v.create_revision,
            mod_revision: v.mod_revision,
            version: v.version,
            lease: v.lease,
        }
    }
}

/// Answer to `GET /v1/kv/{key}`: the key, plus the store revision it was read at.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GetResponse {
    #[serde(flatten)]
    pub kv: KeyValue,
    /// The store revision at the time of the read.
    pub revision: Revision,
}

/// Answer to `GET /v1/kv?prefix=...`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ListResponse {
    pub revision: Revision,
    pub items: Vec<KeyValue>,
    /// True when `limit` cut the listing short.
    #[serde(default)]
    pub more: bool,
}

/// Answer to `DELETE /v1/kv/{key}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeleteResponse {
    pub revision: Revision,
    pub deleted: u32,
}

/// Body of `POST /v1/cluster/nodes`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddNodeRequest {
    pub id: NodeId,
    pub address: String,
}

/// Answer of `POST /v1/cluster/nodes`: the cluster view after the change, whether the node is
/// a voter, and (when it stayed a learner: status 202) why.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AddNodeResponse {
    #[serde(flatten)]
    pub view: crate::raft::consensus::ClusterView,
    pub voter: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The error document: `{"error": {"code", "message", ...details}}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// The inside of an error document.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    #[serde(flatten)]
    pub details: serde_json::Map<String, serde_json::Value>,
}

/// Body of `POST /v1/leases`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterLeaseRequest {
    pub name: String,
    pub ttl_ms: u64,
}

/// Answer to a registration: `revision` is the lease's fencing token.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeaseGranted {
    pub name: String,
    pub ttl_ms: u64,
    pub revision: Revision,
}

/// One lease as `GET /v1/leases/{name}` and `GET /v1/leases` show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    pub name: String,
    pub ttl_ms: u64,
    /// Time left on the leader's clock (`null` while no leader tracks it).
    pub remaining_ms: Option<u64>,
    /// The registration revision (fencing token).
    pub revision: Revision,
    pub keys: Vec<String>,
}

/// Answer to `GET /v1/leases`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeaseList {
    pub revision: Revision,
    pub leases: Vec<LeaseInfo>,
    #[serde(default)]
    pub more: bool,
}

/// Answer to `DELETE /v1/leases/{name}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LeaseRevoked {
    pub revision: Revision,
    pub deleted_keys: Vec<String>,
}

/// Answer to `GET /v1/watch` (long-poll form).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WatchResponse {
    /// Every matching event up to this revision is included: resume from `revision + 1`.
    pub revision: Revision,
    pub events: Vec<crate::domain::command::Event>,
}

/// Body of `POST /v1/members`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterMemberRequest {
    pub id: String,
    pub address: String,
    pub ttl_ms: u64,
    #[serde(default)]
    pub meta: std::collections::BTreeMap<String, String>,
}

/// Answer to a member registration.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemberRegistered {
    pub id: String,
    pub lease: String,
    pub key: String,
    /// The revision of the member key (the lease's is one less).
    pub revision: Revision,
}

/// Answer to a heartbeat.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    pub id: String,
    pub ttl_ms: u64,
    pub remaining_ms: u64,
}

/// Answer to `DELETE /v1/members/{id}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemberLeft {
    pub id: String,
    pub revision: Revision,
}

/// Answer to `GET /v1/members`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemberList {
    pub revision: Revision,
    pub members: Vec<crate::domain::members::MemberRecord>,
}

/// Body of `POST /v1/auth/authenticate` and of `POST /v1/auth/users`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub name: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Answer to `POST /v1/auth/authenticate`.
#[derive(Clone, Serialize, Deserialize)]
pub struct TokenResponse {
    pub token: String,
    pub user: String,
    /// When the token expires, unix milliseconds.
    pub expires_at_ms: u64,
}

impl std::fmt::Debug for TokenResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenResponse")
            .field("user", &self.user)
            .field("expires_at_ms", &self.expires_at_ms)
            .finish_non_exhaustive()
    }
}

/// Body of `PUT /v1/auth/users/{name}/password`.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PasswordRequest {
    pub password: String,
}

/// Body of `POST /v1/auth/roles`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleRequest {
    pub name: String,
}

/// `GET /v1/auth/status`, and the answer to enable and disable.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AuthStatus {
    pub enabled: bool,
    pub auth_revision: u64,
}

/// The answer to a change of users or roles.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AuthChanged {
    pub auth_revision: u64,
}

/// `GET /v1/auth/users`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct UserList {
    pub users: Vec<String>,
}

/// `GET /v1/auth/roles`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RoleList {
    pub roles: Vec<String>,
}
