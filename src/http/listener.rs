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
//!   connection is dropped.
//!
//! # What it must not do
//! Decide which connection goes: [`ConnTable`] (pure) does.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
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
}

impl ListenerLimits {
    /// The client port: short enough to shed slowloris quickly, longer than our own client's
    /// pooled connections stay idle (so a pooled connection is not closed under a request).
    pub const CLIENT: ListenerLimits = ListenerLimits {
        max_connections: 4096,
        header_timeout: Duration::from_secs(10),
        http2: false,
    };
    /// The etcd API's port: HTTP/2 for gRPC (and HTTP/1 for its JSON gateway).
    pub const ETCD: ListenerLimits = ListenerLimits {
        max_connections: 4096,
        header_timeout: Duration::from_secs(10),
        http2: true,
    };
    /// The peer port: peers keep pooled connections for 30 s; the server must outlast that.
    pub const PEER: ListenerLimits = ListenerLimits {
        max_connections: 1024,
        header_timeout: Duration::from_secs(90),
        http2: false,
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
}

impl ConnStats {
    /// Gauges and counters as (name suffix, help, value).
    pub fn snapshot(&self) -> [(&'static str, &'static str, u64); 7] {
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
        let inner = TowerToHyperService::new(self.app.clone());
        let reg = self.registry.clone();
        let id = self.id;
        let body_timeout = self.header_timeout;
        let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
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
            // refuses, which the shim mends (HTTP/1 passes through it untouched).
            let stream = crate::etcd::authority::AuthorityShim::new(stream);
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
