//! Mends the HTTP/2 `:authority` that some etcd clients send, before hyper's HTTP/2 server (the
//! `h2` crate) sees it.
//!
//! etcdctl 3.4, given an endpoint with a scheme (`--endpoints=http://127.0.0.1:2379`, and every
//! `--cluster` command, which dials the members' advertised URLs), sends the whole URL as
//! `:authority`; etcd's 3.5.0 client sent `#initially=[http://...;...]` (etcd issues 13192 and
//! 13359). Neither is an authority, and `h2` resets such a request (PROTOCOL_ERROR) before any
//! leasecore code runs; h2's maintainers will not make it lenient (h2 issue 525), while etcd's
//! Go server accepts it. [`AuthorityShim`] sits between an etcd listener's accepted connection
//! (after TLS) and hyper, and rewrites such a field into the authority it names.
//!
//! # How
//! Only the client-to-server direction is read; writes pass straight through. A connection
//! that does not open with HTTP/2's client preface (HTTP/1.1 for the JSON gateway) is passed
//! through untouched from its first byte to its last. On an HTTP/2 connection, frames are
//! followed by their 9-byte headers: a frame that carries no header block (DATA, SETTINGS,
//! PING, ...) is passed through as it comes, never held, its payload not even looked at. A
//! header block (HEADERS and its CONTINUATION frames) is held until whole and decoded with an
//! HPACK decoder ([`hpack`]) that tracks the client's dynamic table. The first block with an
//! `:authority` decides:
//! - if that `:authority` is valid (as `http::uri::Authority` parses it, which is what h2
//!   checks), the block's original bytes go on, verbatim, and so does everything after it on
//!   that connection, not looked at again (as a connection that is not HTTP/2). A gRPC
//!   channel sends the authority it was made for on every request, and decoding every block
//!   cost about 5% of the leader's instructions per etcd Put;
//! - if it is invalid, the block is re-encoded, that field replaced with the
//!   authority found in it ([`usable_authority`]: the URL's `host:port`, the first URL of an
//!   `#initially=[...]` list) or left out if none is found (`:authority` is optional). From then
//!   on the client's table (tracked here) and h2's (which never sees the client's indexing
//!   again) differ, so every later block on that connection is re-encoded too. Re-encoded
//!   blocks use literals that are never added to the table, not Huffman-coded: h2's table is
//!   never touched again. They are framed anew: HEADERS (END_STREAM and the priority fields
//!   kept, the padding dropped) and CONTINUATION frames of at most 16384 bytes (hyper's
//!   SETTINGS_MAX_FRAME_SIZE), END_HEADERS on the last.
//!
//! # Invariants
//! - A client whose first `:authority` is valid gets byte-for-byte the stream it sent (the
//!   tests check it for any such stream and any split of it into reads).
//! - Bounded memory per connection: a header block over [`MAX_BLOCK`] bytes, as sent or as
//!   re-encoded, closes the connection (hyper refuses header lists over 16 KiB anyway); a
//!   frame that is not part of a header block is never held, whatever its length.
//! - No input panics: malformed framing around header blocks (a CONTINUATION out of place,
//!   padding longer than its frame, a PUSH_PROMISE from a client) closes the connection, as
//!   h2 would. A block that does not decode while nothing was rewritten yet is passed on as it
//!   is, and the connection is passed through untouched from then on (h2 judges it, as it did
//!   without the shim); once rewriting, it closes the connection.
//! - Hot path: DATA payloads are copied once (straight into hyper's buffer), except the part
//!   of a read that follows a held header block in the same read; header blocks, until the
//!   first valid `:authority`, cost one HPACK decode and one copy; after it, nothing.
//!
//! # What it must not do
//! Change anything else: other fields, their order and their "never indexed" mark, stream ids,
//! END_STREAM and priorities are kept; the server-to-client direction is not looked at. It
//! does not judge requests either: whatever else is malformed is left for h2 to refuse.

mod hpack;
mod huffman;

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::http::uri::Authority;
use bytes::{Buf, BufMut, BytesMut};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use hpack::{DecodeError, Field};

/// Bytes written as hex, whitespace ignored (the RFCs' examples, in the unit tests).
#[cfg(test)]
fn test_hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// What an HTTP/2 client sends first (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A frame header's length.
const HEAD_LEN: usize = 9;

const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;

const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// The largest header block held (its frames as sent, headers included) or written (its
/// re-encoded fields): four times hyper's limit on a header list.
pub const MAX_BLOCK: usize = 64 << 10;
/// The largest frame payload written: HTTP/2's default SETTINGS_MAX_FRAME_SIZE, which hyper's
/// server keeps.
const MAX_FRAME: usize = 16_384;
/// How much is read at a time while a header block is held.
const READ_CHUNK: usize = 8 << 10;
/// Scratch buffers that grew past this are given back after a block.
const KEEP_SCRATCH: usize = 16 << 10;

/// Why a connection is closed.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("a header block over {MAX_BLOCK} bytes")]
    BlockTooLarge,
    #[error("a CONTINUATION frame outside a header block")]
    StrayContinuation,
    #[error("a frame other than the stream's CONTINUATION inside a header block")]
    NotContinuation,
    #[error("a PUSH_PROMISE frame from a client")]
    PushPromise,
    #[error("a HEADERS frame shorter than its padding and priority")]
    ShortHeaders,
    #[error("a header block that does not decode: {0}")]
    Hpack(#[from] DecodeError),
}

impl From<ShimError> for io::Error {
    fn from(e: ShimError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// A frame header.
#[derive(Clone, Copy, Debug)]
struct Head {
    len: usize,
    kind: u8,
    flags: u8,
    /// Without the reserved bit.
    stream: u32,
}

impl Head {
    fn parse(b: &[u8]) -> Option<Head> {
        let b: &[u8; HEAD_LEN] = b.get(..HEAD_LEN)?.try_into().ok()?;
        Some(Head {
            len: u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize,
            kind: b[3],
            flags: b[4],
            stream: u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff,
        })
    }

    fn carries_headers(&self) -> bool {
        matches!(self.kind, HEADERS | CONTINUATION | PUSH_PROMISE)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// This many bytes of the client preface seen so far.
    Preface(usize),
    /// HTTP/2 frames.
    Frames,
    /// Not HTTP/2, lost track, or the first `:authority` was valid: everything passes
    /// untouched.
    Transparent,
}

/// A header block being held: its frames are `held[..end]`.
struct Block {
    end: usize,
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    /// Where its fragments are in `held`.
    fragments: SmallVec<[Range<usize>; 2]>,
}

/// The client-to-server byte stream's filter, without I/O: which bytes pass as they are,
/// which are held, and what a held header block becomes.
struct Filter {
    mode: Mode,
    /// Bytes of the current frame still to pass (a frame that carries no header block).
    pass: usize,
    block: Option<Block>,
    hpack: hpack::Decoder,
    /// Every block is re-encoded (a `:authority` was rewritten on this connection).
    rewriting: bool,
    /// Scratch: a block's fragments joined, and a block re-encoded.
    joined: Vec<u8>,
    encoded: Vec<u8>,
    /// The last `:authority` found valid, not parsed again while it repeats.
    valid: Vec<u8>,
}

impl Default for Filter {
    fn default() -> Self {
        Filter {
            mode: Mode::Preface(0),
            pass: 0,
            block: None,
            hpack: hpack::Decoder::default(),
            rewriting: false,
            joined: Vec::new(),
            encoded: Vec::new(),
            valid: Vec::new(),
        }
    }
}

impl Filter {
    /// How many leading bytes of `data` pass untouched, the filter advanced past them. The rest
    /// (from a header block's first frame, or a frame header cut by the end of `data`) must go
    /// through [`Filter::process`]. Only while nothing is held.
    fn pass_len(&mut self, data: &[u8]) -> usize {
        let mut at = 0;
        loop {
            match self.mode {
                Mode::Transparent => return data.len(),
                Mode::Preface(seen) => {
                    if at == data.len() {
                        return at;
                    }
                    at += self.sniff(seen, &data[at..]);
                }
                Mode::Frames => {
                    if self.block.is_some() {
                        return at;
                    }
                    let n = self.pass.min(data.len() - at);
                    self.pass -= n;
                    at += n;
                    if self.pass > 0 {
                        return at;
                    }
                    match data.get(at..).and_then(Head::parse) {
                        Some(head) if !head.carries_headers() => {
                            at += HEAD_LEN;
                            self.pass = head.len;
                        }
                        _ => return at,
                    }
                }
            }
        }
    }

    /// Match `data` against the rest of the preface: the bytes that belong to it (0 and
    /// [`Mode::Transparent`] at the first that does not).
    fn sniff(&mut self, seen: usize, data: &[u8]) -> usize {
        let want = &PREFACE[seen..];
        let n = want.len().min(data.len());
        if data[..n] != want[..n] {
            self.mode = Mode::Transparent;
            return 0;
        }
        self.mode = if seen + n == PREFACE.len() {
            Mode::Frames
        } else {
            Mode::Preface(seen + n)
        };
        n
    }

    /// The next bytes to deliver, taken from `held` (input not delivered yet), or `None` if
    /// more input is needed first.
    fn process(&mut self, held: &mut BytesMut) -> Result<Option<BytesMut>, ShimError> {
        loop {
            match self.mode {
                Mode::Transparent => return Ok((!held.is_empty()).then(|| held.split())),
                Mode::Preface(seen) => {
                    if held.is_empty() {
                        return Ok(None);
                    }
                    let n = self.sniff(seen, held);
                    if n > 0 {
                        return Ok(Some(held.split_to(n)));
                    }
                    continue;
                }
                Mode::Frames => {}
            }
            if self.pass > 0 {
                if held.is_empty() {
                    return Ok(None);
                }
                let n = self.pass.min(held.len());
                self.pass -= n;
                return Ok(Some(held.split_to(n)));
            }
            let at = self.block.as_ref().map_or(0, |b| b.end);
            let Some(head) = held.get(at..).and_then(Head::parse) else {
                return Ok(None);
            };
            if !head.carries_headers() {
                if self.block.is_some() {
                    return Err(ShimError::NotContinuation);
                }
                let n = (HEAD_LEN + head.len).min(held.len());
                self.pass = HEAD_LEN + head.len - n;
                return Ok(Some(held.split_to(n)));
            }
            if head.kind == PUSH_PROMISE {
                return Err(ShimError::PushPromise);
            }
            let end = at + HEAD_LEN + head.len;
            if end > MAX_BLOCK {
                return Err(ShimError::BlockTooLarge);
            }
            if held.len() < end {
                return Ok(None);
            }
            let payload = at + HEAD_LEN..end;
            match (&mut self.block, head.kind) {
                (None, HEADERS) => self.block = Some(headers_frame(head, payload, held)?),
                (Some(block), CONTINUATION) if block.stream == head.stream => {
                    block.fragments.push(payload);
                    block.end = end;
                }
                (None, _) => return Err(ShimError::StrayContinuation),
                (Some(_), _) => return Err(ShimError::NotContinuation),
            }
            if head.flags & END_HEADERS != 0
                && let Some(block) = self.block.take()
            {
                return self.resolve(block, held).map(Some);
            }
        }
    }

    /// A whole header block, `held[..block.end]`: what goes on in its place.
    fn resolve(&mut self, block: Block, held: &mut BytesMut) -> Result<BytesMut, ShimError> {
        let Filter {
            hpack,
            rewriting,
            joined,
            encoded,
            valid,
            ..
        } = self;
        let fragment: &[u8] = match block.fragments.as_slice() {
            [one] => &held[one.clone()],
            many => {
                joined.clear();
                for r in many {
                    joined.extend_from_slice(&held[r.clone()]);
                }
                joined
            }
        };
        // Every field is re-encoded as it is decoded, in case a `:authority` needs rewriting:
        // by then the earlier fields may have changed the table, so they cannot be decoded
        // again. Past MAX_BLOCK the copy stops; only a rewrite needs it.
        encoded.clear();
        let (mut bad, mut overflow) = (false, false);
        let was_rewriting = *rewriting;
        let decoded = hpack.decode(fragment, |mut field: Field<'_>| {
            if field.name == b":authority" && (valid.is_empty() || field.value != valid.as_slice())
            {
                if Authority::try_from(field.value).is_ok() {
                    valid.clear();
                    valid.extend_from_slice(field.value);
                } else {
                    let usable = usable_authority(field.value);
                    if !bad && !was_rewriting {
                        tracing::debug!(
                            sent = %String::from_utf8_lossy(field.value),
                            now = %usable.map_or("(left out)".into(), String::from_utf8_lossy),
                            "an invalid HTTP/2 :authority: this connection's header blocks are re-encoded",
                        );
                    }
                    bad = true;
                    match usable {
                        Some(authority) => field.value = authority,
                        None => return Ok(()),
                    }
                }
            }
            if !overflow {
                hpack::encode_literal(encoded, field);
                overflow = encoded.len() > MAX_BLOCK;
            }
            if overflow && (was_rewriting || bad) {
                return Err(ShimError::BlockTooLarge);
            }
            Ok(())
        });
        let out = match decoded {
            Ok(()) if !was_rewriting && !bad => {
                // A valid `:authority` seen and none rewritten: no mending on this connection.
                if !valid.is_empty() {
                    self.mode = Mode::Transparent;
                }
                Ok(held.split_to(block.end))
            }
            Ok(()) => {
                *rewriting = true;
                let mut out = BytesMut::with_capacity(
                    encoded.len() + (encoded.len() / MAX_FRAME + 1) * HEAD_LEN + 5,
                );
                frame_block(&mut out, &block, encoded);
                held.advance(block.end);
                Ok(out)
            }
            Err(ShimError::Hpack(e)) if !was_rewriting => {
                // h2 judges this block as it would have without the shim; the table is lost,
                // so nothing after it is looked at.
                tracing::debug!(error = %e, "a header block that does not decode: passed through untouched from here on");
                self.mode = Mode::Transparent;
                Ok(held.split_to(block.end))
            }
            Err(e) => Err(e),
        };
        for buf in [&mut self.joined, &mut self.encoded] {
            if buf.capacity() > KEEP_SCRATCH {
                *buf = Vec::new();
            }
        }
        out
    }
}

/// A whole HEADERS frame's block, as begun: where its fragment is, without padding and
/// priority.
fn headers_frame(head: Head, payload: Range<usize>, held: &[u8]) -> Result<Block, ShimError> {
    let padded = head.flags & PADDED != 0;
    let pad = if padded {
        held.get(payload.start)
            .map(|p| usize::from(*p))
            .ok_or(ShimError::ShortHeaders)?
    } else {
        0
    };
    let prio = if head.flags & PRIORITY != 0 { 5 } else { 0 };
    if usize::from(padded) + prio + pad > payload.len() {
        return Err(ShimError::ShortHeaders);
    }
    let start = payload.start + usize::from(padded);
    let priority = (prio > 0)
        .then(|| held.get(start..start + 5)?.try_into().ok())
        .flatten();
    Ok(Block {
        end: payload.end,
        stream: head.stream,
        end_stream: head.flags & END_STREAM != 0,
        priority,
        fragments: smallvec::smallvec![start + prio..payload.end - pad],
    })
}

/// `fragment` as HEADERS and CONTINUATION frames of `block`'s stream.
fn frame_block(out: &mut BytesMut, block: &Block, fragment: &[u8]) {
    let prio = if block.priority.is_some() { 5 } else { 0 };
    let (first, mut rest) = fragment.split_at(fragment.len().min(MAX_FRAME - prio));
    let mut flags = 0;
    if block.end_stream {
        flags |= END_STREAM;
    }
    if prio > 0 {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    put_head(out, first.len() + prio, HEADERS, flags, block.stream);
    if let Some(p) = &block.priority {
        out.put_slice(p);
    }
    out.put_slice(first);
    while !rest.is_empty() {
        let (chunk, r) = rest.split_at(rest.len().min(MAX_FRAME));
        rest = r;
        let flags = if rest.is_empty() { END_HEADERS } else { 0 };
        put_head(out, chunk.len(), CONTINUATION, flags, block.stream);
        out.put_slice(chunk);
    }
}

fn put_head(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream: u32) {
    out.put_uint(len as u64, 3);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream);
}

/// The authority named in an invalid `:authority`, if there is one: `http://host:port/path`
/// gives `host:port`; `#initially=[http://a:1;http://b:2]` (etcd 3.5.0's client) gives `a:1`.
pub fn usable_authority(value: &[u8]) -> Option<&[u8]> {
    let mut s = value;
    if let Some(list) = s.strip_prefix(b"#initially=[") {
        let end = list
            .iter()
            .position(|b| matches!(b, b';' | b',' | b' ' | b']'))
            .unwrap_or(list.len());
        s = &list[..end];
    }
    if let Some(i) = s.windows(3).position(|w| w == b"://")
        && i > 0
        && s[..i]
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
    {
        s = &s[i + 3..];
    }
    let end = s
        .iter()
        .position(|b| matches!(b, b'/' | b'?' | b'#'))
        .unwrap_or(s.len());
    let s = &s[..end];
    (!s.is_empty() && Authority::try_from(s).is_ok()).then_some(s)
}

/// An accepted connection as hyper reads it: the client's bytes through a [`Filter`] (see the
/// module docs); writes go straight to the connection.
pub struct AuthorityShim<S> {
    inner: S,
    filter: Filter,
    /// Read, not delivered yet, waiting on the filter.
    held: BytesMut,
    /// Ready to deliver.
    out: BytesMut,
    eof: bool,
    failed: bool,
}

impl<S> AuthorityShim<S> {
    pub fn new(inner: S) -> Self {
        AuthorityShim {
            inner,
            filter: Filter::default(),
            held: BytesMut::new(),
            out: BytesMut::new(),
            eof: false,
            failed: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityShim<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.out.is_empty() {
                let n = this.out.len().min(buf.remaining());
                buf.put_slice(&this.out[..n]);
                this.out.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.failed {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "the connection was closed for malformed HTTP/2 framing",
                )));
            }
            if !this.held.is_empty() {
                match this.filter.process(&mut this.held) {
                    Ok(Some(bytes)) => this.out = bytes,
                    // The connection ended inside a frame: what came goes on as it is.
                    Ok(None) if this.eof => this.out = this.held.split(),
                    Ok(None) => {
                        this.held.reserve(READ_CHUNK);
                        let n = ready!(tokio_util::io::poll_read_buf(
                            Pin::new(&mut this.inner),
                            cx,
                            &mut this.held
                        ))?;
                        this.eof = n == 0;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "closing an HTTP/2 connection");
                        this.failed = true;
                        return Poll::Ready(Err(e.into()));
                    }
                }
                continue;
            }
            if this.eof || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            // Nothing held: read straight into the caller's buffer, and take back what the
            // filter must hold.
            let start = buf.filled().len();
            ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
            let read = &buf.filled()[start..];
            if read.is_empty() {
                this.eof = true;
                return Poll::Ready(Ok(()));
            }
            let pass = this.filter.pass_len(read);
            if pass < read.len() {
                this.held.extend_from_slice(&read[pass..]);
                buf.set_filled(start + pass);
            }
            if pass > 0 {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityShim<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
