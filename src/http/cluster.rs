//! `/v1/cluster`: membership status and changes; `/health`, `/livez`, `/readyz` and `/metrics`.
//!
//! - `/livez`: the process is up and its Raft core runs (etcd's livez).
//! - `/readyz`: the node knows a leader it heard from within an election timeout (itself, with
//!   a fresh quorum acknowledgement, if it leads) and has applied what it knows to be committed
//!   (`domain::health::readiness`); 503 `not_ready` with the reason otherwise (etcd's readyz).
//!   A node only briefly behind on apply is given a bounded moment to catch up before it is
//!   judged, so that readiness does not flap under load.
//! - `/health`: always 200 (for old scripts), with `"status": "ok"` only when ready.
//! - `/metrics`: Prometheus text ([`metrics_text`], which the etcd port's `/metrics` serves
//!   too), with the process metrics of `metrics::ProcessStats`.

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde_json::{Value, json};

use super::AppState;
use super::error::ApiError;
use super::extract::{ApiJson, ApiPath};
use crate::domain::health::NotReady;
use crate::raft::consensus::{AdminOutcome, AdminRequest, ClusterView};
use crate::runtime::auth::Caller;
use crate::wire::{AddNodeRequest, AddNodeResponse, MoveLeaderRequest};
use axum::http::StatusCode;

/// How long `/readyz` lets a node that is only behind on apply catch up before judging it.
const READY_APPLY_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Any authenticated caller (as etcd's member list).
pub async fn status(State(state): State<AppState>, _caller: Caller) -> Json<ClusterView> {
    Json(state.cluster_view())
}

/// 200 when the node is a voter; 202 when it was added but stays a learner (it did not answer
/// or catch up in time): the answer says why, and the node can be removed or added again.
pub async fn add_node(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<AddNodeRequest>,
) -> Result<(StatusCode, Json<AddNodeResponse>), ApiError> {
    super::auth::require_root(&state, &caller)?;
    check_address(&req.address)?;
    let outcome = state
        .consensus
        .admin(AdminRequest::AddNode {
            id: req.id,
            address: req.address,
        })
        .await?;
    let id = req.id;
    // What this node's view must show before answering (a forwarded change reaches it a
    // moment after the leader): the node as a voter, as a learner, or gone.
    let (status, message, expect) = match outcome {
        AdminOutcome::Done => (StatusCode::OK, None, Some(true)),
        AdminOutcome::Learner { message } => (StatusCode::ACCEPTED, Some(message), Some(false)),
        AdminOutcome::Removed { message } => (StatusCode::ACCEPTED, Some(message), None),
    };
    let view = state.served(
        state
            .consensus
            .view_once(|v| v.nodes.iter().find(|n| n.id == id).map(|n| n.voter) == expect)
            .await,
    );
    let voter = view.nodes.iter().any(|n| n.id == id && n.voter);
    Ok((
        status,
        Json(AddNodeResponse {
            view,
            voter,
            message,
        }),
    ))
}

/// Hand the leadership to a voter (root only, as etcd's `MoveLeader`): answers the cluster
/// view once this node knows the new leader.
pub async fn move_leader(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<MoveLeaderRequest>,
) -> Result<Json<ClusterView>, ApiError> {
    super::auth::require_root(&state, &caller)?;
    let leader = state.consensus.move_leader(req.id).await?;
    let view = state
        .consensus
        .view_once(|v| v.leader_id == Some(leader))
        .await;
    Ok(Json(state.served(view)))
}

pub async fn remove_node(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<u64>,
) -> Result<Json<ClusterView>, ApiError> {
    super::auth::require_root(&state, &caller)?;
    state
        .consensus
        .admin(AdminRequest::RemoveNode { id })
        .await?;
    let view = state
        .consensus
        .view_once(|v| v.nodes.iter().all(|n| n.id != id))
        .await;
    Ok(Json(state.served(view)))
}

/// A node address is `host:port`, the form peers dial.
/// A node address a membership change may name (client and forwarded requests alike).
pub(crate) fn check_address(addr: &str) -> Result<(), ApiError> {
    let ok = addr
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0))
        && !addr.contains('/')
        && !addr.contains(char::is_whitespace);
    if !ok {
        return Err(ApiError::invalid(format!(
            "address {addr:?} must be host:port (no scheme)"
        )));
    }
    // Peers reach the node at the port + the peer offset: that port must exist.
    crate::domain::resources::peer_address(addr)
        .map(|_| ())
        .map_err(ApiError::invalid)
}

pub async fn health(State(state): State<AppState>) -> Json<Value> {
    let view = state.consensus.cluster_view();
    let mut doc = json!({
        "status": if view.ready { "ok" } else { "not_ready" },
        "node_id": view.node_id,
        "state": view.state,
        "leader_id": view.leader_id,
        "ready": view.ready,
    });
    if let Some(why) = view.not_ready {
        doc["not_ready"] = json!(why);
    }
    Json(doc)
}

/// The process is alive: it answers, and its Raft core has not stopped.
pub async fn livez(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let running = state
        .consensus
        .raft()
        .metrics()
        .borrow()
        .running_state
        .is_ok();
    if !running {
        return Err(crate::raft::consensus::ConsensusError::ShuttingDown.into());
    }
    Ok(Json(
        json!({"status": "alive", "node_id": state.consensus.id()}),
    ))
}

/// What this node's binary is (open, like etcd's `/version`: no secret, and it tells an
/// operator which nodes are upgraded).
pub async fn version() -> Json<crate::version::VersionInfo> {
    Json(crate::version::VersionInfo::of_this_build())
}

/// This node's readiness as `/readyz` judges it (see the module docs): a node only behind on
/// apply gets [`READY_APPLY_WAIT`] to catch up first. etcd's `/health` on the etcd port asks
/// this too (`etcd::probes`).
pub async fn ready(state: &AppState) -> Result<(), NotReady> {
    let consensus = &state.consensus;
    let mut verdict = consensus.readiness();
    if let Err(NotReady::Applying { commit_index, .. }) = verdict {
        consensus
            .view()
            .wait_applied(commit_index, READY_APPLY_WAIT)
            .await;
        verdict = consensus.readiness();
    }
    verdict
}

/// The node is ready to serve (see the module docs).
pub async fn readyz(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    ready(&state).await?;
    let consensus = &state.consensus;
    let view = consensus.cluster_view();
    Ok(Json(json!({
        "status": "ready",
        "node_id": view.node_id,
        "state": view.state,
        "leader_id": view.leader_id,
        "applied_index": view.applied_index,
    })))
}

/// The content type of Prometheus' text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4";

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        metrics_text(&state).await,
    )
}

/// This node's metrics in Prometheus text: what `/metrics` answers on the client port and on
/// the etcd port (`etcd::probes`).
pub async fn metrics_text(state: &AppState) -> String {
    // A walk of the data directory and reads of /proc: file system calls, off the async
    // workers.
    let consensus = state.consensus.clone();
    let (process, data_dir_bytes) = tokio::task::spawn_blocking(move || {
        (
            crate::metrics::ProcessStats::read(),
            consensus.data_dir_bytes(),
        )
    })
    .await
    .unwrap_or_default();
    let v = state.consensus.cluster_view();
    let (history_keys, history_versions) = state.consensus.view().history_size();
    let is_leader = if v.leader_id == Some(v.node_id) && v.state == "leader" {
        1.0
    } else {
        0.0
    };
    let gauges = [
        (
            "leasecore_is_leader",
            "1 if this node is the Raft leader.",
            is_leader,
        ),
        (
            "leasecore_ready",
            "1 if this node is ready (as /readyz judges, without its wait for apply).",
            if v.ready { 1.0 } else { 0.0 },
        ),
        (
            "leasecore_vote_withheld",
            "1 while this node withholds its vote and does not campaign (it joined with an \
             empty data dir and the cluster does not list it as a non-voter yet: \
             raft::vote_hold).",
            if state.consensus.vote_withheld() {
                1.0
            } else {
                0.0
            },
        ),
        (
            "leasecore_raft_term",
            "The current Raft term.",
            v.term as f64,
        ),
        (
            "leasecore_raft_commit_index",
            "The highest log index known committed.",
            v.commit_index as f64,
        ),
        (
            "leasecore_raft_applied_index",
            "The highest log index applied to the state machine.",
            v.applied_index as f64,
        ),
        (
            "leasecore_raft_last_log_index",
            "The last log index on this node.",
            v.last_log_index as f64,
        ),
        (
            "leasecore_store_revision",
            "The store revision.",
            v.revision.0 as f64,
        ),
        (
            "leasecore_history_floor_revision",
            "The lowest revision this node reads at (the compaction mark; above it while the \
             history before a snapshot this node installed is being filled in from a peer).",
            state.consensus.view().history_floor().0 as f64,
        ),
        (
            "leasecore_history_keys",
            "Keys with a version in this node's history (its key index).",
            history_keys as f64,
        ),
        (
            "leasecore_history_versions",
            "Versions held in this node's history, tombstones included (its key index, in \
             memory: compaction bounds it).",
            history_versions as f64,
        ),
        (
            "leasecore_peer_streams_open",
            "Peer streams this node serves now (connections upgraded from its peer port, \
             counted apart from leasecore_peer_connections_open).",
            state.peer_streams.open() as f64,
        ),
        (
            "leasecore_cluster_nodes",
            "Nodes in the membership (voters and learners).",
            v.nodes.len() as f64,
        ),
        (
            "leasecore_storage_used_bytes",
            "Bytes the storage quota counts: live keys and values plus the Raft log.",
            state.consensus.storage_used() as f64,
        ),
        (
            "leasecore_storage_quota_bytes",
            "The storage quota; past it writes get 507 quota_exceeded.",
            state.consensus.quota().max_bytes as f64,
        ),
        (
            "leasecore_raft_log_bytes",
            "Bytes of the stored Raft log entries.",
            state.consensus.log_bytes() as f64,
        ),
        (
            "leasecore_data_dir_bytes",
            "Disk space taken by the data directory (allocated blocks, as du counts them).",
            data_dir_bytes as f64,
        ),
    ];
    let (history_events, history_bytes, compacted, waiting) = state.watch.stats();
    let gauges: Vec<(&str, &str, f64)> = gauges
        .into_iter()
        .chain([
            (
                "leasecore_watch_history_events",
                "Events retained for watches.",
                history_events as f64,
            ),
            (
                "leasecore_watch_history_bytes",
                "Bytes retained for watches (estimated).",
                history_bytes as f64,
            ),
            (
                "leasecore_watch_compact_revision",
                "Events at or below this revision are no longer retained.",
                compacted.0 as f64,
            ),
            (
                "leasecore_watch_waiting",
                "Long polls waiting for a change.",
                waiting as f64,
            ),
        ])
        .chain(process.resident_memory_bytes.map(|rss| {
            (
                "leasecore_process_resident_memory_bytes",
                "Resident memory of this process (Linux; the same as \
                 process_resident_memory_bytes).",
                rss as f64,
            )
        }))
        .collect();
    let mut text = state.metrics.render(&gauges);
    render_lease_metrics(state, &mut text);
    render_flease_metrics(state, &mut text);
    process.render(&mut text);
    text
}

fn render_flease_metrics(state: &AppState, out: &mut String) {
    use crate::domain::flease::Protocol;
    use std::fmt::Write;
    use std::sync::atomic::Ordering::Relaxed;
    let f = &state.flease;
    let protos = [Protocol::Flease, Protocol::PaxosLease];
    let stats = protos.map(|p| f.stats(p));
    let m = protos.map(|p| f.metrics(p));
    let both = |g: &dyn Fn(usize) -> u64| [g(0), g(1)];
    for (name, kind, help, v) in [
        (
            "leasecore_flease_cells",
            "gauge",
            "Acceptor cells held (resources touched recently or still leased).",
            both(&|i| stats[i].0 as u64),
        ),
        (
            "leasecore_flease_recovering",
            "gauge",
            "1 while the acceptor waits out its restart wait.",
            both(&|i| u64::from(stats[i].3)),
        ),
        (
            "leasecore_flease_rounds_total",
            "counter",
            "Rounds run by this node.",
            both(&|i| m[i].rounds.load(Relaxed)),
        ),
        (
            "leasecore_flease_granted_total",
            "counter",
            "Acquisitions and renewals granted.",
            both(&|i| m[i].granted.load(Relaxed)),
        ),
        (
            "leasecore_flease_renewals_total",
            "counter",
            "Grants that extended the owner's tenure (same epoch).",
            both(&|i| m[i].renewals.load(Relaxed)),
        ),
        (
            "leasecore_flease_busy_total",
            "counter",
            "Acquisitions that found another holder (contention).",
            both(&|i| m[i].busy.load(Relaxed)),
        ),
        (
            "leasecore_flease_released_total",
            "counter",
            "Releases committed.",
            both(&|i| m[i].released.load(Relaxed)),
        ),
        (
            "leasecore_flease_retries_total",
            "counter",
            "Rounds retried (NACK, timeout, doubt window).",
            both(&|i| m[i].retries.load(Relaxed)),
        ),
        (
            "leasecore_flease_nacks_total",
            "counter",
            "NACKs sent by this acceptor.",
            both(&|i| stats[i].1),
        ),
        (
            "leasecore_flease_clock_skew_suspicions_total",
            "counter",
            "Messages stamped more than eps in the future (Flease only).",
            both(&|i| stats[i].2),
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (p, v) in protos.iter().zip(v) {
            let _ = writeln!(out, "{name}{{protocol=\"{}\"}} {v}", p.name());
        }
    }
}

fn render_lease_metrics(state: &AppState, out: &mut String) {
    use std::fmt::Write;
    use std::sync::atomic::Ordering::Relaxed;
    let hub = state.leases.hub();
    let m = &hub.metrics;
    let active = state.consensus.view().with_state(|kv| kv.leases().len());
    let _ = writeln!(
        out,
        "# HELP leasecore_leases_active Leases in the replicated state.\n# TYPE leasecore_leases_active gauge\nleasecore_leases_active {active}"
    );
    let _ = writeln!(
        out,
        "# HELP leasecore_leases_tracked Leases with a deadline on this node (the leader).\n# TYPE leasecore_leases_tracked gauge\nleasecore_leases_tracked {}",
        hub.tracked()
    );
    for (name, help, v) in [
        (
            "leasecore_leases_granted_total",
            "Lease registrations applied.",
            &m.granted,
        ),
        (
            "leasecore_leases_refreshed_total",
            "Refreshes acknowledged by this node as leader.",
            &m.refreshed,
        ),
        (
            "leasecore_leases_expired_total",
            "Lease expiries applied.",
            &m.expired,
        ),
        (
            "leasecore_leases_revoked_total",
            "Lease revocations applied.",
            &m.revoked,
        ),
        (
            "leasecore_lease_housekeeping_held_total",
            "Times the leader held back lease expiries and checkpoints because its followers were not keeping up.",
            &m.housekeeping_held,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
            v.load(Relaxed)
        );
    }
    let name = "leasecore_lease_expiry_lateness_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Applied expiry minus deadline, on the leader.\n# TYPE {name} histogram"
    );
    m.lateness
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .render(out, name, "");
}
