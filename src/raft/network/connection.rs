//! openraft's side of the peer network: [`NetworkFactory`] makes one [`PeerConnection`] per
//! target, which carries AppendEntries (MessagePack, cut to a byte budget, over a peer stream
//! where it can), votes and snapshots (one binary frame), and maps each failure to the error
//! openraft needs.
//!
//! # Invariants
//! - An append carries at most [`MAX_APPEND_BYTES`] of entries (at least one entry); a cut
//!   batch that succeeds is reported as `PartialSuccess` up to the last entry sent.
//! - With a durable view, the commit told to followers is no higher than this node's durable
//!   log (`raft::durability`).
//! - Every answer is recorded as a contact and may end an outage in the link log; every
//!   transport failure goes to the link log.
//! - A follower's acknowledged match is recorded with the [`ReversionGuard`]; a conflict below
//!   it (the follower lost its data) is answered to openraft as "unreachable", never as a
//!   conflict (openraft 0.9 cannot take a follower's log going back).
//! - A commit notice (a replication stream's heartbeat that only carries a new commit: see
//!   [`is_commit_notice`]) is sent without holding openraft's one append in flight for its
//!   answer, and openraft is told it failed, which it ignores for a heartbeat. So nothing the
//!   target did not say is ever reported to openraft: no match, and no acknowledgement time
//!   (the leader's quorum-ack age, which its lease and health rules read, comes only from
//!   answers). At most one notice per connection is in flight; one answered with anything
//!   but a match makes the next heartbeat an ordinary one, whose answer openraft hears.
//!
//! # What it must not do
//! Decide. It encodes, sends, maps errors and records contacts; openraft decides what to send,
//! and when to send it again.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use openraft::error::{
    Fatal, NetworkError, RPCError, RaftError, RemoteError, ReplicationClosed, StreamingError,
    Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{AnyError, BasicNode, EntryPayload, OptionalSend, Snapshot, Vote};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::append_codec::{append_size_hint, write_append};
use super::reversion::ReversionGuard;
use super::{MAX_APPEND_BYTES, MSGPACK, PeerClient, PeerError, encode_snapshot_frame, routes};
use crate::raft::durability::DurableView;
use crate::raft::peer_stream;
use crate::raft::{Entry, LogId, NodeId, TypeConfig};

/// A cheap estimate of an entry's encoded size.
fn approx_entry_bytes(entry: &Entry) -> usize {
    const OVERHEAD: usize = 48;
    match &entry.payload {
        EntryPayload::Normal(cmd) => OVERHEAD + cmd.approx_bytes(),
        EntryPayload::Membership(_) => 8 * OVERHEAD,
        EntryPayload::Blank => OVERHEAD,
    }
}

/// Cut `entries` to the byte budget, keeping at least one. Returns whether anything was cut.
fn cut_to_budget(entries: &mut Vec<Entry>) -> bool {
    let mut total = 0;
    let keep = entries
        .iter()
        .position(|e| {
            total += approx_entry_bytes(e);
            total > MAX_APPEND_BYTES
        })
        .map_or(entries.len(), |i| i.max(1));
    let cut = keep < entries.len();
    entries.truncate(keep);
    cut
}

/// Makes one [`PeerConnection`] per target for openraft.
#[derive(Clone)]
pub struct NetworkFactory {
    client: PeerClient,
    durable: Option<DurableView>,
    reversions: Option<ReversionGuard>,
}

impl NetworkFactory {
    pub fn new(client: PeerClient) -> Self {
        NetworkFactory {
            client,
            durable: None,
            reversions: None,
        }
    }

    /// Record followers' matches, and keep a follower whose log went back from openraft.
    pub fn with_reversion_guard(mut self, guard: ReversionGuard) -> Self {
        self.reversions = Some(guard);
        self
    }

    /// Tell followers a commit no higher than this node's durable log (the leader
    /// acknowledges its own appends before their sync: `super::durability`).
    pub fn with_durability(mut self, durable: DurableView) -> Self {
        self.durable = Some(durable);
        self
    }
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Self::Network {
        PeerConnection {
            client: self.client.clone(),
            target,
            addr: node.addr.clone(),
            durable: self.durable.clone(),
            reversions: self.reversions.clone(),
            settled: false,
            told_commit: None,
            notice: Arc::default(),
            failures_in_a_row: AtomicU32::new(0),
        }
    }
}

/// openraft's view of one peer.
pub struct PeerConnection {
    client: PeerClient,
    target: NodeId,
    addr: String,
    durable: Option<DurableView>,
    reversions: Option<ReversionGuard>,
    /// Whether this connection's last append was answered with a match: it is a replication
    /// stream's, in its steady state (openraft makes a fresh connection for every leadership
    /// round, so those never are).
    settled: bool,
    /// The highest commit an append of this connection told the target.
    told_commit: Option<LogId>,
    /// This connection's commit notice in flight, and how the last one ended.
    notice: Arc<NoticeState>,
    /// RPCs that failed in a row since the target last answered.
    failures_in_a_row: AtomicU32,
}

/// Shared between a connection and the task that awaits its commit notice's answer.
#[derive(Default)]
struct NoticeState {
    in_flight: AtomicBool,
    /// The last notice was not answered with a match (the target may have a higher vote, or
    /// have lost its log): the next heartbeat waits for its answer, so openraft hears it.
    failed: AtomicBool,
}

impl PeerConnection {
    async fn call<Req, Resp, E>(
        &self,
        path: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, RPCError<NodeId, BasicNode, E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let answer: Result<Resp, E> = self
            .client
            .post_json(&self.addr, path, req, timeout)
            .await
            .map_err(|e| self.failed(e))?;
        self.answered();
        answer.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl PeerConnection {
    /// The peer answered: a contact for the health rules, maybe the end of an outage.
    fn answered(&self) {
        self.failures_in_a_row.store(0, Ordering::Relaxed);
        record_answer(&self.client, self.target, &self.addr);
    }

    /// An RPC failed: maybe the start of an outage worth a log line; openraft's error.
    ///
    /// A second failure in a row is reported as `Unreachable` whatever its cause: openraft
    /// 0.9 backs off ([`RaftNetwork::backoff`]) only after that error, and retries at once
    /// after any other. A target that answers, but not as a peer does (a member added with
    /// another server's address, whose 404 or 500 comes back in microseconds), had the
    /// leader resend to it in a loop that took a whole core. One failure alone is still
    /// retried at once: a peer stream cut by a restart comes back on the next try.
    fn failed<E: std::error::Error>(&self, e: PeerError) -> RPCError<NodeId, BasicNode, E> {
        self.client.links.failed(self.target, &self.addr, &e);
        let in_a_row = self.failures_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        if in_a_row >= 2 && !matches!(e, PeerError::Unreachable { .. }) {
            return RPCError::Unreachable(Unreachable::new(&e));
        }
        to_rpc_error(&e)
    }
}

/// `target` (at `addr`) answered: a contact for the health rules, maybe the end of an outage.
fn record_answer(client: &PeerClient, target: NodeId, addr: &str) {
    client.contacts.heard_from(target);
    client.links.answered(target, addr);
}

fn to_rpc_error<E: std::error::Error>(e: &PeerError) -> RPCError<NodeId, BasicNode, E> {
    match e {
        PeerError::Unreachable { .. } => RPCError::Unreachable(Unreachable::new(e)),
        PeerError::Transport { .. } | PeerError::NoRoute { .. } => {
            RPCError::Network(NetworkError::new(e))
        }
    }
}

/// Whether `rpc` would only tell a settled replication stream's target a commit it has not
/// been told: a heartbeat (no entries) whose commit is above the last one sent. openraft 0.9
/// sends one after every commit that finds no new entry to send, and holds the target's one
/// append in flight until its answer: proposals that arrive meanwhile wait a round trip more.
fn is_commit_notice(
    rpc: &AppendEntriesRequest<TypeConfig>,
    settled: bool,
    told_commit: Option<LogId>,
) -> bool {
    rpc.entries.is_empty() && settled && rpc.leader_commit > told_commit
}

/// Send an encoded append frame over a peer stream (plain HTTP where the peer has none) and
/// read its answer.
async fn deliver_append(
    client: &PeerClient,
    addr: &str,
    frame: &[u8],
    ttl: Duration,
) -> Result<Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>, PeerError> {
    let transport = |detail: String| PeerError::Transport {
        addr: addr.to_string(),
        detail,
    };
    match client
        .stream_call(addr, frame, ttl, peer_stream::MAX_ANSWER_FRAME)
        .await?
    {
        Some((peer_stream::ANSWERED, body)) => {
            serde_json::from_slice(&body).map_err(|e| transport(format!("undecodable answer: {e}")))
        }
        Some((status, body)) => {
            let why = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
            Err(transport(format!(
                "append refused on the peer stream (status {status}): {why}"
            )))
        }
        None => {
            client
                .post_bytes(addr, routes::APPEND, MSGPACK, frame[5..].to_vec(), ttl)
                .await
        }
    }
}

impl PeerConnection {
    /// Tell the target a new commit without holding openraft's one append in flight for the
    /// answer: the append goes out on a task of its own, and openraft is answered at once with
    /// a network error, which it ignores for a heartbeat (no progress, no acknowledgement time:
    /// nothing is claimed that the follower did not say). Its answer only records the contact.
    /// The task is not tracked by the node's shutdown: like any append, it ends within the
    /// append's deadline (`ttl`, openraft's heartbeat interval), answered or not.
    fn send_commit_notice(
        &self,
        frame: Vec<u8>,
        ttl: Duration,
    ) -> RPCError<NodeId, BasicNode, RaftError<NodeId>> {
        let client = self.client.clone();
        let addr = self.addr.clone();
        let target = self.target;
        let notice = self.notice.clone();
        tokio::spawn(async move {
            let answer = deliver_append(&client, &addr, &frame, ttl).await;
            if answer.is_ok() {
                record_answer(&client, target, &addr);
            }
            let matched = matches!(
                answer,
                Ok(Ok(
                    AppendEntriesResponse::Success | AppendEntriesResponse::PartialSuccess(_)
                ))
            );
            if !matched {
                notice.failed.store(true, Ordering::Release);
            }
            notice.in_flight.store(false, Ordering::Release);
        });
        RPCError::Network(NetworkError::new(&AnyError::error(COMMIT_NOTICE_SENT)))
    }
}

/// What openraft is told for a commit notice (it ignores a heartbeat's error).
const COMMIT_NOTICE_SENT: &str = "commit notice sent; its answer is not awaited";

impl RaftNetwork<TypeConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        if let Some(durable) = &self.durable {
            rpc.leader_commit = durable.cap_commit(rpc.leader_commit);
        }
        let cut = cut_to_budget(&mut rpc.entries);
        let last_sent = rpc.entries.last().map(|e| e.log_id);
        let network = |e: &dyn std::error::Error| {
            RPCError::Network(NetworkError::new(&AnyError::error(e.to_string())))
        };
        // The MessagePack body is encoded once, straight into a stream frame; over plain HTTP
        // the same bytes (after the frame's head) are the request body.
        let estimate = append_size_hint(&rpc, approx_entry_bytes);
        let mut frame = peer_stream::start_frame(peer_stream::KIND_APPEND, estimate);
        write_append(&mut frame, &rpc).map_err(|e| network(&*e))?;
        let frame = peer_stream::finish_frame(frame).map_err(|e| network(&e))?;
        let ttl = option.hard_ttl();
        if self.notice.failed.swap(false, Ordering::AcqRel) {
            self.settled = false;
        }
        if is_commit_notice(&rpc, self.settled, self.told_commit)
            && !self.notice.in_flight.swap(true, Ordering::AcqRel)
        {
            self.told_commit = rpc.leader_commit;
            return Err(self.send_commit_notice(frame, ttl));
        }
        let answer = match deliver_append(&self.client, &self.addr, &frame, ttl).await {
            Ok(answer) => answer,
            Err(e) => {
                self.settled = false;
                return Err(self.failed(e));
            }
        };
        self.answered();
        let answer = match answer {
            Ok(AppendEntriesResponse::Success) if cut => {
                Ok(AppendEntriesResponse::PartialSuccess(last_sent))
            }
            other => other,
        };
        self.settled = matches!(
            answer,
            Ok(AppendEntriesResponse::Success | AppendEntriesResponse::PartialSuccess(_))
        );
        if self.settled {
            self.told_commit = self.told_commit.max(rpc.leader_commit);
        }
        if let Some(guard) = &self.reversions {
            let leader = (rpc.vote.leader_id().term, rpc.vote.leader_id().node_id);
            let matched = match &answer {
                Ok(AppendEntriesResponse::Success) => last_sent.or(rpc.prev_log_id),
                Ok(AppendEntriesResponse::PartialSuccess(upto)) => *upto,
                _ => None,
            };
            if let Some(m) = matched {
                guard.acknowledged(self.target, leader, m.index);
            }
            if let (Ok(AppendEntriesResponse::Conflict), Some(prev)) = (&answer, rpc.prev_log_id)
                && guard.reverted(self.target, leader, prev.index)
            {
                return Err(RPCError::Unreachable(Unreachable::new(&AnyError::error(
                    format!(
                        "node {} lost entries it acknowledged (its log went back); it is being \
                         replaced",
                        self.target
                    ),
                ))));
            }
        }
        answer.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(routes::VOTE, &rpc, option.hard_ttl()).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote<NodeId>,
        snapshot: Snapshot<TypeConfig>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<TypeConfig, Fatal<NodeId>>> {
        let frame = encode_snapshot_frame(&vote, &snapshot.meta, &snapshot.snapshot);
        let installs_upto = snapshot.meta.last_log_id.map(|l| l.index);
        let send = self
            .client
            .post_bytes::<Result<SnapshotResponse<NodeId>, Fatal<NodeId>>>(
                &self.addr,
                routes::SNAPSHOT,
                "application/octet-stream",
                frame,
                option.hard_ttl(),
            );
        let answer = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            answer = send => answer,
        };
        match &answer {
            Ok(_) => self.answered(),
            Err(e) => {
                self.client.links.failed(self.target, &self.addr, e);
            }
        }
        match answer {
            Ok(Ok(resp)) => {
                if let (Some(guard), Some(index)) = (&self.reversions, installs_upto)
                    && resp.vote == vote
                {
                    let leader = (vote.leader_id().term, vote.leader_id().node_id);
                    guard.acknowledged(self.target, leader, index);
                }
                Ok(resp)
            }
            Ok(Err(fatal)) => Err(StreamingError::RemoteError(RemoteError::new(
                self.target,
                fatal,
            ))),
            Err(e @ PeerError::Unreachable { .. }) => {
                Err(StreamingError::Unreachable(Unreachable::new(&e)))
            }
            Err(e) => Err(StreamingError::Network(NetworkError::new(&e))),
        }
    }

    fn backoff(&self) -> openraft::network::Backoff {
        // Retry an unreachable peer quickly at first (a restarting node comes back within a
        // second), then settle at one attempt per 500 ms.
        let steps = [50u64, 100, 200, 400]
            .into_iter()
            .chain(std::iter::repeat(500))
            .map(Duration::from_millis);
        openraft::network::Backoff::new(steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU8;

    /// How the fake follower answers appends.
    const ANSWER_MATCH: u8 = 0;
    const ANSWER_NOTHING: u8 = 1;
    const ANSWER_HIGHER_VOTE: u8 = 2;
    /// Not as a peer does: a 404 with a body, as another server (an etcd port) answers.
    const ANSWER_FOREIGN: u8 = 3;

    /// A follower on loopback that serves no peer streams (so appends come over plain HTTP)
    /// and answers each append as `mode` says: a match, a higher vote, or never.
    async fn follower(mode: Arc<AtomicU8>) -> String {
        use axum::routing::post;
        let app = axum::Router::new()
            .route(
                routes::APPEND,
                post(move || {
                    let mode = mode.load(Ordering::SeqCst);
                    async move {
                        use axum::response::IntoResponse;
                        let body = match mode {
                            ANSWER_FOREIGN => {
                                return (axum::http::StatusCode::NOT_FOUND, "{\"error\":{}}")
                                    .into_response();
                            }
                            ANSWER_MATCH => serde_json::json!({"Ok": "Success"}),
                            ANSWER_HIGHER_VOTE => serde_json::json!({"Ok": {"HigherVote":
                                Vote::new_committed(9, 3)}}),
                            _ => {
                                tokio::time::sleep(Duration::from_secs(60)).await;
                                serde_json::json!({"Ok": "Success"})
                            }
                        };
                        axum::Json(body).into_response()
                    }
                }),
            )
            .fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "{\"error\":{}}") });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let offset = crate::domain::resources::PEER_PORT_OFFSET;
        format!("127.0.0.1:{}", port - offset)
    }

    fn log_id(index: u64) -> LogId {
        LogId::new(openraft::CommittedLeaderId::new(1, 1), index)
    }

    /// A heartbeat of leader 1 in term 1, matching at index 5, telling commit `commit`.
    fn heartbeat(commit: u64) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(1, 1),
            prev_log_id: Some(log_id(5)),
            leader_commit: Some(log_id(commit)),
            entries: vec![],
        }
    }

    async fn connection(addr: String) -> PeerConnection {
        let node = BasicNode { addr };
        NetworkFactory::new(PeerClient::new(1))
            .new_client(2, &node)
            .await
    }

    /// Bounds a call that must not wait for the follower (which, here, never answers).
    async fn promptly<T>(call: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(20), call)
            .await
            .expect("waited for an answer that never comes, or for a notice that never ended")
    }

    /// A target that keeps failing is `Unreachable` from its second failure in a row, whatever
    /// the failure, so that openraft backs off: a member added with the address of a server
    /// that answers 404 had the leader resend to it thousands of times a second.
    #[tokio::test]
    async fn a_target_failing_twice_in_a_row_is_unreachable_so_openraft_backs_off() {
        let mode = Arc::new(AtomicU8::new(ANSWER_FOREIGN));
        let mut conn = connection(follower(mode.clone()).await).await;
        let option = RPCOption::new(Duration::from_secs(30));
        let first = conn.append_entries(heartbeat(3), option.clone()).await;
        assert!(
            matches!(first, Err(RPCError::Network(_))),
            "one failure is retried at once: {first:?}"
        );
        for _ in 0..3 {
            let again = conn.append_entries(heartbeat(3), option.clone()).await;
            assert!(matches!(again, Err(RPCError::Unreachable(_))), "{again:?}");
        }
        // An answer ends the run: the next failure is retried at once again.
        mode.store(ANSWER_MATCH, Ordering::SeqCst);
        let answered = conn.append_entries(heartbeat(3), option.clone()).await;
        assert_eq!(answered.unwrap(), AppendEntriesResponse::Success);
        mode.store(ANSWER_FOREIGN, Ordering::SeqCst);
        let after = conn.append_entries(heartbeat(3), option.clone()).await;
        assert!(matches!(after, Err(RPCError::Network(_))), "{after:?}");
    }

    /// The rule alone: only a settled connection's heartbeat that tells a higher commit.
    #[test]
    fn a_notice_is_only_a_settled_streams_heartbeat_with_a_higher_commit() {
        let beat = heartbeat(4);
        assert!(is_commit_notice(&beat, true, Some(log_id(3))));
        assert!(is_commit_notice(&beat, true, None));
        // A fresh connection (every leadership round's) waits for its answer.
        assert!(!is_commit_notice(&beat, false, Some(log_id(3))));
        // Nothing new to tell: the periodic heartbeat, whose answer openraft needs.
        assert!(!is_commit_notice(&beat, true, Some(log_id(4))));
        assert!(!is_commit_notice(&beat, true, Some(log_id(5))));
        // Entries always wait for their answer.
        let mut append = heartbeat(4);
        append.entries.push(Entry {
            log_id: log_id(6),
            payload: EntryPayload::Blank,
        });
        assert!(!is_commit_notice(&append, true, Some(log_id(3))));
    }

    #[tokio::test]
    async fn a_commit_notice_is_not_awaited_and_reports_no_acknowledgement() {
        let mode = Arc::new(AtomicU8::new(ANSWER_MATCH));
        let mut conn = connection(follower(mode.clone()).await).await;
        let long = RPCOption::new(Duration::from_secs(30));
        let short = RPCOption::new(Duration::from_millis(300));

        // A fresh connection (a leadership round's, or a replication stream's first append)
        // always waits for the answer, even with a new commit.
        let first = conn.append_entries(heartbeat(3), long.clone()).await;
        assert_eq!(first.unwrap(), AppendEntriesResponse::Success);

        // The follower goes silent. A heartbeat with a new commit is sent as a notice: the
        // call returns at once, and as a failure, so openraft records no match and no
        // acknowledgement time for it.
        mode.store(ANSWER_NOTHING, Ordering::SeqCst);
        let notice = promptly(conn.append_entries(heartbeat(4), long.clone())).await;
        let err = notice.unwrap_err().to_string();
        assert!(err.contains(COMMIT_NOTICE_SENT), "{err}");

        // Its answer has not come: the next heartbeat, even with a newer commit, is an
        // ordinary one and fails when the follower stays silent.
        let waited = promptly(conn.append_entries(heartbeat(5), short.clone())).await;
        let err = waited.unwrap_err().to_string();
        assert!(!err.contains(COMMIT_NOTICE_SENT), "{err}");

        // A heartbeat that tells no new commit is never a notice.
        mode.store(ANSWER_MATCH, Ordering::SeqCst);
        let plain = conn.append_entries(heartbeat(4), long.clone()).await;
        assert_eq!(plain.unwrap(), AppendEntriesResponse::Success);
    }

    #[tokio::test]
    async fn a_notice_answered_without_a_match_makes_the_next_heartbeat_ordinary() {
        let mode = Arc::new(AtomicU8::new(ANSWER_MATCH));
        let mut conn = connection(follower(mode.clone()).await).await;
        let option = RPCOption::new(Duration::from_secs(30));
        assert!(
            conn.append_entries(heartbeat(3), option.clone())
                .await
                .is_ok()
        );

        mode.store(ANSWER_HIGHER_VOTE, Ordering::SeqCst);
        let notice = conn.append_entries(heartbeat(4), option.clone()).await;
        assert!(notice.unwrap_err().to_string().contains(COMMIT_NOTICE_SENT));
        promptly(async {
            while conn.notice.in_flight.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;

        // openraft hears the higher vote from the next heartbeat, although it tells a new
        // commit too.
        let next = conn.append_entries(heartbeat(5), option).await.unwrap();
        assert_eq!(
            next,
            AppendEntriesResponse::HigherVote(Vote::new_committed(9, 3))
        );
    }
}
