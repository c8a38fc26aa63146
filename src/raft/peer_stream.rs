//! Peer streams: Raft's AppendEntries (heartbeats included) and the other peer requests
//! (tunneled: path, content type, body) as length-prefixed frames on persistent connections,
//! instead of one HTTP request each. Snapshots and the status document stay on plain HTTP.
//!
//! A stream starts as an HTTP/1.1 request on the peer listener, `GET /raft/stream` with
//! `Upgrade: leasecore-peer/1` and the sender header, so it passes the same TLS and the same
//! membership gate (`http::peer_trust`) as every peer request; the node answers `101 Switching
//! Protocols` and from then on both sides exchange frames on the bare connection:
//!
//! ```text
//! request:  [u32 BE length][u8 kind  ][payload]   length = 1 + payload's length
//! answer:   [u32 BE length][u8 status][payload]
//! ```
//!
//! One request at a time per stream, each answered before the next is sent: no ids, no
//! reordering. A caller takes an idle stream of the pool ([`StreamPool`]), or opens one, and
//! gives it back only after a whole exchange succeeded; a stream that failed or timed out in the
//! middle (an answer may still be on its way) is dropped, never reused.
//!
//! Why: per append, hyper, reqwest and axum cost about a fifth of each node's CPU at one client
//! connection (URL parsing, headers, the pool's connection task and its wake-ups, routing,
//! middleware), for messages whose whole content is a MessagePack body. openraft also makes a
//! new network client for every heartbeat round that confirms leadership; the pool lets those
//! rounds reuse streams as well.
//!
//! # Invariants
//! - Every length is checked against a cap before anything is allocated for it (a hostile
//!   peer cannot make this node reserve a gigabyte with five bytes).
//! - A frame larger than [`SMALL_FRAME`] is read only within the node's [`FrameBudget`], held
//!   until it has been handled: streams that each send (or stall in the middle of) a huge
//!   frame together hold at most the budget, not the cap times the stream count. Small frames
//!   (every heartbeat, and appends, which senders cut to about a mebibyte) never wait for it.
//! - A peer that does not serve streams (a build before them answers the upgrade with 404) is
//!   asked again only after [`FALLBACK_FOR`]; meanwhile its messages go over plain HTTP as
//!   before. Any other refusal of the upgrade sends that one message over plain HTTP.
//! - A stream's sender that leaves before its answer cancels the request on the other side
//!   (`http::peer_stream`), as closing an HTTP connection cancels its handler.
//!
//! # What it must not do
//! Decide anything about Raft: it moves frames; `raft::network` maps errors for openraft and
//! `http::peer_stream` hands frames to the same checks as the HTTP routes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::domain::types::MonoMillis;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

/// The `Upgrade` token of the peer stream protocol.
pub const PROTOCOL: &str = "leasecore-peer/1";

/// Request kind: an AppendEntries request, MessagePack; answered with the JSON document
/// `{"Ok": AppendEntriesResponse} | {"Err": RaftError}`, as the HTTP route answers.
pub const KIND_APPEND: u8 = 1;

/// Request kind: any other peer request (`raft::network::routes`), tunneled: the payload is
/// [`request_payload`] (path, content type, body); the node hands it to its peer router as if
/// it had come over HTTP from the stream's sender, and answers with [`answer_payload`] (status,
/// body). Snapshots are not tunneled (a stream is for small messages).
pub const KIND_REQUEST: u8 = 2;

/// Answer status: the request's answer.
pub const ANSWERED: u8 = 0;
/// Answer status: the request was refused before it reached Raft; the payload is the JSON
/// error document a 4xx HTTP answer would carry.
pub const REFUSED: u8 = 1;

/// The largest answer read from a peer: answers are small documents.
pub const MAX_ANSWER_FRAME: usize = 1 << 20;

/// How long a peer that does not serve streams is left on plain HTTP before it is asked again
/// (a rolling upgrade replaces it in the meantime).
pub const FALLBACK_FOR: Duration = Duration::from_secs(60);

/// Idle streams kept per peer. openraft sends to a peer from its replication task and, for
/// each leadership confirmation, from one more task at a time: a few streams serve both.
pub const MAX_IDLE_PER_PEER: usize = 4;

/// A pooled stream idle for longer than this is closed rather than reused: the peer listener
/// closes a connection idle for its header timeout (90 s by default), and a stream closed
/// under a request would fail that request.
pub const MAX_IDLE: Duration = Duration::from_secs(30);

/// What is wrong with a frame's head.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("an empty frame (no kind byte)")]
    Empty,
    #[error("a frame of {len} bytes exceeds the {cap}-byte limit")]
    TooLong { len: usize, cap: usize },
}

/// Start a frame of `kind`: its head, with the length to be set by [`finish_frame`]. The
/// payload is written after it (MessagePack encodes straight into the frame: one buffer).
pub fn start_frame(kind: u8, capacity: usize) -> Vec<u8> {
    let mut frame = Vec::with_capacity(5 + capacity);
    frame.extend_from_slice(&[0, 0, 0, 0, kind]);
    frame
}

/// Set the length of a frame begun with [`start_frame`]; `Err` if it does not fit a `u32`.
pub fn finish_frame(mut frame: Vec<u8>) -> Result<Vec<u8>, FrameError> {
    let len = frame.len() - 4;
    let as_u32 = u32::try_from(len).map_err(|_| FrameError::TooLong {
        len,
        cap: u32::MAX as usize,
    })?;
    frame[..4].copy_from_slice(&as_u32.to_be_bytes());
    Ok(frame)
}

/// A whole frame of `kind` carrying `payload`.
pub fn frame(kind: u8, payload: &[u8]) -> Result<Vec<u8>, FrameError> {
    let mut f = start_frame(kind, payload.len());
    f.extend_from_slice(payload);
    finish_frame(f)
}

/// The payload length a frame's 4-byte length announces, checked against `cap` (the payload's
/// largest size).
pub fn payload_len(head: [u8; 4], cap: usize) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(head) as usize;
    if len == 0 {
        return Err(FrameError::Empty);
    }
    let payload = len - 1;
    if payload > cap {
        return Err(FrameError::TooLong { len: payload, cap });
    }
    Ok(payload)
}

/// A tunneled request: `[u16 BE path length][path][u16 BE content type length][content
/// type][body]`, as a frame of [`KIND_REQUEST`].
pub fn request_frame(path: &str, content_type: &str, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let too_long = |len| FrameError::TooLong {
        len,
        cap: u16::MAX as usize,
    };
    let path_len = u16::try_from(path.len()).map_err(|_| too_long(path.len()))?;
    let ct_len = u16::try_from(content_type.len()).map_err(|_| too_long(content_type.len()))?;
    let mut f = start_frame(
        KIND_REQUEST,
        4 + path.len() + content_type.len() + body.len(),
    );
    f.extend_from_slice(&path_len.to_be_bytes());
    f.extend_from_slice(path.as_bytes());
    f.extend_from_slice(&ct_len.to_be_bytes());
    f.extend_from_slice(content_type.as_bytes());
    f.extend_from_slice(body);
    finish_frame(f)
}

/// A tunneled request's parts: (path, content type, body). `Err` says what is malformed.
pub fn parse_request(payload: &[u8]) -> Result<(&str, &str, &[u8]), &'static str> {
    let (path, rest) = take_prefixed(payload).ok_or("a tunneled request's path is cut short")?;
    let (ct, body) = take_prefixed(rest).ok_or("a tunneled request's content type is cut short")?;
    let path = std::str::from_utf8(path).map_err(|_| "a tunneled request's path is not UTF-8")?;
    let ct =
        std::str::from_utf8(ct).map_err(|_| "a tunneled request's content type is not UTF-8")?;
    Ok((path, ct, body))
}

/// `[u16 BE length][bytes]` off the front of `buf`: the bytes and the rest.
fn take_prefixed(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u16::from_be_bytes(buf.get(..2)?.try_into().ok()?) as usize;
    let end = 2 + len;
    Some((buf.get(2..end)?, &buf[end..]))
}

/// A tunneled answer (inside an [`ANSWERED`] frame): `[u16 BE HTTP status][body]`.
pub fn answer_frame(status: u16, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let mut f = start_frame(ANSWERED, 2 + body.len());
    f.extend_from_slice(&status.to_be_bytes());
    f.extend_from_slice(body);
    finish_frame(f)
}

/// A tunneled answer's status and body.
pub fn parse_answer(payload: &[u8]) -> Result<(u16, &[u8]), &'static str> {
    let status = payload
        .get(..2)
        .ok_or("a tunneled answer without a status")?;
    Ok((u16::from_be_bytes([status[0], status[1]]), &payload[2..]))
}

/// A frame as read: its kind (or status) byte and its payload.
pub type Frame = (u8, Vec<u8>);

/// Payloads up to this size are read without drawing on a [`FrameBudget`]: at most
/// `MAX_PEER_STREAMS` of them are held at once.
pub const SMALL_FRAME: usize = 1 << 20;

/// The bytes of large frames (over [`SMALL_FRAME`]) that a node's peer streams may read and
/// handle at once, together. A frame waits for its share before its payload is read.
#[derive(Clone, Debug)]
pub struct FrameBudget {
    /// In KiB (a semaphore counts in `u32`).
    kib: std::sync::Arc<tokio::sync::Semaphore>,
    total_kib: u32,
}

impl FrameBudget {
    pub fn new(bytes: usize) -> Self {
        let total_kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        FrameBudget {
            kib: std::sync::Arc::new(tokio::sync::Semaphore::new(total_kib as usize)),
            total_kib,
        }
    }

    /// The share of a payload of `len` bytes, waited for (none for a small one). A payload
    /// larger than the whole budget is refused.
    async fn share(
        &self,
        len: usize,
    ) -> std::io::Result<Option<tokio::sync::OwnedSemaphorePermit>> {
        if len <= SMALL_FRAME {
            return Ok(None);
        }
        let kib = u32::try_from(len.div_ceil(1024))
            .ok()
            .filter(|k| *k <= self.total_kib)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a frame larger than the node's budget for large peer frames",
                )
            })?;
        let permit = self.kib.clone().acquire_many_owned(kib).await;
        permit.map(Some).map_err(std::io::Error::other)
    }
}

/// Read one frame whose payload is at most `cap` bytes. `Ok(None)`: the other side closed the
/// stream cleanly between frames. The payload is read as it arrives, never reserved whole in
/// advance beyond what has come.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    cap: usize,
) -> std::io::Result<Option<Frame>> {
    Ok(read_frame_within(r, cap, None)
        .await?
        .map(|(frame, _)| frame))
}

/// [`read_frame`], a large payload read only within `budget` (when given): the frame comes
/// with its share, to be dropped once the frame has been handled.
pub async fn read_frame_within<R: AsyncRead + Unpin>(
    r: &mut R,
    cap: usize,
    budget: Option<&FrameBudget>,
) -> std::io::Result<Option<(Frame, Option<tokio::sync::OwnedSemaphorePermit>)>> {
    let mut head = [0u8; 4];
    // Nothing at all before the head: a clean end. Part of a head: a torn frame.
    let first = r.read(&mut head).await?;
    if first == 0 {
        return Ok(None);
    }
    r.read_exact(&mut head[first..]).await?;
    let len = payload_len(head, cap)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let share = match budget {
        Some(b) => b.share(len).await?,
        None => None,
    };
    let kind = r.read_u8().await?;
    let mut payload = Vec::with_capacity(len.min(1 << 20));
    let read = r.take(len as u64).read_to_end(&mut payload).await?;
    if read < len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(((kind, payload), share)))
}

/// Write a whole frame (one write call for the common case) and flush it.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8]) -> std::io::Result<()> {
    w.write_all(frame).await?;
    w.flush().await
}

/// One open stream to a peer (the client side).
pub struct PeerStream {
    io: BufReader<reqwest::Upgraded>,
    /// When it was last given back to the pool (set by the pool).
    idle_since: MonoMillis,
}

impl PeerStream {
    pub fn new(io: reqwest::Upgraded) -> Self {
        PeerStream {
            io: BufReader::new(io),
            idle_since: MonoMillis(0),
        }
    }

    /// Whether the peer has closed the stream (or sent what it should not have) while it sat
    /// idle in the pool. Checked without waiting: a peer that restarted has closed its end,
    /// and a request sent on that stream would fail after it may have been delivered (a
    /// forwarded write would then answer `outcome_unknown`) instead of going on a new one.
    fn is_stale(&mut self) -> bool {
        use tokio::io::AsyncBufRead;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Pending (nothing to read) is the healthy idle state; anything ready is the end of
        // the stream, an error, or bytes no request asked for.
        std::pin::Pin::new(&mut self.io)
            .poll_fill_buf(&mut cx)
            .is_ready()
    }

    /// Send one request frame and read its answer (of at most `cap` bytes).
    pub async fn exchange(&mut self, frame: &[u8], cap: usize) -> std::io::Result<Frame> {
        write_frame(self.io.get_mut(), frame).await?;
        read_frame(&mut self.io, cap)
            .await?
            .ok_or_else(|| std::io::Error::other("the peer closed the stream without an answer"))
    }
}

/// Idle streams per peer address, and the peers that do not serve streams.
#[derive(Default)]
pub struct StreamPool {
    clock: SystemClock,
    idle: Mutex<HashMap<String, Vec<PeerStream>>>,
    /// Peers that answered "no such route", until when they stay on plain HTTP.
    plain_until: Mutex<HashMap<String, MonoMillis>>,
}

impl StreamPool {
    /// An idle stream to `addr`, if one is fresh enough (stale ones are dropped).
    pub fn take(&self, addr: &str) -> Option<PeerStream> {
        let now = self.clock.mono();
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let streams = idle.get_mut(addr)?;
        while let Some(mut s) = streams.pop() {
            if s.idle_since.until(now) < MAX_IDLE.as_millis() as u64 && !s.is_stale() {
                return Some(s);
            }
        }
        None
    }

    /// Give back a stream after a whole exchange (kept if the peer's idle list has room).
    pub fn give_back(&self, addr: &str, mut stream: PeerStream) {
        stream.idle_since = self.clock.mono();
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let streams = idle.entry(addr.to_string()).or_default();
        if streams.len() < MAX_IDLE_PER_PEER {
            streams.push(stream);
        }
    }

    /// Whether `addr` is to be reached over plain HTTP for now.
    pub fn plain(&self, addr: &str) -> bool {
        let now = self.clock.mono();
        let mut plain = self.plain_until.lock().unwrap_or_else(|p| p.into_inner());
        match plain.get(addr) {
            Some(until) if now < *until => true,
            Some(_) => {
                plain.remove(addr);
                false
            }
            None => false,
        }
    }

    /// `addr` does not serve streams: plain HTTP for [`FALLBACK_FOR`].
    pub fn use_plain(&self, addr: &str) {
        tracing::info!(
            addr,
            "peer does not serve peer streams (an older build?): plain HTTP for {} s",
            FALLBACK_FOR.as_secs()
        );
        self.plain_until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                addr.to_string(),
                self.clock.mono().plus(FALLBACK_FOR.as_millis() as u64),
            );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Large frames share one budget: a second one waits until the first is handled (its
    /// share dropped), one larger than the budget is refused, and small ones never wait.
    #[tokio::test]
    async fn large_frames_are_read_within_the_budget() {
        let budget = FrameBudget::new(3 << 20);
        let big = frame(KIND_APPEND, &vec![7u8; 2 << 20]).unwrap();
        let (mut a, mut a_in) = tokio::io::duplex(8 << 20);
        let (mut b, mut b_in) = tokio::io::duplex(8 << 20);
        a.write_all(&big).await.unwrap();
        b.write_all(&big).await.unwrap();
        let (first, share) = read_frame_within(&mut a_in, 1 << 30, Some(&budget))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first.1.len(), 2 << 20);
        assert!(share.is_some());
        let mut second = Box::pin(read_frame_within(&mut b_in, 1 << 30, Some(&budget)));
        let waited = tokio::time::timeout(Duration::from_millis(50), &mut second).await;
        assert!(
            waited.is_err(),
            "the second large frame waits for the budget"
        );

        // A small frame on a third stream is read meanwhile.
        let (mut c, mut c_in) = tokio::io::duplex(1 << 20);
        c.write_all(&frame(KIND_APPEND, b"heartbeat").unwrap())
            .await
            .unwrap();
        let (small, none) = read_frame_within(&mut c_in, 1 << 30, Some(&budget))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(small.1, b"heartbeat");
        assert!(none.is_none());

        drop(share);
        let (got, _share) = second.await.unwrap().unwrap();
        assert_eq!(got.1.len(), 2 << 20);

        // Larger than the whole budget: refused before its payload is read.
        let (mut d, mut d_in) = tokio::io::duplex(1 << 10);
        d.write_all(&((4u32 << 20) + 1).to_be_bytes())
            .await
            .unwrap();
        let refused = read_frame_within(&mut d_in, 1 << 30, Some(&budget)).await;
        assert_eq!(refused.unwrap_err().kind(), std::io::ErrorKind::InvalidData);
    }
    use proptest::prelude::*;

    #[test]
    fn a_frame_announces_its_kind_and_payload() {
        let f = frame(KIND_APPEND, b"abc").unwrap();
        assert_eq!(f, [0, 0, 0, 4, KIND_APPEND, b'a', b'b', b'c']);
        assert_eq!(payload_len([0, 0, 0, 4], 3), Ok(3));
    }

    #[test]
    fn impossible_lengths_are_refused_before_any_allocation() {
        assert_eq!(payload_len([0, 0, 0, 0], 10), Err(FrameError::Empty));
        assert_eq!(
            payload_len([0xff, 0xff, 0xff, 0xff], 1 << 20),
            Err(FrameError::TooLong {
                len: u32::MAX as usize - 1,
                cap: 1 << 20
            })
        );
        assert_eq!(payload_len([0, 0, 0, 11], 10), Ok(10));
        assert!(payload_len([0, 0, 0, 12], 10).is_err());
    }

    #[tokio::test]
    async fn frames_read_back_whole_and_a_torn_one_is_an_error() {
        let mut bytes = frame(KIND_APPEND, b"hello").unwrap();
        bytes.extend(frame(REFUSED, b"").unwrap());
        let mut r = &bytes[..];
        assert_eq!(
            read_frame(&mut r, 64).await.unwrap(),
            Some((KIND_APPEND, b"hello".to_vec()))
        );
        assert_eq!(
            read_frame(&mut r, 64).await.unwrap(),
            Some((REFUSED, vec![]))
        );
        assert_eq!(read_frame(&mut r, 64).await.unwrap(), None);
        // Cut inside the payload: not a clean end.
        let torn = frame(KIND_APPEND, b"hello").unwrap();
        let mut r = &torn[..7];
        assert!(read_frame(&mut r, 64).await.is_err());
        // Longer than the reader's cap: refused from the head alone.
        let mut r = &torn[..];
        let e = read_frame(&mut r, 4).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_tunneled_request_and_answer_read_back() {
        let f = request_frame("/raft/propose", "application/json", b"{}").unwrap();
        assert_eq!(f[4], KIND_REQUEST);
        assert_eq!(
            parse_request(&f[5..]),
            Ok(("/raft/propose", "application/json", &b"{}"[..]))
        );
        let a = answer_frame(404, b"").unwrap();
        assert_eq!(a[4], ANSWERED);
        assert_eq!(parse_answer(&a[5..]), Ok((404, &b""[..])));
        assert!(parse_answer(&[1]).is_err());
    }

    proptest! {
        /// No payload, however malformed, makes the request parser panic; a well-formed one
        /// reads back exactly.
        #[test]
        fn tunneled_requests_parse_or_refuse(
            junk in proptest::collection::vec(any::<u8>(), 0..64),
            path in "[a-z/_]{0,20}",
            ct in "[a-z/]{0,20}",
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let _ = parse_request(&junk);
            let _ = parse_answer(&junk);
            let f = request_frame(&path, &ct, &body).unwrap();
            prop_assert_eq!(parse_request(&f[5..]), Ok((&path[..], &ct[..], &body[..])));
        }

        /// Any sequence of frames reads back as written; any cut of it reads back a prefix
        /// and then either ends cleanly (a cut between frames) or fails (a cut inside one).
        #[test]
        fn frames_survive_any_cut(
            payloads in proptest::collection::vec(
                (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..40)), 0..8),
            cut_at in any::<proptest::sample::Index>(),
        ) {
            let mut bytes = Vec::new();
            let mut ends = vec![0];
            for (k, p) in &payloads {
                bytes.extend(frame(*k, p).unwrap());
                ends.push(bytes.len());
            }
            let cut = if bytes.is_empty() { 0 } else { cut_at.index(bytes.len() + 1) };
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let mut r = &bytes[..cut];
                let mut read = Vec::new();
                let end = loop {
                    match read_frame(&mut r, 64).await {
                        Ok(Some(f)) => read.push(f),
                        Ok(None) => break true,
                        Err(_) => break false,
                    }
                };
                prop_assert_eq!(&read[..], &payloads[..read.len()]);
                prop_assert_eq!(end, ends.contains(&cut));
                Ok(())
            })?;
        }
    }
}
