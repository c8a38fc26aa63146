//! The JSON documents of the client API, shared by the HTTP server and the Rust client.
//!
//! `api/openapi.yaml` describes these shapes; a test checks that the document and the router
//! agree. Request documents reject unknown fields, so a misspelt field is an error, not a
//! silently ignored option.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::types::{NodeId, Revision};

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

/// Body of `POST /v1/cluster/leader`: the node that is to lead.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveLeaderRequest {
    pub id: NodeId,
}

/// Answer of `POST /v1/cluster/nodes`: the cluster view after the change, whether the node is
/// a voter, and (when it stayed a learner: status 202) why.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AddNodeResponse {
    #[serde(flatten)]
    pub view: ClusterView,
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
    pub events: Vec<Event>,
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
    pub members: Vec<MemberRecord>,
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

// ---- Documents the server builds from its own state -------------------------------------

/// One key's current value and its history counters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versioned {
    pub value: String,
    pub create_revision: Revision,
    pub mod_revision: Revision,
    pub version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
}

/// Why a key changed: what a watcher sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    Client,
    LeaseExpired,
    LeaseRevoked,
}

/// The kind of change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Put,
    Delete,
}

/// One change to one key, at its own revision. Events are produced only by apply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    #[serde(rename = "type")]
    pub kind: EventKind,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    pub revision: Revision,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    pub cause: Cause,
    /// A put's key as it is after it: the revision that created it and its version (absent on
    /// deletes, and in events recorded before these fields existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create_revision: Option<Revision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
}

/// Which lease protocol a register, a round and a message belong to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// Absolute expiries on loosely synchronized wall clocks.
    #[default]
    Flease,
    /// Relative timespans, each node timing on its own monotonic clock.
    PaxosLease,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Flease => "flease",
            Protocol::PaxosLease => "paxoslease",
        }
    }
}

/// The answer to an acquire (and to a read of a resource).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseView {
    pub resource: String,
    /// Whether the asking owner holds it (acquire only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub granted: Option<bool>,
    /// The current holder, if any.
    pub holder: Option<String>,
    /// How long the holder may still act, from the time of this answer (already reduced by
    /// the clock-skew bound).
    pub valid_ms: u64,
    pub epoch: u64,
}

/// A refresh acknowledgement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefreshAck {
    pub name: String,
    pub ttl_ms: u64,
    pub remaining_ms: u64,
}

/// One node of the membership.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberNode {
    pub id: NodeId,
    pub address: String,
    pub voter: bool,
    #[serde(flatten, default)]
    pub status: MemberStatus,
}

/// This node's view of the cluster.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterView {
    pub node_id: NodeId,
    pub state: String,
    pub leader_id: Option<NodeId>,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_log_index: u64,
    pub revision: Revision,
    pub nodes: Vec<MemberNode>,
    /// Whether this node is ready (`domain::health::readiness`), and why not.
    #[serde(default)]
    pub ready: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<NotReady>,
    /// On the leader: milliseconds since a quorum last acknowledged it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quorum_ack_ms: Option<u64>,
    /// This node's etcd client URL (`--etcd-listen`), if it serves the etcd API: what the
    /// other members' etcd `MemberList` shows for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_url: Option<String>,
}

/// Why a node is not ready.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum NotReady {
    /// No leader is known.
    NoLeader,
    /// This node leads but has not heard from a quorum recently.
    NoQuorum { quorum_ack_age_ms: Option<u64> },
    /// This node follows a leader it has not heard from recently.
    LeaderSilent {
        leader_id: NodeId,
        contact_age_ms: Option<u64>,
    },
    /// This node has not applied everything it knows to be committed.
    Applying {
        applied_index: u64,
        commit_index: u64,
    },
}

/// A user as read answers show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserInfo {
    pub name: String,
    pub roles: Vec<String>,
}

/// A role as read answers show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleInfo {
    pub name: String,
    pub permissions: Vec<Permission>,
}

/// What a grant allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PermKind {
    Read,
    Write,
    Readwrite,
}

/// One grant of a role: `kind` on `key`, or on every key starting with `key` if `prefix`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Permission {
    pub kind: PermKind,
    pub key: String,
    #[serde(default)]
    pub prefix: bool,
}

/// Per-member status in [`ClusterView`], as this node knows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberStatus {
    /// Heard from within an election timeout (`None`: this node has no way to know).
    pub reachable: Option<bool>,
    /// Milliseconds since this node last heard from the member.
    pub last_contact_ms: Option<u64>,
    /// Entries of the leader's log the member has not acknowledged (known on the leader only).
    pub lag: Option<u64>,
    /// The last log index the member acknowledged (known on the leader only).
    pub matched_index: Option<u64>,
}

/// What a member key holds (its value, as JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub id: String,
    pub address: String,
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
}

impl MemberRecord {
    /// The canonical value of the member key (deterministic: `meta` is ordered).
    pub fn encode(&self) -> String {
        serde_json::to_string(self).expect("plain data serializes")
    }

    pub fn decode(value: &str) -> Option<MemberRecord> {
        serde_json::from_str(value).ok()
    }
}

// ---- Locks and elections ---------------------------------------------------------------

/// Body of `POST /v1/locks/{name}` and `POST /v1/elections/{name}/campaign`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContendRequest {
    /// The contender's lease: the key goes with it.
    pub lease: String,
    /// Stored in the contender's key (for an election, the leader's value).
    #[serde(default)]
    pub value: String,
    /// How long to wait for the lock (leadership) in this call, in ms.
    pub timeout_ms: Option<u64>,
}

/// Body of `PUT /v1/elections/{name}/proclaim`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProclaimRequest {
    pub lease: String,
    pub value: String,
}

/// Body of `POST /v1/elections/{name}/resign`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRef {
    pub lease: String,
}

/// Where a contender stands: the answer of a lock or a campaign.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Standing {
    pub name: String,
    /// The contender's key.
    pub key: String,
    pub lease: String,
    /// Whether it holds the lock (leads the election).
    pub held: bool,
    /// Its key's create revision: the fencing token once it holds.
    pub revision: Revision,
    /// While queued: the key it waits for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
}

/// `GET /v1/elections/{name}`: the leader.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Leadership {
    pub name: String,
    pub key: String,
    pub lease: String,
    pub value: String,
    /// The leader key's create revision (its term, as a fencing token).
    pub revision: Revision,
    /// The value's revision (what a proclaim changes).
    pub mod_revision: Revision,
    /// The store revision of the read: watch `elections/<name>/` from here + 1 for changes.
    pub store_revision: Revision,
}

/// Answer to an unlock or a resign.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Released {
    pub name: String,
    pub key: String,
    pub revision: Revision,
    /// Whether the key was there.
    pub released: bool,
}

/// Answer to a proclaim.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Proclaimed {
    pub name: String,
    pub key: String,
    pub revision: Revision,
}
