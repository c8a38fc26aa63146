//! The `Watch` service: one bidirectional stream per client, carrying any number of watchers.
//!
//! Each stream has a session task that reads the client's requests (create, cancel, progress)
//! and one task per watcher that follows the watch hub from its start revision and sends
//! batches. Everything leaves through one channel bounded by count and by the bytes of events
//! queued ([`QUEUE_BYTES`]), so a watcher's `created` answer always precedes its events, a
//! slow client slows its own watchers, no one else's, and one that stops reading costs at
//! most that much memory.
//!
//! # Invariants
//! - A watcher never skips an event and never sends one twice: it resumes each wait from the
//!   revision after the last one it sent (`through + 1`), and batches end on whole revisions.
//! - Bounded by bytes: the hub's batch holds at most [`BATCH_BYTES`] of keys and values, and a
//!   response at most [`RESPONSE_BYTES`] of encoded events (`prev_kv` included), each ending
//!   before the revision that would pass its bound, unless that revision is alone
//!   ([`crate::domain::watch_batch`]). A watcher resuming from an old revision then gets past
//!   any amount of history in responses that fit the API's messages, and holds little.
//! - A start below what the history holds cancels the watcher with etcd's `compacted` reason
//!   and the first revision still held, so the client can resume there. As in etcd, a
//!   compaction at `C` keeps `C` ([`Resume::AtMark`]): a watch from `C` delivers its events,
//!   one from below is cancelled with `compact_revision` `C`.
//! - An empty key is `"\0"`, the smallest key, as etcd reads it: a watch of `""` follows
//!   that one key, `""` to `"\0"` every key, `""` to `end` every key below `end`.
//! - Events are checked against the caller's read permission at delivery.
//! - The session ends when the client's stream ends, the client stops reading, or the node
//!   stops; its watchers end with it. A client that stops reading is cut off: when a
//!   watcher has waited for room in a full queue for the connection's write timeout
//!   (`http::listener::ConnHandle`), the connection is closed (see [`Outbox`]).
//! - Bounded per node too: a stream's first [`OWN_QUEUE_BYTES`] of queued events are its own,
//!   beyond them its responses also draw on the node's [`WatchBudget`] ([`NODE_QUEUE_BYTES`]
//!   for all streams), and a node serves at most [`MAX_WATCH_STREAMS`] streams. So stalled
//!   clients together hold at most the budget plus a small share per stream, and a watcher
//!   that waits for the budget while its own client takes nothing for the write timeout cuts
//!   that client off (its queued events give the budget back).
//! - `prev_kv` is the key's previous version from the MVCC history, looked up per event
//!   (absent when it was not live, or has been compacted since).
//! - A response larger than [`FRAGMENT_BYTES`] (one revision larger than the bound, alone) is
//!   split into fragments (`fragment: true` on all but the last) when the watcher asked for
//!   them, as etcd does; otherwise it goes whole, as etcd sends it (up to etcd's own send
//!   limit, [`super::MAX_WATCH_SEND_BYTES`]).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use leasecore_etcd_api::etcdserverpb::watch_server::Watch;
use leasecore_etcd_api::etcdserverpb::{
    WatchCreateRequest, WatchRequest, WatchResponse, watch_create_request, watch_request,
};
use leasecore_etcd_api::mvccpb;
use prost::Message;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::{Etcd, key_value, lease_id};
use crate::domain::auth::{Access, KeyRange, perm::prefix_end};
use crate::domain::command::{Event, EventKind};
use crate::domain::health::LeaderlessStreak;
use crate::domain::history::{KeyFilter, Resume};
use crate::domain::types::Revision;
use crate::domain::watch_batch::{BATCH_BYTES, BatchCut, BatchLimit, Cut};
use crate::domain::{key_bytes, value_bytes};
use crate::http::auth::{can_read, check};
use crate::http::listener::ConnHandle;
use crate::runtime::auth::Caller;

/// Watchers one stream may hold.
const MAX_WATCHERS_PER_STREAM: usize = 1024;
/// Events and bytes of keys and values per batch at most (a batch never splits a revision,
/// so one revision alone may be larger: it then goes alone, in fragments if asked for).
const BATCH_LIMIT: BatchLimit = BatchLimit::events(1000);
/// Encoded events per response at most, unless one revision alone is larger (then it goes
/// alone, in fragments if the watcher asked for them): as a batch's keys and values.
const RESPONSE_BYTES: usize = BATCH_BYTES;
/// Responses queued for a client that reads slowly.
const QUEUE: usize = 64;
/// Bytes of events queued for a client at most (each watcher waits for room before it reads
/// on): without it, a stream whose client stopped reading held up to [`QUEUE`] responses of
/// about [`RESPONSE_BYTES`] each.
const QUEUE_BYTES: usize = 4 << 20;
/// Bytes of events a stream queues without drawing on the node's [`WatchBudget`]: what a
/// watcher that keeps up ever holds.
const OWN_QUEUE_BYTES: usize = 64 << 10;
/// Bytes of queued events beyond their own share that all of a node's watch streams hold
/// together at most.
const NODE_QUEUE_BYTES: usize = 256 << 20;
/// Watch streams (gRPC and the gateway's `/v3/watch`) a node serves at once: each holds a
/// session task and up to [`OWN_QUEUE_BYTES`] of its own.
pub const MAX_WATCH_STREAMS: usize = 10_000;

/// What all of a node's watch streams share: the bytes queued beyond each stream's own share,
/// and the stream slots.
#[derive(Clone)]
pub(super) struct WatchBudget {
    queued: Arc<Semaphore>,
    streams: Arc<Semaphore>,
}

impl WatchBudget {
    pub(super) fn new() -> Self {
        WatchBudget {
            queued: Arc::new(Semaphore::new(NODE_QUEUE_BYTES)),
            streams: Arc::new(Semaphore::new(MAX_WATCH_STREAMS)),
        }
    }
}

/// Above this encoded size a response is sent in fragments to a watcher that asked for them:
/// etcd's default `--max-request-bytes` (1.5 MiB).
const FRAGMENT_BYTES: usize = 3 * 1024 * 1024 / 2;
/// How often an idle watcher with `progress_notify` says how far it has looked (etcd's
/// default progress-notify interval).
const PROGRESS_INTERVAL: Duration = Duration::from_secs(600);

pub(super) type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchResponse, Status>> + Send>>;
/// A response on its way to the client, with the share of [`QUEUE_BYTES`] it holds until
/// the stream takes it.
struct Queued {
    resp: Result<WatchResponse, Status>,
    _bytes: Option<OwnedSemaphorePermit>,
    /// Its share of the node's budget, if it went beyond the stream's own.
    _shared: Option<OwnedSemaphorePermit>,
}

/// The stream's queue: at most [`QUEUE`] responses, and a watcher's events at most
/// [`QUEUE_BYTES`] of them (besides one response larger alone).
#[derive(Clone)]
struct Outbox {
    tx: mpsc::Sender<Queued>,
    bytes: Arc<Semaphore>,
    /// The node's [`WatchBudget::queued`].
    shared: Arc<Semaphore>,
    /// Responses the client has taken so far (a wait for the node's budget tells a stalled
    /// client from a busy node by it).
    taken: Arc<AtomicU64>,
    /// The client's connection: a queue that has no room for a response for its write
    /// timeout closes it (`None` outside a listener: the wait is then unbounded).
    conn: Option<ConnHandle>,
}

impl Outbox {
    /// Queue a control response (small: created, canceled, progress).
    async fn send(&self, resp: Result<WatchResponse, Status>) -> Result<(), ()> {
        let queued = Queued {
            resp,
            _bytes: None,
            _shared: None,
        };
        self.within_write_timeout(self.tx.send(queued))
            .await?
            .map_err(|_| ())
    }

    /// The bytes of the stream's queue in use: responses queued, and shares taken for
    /// responses on their way (this one's included).
    fn queued_bytes(&self) -> usize {
        QUEUE_BYTES - self.bytes.available_permits()
    }

    /// Whether responses wait in the queue for the client to take them (not counting those
    /// still on their way, which it cannot take yet).
    fn waiting_in_queue(&self) -> bool {
        self.tx.capacity() < self.tx.max_capacity()
    }

    /// Queue a response of events, once the queue's bytes leave room for it (all of them,
    /// for one larger than the whole budget): a client that does not read holds its
    /// watchers here, not their batches in memory.
    async fn send_events(&self, resp: WatchResponse) -> Result<(), ()> {
        let share = resp.encoded_len().clamp(1, QUEUE_BYTES) as u32;
        let own = self
            .within_write_timeout(self.bytes.clone().acquire_many_owned(share))
            .await?
            .map_err(|_| ())?;
        let shared = if self.queued_bytes() > OWN_QUEUE_BYTES {
            Some(self.node_share(share).await?)
        } else {
            None
        };
        let queued = Queued {
            resp: Ok(resp),
            _bytes: Some(own),
            _shared: shared,
        };
        self.within_write_timeout(self.tx.send(queued))
            .await?
            .map_err(|_| ())
    }

    /// `share` bytes of the node's budget (the response holds `share` of the stream's own
    /// queue meanwhile), waited for as long as the node's other streams need them, but not
    /// past the write timeout while this stream's client, with responses queued for it,
    /// takes none of them: then it is the one that stalls, and its connection is closed.
    async fn node_share(&self, share: u32) -> Result<OwnedSemaphorePermit, ()> {
        let share = share.min(NODE_QUEUE_BYTES as u32);
        let Some(conn) = &self.conn else {
            return self
                .shared
                .clone()
                .acquire_many_owned(share)
                .await
                .map_err(|_| ());
        };
        loop {
            let taken = self.taken.load(Ordering::Acquire);
            let wait = self.shared.clone().acquire_many_owned(share);
            match tokio::time::timeout(conn.write_timeout(), wait).await {
                Ok(permit) => return permit.map_err(|_| ()),
                Err(_)
                    if self.waiting_in_queue() && self.taken.load(Ordering::Acquire) == taken =>
                {
                    conn.close_stalled();
                    return Err(());
                }
                Err(_) => {}
            }
        }
    }

    /// `wait` for room in the queue, at most the connection's write timeout: a client whose
    /// queue stays full that long has stopped taking its stream (an HTTP/2 client can do so
    /// without filling any socket, by granting no window), and its connection is closed, so
    /// that it holds neither this queue nor what `h2` buffered for it. The queue holds at most
    /// [`QUEUE_BYTES`] a stream, but a connection carries up to 1,024 streams: 300 stalled
    /// streams on one connection held 520 MB before this.
    async fn within_write_timeout<T>(&self, wait: impl Future<Output = T>) -> Result<T, ()> {
        let Some(conn) = &self.conn else {
            return Ok(wait.await);
        };
        match tokio::time::timeout(conn.write_timeout(), wait).await {
            Ok(done) => Ok(done),
            Err(_) => {
                conn.close_stalled();
                Err(())
            }
        }
    }

    async fn closed(&self) {
        self.tx.closed().await
    }
}

/// What one watcher follows.
struct Spec {
    range: KeyRange,
    filter: KeyFilter,
    no_put: bool,
    no_delete: bool,
    progress_notify: bool,
    prev_kv: bool,
    fragment: bool,
}

/// The hub filter that covers `range` (the events are checked against the range too).
fn hub_filter(range: &KeyRange) -> KeyFilter {
    if let Some(key) = range.single_key() {
        return KeyFilter::Key(key_bytes::store(key.to_vec()));
    }
    if let Ok(prefix) = std::str::from_utf8(&range.start)
        && range.end == prefix_end(&range.start)
    {
        return KeyFilter::Prefix(prefix.to_string());
    }
    KeyFilter::Prefix(String::new())
}

fn event(e: &Event) -> mvccpb::Event {
    let (kind, kv) = match e.kind {
        EventKind::Put => (
            mvccpb::event::EventType::Put,
            mvccpb::KeyValue {
                key: key_bytes::bytes(&e.key).into_owned(),
                create_revision: e.create_revision.unwrap_or(e.revision).0 as i64,
                mod_revision: e.revision.0 as i64,
                version: e.version.unwrap_or(1) as i64,
                value: value_bytes::bytes(e.value.as_deref().unwrap_or_default()).into_owned(),
                lease: e.lease.as_deref().map_or(0, lease_id),
            },
        ),
        EventKind::Delete => (
            mvccpb::event::EventType::Delete,
            mvccpb::KeyValue {
                key: key_bytes::bytes(&e.key).into_owned(),
                mod_revision: e.revision.0 as i64,
                ..Default::default()
            },
        ),
    };
    mvccpb::Event {
        r#type: kind as i32,
        kv: Some(kv),
        prev_kv: None,
    }
}

/// One stream's watchers.
struct Session {
    etcd: Etcd,
    caller: Caller,
    out: Outbox,
    watchers: HashMap<i64, (CancellationToken, Arc<AtomicU64>)>,
    next_id: i64,
    /// Fires when the session ends: every watcher's token is a child of it.
    done: CancellationToken,
    /// The revision a progress request waits for every watcher to have looked through (0:
    /// none yet): a watcher asleep on keys nobody writes looks at once when it rises.
    wanted: watch::Sender<u64>,
    /// Told by a watcher that has looked through the wanted revision (or has ended).
    synced: Arc<Notify>,
    /// The highest revision through which some watcher of the stream has sent events: a
    /// progress answer never goes below it (the client's watchers all take it).
    events_sent: Arc<AtomicU64>,
    /// A progress request not answered yet: answered once every watcher has delivered
    /// everything through this revision.
    pending_progress: Option<Revision>,
    /// Opened with etcd's `hasleader` metadata: the stream ends with `no leader` once its
    /// member has been without one for [`LEADERLESS_CHECKS`] election timeouts.
    require_leader: bool,
}

/// How many checks in a row, an election timeout apart, must find a `hasleader` stream's
/// member without a leader before the stream ends (etcd's `maxNoLeaderCnt`: ending a stream
/// costs its client more than refusing a new call, so the wait is longer).
const LEADERLESS_CHECKS: u32 = 3;

impl Session {
    async fn run(mut self, mut inbound: impl Stream<Item = Result<WatchRequest, Status>> + Unpin) {
        let hub = self.etcd.state.watch.clone();
        let synced = self.synced.clone();
        let mut leader_checks = tokio::time::interval(self.etcd.state.consensus.election_timeout());
        let mut leaderless = LeaderlessStreak::new(LEADERLESS_CHECKS);
        loop {
            let msg = tokio::select! {
                m = inbound.next() => m,
                _ = leader_checks.tick(), if self.require_leader => {
                    if leaderless.check(self.etcd.leaderless()) {
                        // The client reconnects elsewhere and resumes its watches.
                        let _ = self.out.send(Err(super::no_leader())).await;
                        break;
                    }
                    continue;
                }
                _ = synced.notified(), if self.pending_progress.is_some() => {
                    if !self.answer_progress().await {
                        break;
                    }
                    continue;
                }
                _ = self.out.closed() => break,
                _ = hub.closed() => break,
            };
            let request = match msg {
                Some(Ok(WatchRequest {
                    request_union: Some(r),
                })) => r,
                Some(Ok(_)) => continue,
                None | Some(Err(_)) => break,
            };
            let sent = match request {
                watch_request::RequestUnion::CreateRequest(c) => self.create(c).await,
                watch_request::RequestUnion::CancelRequest(c) => self.cancel(c.watch_id).await,
                watch_request::RequestUnion::ProgressRequest(_) => self.progress().await,
            };
            if !sent {
                break;
            }
        }
        self.done.cancel();
    }

    async fn send(&self, resp: WatchResponse) -> bool {
        self.out.send(Ok(resp)).await.is_ok()
    }

    fn refused(&self, watch_id: i64, reason: &str) -> WatchResponse {
        WatchResponse {
            header: self.etcd.header(),
            watch_id,
            created: true,
            canceled: true,
            cancel_reason: reason.to_string(),
            ..Default::default()
        }
    }

    async fn create(&mut self, mut c: WatchCreateRequest) -> bool {
        if c.key.is_empty() {
            // As etcd: `etcdctl watch ""` and `watch "" <end>` are accepted and mean "\0",
            // the smallest key (`watch --prefix ""` sends "\0" itself).
            c.key = vec![0];
        }
        // As etcd: a range that ends at or before its start ("\0" alone means "from the key")
        // is refused at once, not followed by a watch that could never fire.
        if !c.range_end.is_empty() && c.range_end != [0] && c.key >= c.range_end {
            return self
                .send(self.refused(-1, "mvcc: watcher range is empty"))
                .await;
        }
        let range = KeyRange::from_etcd(&c.key, &c.range_end);
        let id = if c.watch_id != 0 {
            c.watch_id
        } else {
            while self.watchers.contains_key(&self.next_id) {
                self.next_id += 1;
            }
            self.next_id
        };
        if self.watchers.contains_key(&id) {
            // etcd's words, and its id: mvcc hands back -1 with the error.
            return self
                .send(self.refused(-1, "mvcc: duplicate watch ID provided on the WatchStream"))
                .await;
        }
        if self.watchers.len() >= MAX_WATCHERS_PER_STREAM {
            let reason = format!(
                "etcdserver: too many watchers on one stream (at most {MAX_WATCHERS_PER_STREAM})"
            );
            return self.send(self.refused(id, &reason)).await;
        }
        if check(&self.etcd.state, &self.caller, Access::Read, &range).is_err() {
            return self
                .send(self.refused(id, "etcdserver: permission denied"))
                .await;
        }
        let current = self.etcd.state.watch.current();
        let from = match u64::try_from(c.start_revision) {
            Ok(r) if r > 0 => Revision(r),
            _ => current.next(),
        };
        let spec = Spec {
            filter: hub_filter(&range),
            range,
            no_put: c
                .filters
                .contains(&(watch_create_request::FilterType::Noput as i32)),
            no_delete: c
                .filters
                .contains(&(watch_create_request::FilterType::Nodelete as i32)),
            progress_notify: c.progress_notify,
            prev_kv: c.prev_kv,
            fragment: c.fragment,
        };
        let created = WatchResponse {
            header: self.etcd.header_at(current),
            watch_id: id,
            created: true,
            ..Default::default()
        };
        if !self.send(created).await {
            return false;
        }
        let cancel = self.done.child_token();
        let delivered = Arc::new(AtomicU64::new(from.0.saturating_sub(1)));
        self.watchers
            .insert(id, (cancel.clone(), delivered.clone()));
        let watcher = Watcher {
            etcd: self.etcd.clone(),
            caller: self.caller.clone(),
            id,
            spec,
            out: self.out.clone(),
            delivered,
            wanted: self.wanted.subscribe(),
            synced: self.synced.clone(),
            events_sent: self.events_sent.clone(),
        };
        tokio::spawn(watcher.run(from, cancel));
        true
    }

    /// Cancel watcher `id`, and say so. A cancel of an id the stream does not hold gets no
    /// answer, as in etcd (a client that cancels twice would otherwise read a second
    /// `canceled` for an id it may have reused).
    async fn cancel(&mut self, id: i64) -> bool {
        let Some((token, _)) = self.watchers.remove(&id) else {
            return true;
        };
        token.cancel();
        self.send(WatchResponse {
            header: self.etcd.header(),
            watch_id: id,
            canceled: true,
            ..Default::default()
        })
        .await
    }

    /// etcd's progress response (watch id -1): once every watcher of the stream has sent
    /// everything through the store's current revision, that revision (or a later one all
    /// have reached). Watchers asleep on keys nobody writes are woken to look; the answer waits
    /// for those still catching up (as etcd 3.4.25 and 3.5.8 on defer it), so it never says a
    /// revision some watcher has not delivered yet, nor one below the stream's events.
    async fn progress(&mut self) -> bool {
        let current = self.etcd.state.watch.current();
        let want = self.pending_progress.map_or(current, |p| p.max(current));
        self.pending_progress = Some(want);
        self.wanted.send_replace(want.0);
        self.answer_progress().await
    }

    /// Send the pending progress response if every watcher has delivered through it.
    async fn answer_progress(&mut self) -> bool {
        let Some(want) = self.pending_progress else {
            return true;
        };
        let current = self.etcd.state.watch.current();
        // An ended watcher counts as done (`u64::MAX`); none at all, as current.
        let through = self
            .watchers
            .values()
            .map(|(_, d)| d.load(Ordering::Acquire))
            .min()
            .unwrap_or(u64::MAX)
            .min(current.0);
        // A busy watcher may have sent events past what the others looked through meanwhile:
        // they look again, that far (it is at most the current revision).
        let sent = self.events_sent.load(Ordering::Acquire);
        if sent > want.0 && through < sent {
            self.pending_progress = Some(Revision(sent));
            self.wanted.send_replace(sent);
            return true;
        }
        if through < want.0 {
            return true;
        }
        self.pending_progress = None;
        self.send(WatchResponse {
            header: self.etcd.header_at(Revision(through)),
            watch_id: -1,
            ..Default::default()
        })
        .await
    }
}

/// One watcher's follower task.
struct Watcher {
    etcd: Etcd,
    caller: Caller,
    id: i64,
    spec: Spec,
    out: Outbox,
    /// The revision through which this watcher has sent every event (`u64::MAX` once it has
    /// ended: it holds no progress response back).
    delivered: Arc<AtomicU64>,
    /// The revision a progress request wants looked through ([`Session::progress`]).
    wanted: watch::Receiver<u64>,
    synced: Arc<Notify>,
    /// The stream's [`Session::events_sent`].
    events_sent: Arc<AtomicU64>,
}

/// Marks a watcher ended, whichever way its task returns.
struct Ended {
    delivered: Arc<AtomicU64>,
    synced: Arc<Notify>,
}

impl Drop for Ended {
    fn drop(&mut self) {
        self.delivered.store(u64::MAX, Ordering::Release);
        self.synced.notify_one();
    }
}

impl Watcher {
    async fn run(mut self, mut from: Revision, cancel: CancellationToken) {
        let _ended = Ended {
            delivered: self.delivered.clone(),
            synced: self.synced.clone(),
        };
        let hub = self.etcd.state.watch.clone();
        let view = self.etcd.state.consensus.view();
        loop {
            // A progress request wants this watcher to look through its revision now: the
            // hub is read without waiting, and the watcher says when it is there.
            let want = *self.wanted.borrow_and_update();
            let poked = want > self.delivered.load(Ordering::Acquire);
            let wait = if poked {
                Duration::ZERO
            } else {
                PROGRESS_INTERVAL
            };
            let batch = tokio::select! {
                _ = cancel.cancelled() => return,
                changed = self.wanted.changed(), if !poked => {
                    if changed.is_err() {
                        return;
                    }
                    continue;
                }
                b = hub.watch(&self.spec.filter, Some(from), wait, BATCH_LIMIT, Resume::AtMark) => b,
            };
            let batch = match batch {
                Ok(b) => b,
                Err(c) => {
                    let gone = WatchResponse {
                        header: self.etcd.header(),
                        watch_id: self.id,
                        canceled: true,
                        compact_revision: c.compacted.next().0 as i64,
                        cancel_reason: "etcdserver: mvcc: required revision has been compacted"
                            .into(),
                        ..Default::default()
                    };
                    let _ = self.out.send(Ok(gone)).await;
                    return;
                }
            };
            if hub.is_closed() {
                return;
            }
            // The response is bounded as the batch is, now by its encoded events (`prev_kv`
            // doubles a value, and a small change may follow a large version): it ends
            // before the revision that would pass the bound, unless that revision is alone,
            // and the next round reads on from that revision.
            let mut cut = BatchCut::new(BatchLimit {
                events: usize::MAX,
                bytes: RESPONSE_BYTES,
            });
            let mut through = batch.through;
            let mut events: Vec<mvccpb::Event> = Vec::new();
            let visible = batch
                .events
                .iter()
                .filter(|e| self.spec.range.contains_stored(&e.key))
                .filter(|e| match e.kind {
                    EventKind::Put => !self.spec.no_put,
                    EventKind::Delete => !self.spec.no_delete,
                })
                .filter(|e| can_read(&self.etcd.state, &self.caller, &e.key));
            for e in visible {
                let mut out = event(e);
                if self.spec.prev_kv {
                    out.prev_kv = view
                        .version_before(&e.key, e.revision)
                        .map(|v| key_value(&e.key, &v));
                }
                match cut.offer(e.revision, out.encoded_len()) {
                    Cut::Take => events.push(out),
                    Cut::End { keep, through: t } => {
                        events.truncate(keep);
                        through = t;
                        break;
                    }
                }
            }
            // A periodic progress notification, when asked for: not one a progress request
            // prompted (that one is the stream's, with watch id -1).
            let progress = events.is_empty() && batch.events.is_empty() && !poked;
            let sends_events = !events.is_empty();
            if sends_events {
                // Said before the events are queued, so that a progress answer reading it
                // after goes no lower than them. (One that read it just before and is queued
                // just after them still could: a window of a few instructions, not closed.)
                self.events_sent.fetch_max(through.0, Ordering::AcqRel);
            }
            if sends_events || (progress && self.spec.progress_notify) {
                let resp = WatchResponse {
                    header: self.etcd.header_at(through),
                    watch_id: self.id,
                    events,
                    ..Default::default()
                };
                let parts = if self.spec.fragment {
                    fragments(resp, FRAGMENT_BYTES)
                } else {
                    vec![resp]
                };
                for part in parts {
                    if self.out.send_events(part).await.is_err() {
                        return;
                    }
                }
            }
            self.delivered.store(through.0, Ordering::Release);
            if poked && through.0 >= want {
                self.synced.notify_one();
            }
            from = through.next();
        }
    }
}

/// `resp` as etcd sends it to a watcher that asked for fragments: whole when it fits in
/// `limit` bytes, else its events split in order into responses of at most `limit` bytes each
/// (at least one event each), all but the last marked `fragment`.
fn fragments(resp: WatchResponse, limit: usize) -> Vec<WatchResponse> {
    if resp.encoded_len() <= limit || resp.events.len() < 2 {
        return vec![resp];
    }
    let mut shell = resp.clone();
    shell.events.clear();
    shell.fragment = true; // counted in every part's size; the last part is cleared below
    let base = shell.encoded_len();
    let mut parts: Vec<WatchResponse> = Vec::new();
    let mut current = shell.clone();
    let mut size = base;
    for e in resp.events {
        // An event's share of the response: its bytes plus the field's tag and length.
        let len = e.encoded_len();
        let share = len + prost::length_delimiter_len(len) + 1;
        if !current.events.is_empty() && size + share > limit {
            let full = std::mem::replace(&mut current, shell.clone());
            parts.push(full);
            size = base;
        }
        current.events.push(e);
        size += share;
    }
    parts.push(current);
    if let Some(last) = parts.last_mut() {
        last.fragment = false;
    }
    parts
}

#[tonic::async_trait]
impl Watch for Etcd {
    type WatchStream = WatchStream;

    async fn watch(
        &self,
        req: Request<Streaming<WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let caller = self.caller(&req)?;
        let conn = req.extensions().get::<ConnHandle>().cloned();
        let require_leader = super::requires_leader(req.metadata().as_ref());
        Ok(Response::new(self.watch_session(
            caller,
            conn,
            require_leader,
            req.into_inner(),
        )))
    }
}

impl Etcd {
    /// A watch stream fed by `inbound` (a gRPC stream, or the gateway's one request): the
    /// session lives until `inbound` ends, the client stops reading, or the node stops. With
    /// `conn` (the request's connection), a client that takes nothing from a full queue for
    /// the connection's write timeout loses its connection.
    pub(super) fn watch_session(
        &self,
        caller: Caller,
        conn: Option<ConnHandle>,
        require_leader: bool,
        inbound: impl Stream<Item = Result<WatchRequest, Status>> + Unpin + Send + 'static,
    ) -> WatchStream {
        let Ok(slot) = self.watch_budget.streams.clone().try_acquire_owned() else {
            let full = Status::resource_exhausted(format!(
                "etcdserver: this member serves at most {MAX_WATCH_STREAMS} watch streams"
            ));
            return Box::pin(futures::stream::once(async move { Err(full) }));
        };
        let (tx, rx) = mpsc::channel(QUEUE);
        let taken = Arc::new(AtomicU64::new(0));
        let out = Outbox {
            tx,
            bytes: Arc::new(Semaphore::new(QUEUE_BYTES)),
            shared: self.watch_budget.queued.clone(),
            taken: taken.clone(),
            conn,
        };
        let session = Session {
            etcd: self.clone(),
            caller,
            out,
            watchers: HashMap::new(),
            next_id: 0,
            done: CancellationToken::new(),
            wanted: watch::Sender::new(0),
            synced: Arc::new(Notify::new()),
            events_sent: Arc::new(AtomicU64::new(0)),
            pending_progress: None,
            require_leader,
        };
        tokio::spawn(session.run(inbound));
        // The stream holds its slot until it is dropped.
        let stream =
            futures::stream::unfold((rx, taken, slot), |(mut rx, taken, slot)| async move {
                // The queue's bytes are released as the stream takes the response.
                let queued = rx.recv().await?;
                taken.fetch_add(1, Ordering::Release);
                Some((queued.resp, (rx, taken, slot)))
            });
        Box::pin(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn put(key: &str, value_len: usize) -> mvccpb::Event {
        mvccpb::Event {
            kv: Some(mvccpb::KeyValue {
                key: key.as_bytes().to_vec(),
                value: vec![b'x'; value_len],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    proptest! {
        /// Fragments keep every event in order, each fits the limit (unless one event alone
        /// does not), and only the last is not marked.
        #[test]
        fn fragments_split_in_order_within_the_limit(
            sizes in proptest::collection::vec(0usize..400, 0..40),
            limit in 64usize..2000,
        ) {
            let events: Vec<_> = sizes.iter().enumerate().map(|(i, n)| put(&format!("k{i}"), *n)).collect();
            let resp = WatchResponse { watch_id: 7, events: events.clone(), ..Default::default() };
            let parts = fragments(resp, limit);
            let joined: Vec<_> = parts.iter().flat_map(|p| p.events.clone()).collect();
            prop_assert_eq!(joined, events);
            for (i, p) in parts.iter().enumerate() {
                prop_assert_eq!(p.fragment, i + 1 < parts.len());
                prop_assert_eq!(p.watch_id, 7);
                prop_assert!(p.encoded_len() <= limit || p.events.len() == 1);
            }
        }
    }

    /// A stream's queue drawing on `shared` as the node's budget.
    fn outbox(
        shared: &Arc<Semaphore>,
        conn: Option<ConnHandle>,
    ) -> (Outbox, mpsc::Receiver<Queued>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let out = Outbox {
            tx,
            bytes: Arc::new(Semaphore::new(QUEUE_BYTES)),
            shared: shared.clone(),
            taken: Arc::new(AtomicU64::new(0)),
            conn,
        };
        (out, rx)
    }

    fn events_of(bytes: usize) -> WatchResponse {
        let mut resp = WatchResponse {
            events: vec![put("k", bytes)],
            ..Default::default()
        };
        // Exactly `bytes` encoded, so that the shares below are exact.
        let over = resp.encoded_len() - bytes;
        resp.events[0]
            .kv
            .as_mut()
            .unwrap()
            .value
            .truncate(bytes - over);
        assert_eq!(resp.encoded_len(), bytes);
        resp
    }

    /// Beyond its own share a stream's queue draws on the node's budget: stalled streams
    /// together hold at most the budget, and a stream that keeps up is never held back by
    /// them.
    #[tokio::test]
    async fn streams_beyond_their_own_share_draw_on_the_node_budget() {
        use futures::FutureExt;
        let shared = Arc::new(Semaphore::new(4 * OWN_QUEUE_BYTES));
        let (a, _a_rx) = outbox(&shared, None);
        let share = events_of(OWN_QUEUE_BYTES);
        // Its own share, then four more such responses from the budget.
        for _ in 0..5 {
            a.send_events(share.clone()).await.unwrap();
        }
        assert_eq!(shared.available_permits(), 0);
        assert!(
            a.send_events(share.clone()).now_or_never().is_none(),
            "the budget is spent: the sixth waits"
        );
        // Another stream's own share does not wait for the budget.
        let (b, mut b_rx) = outbox(&shared, None);
        b.send_events(share.clone()).await.unwrap();
        assert!(b.send_events(share.clone()).now_or_never().is_none());
        // A stream taking its responses gives the budget back.
        drop(_a_rx);
        assert_eq!(shared.available_permits(), 4 * OWN_QUEUE_BYTES);
        drop(b_rx.recv().await);
    }

    /// A watcher that waits for the node's budget while its own client takes nothing for the
    /// write timeout closes that client's connection; one whose client takes responses meanwhile
    /// goes on waiting.
    #[tokio::test(start_paused = true)]
    async fn a_stream_waiting_for_the_budget_whose_client_takes_nothing_is_cut_off() {
        use crate::http::listener::ConnStats;
        let within = Duration::from_secs(5);
        let shared = Arc::new(Semaphore::new(0));
        let share = events_of(OWN_QUEUE_BYTES);

        let (close, stats) = (CancellationToken::new(), Arc::new(ConnStats::default()));
        let conn = ConnHandle::new(close.clone(), within, stats.clone());
        let (stalled, _rx) = outbox(&shared, Some(conn));
        stalled.send_events(share.clone()).await.unwrap();
        assert!(stalled.send_events(share.clone()).await.is_err());
        assert!(close.is_cancelled());
        assert_eq!(stats.write_timeouts.load(Ordering::Relaxed), 1);

        let close = CancellationToken::new();
        let conn = ConnHandle::new(close.clone(), within, stats.clone());
        let (reading, mut rx) = outbox(&shared, Some(conn));
        reading.send_events(share.clone()).await.unwrap();
        let taken = reading.taken.clone();
        let budget = shared.clone();
        let client = async move {
            // Takes its queued response within the timeout; the budget frees up later.
            tokio::time::sleep(within - Duration::from_secs(1)).await;
            drop(rx.recv().await);
            taken.fetch_add(1, Ordering::Release);
            tokio::time::sleep(within * 2).await;
            budget.add_permits(OWN_QUEUE_BYTES);
            rx
        };
        let (sent, _rx) = tokio::join!(reading.send_events(share.clone()), client);
        assert!(sent.is_ok());
        assert!(!close.is_cancelled());
    }

    /// A client that does not read holds at most [`QUEUE_BYTES`] of events in its queue:
    /// a watcher waits for room, and the stream taking a response makes room.
    #[tokio::test]
    async fn the_queue_is_bounded_by_bytes() {
        use futures::FutureExt;
        let (out, mut rx) = outbox(&Arc::new(Semaphore::new(NODE_QUEUE_BYTES)), None);
        let resp = WatchResponse {
            events: vec![put("k", 1 << 20)],
            ..Default::default()
        };
        for _ in 0..3 {
            out.send_events(resp.clone()).await.unwrap();
        }
        assert!(
            out.send_events(resp.clone()).now_or_never().is_none(),
            "a fourth MiB waits"
        );
        // Control responses are not held back.
        out.send(Ok(WatchResponse::default())).await.unwrap();
        drop(rx.recv().await.unwrap());
        assert!(out.send_events(resp.clone()).now_or_never().is_some());
        // One response larger than the whole budget waits for an empty queue, then goes.
        let huge = WatchResponse {
            events: vec![put("k", QUEUE_BYTES + 1)],
            ..Default::default()
        };
        assert!(out.send_events(huge.clone()).now_or_never().is_none());
        while out.bytes.available_permits() < QUEUE_BYTES {
            drop(rx.recv().await.unwrap());
        }
        assert!(out.send_events(huge).now_or_never().is_some());
    }

    /// A queue that has no room for a response for the connection's write timeout closes the
    /// connection (its client stopped taking the stream), and the watcher stops.
    #[tokio::test(start_paused = true)]
    async fn a_queue_full_for_the_write_timeout_closes_the_connection() {
        use crate::http::listener::ConnStats;
        let close = CancellationToken::new();
        let stats = Arc::new(ConnStats::default());
        let within = Duration::from_secs(5);
        let conn = ConnHandle::new(close.clone(), within, stats.clone());
        let (out, mut rx) = outbox(&Arc::new(Semaphore::new(NODE_QUEUE_BYTES)), Some(conn));
        let resp = WatchResponse {
            events: vec![put("k", 1 << 20)],
            ..Default::default()
        };
        for _ in 0..3 {
            out.send_events(resp.clone()).await.unwrap();
        }
        // The client takes one response just before the timeout: the wait ends in time.
        let taken = async {
            tokio::time::sleep(within - Duration::from_secs(1)).await;
            drop(rx.recv().await);
            rx
        };
        let (sent, _rx) = tokio::join!(out.send_events(resp.clone()), taken);
        sent.unwrap();
        assert!(!close.is_cancelled());
        // Then it takes nothing.
        assert!(out.send_events(resp).await.is_err());
        assert!(close.is_cancelled());
        assert_eq!(stats.write_timeouts.load(Ordering::Relaxed), 1);
    }
}
