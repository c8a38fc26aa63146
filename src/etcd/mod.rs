//! etcd v3's gRPC API, served on its own listener (`--etcd-listen`): an adapter that
//! translates etcd's requests into the same calls the `/v1` handlers make (proposals through
//! consensus, read barriers, the watch hub, the lease service) and their answers back.
//!
//! # Mapping
//! - Values are bytes, as in etcd: each is stored with [`value_bytes::store`] (UTF-8 that does
//!   not begin with NUL as it is, anything else as NUL and its base64) and answered with
//!   [`value_bytes::bytes`], wherever a value goes in or out (puts, txn puts and compares,
//!   ranges, `prev_kv`, watch events, election values).
//! - Keys are bytes too: each is stored with [`key_bytes::store`] (UTF-8 that does not begin
//!   with NUL as it is, anything else as NUL and its hex) and answered with
//!   [`key_bytes::bytes`]; ranges, watches and permissions match them by their raw bytes, and
//!   ranges answer in raw key order. Lock and election names, and permission keys, are UTF-8
//!   text in leasecore: one that is not is refused (`InvalidArgument`).
//! - A `Put`, a `DeleteRange` and a `Txn` are each one [`crate::domain::command::Command::Txn`]: one revision, one
//!   event per changed key, `prev_kv` read at apply time.
//! - etcd's int64 lease ids are leasecore leases named `etcd-<id as 16 hex digits>` (see
//!   [`lease_name`]); TTLs are whole seconds here and milliseconds inside. Keys attached to a
//!   lease registered through `/v1` under another name show lease 0.
//! - Response headers carry [`CLUSTER_ID`], this node's id as `member_id`, the store revision
//!   and the Raft term.
//! - Errors become etcd's gRPC codes and messages in one place ([`status`]).
//!
//! # What it must not do
//! Decide anything: validation rules, authorization and apply semantics are the domain's, and
//! the `/v1` helpers it calls are the same ones the HTTP handlers use.

mod auth;
pub mod authority;
pub mod client_urls;
mod cluster;
mod election;
mod gateway;
mod grpc_health;
mod kv;
pub(crate) mod learner;
mod lease;
mod lock;
mod permission;
mod probes;
mod reflection;
pub mod status;
mod watch;

use std::sync::Arc;

use axum::Router;
use leasecore_etcd_api::etcdserverpb::ResponseHeader;
use leasecore_etcd_api::etcdserverpb::cluster_server::ClusterServer;
use leasecore_etcd_api::etcdserverpb::kv_server::KvServer;
use leasecore_etcd_api::etcdserverpb::lease_server::LeaseServer;
use leasecore_etcd_api::etcdserverpb::maintenance_server::MaintenanceServer;
use leasecore_etcd_api::etcdserverpb::watch_server::WatchServer;
use leasecore_etcd_api::mvccpb;

use crate::domain::kv::Versioned;
use crate::domain::types::Revision;
use crate::domain::{key_bytes, value_bytes};
use crate::http::AppState;
use crate::runtime::auth::Caller;

pub use status::EtcdError;

/// The cluster id every response header carries. leasecore has no per-cluster id yet; a fixed
/// one keeps headers well-formed (clients only compare it between responses).
pub const CLUSTER_ID: u64 = 0x6c65_6173_6563_6f72;

/// The etcd version leasecore speaks, as `Maintenance.Status` and `GET /version` report it.
pub const ETCD_VERSION: &str = "3.5.17";

/// The largest gRPC message accepted or sent (etcd's `--max-request-bytes` default is 1.5 MiB;
/// values may be up to the configured limit, so allow a little more than that).
const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Room, beyond what a read's answer may hold ([`crate::domain::limits::Limits`]'s
/// `max_read_answer_bytes`, refused before it is built beyond), for the headers of a Txn's
/// 128 operations, so that no admitted answer fails to encode.
const KV_ANSWER_FRAMING_BYTES: usize = 1 << 20;

/// The largest watch response sent: etcd's (`grpc.MaxSendMsgSize(math.MaxInt32)`). Watch
/// responses are bounded by bytes ([`watch`]'s module docs) except one revision too large
/// alone, which a watcher that did not ask for fragments must get whole to get past it.
pub(crate) const MAX_WATCH_SEND_BYTES: usize = i32::MAX as usize;

/// What every service shares: the node's state.
#[derive(Clone)]
pub struct Etcd {
    state: AppState,
    /// The other members' etcd URLs, as `MemberList` shows them (this node's own is
    /// `state.etcd_url`).
    client_urls: Arc<client_urls::ClientUrls>,
    /// What the node's watch streams share (`watch::WatchBudget`).
    watch_budget: watch::WatchBudget,
    /// Turns for the reads whose answers are large (`kv::LARGE_READS_AT_ONCE`).
    large_reads: Arc<tokio::sync::Semaphore>,
}

/// etcd's gRPC metadata key by which a call asks for a member with a leader (Go's
/// `clientv3.WithRequireLeader`; Kubernetes sets it on every watch).
const REQUIRE_LEADER_KEY: &str = "hasleader";

/// The same metadata through etcd's JSON gateway: grpc-gateway hands a `Grpc-Metadata-<name>`
/// HTTP header to the gRPC call as metadata `<name>`.
const GATEWAY_REQUIRE_LEADER_KEY: &str = "grpc-metadata-hasleader";

/// Whether a request carries `hasleader: true` (as gRPC metadata, or as the gateway's header).
fn requires_leader(headers: &axum::http::HeaderMap) -> bool {
    [REQUIRE_LEADER_KEY, GATEWAY_REQUIRE_LEADER_KEY]
        .iter()
        .any(|key| headers.get(*key).is_some_and(|v| v.as_bytes() == b"true"))
}

/// etcd's answer to a `hasleader` call on a member without a leader: the one mapping of
/// `NoLeader` to etcd's status ([`status`]).
fn no_leader() -> tonic::Status {
    EtcdError::from(crate::raft::consensus::ConsensusError::NoLeader).into()
}

/// A gRPC call with `hasleader: true` on a member that knows no leader is refused at once,
/// before its service sees it, as etcd's interceptor refuses it (the client then tries another
/// member). A watch stream opened with it also ends once the member has been without a leader
/// for a while ([`watch`]).
async fn refuse_leaderless(
    axum::extract::State(etcd): axum::extract::State<Etcd>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    match etcd.refusal_for_no_leader(req.headers()) {
        Some(status) => status.into_http::<axum::body::Body>(),
        None => next.run(req).await,
    }
}

impl Etcd {
    /// Whether this member has no leader, as etcd's `hasleader` means it: none known, a
    /// leader that lost its quorum, or one this follower has not heard from within an election
    /// timeout. A member still applying what it has committed has one.
    fn leaderless(&self) -> bool {
        use crate::domain::health::NotReady;
        matches!(
            self.state.consensus.readiness(),
            Err(NotReady::NoLeader | NotReady::NoQuorum { .. } | NotReady::LeaderSilent { .. })
        )
    }

    /// The refusal of a call that asks for a member with a leader (`hasleader`, as metadata
    /// or the gateway's header) on this one, if it has none; the one check of both the gRPC
    /// services and the gateway, which each answer it in their own shape.
    fn refusal_for_no_leader(&self, headers: &axum::http::HeaderMap) -> Option<tonic::Status> {
        (requires_leader(headers) && self.leaderless()).then(no_leader)
    }

    /// A response header as of `revision`.
    fn header_at(&self, revision: Revision) -> Option<ResponseHeader> {
        Some(ResponseHeader {
            cluster_id: CLUSTER_ID,
            member_id: self.state.consensus.id(),
            revision: revision.0 as i64,
            raft_term: self.state.consensus.raft().metrics().borrow().current_term,
        })
    }

    /// A response header as of this node's applied revision.
    fn header(&self) -> Option<ResponseHeader> {
        self.header_at(self.state.consensus.view().applied().revision)
    }

    /// Who sent `req`: etcd clients send their token, bare, in the `token` metadata (the
    /// gateway's callers in `Authorization`, bare or as `Bearer <token>`).
    /// Check `cmd` (`admit`), authorize it for `caller` (`guard`) and propose it: what every
    /// write through the etcd API goes through, as `/v1`'s do.
    async fn submit(
        &self,
        caller: &Caller,
        cmd: crate::domain::command::Command,
    ) -> Result<crate::domain::command::Response, EtcdError> {
        crate::http::kv::admit(&self.state, &cmd)?;
        let cmd = crate::http::auth::guard(&self.state, caller, cmd)?;
        Ok(crate::http::kv::propose(&self.state, cmd).await?)
    }

    fn caller<T>(&self, req: &tonic::Request<T>) -> Result<Caller, EtcdError> {
        let md = req.metadata();
        let header = md
            .get("token")
            .or_else(|| md.get("authorization"))
            .map(|v| {
                let raw = v.as_bytes();
                if raw.starts_with(b"Bearer ") {
                    raw.to_vec()
                } else {
                    [b"Bearer ".as_slice(), raw].concat()
                }
            });
        match (header, self.state.auth.caller(None)) {
            // Auth is on and no token came: etcd's ErrUserEmpty, which clients do not retry
            // (an invalid token they refresh and retry, about a hundred times).
            (None, Err(_)) => Err(EtcdError::Status(tonic::Status::invalid_argument(
                "etcdserver: user name is empty",
            ))),
            (None, Ok(anonymous)) => Ok(anonymous),
            (Some(header), _) => Ok(self.state.auth.caller(Some(&header))?),
        }
    }
}

/// The etcd API's router: the gRPC services (HTTP/2), etcd's JSON gateway (`/v3/...`,
/// `GET /version`), its plain `GET /health` and `GET /metrics` ([`probes`]), gRPC's health
/// service ([`grpc_health`]) and server reflection ([`reflection`]), to be served by a
/// listener that speaks both HTTP/1 and HTTP/2.
pub fn router(state: AppState) -> Router {
    let probes = probes::routes(state.clone());
    let client_urls = client_urls::ClientUrls::new(
        state.consensus.peers().clone(),
        Arc::new(crate::clock::SystemClock::new()),
    );
    let etcd = Etcd {
        state,
        client_urls: Arc::new(client_urls),
        watch_budget: watch::WatchBudget::new(),
        large_reads: Arc::new(tokio::sync::Semaphore::new(kv::LARGE_READS_AT_ONCE)),
    };
    let routes = tonic::service::Routes::new(
        KvServer::new(etcd.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(
                etcd.state.limits.max_read_answer_bytes + KV_ANSWER_FRAMING_BYTES,
            ),
    )
    .add_service(
        WatchServer::new(etcd.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_WATCH_SEND_BYTES),
    )
    .add_service(LeaseServer::new(etcd.clone()))
    .add_service(ClusterServer::new(etcd.clone()))
    .add_service(MaintenanceServer::new(etcd.clone()))
    .add_service(leasecore_etcd_api::etcdserverpb::auth_server::AuthServer::new(etcd.clone()))
    .add_service(leasecore_etcd_api::v3lockpb::lock_server::LockServer::new(
        etcd.clone(),
    ))
    .add_service(
        leasecore_etcd_api::v3electionpb::election_server::ElectionServer::new(etcd.clone()),
    )
    .add_service(grpc_health::server(etcd.state.clone()));
    reflection::add_to(routes)
        .into_axum_router()
        .layer(axum::middleware::from_fn_with_state(
            etcd.clone(),
            refuse_leaderless,
        ))
        .merge(gateway::routes(etcd))
        .merge(probes)
        .fallback(gateway::unrouted)
}

/// The lease name of etcd lease `id`: `etcd-` and its 16 lowercase hex digits. Written by
/// hand rather than with `format!`, whose machinery cost a keepalive about 3% of its
/// instructions on the leader (every keepalive names its lease).
pub fn lease_name(id: i64) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut name = String::with_capacity(5 + 16);
    name.push_str("etcd-");
    let id = id as u64;
    for shift in (0..16).rev() {
        name.push(DIGITS[((id >> (4 * shift)) & 0xf) as usize] as char);
    }
    name
}

/// The etcd id of lease `name` (0 for leases not named by [`lease_name`]).
pub fn lease_id(name: &str) -> i64 {
    name.strip_prefix("etcd-")
        .filter(|hex| hex.len() == 16)
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
        .map_or(0, |id| id as i64)
}

/// etcd's view of one key.
fn key_value(key: &str, v: &Versioned) -> mvccpb::KeyValue {
    mvccpb::KeyValue {
        key: key_bytes::bytes(key).into_owned(),
        create_revision: v.create_revision.0 as i64,
        mod_revision: v.mod_revision.0 as i64,
        version: v.version as i64,
        value: value_bytes::bytes(&v.value).into_owned(),
        lease: v.lease.as_deref().map_or(0, lease_id),
    }
}

/// Bytes that must be UTF-8 text (a key, a lock or election name). Values are bytes:
/// [`value_bytes::store`].
fn text(what: &str, bytes: Vec<u8>) -> Result<String, EtcdError> {
    String::from_utf8(bytes).map_err(|_| {
        EtcdError::invalid(format!(
            "leasecore stores {what}s as UTF-8 text; this {what} is not"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_ids_round_trip_through_names() {
        for id in [1i64, 0x7fff_ffff_ffff_ffff, 42, -1] {
            assert_eq!(lease_id(&lease_name(id)), id);
        }
        assert_eq!(lease_id("members/n1"), 0);
        assert_eq!(lease_id("etcd-12"), 0);
    }

    proptest::proptest! {
        /// The name is what `format!("etcd-{:016x}")` gives (the names stored so far).
        #[test]
        fn a_lease_name_is_its_ids_sixteen_hex_digits(id in proptest::prelude::any::<i64>()) {
            proptest::prop_assert_eq!(lease_name(id), format!("etcd-{:016x}", id as u64));
            proptest::prop_assert_eq!(lease_id(&lease_name(id)), id);
        }
    }
}
