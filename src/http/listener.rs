//! The accept loop: HTTP/1 connections with a cap, a header timeout and bounded draining.
//!
//! `axum::serve` accepts without limit and never closes an idle or slow connection: 20,000
//! idle sockets exhausted the node's file descriptors. This loop serves the same router with
//! hyper's HTTP/1 connection builder and adds:
//! - a header timeout ([`ListenerLimits::header_timeout`]): hyper starts it whenever it waits
//!   for a request head, so it closes both slowloris connections (headers dribbled byte by
//!   byte) and keep-alive connections idle between requests;
//! - a body deadline (`DeadlineBody`): a request's body must arrive whole within the same
//!   time after its head, or reading it fails with [`BodyDeadlineExceeded`] (408);
//! - a protocol deadline on a listener that speaks both HTTP/1 and HTTP/2 (`Watchdog`): a
//!   connection must say which it speaks (a byte off HTTP/2's preface, or the whole preface)
//!   within the header timeout; hyper-util's detection has no deadline of its own;
//! - a write timeout ([`ListenerLimits::write_timeout`]): a write the client's socket does
//!   not take for that long fails and closes the connection (`Watchdog`), and a streaming
//!   handler whose client takes none of its queued answers for that long closes it through
//!   the request's [`ConnHandle`] (an HTTP/2 client can stall a stream without filling any
//!   socket). So a client that stops reading holds neither its connection nor its answers;
//! - a connection cap ([`ListenerLimits::max_connections`]): a full listener evicts the
//!   connection idle the longest (never one with a request in flight) to admit the new one,
//!   and refuses the new one only when every held connection is busy. So a flood of idle
//!   sockets can neither exhaust descriptors nor lock out `/health`;
//! - TLS, when configured ([`ServerTlsConfig`]): the handshake runs inside the connection's
//!   task, bounded by the header timeout, and the connection counts toward the cap (and is
//!   evictable, as it has no request in flight) from accept on. A failed handshake (plaintext
//!   to a TLS port, an untrusted or missing client certificate) closes the connection,
//!   logs at debug and counts in `connections_tls_handshake_failures_total`. Each new
//!   connection takes the config in force at accept (a reload swaps it, see `crate::tls`);
//! - counters of all of it ([`ConnStats`], in `/metrics`).
//!
//! # Invariants
//! - The table of connections ([`ConnTable`]) has one owner, a mutex held only for a table
//!   update, never across an await.
//! - A request in flight is never cut by eviction (an evicted connection is dropped at once:
//!   it has none); at shutdown, in-flight requests get [`DRAIN`] to finish before their
//!   connection is dropped. Only a client that took nothing for the write timeout loses a
//!   request in flight.
//!
//! # What it must not do
//! Decide which connection goes: [`ConnTable`] (pure) does.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::coalesce::Coalesce;
use crate::domain::resources::{Admission, ConnId, ConnTable};
use crate::tls::Reloadable;

/// A listener's TLS: the rustls config in force, swapped on reload.
pub type ServerTlsConfig = Arc<Reloadable<rustls::ServerConfig>>;

/// How long in-flight requests get to finish when the node stops.
pub const DRAIN: Duration = Duration::from_secs(5);

/// The limits of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Connections held at once.
    pub max_connections: usize,
    /// The longest a connection may wait before its next request's headers are complete.
    pub header_timeout: Duration,
    /// Also speak HTTP/2 (cleartext with prior knowledge, as gRPC clients do). HTTP/2 requests
    /// have no body deadline: a gRPC stream's body lasts as long as the stream.
    pub http2: bool,
    /// The longest a connection may keep answers waiting on its client: a write its socket
    /// does not take for this long, or (for a watch stream, see [`ConnHandle`]) answers queued
    /// for a client that takes none of them for this long, closes the connection.
    pub write_timeout: Duration,
}

impl ListenerLimits {
    /// The client port: short enough to shed slowloris quickly, longer than our own client's
    /// pooled connections stay idle (so a pooled connection is not closed under a request).
    pub const CLIENT: ListenerLimits = ListenerLimits {
        max_connections: 4096,
        header_timeout: Duration::from_secs(10),
        http2: false,
        write_timeout: Duration::from_secs(30),
    };
    /// The etcd API's port: HTTP/2 for gRPC (and HTTP/1 for its JSON gateway).
    pub const ETCD: ListenerLimits = ListenerLimits {
        max_connections: 4096,
        header_timeout: Duration::from_secs(10),
        http2: true,
        write_timeout: Duration::from_secs(30),
    };
    /// The peer port: peers keep pooled connections for 30 s; the server must outlast that.
    pub const PEER: ListenerLimits = ListenerLimits {
        max_connections: 1024,
        header_timeout: Duration::from_secs(90),
        http2: false,
        write_timeout: Duration::from_secs(90),
    };
}

/// What one listener did, for `/metrics`.
#[derive(Debug, Default)]
pub struct ConnStats {
    pub open: AtomicU64,
    pub accepted: AtomicU64,
    /// Idle connections closed to make room.
    pub evicted: AtomicU64,
    /// New connections closed at once (every held one was busy).
    pub refused: AtomicU64,
    /// Connections closed because their headers did not arrive in time.
    pub header_timeouts: AtomicU64,
    /// The cap in force.
    pub max: AtomicU64,
    /// TLS handshakes that failed or timed out (the connection was closed).
    pub tls_handshake_failures: AtomicU64,
    /// Connections closed because their client took none of its answers for the write
    /// timeout (a client that stopped reading).
    pub write_timeouts: AtomicU64,
}

impl ConnStats {
    /// Gauges and counters as (name suffix, help, value).
    pub fn snapshot(&self) -> [(&'static str, &'static str, u64); 8] {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("connections_open", "Connections held now.", g(&self.open)),
            ("connections_max", "The connection cap.", g(&self.max)),
            (
                "connections_accepted_total",
                "Connections accepted.",
                g(&self.accepted),
            ),
            (
                "connections_evicted_total",
                "Idle connections closed to admit a new one at the cap.",
                g(&self.evicted),
            ),
            (
                "connections_refused_total",
                "Connections closed at once because every held one was busy.",
                g(&self.refused),
            ),
            (
                "connections_header_timeouts_total",
                "Connections closed because a request's headers did not arrive in time.",
                g(&self.header_timeouts),
            ),
            (
                "connections_tls_handshake_failures_total",
                "TLS handshakes that failed or timed out (plaintext to a TLS port, a refused certificate).",
                g(&self.tls_handshake_failures),
            ),
            (
                "connections_write_timeouts_total",
                "Connections closed because their client took none of its answers for the write timeout.",
                g(&self.write_timeouts),
            ),
        ]
    }
}

/// The shared table and each connection's close signal.
struct Registry {
    table: ConnTable,
    close: HashMap<ConnId, CancellationToken>,
}

type Shared = Arc<Mutex<Registry>>;

fn lock(r: &Shared) -> std::sync::MutexGuard<'_, Registry> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serve `app` on `listener` under `limits` until `cancel` fires, then drain (bounded). With
/// `tls`, every connection is a TLS connection (see the module docs).
pub async fn serve_limited(
    listener: TcpListener,
    app: Router,
    cancel: CancellationToken,
    limits: ListenerLimits,
    stats: Arc<ConnStats>,
    tls: Option<ServerTlsConfig>,
) -> std::io::Result<()> {
    stats
        .max
        .store(limits.max_connections as u64, Ordering::Relaxed);
    let registry: Shared = Arc::new(Mutex::new(Registry {
        table: ConnTable::new(limits.max_connections),
        close: HashMap::new(),
    }));
    let conns = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors (EMFILE) or a connection reset before accept: pause
                // briefly rather than spin; the cap makes this rare.
                tracing::warn!(error = %e, "accept failed");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
        };
        let (admission, id, close, victim) = {
            let mut reg = lock(&registry);
            let (admission, id) = reg.table.arrive();
            let victim = match admission {
                Admission::Evict(v) => reg.close.remove(&v),
                _ => None,
            };
            let close = id.map(|id| {
                let token = cancel.child_token();
                reg.close.insert(id, token.clone());
                token
            });
            (admission, id, close, victim)
        };
        match admission {
            Admission::Refuse => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                drop(stream);
                continue;
            }
            Admission::Evict(_) => {
                stats.evicted.fetch_add(1, Ordering::Relaxed);
                if let Some(v) = victim {
                    v.cancel();
                }
            }
            Admission::Admit => {}
        }
        let (Some(id), Some(close)) = (id, close) else {
            continue;
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        stats.open.fetch_add(1, Ordering::Relaxed);
        // Small answers must leave at once: Nagle's algorithm would hold a response's last
        // segment for the peer's delayed ACK (tens of milliseconds).
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY on an accepted connection: {e}");
        }
        let conn = Conn {
            app: app.clone(),
            id,
            registry: registry.clone(),
            close,
            shutdown: cancel.clone(),
            header_timeout: limits.header_timeout,
            write_timeout: limits.write_timeout,
            http2: limits.http2,
            stats: stats.clone(),
        };
        match &tls {
            None => conns.spawn(conn.serve(stream)),
            Some(tls) => conns.spawn(conn.handshake_then_serve(stream, tls.current())),
        };
    }
    conns.close();
    conns.wait().await;
    Ok(())
}

/// One admitted connection and what it needs until it leaves the table.
struct Conn {
    app: Router,
    id: ConnId,
    registry: Shared,
    /// Fires when the connection is evicted or the listener stops.
    close: CancellationToken,
    shutdown: CancellationToken,
    header_timeout: Duration,
    write_timeout: Duration,
    http2: bool,
    stats: Arc<ConnStats>,
}

/// Concurrent HTTP/2 streams one connection may open (each is a request in flight).
const MAX_HTTP2_STREAMS: u32 = 1024;

impl Conn {
    /// The TLS handshake, bounded by the header timeout (a client that connects and says
    /// nothing is a slowloris too) and cut short by eviction; then serve.
    async fn handshake_then_serve(
        self,
        stream: tokio::net::TcpStream,
        config: Arc<rustls::ServerConfig>,
    ) {
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let outcome = tokio::select! {
            r = tokio::time::timeout(self.header_timeout, acceptor.accept(stream)) => Some(r),
            _ = self.close.cancelled() => None,
        };
        match outcome {
            Some(Ok(Ok(tls))) => return self.serve(tls).await,
            Some(Ok(Err(e))) => {
                self.stats
                    .tls_handshake_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "TLS handshake failed");
            }
            Some(Err(_)) => {
                self.stats
                    .tls_handshake_failures
                    .fetch_add(1, Ordering::Relaxed);
                self.stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("TLS handshake timed out");
            }
            None => {}
        }
        self.leave();
    }

    async fn serve<S>(self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        // Every read and write goes through the watchdog: a client that stops taking bytes,
        // or (on an HTTP/2 port) never says which protocol it speaks, is cut off.
        let stream = Watchdog::new(
            stream,
            self.write_timeout,
            self.http2.then_some(self.header_timeout),
            self.stats.clone(),
        );
        let inner = TowerToHyperService::new(self.app.clone());
        let reg = self.registry.clone();
        let id = self.id;
        let body_timeout = self.header_timeout;
        // Only the etcd port's streaming handlers (gRPC Watch, `/v3/watch`) look for the
        // handle, and it is the port that speaks HTTP/2: elsewhere no request pays for it.
        let handle = self.http2.then(|| ConnHandle {
            close: self.close.clone(),
            write_timeout: self.write_timeout,
            stats: self.stats.clone(),
        });
        let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            if let Some(handle) = &handle {
                req.extensions_mut().insert(handle.clone());
            }
            let guard = InFlight::start(reg.clone(), id);
            // The head is complete; the body gets as long again (a slowloris body would
            // otherwise hold the connection and its handler for ever: hyper times out heads
            // only). An HTTP/2 stream's body is a gRPC stream, as long as the client keeps it:
            // HTTP/2's own flow control and keep-alive bound it instead.
            let deadline = (req.version() != hyper::Version::HTTP_2).then_some(body_timeout);
            let req = req.map(|body| match deadline {
                Some(within) => Body::new(DeadlineBody::new(body, within)),
                None => Body::new(body),
            });
            let fut = hyper::service::Service::call(&inner, req);
            async move {
                let resp = match fut.await {
                    Ok(resp) => resp,
                    Err(never) => match never {},
                };
                Ok::<_, Infallible>(resp.map(|body| {
                    Body::new(Guarded {
                        inner: body,
                        _guard: guard,
                    })
                }))
            }
        });
        if self.http2 {
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(self.header_timeout)
                .keep_alive(true);
            builder
                .http2()
                .timer(TokioTimer::new())
                .max_concurrent_streams(MAX_HTTP2_STREAMS)
                // A peer that stops answering pings is gone: its streams end.
                .keep_alive_interval(Some(self.header_timeout))
                .keep_alive_timeout(self.header_timeout);
            // HTTP/2 here is the etcd API's: some etcd clients send an `:authority` h2
            // refuses, which the shim mends (HTTP/1 passes through it untouched). Its
            // answers go out in one write each (`coalesce`).
            let stream = crate::etcd::authority::AuthorityShim::new(Coalesce::new(stream));
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let result = tokio::select! {
                r = conn.as_mut() => r,
                _ = self.close.cancelled() => {
                    if self.shutdown.is_cancelled() {
                        conn.as_mut().graceful_shutdown();
                        tokio::time::timeout(DRAIN, conn.as_mut()).await.unwrap_or(Ok(()))
                    } else {
                        Ok(())
                    }
                }
            };
            if let Err(e) = result {
                tracing::debug!(error = %e, "connection ended");
            }
            self.leave();
            return;
        }
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_timeout)
            .keep_alive(true);
        // With upgrades: a peer stream (`http::peer_stream`) takes the connection over; the
        // connection then leaves this table and is counted there.
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .with_upgrades();
        tokio::pin!(conn);
        let result = tokio::select! {
            r = conn.as_mut() => r,
            _ = self.close.cancelled() => {
                if self.shutdown.is_cancelled() {
                    // Shutdown: in-flight requests get the drain time, then the connection goes.
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(DRAIN, conn.as_mut()).await.unwrap_or(Ok(()))
                } else {
                    // Evicted: it has no request in flight (idle, or its headers still
                    // incomplete), so it is dropped at once; waiting would let a fast flood hold
                    // far more than the cap while evicted connections linger.
                    Ok(())
                }
            }
        };
        if let Err(e) = result {
            if e.is_timeout() {
                self.stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            tracing::debug!(error = %e, "connection ended");
        }
        self.leave();
    }

    /// Out of the table and the gauge.
    fn leave(self) {
        {
            let mut reg = lock(&self.registry);
            reg.table.left(self.id);
            reg.close.remove(&self.id);
        }
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request in flight on a connection, from its head until its response body is done.
struct InFlight {
    registry: Shared,
    id: ConnId,
}

impl InFlight {
    fn start(registry: Shared, id: ConnId) -> Self {
        lock(&registry).table.request_started(id);
        InFlight { registry, id }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.registry).table.request_finished(self.id);
    }
}

/// A response body that keeps its request counted as in flight until it is sent (a watch
/// stream is a request in flight for as long as it streams).
struct Guarded {
    inner: Body,
    _guard: InFlight,
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The connection a request came on, as a handler that streams its answer may act on it (a
/// request extension the listener adds to every request).
///
/// A stream whose client has taken none of its queued answers for
/// [`ConnHandle::write_timeout`] ends the connection with [`ConnHandle::close_stalled`].
/// Why the stream's producer decides, not the socket: an HTTP/2 client can stop taking one
/// stream without filling any socket (it grants that stream no more window, and answers
/// pings), so only the producer sees its queue stay full. Why the whole connection: hyper
/// offers a server no way to reset one stream, and a stream that ended instead would keep its
/// already-sent data buffered in `h2` until the connection ends anyway.
#[derive(Clone)]
pub struct ConnHandle {
    close: CancellationToken,
    write_timeout: Duration,
    stats: Arc<ConnStats>,
}

impl ConnHandle {
    /// A handle that closes a connection by cancelling `close` (the listener's own; tests
    /// make their own).
    pub fn new(close: CancellationToken, write_timeout: Duration, stats: Arc<ConnStats>) -> Self {
        ConnHandle {
            close,
            write_timeout,
            stats,
        }
    }

    /// How long a client may take none of its answers.
    pub fn write_timeout(&self) -> Duration {
        self.write_timeout
    }

    /// Close the connection at once (its client stopped taking its answers), and count it.
    pub fn close_stalled(&self) {
        if !self.close.is_cancelled() {
            self.stats.write_timeouts.fetch_add(1, Ordering::Relaxed);
            self.close.cancel();
        }
    }
}

/// What an HTTP/2 client sends first (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A connection's bytes, timed: fails a write its client has not taken for the write timeout,
/// and (on a listener that speaks both HTTP/1 and HTTP/2) a read while the connection has not
/// yet said which protocol it speaks, past the header timeout.
///
/// Why: hyper times out neither. A client that stops reading leaves a write pending for
/// ever (TCP keeps a zero window open indefinitely), holding its connection and whatever the
/// answer holds; and hyper-util's protocol detection reads the first bytes without any
/// deadline, before either protocol's own timeout (HTTP/1's header timeout, HTTP/2's
/// keep-alive) has started. Once the protocol is known (a byte off HTTP/2's preface, or the
/// whole preface), reads are left to those.
struct Watchdog<S> {
    inner: S,
    write_timeout: Duration,
    /// Armed while a write waits on the client.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// While the protocol is unknown: the bytes of the HTTP/2 preface matched so far, and the
    /// deadline for the rest.
    preface: Option<(usize, Pin<Box<tokio::time::Sleep>>)>,
    /// Set once a timeout has failed the connection: every later call fails too (and is not
    /// counted again).
    failed: Option<Timeout>,
    stats: Arc<ConnStats>,
}

/// Why a [`Watchdog`] failed its connection.
#[derive(Clone, Copy, Debug, thiserror::Error)]
enum Timeout {
    #[error("the client took no bytes for the write timeout")]
    Write,
    #[error("the client did not name its protocol within the header timeout")]
    Protocol,
}

impl Timeout {
    fn error(self) -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, self)
    }
}

impl<S> Watchdog<S> {
    fn new(
        inner: S,
        write_timeout: Duration,
        protocol_within: Option<Duration>,
        stats: Arc<ConnStats>,
    ) -> Self {
        Watchdog {
            inner,
            write_timeout,
            stalled: None,
            preface: protocol_within.map(|d| (0, Box::pin(tokio::time::sleep(d)))),
            failed: None,
            stats,
        }
    }

    fn failure(&self) -> Option<io::Error> {
        self.failed.map(Timeout::error)
    }

    /// The outcome of a write-side call: a pending one arms (or checks) the stall timer, any
    /// other disarms it (the client took bytes, or the connection failed anyway).
    fn written<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if !polled.is_pending() {
            self.stalled = None;
            return polled;
        }
        let within = self.write_timeout;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(within)));
        match timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.stalled = None;
                self.failed = Some(Timeout::Write);
                self.stats.write_timeouts.fetch_add(1, Ordering::Relaxed);
                Poll::Ready(Err(Timeout::Write.error()))
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watchdog<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(e) = this.failure() {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        let Some((matched, deadline)) = &mut this.preface else {
            return polled;
        };
        match polled {
            Poll::Ready(Ok(())) => {
                let new = &buf.filled()[before..];
                let rest = &H2_PREFACE[*matched..];
                let n = new.len().min(rest.len());
                if new[..n] != rest[..n] || n == rest.len() {
                    // HTTP/1 (a byte off the preface) or HTTP/2 (all of it): known.
                    this.preface = None;
                } else {
                    *matched += n;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(()) => {
                    this.preface = None;
                    this.failed = Some(Timeout::Protocol);
                    this.stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                    Poll::Ready(Err(Timeout::Protocol.error()))
                }
            },
            failed => failed,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watchdog<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.failure() {
            return Poll::Ready(Err(e));
        }
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.written(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.failure() {
            return Poll::Ready(Err(e));
        }
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.written(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = self.failure() {
            return Poll::Ready(Err(e));
        }
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.written(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.failed.is_some() {
            // The connection is being dropped for a timeout: nothing more to say to it.
            return Poll::Ready(Ok(()));
        }
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.written(cx, polled)
    }
}

/// A request body that must arrive whole before its deadline.
struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl DeadlineBody {
    fn new(inner: Incoming, within: Duration) -> Self {
        DeadlineBody {
            inner,
            deadline: Box::pin(tokio::time::sleep(within)),
        }
    }
}

/// A request body that did not arrive within its deadline (see `DeadlineBody`).
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
pub struct BodyDeadlineExceeded;

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyDeadlineExceeded)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    const WITHIN: Duration = Duration::from_secs(10);

    fn watched(
        io: tokio::io::DuplexStream,
        protocol: bool,
    ) -> (Watchdog<tokio::io::DuplexStream>, Arc<ConnStats>) {
        let stats = Arc::new(ConnStats::default());
        let dog = Watchdog::new(io, WITHIN, protocol.then_some(WITHIN), stats.clone());
        (dog, stats)
    }

    /// A connection that names no protocol fails at the deadline, once and counted once; one
    /// that sent the whole preface, in pieces, or any byte off it, is left to the protocol.
    #[tokio::test(start_paused = true)]
    async fn the_protocol_must_be_named_within_the_header_timeout() {
        let (mut client, server) = duplex(1024);
        let (mut dog, stats) = watched(server, true);
        client.write_all(&H2_PREFACE[..5]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(dog.read(&mut buf).await.unwrap(), 5);
        let e = dog.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(dog.read(&mut buf).await.is_err());
        assert_eq!(stats.header_timeouts.load(Ordering::Relaxed), 1);

        for opening in [&H2_PREFACE[..], b"GET / HTTP/1.1\r\n", b"PRI * HTTP/1.1"] {
            let (mut client, server) = duplex(1024);
            let (mut dog, stats) = watched(server, true);
            for piece in opening.chunks(7) {
                client.write_all(piece).await.unwrap();
                dog.read_exact(&mut buf[..piece.len()]).await.unwrap();
            }
            // Then silence, for longer than the deadline: no failure (the protocol's own
            // timeouts apply). The read is still pending when the test ends it.
            let waited = tokio::time::timeout(3 * WITHIN, dog.read(&mut buf)).await;
            assert!(waited.is_err(), "{opening:?}");
            assert_eq!(stats.header_timeouts.load(Ordering::Relaxed), 0);
        }
    }

    /// A write the other side does not take fails at the write timeout; one it takes, however
    /// late within the timeout, resets the clock.
    #[tokio::test(start_paused = true)]
    async fn a_write_not_taken_for_the_write_timeout_fails() {
        let (mut client, server) = duplex(16);
        let (mut dog, stats) = watched(server, false);
        dog.write_all(&[1; 16]).await.unwrap();
        // The pipe is full: the next write waits; the client takes it just in time.
        let taker = async {
            tokio::time::sleep(WITHIN - Duration::from_secs(1)).await;
            let mut buf = [0u8; 16];
            client.read_exact(&mut buf).await.unwrap();
            client
        };
        let (written, mut client) = tokio::join!(dog.write_all(&[2; 16]), taker);
        written.unwrap();
        // Now nobody reads.
        let e = dog.write_all(&[3; 16]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(dog.flush().await.is_err());
        assert_eq!(stats.write_timeouts.load(Ordering::Relaxed), 1);
        let mut buf = [0u8; 16];
        client.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, [2; 16]);
    }
}
