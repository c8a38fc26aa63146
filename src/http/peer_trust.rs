//! The peer port's gate: every peer route but the open ones (`http::OPEN_PEER_ROUTES`: the
//! status document a starting node asks for) admits only messages whose sender (the
//! `x-leasecore-node` header) is a member of this node's current membership
//! (`domain::peer_trust::admit_sender`), and hands the sender to the handler, which checks the
//! body's claims against it. This file reads the facts the rules need (membership, contact
//! ages) and answers refusals; the rules are in `domain::peer_trust`.
//!
//! A refusal is a 403 `peer_refused` JSON error (with `reason`), counted in
//! `leasecore_peer_refused_total{reason}` and logged at the 1st, 2nd, 4th, 8th, ... refusal of
//! each reason (bounded log volume under a flood, no clock needed). Nothing from the body is
//! ever logged: only the reason, the route and the sender id when it parsed.
//!
//! # What it must not do
//! Decide (the rules are pure), or let a message through to a handler without a sender.

use std::collections::BTreeSet;

use axum::extract::{MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use openraft::ServerState;

use super::AppState;
use super::error::ApiError;
use crate::domain::peer_trust::{Refusal, SENDER_HEADER, VoteContext, admit_sender};
use crate::domain::types::NodeId;
use crate::raft::consensus::Consensus;

/// The admitted sender of a peer message (a request extension set by [`gate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerSender(pub NodeId);

/// Admit a peer message or refuse it.
pub async fn gate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let header = req
        .headers()
        .get(SENDER_HEADER)
        .and_then(|v| v.to_str().ok());
    match admit_sender(header, &member_ids(&state.consensus)) {
        Ok(sender) => {
            req.extensions_mut().insert(PeerSender(sender));
            next.run(req).await
        }
        Err(why) => {
            let sender = header.and_then(|h| h.trim().parse::<NodeId>().ok());
            let route = req
                .extensions()
                .get::<MatchedPath>()
                .map_or("unmatched", |p| p.as_str())
                .to_string();
            refuse(&state, why, sender, &route).into_response()
        }
    }
}

/// Count and (rate-limited) log a refusal; the 403 answer for it.
pub fn refuse(state: &AppState, why: Refusal, sender: Option<NodeId>, route: &str) -> ApiError {
    record(state, why, sender, route, &why.to_string());
    ApiError::new(StatusCode::FORBIDDEN, "peer_refused", why.to_string())
        .with("reason", why.label())
}

/// Count and (rate-limited) log a refusal answered otherwise (a vote not granted, a Flease
/// message left without an answer). `detail` must not quote the message body.
pub fn record(state: &AppState, why: Refusal, sender: Option<NodeId>, route: &str, detail: &str) {
    let n = state.metrics.peer_refused(why.label());
    if n.is_power_of_two() {
        // A detail may quote a name from the message (an address): bounded.
        let detail: String = detail.chars().take(200).collect();
        tracing::warn!(
            reason = why.label(),
            ?sender,
            route,
            count = n,
            "peer message refused: {detail} (logged at counts 1, 2, 4, ...)"
        );
    }
}

/// The ids of this node's current membership (voters and learners of every configuration;
/// empty before it knows one).
pub fn member_ids(consensus: &Consensus) -> BTreeSet<NodeId> {
    let m = consensus.raft().metrics();
    let m = m.borrow();
    m.membership_config
        .membership()
        .nodes()
        .map(|(id, _)| *id)
        .collect()
}

/// What the vote rule needs to know, now.
pub fn vote_context(consensus: &Consensus) -> VoteContext {
    let quorum_ack_age_ms = {
        let m = consensus.raft().metrics();
        let m = m.borrow();
        if m.state == ServerState::Leader {
            m.millis_since_quorum_ack
        } else {
            None
        }
    };
    VoteContext {
        quorum_ack_age_ms,
        leader_contact_age_ms: consensus.peers().contacts().led_age(),
        election_min_ms: consensus.raft().config().election_timeout_min,
    }
}
