//! Where an HTTP/2 connection's request streams run: on tasks of their own, or on the
//! connection's own task.
//!
//! hyper's HTTP/2 server hands every request stream (the service's future, then its answer's
//! body) to an executor. With tokio's, each stream is a task: spawned (an allocation and a
//! queue entry), woken by the connection's task when its body arrives, and waking that task
//! again to send each part of its answer. On a runtime with several workers that buys
//! parallelism: one client's many streams, multiplexed on one connection as etcd's clients
//! do, can run on several cores. On a runtime with one worker (a node sized to a share of a
//! machine it shares with other nodes, `node::workers`) there is no other core to run them on,
//! and the hand-offs are pure cost. There [`StreamExec`] keeps the streams on the connection's
//! task: the executor queues each one, and [`WithStreams`] polls the queued streams every time
//! the connection is polled.
//!
//! # Invariants
//! - A stream is polled whenever the connection's task is woken, and only then; a stream's
//!   waker is that task's, so whatever wakes the stream wakes the connection's task.
//! - Streams still running when the connection's future ends are dropped with it: their
//!   connection is gone, so there is nobody to answer (as hyper's own stream tasks end when
//!   their stream is reset).
//!
//! # What it must not do
//! Block: a stream that computes for long holds the connection's other streams and its I/O,
//! which is why multi-worker runtimes keep spawning.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::StreamExt;
use futures::stream::FuturesUnordered;

type Stream = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The executor of one connection's streams (see the module docs).
#[derive(Clone)]
pub struct StreamExec {
    /// `Some` when the streams run on the connection's task: they wait here for its next poll.
    local: Option<Arc<Mutex<Vec<Stream>>>>,
}

impl StreamExec {
    /// Streams on the connection's task when the runtime has one worker, tasks of their own
    /// otherwise.
    pub fn for_current_runtime() -> Self {
        Self::new(tokio::runtime::Handle::current().metrics().num_workers() == 1)
    }

    /// Streams on the connection's task (`local`) or on tasks of their own.
    pub fn new(local: bool) -> Self {
        Self {
            local: local.then(|| Arc::new(Mutex::new(Vec::new()))),
        }
    }

    /// `conn`, polled with the streams this executor kept for it.
    pub fn drive<C: Future>(&self, conn: C) -> WithStreams<C> {
        WithStreams {
            conn: Box::pin(conn),
            queued: self.local.clone(),
            running: FuturesUnordered::new(),
        }
    }
}

impl<F> hyper::rt::Executor<F> for StreamExec
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, stream: F) {
        match &self.local {
            Some(queue) => queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Box::pin(stream)),
            None => {
                tokio::spawn(stream);
            }
        }
    }
}

/// A connection's future and the streams it started on its own task.
pub struct WithStreams<C> {
    conn: Pin<Box<C>>,
    queued: Option<Arc<Mutex<Vec<Stream>>>>,
    running: FuturesUnordered<Stream>,
}

impl<C> WithStreams<C> {
    /// The connection itself (for a graceful shutdown).
    pub fn conn(&mut self) -> Pin<&mut C> {
        self.conn.as_mut()
    }
}

impl<C: Future> Future for WithStreams<C> {
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = &mut *self;
        let done = this.conn.as_mut().poll(cx);
        if done.is_ready() {
            return done;
        }
        let Some(queue) = &this.queued else {
            return done;
        };
        this.running
            .extend(queue.lock().unwrap_or_else(|p| p.into_inner()).drain(..));
        // Every stream that finishes is dropped here; one still waiting was registered with
        // this task's waker by its poll.
        while let Poll::Ready(Some(())) = this.running.poll_next_unpin(cx) {}
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use hyper::body::Incoming;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::sync::Notify;

    use super::*;

    /// Sets its flag when dropped: tells whether a stream's future was dropped.
    struct DropFlag(Arc<AtomicBool>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// An HTTP/2 server on one in-memory connection whose streams run as `exec` says: `/wait`
    /// answers once `release` is notified, anything else at once with its path. Returns the
    /// client's sender, the server's task and the flag `/wait`'s future sets when dropped.
    async fn serve(
        exec: StreamExec,
        release: Arc<Notify>,
    ) -> (
        hyper::client::conn::http2::SendRequest<String>,
        tokio::task::JoinHandle<()>,
        Arc<AtomicBool>,
    ) {
        let (client_io, server_io) = tokio::io::duplex(1 << 16);
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let (release, flag) = (release.clone(), flag.clone());
            async move {
                if req.uri().path() == "/wait" {
                    let _guard = DropFlag(flag);
                    release.notified().await;
                }
                Ok::<_, Infallible>(hyper::Response::new(req.uri().path().to_owned()))
            }
        });
        let builder = hyper::server::conn::http2::Builder::new(exec.clone());
        let conn = exec.drive(builder.serve_connection(TokioIo::new(server_io), svc));
        let server = tokio::spawn(async move {
            let _ = conn.await;
        });
        let (send, client_conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(client_io))
                .await
                .unwrap();
        tokio::spawn(client_conn);
        (send, server, dropped)
    }

    async fn get(
        send: &mut hyper::client::conn::http2::SendRequest<String>,
        path: &str,
    ) -> impl Future<Output = String> + use<> {
        let req = hyper::Request::get(format!("http://test{path}"))
            .body(String::new())
            .unwrap();
        let sent = send.send_request(req);
        async move {
            let body = axum::body::Body::new(sent.await.unwrap().into_body());
            let bytes = axum::body::to_bytes(body, 1 << 16).await.unwrap();
            String::from_utf8(bytes.to_vec()).unwrap()
        }
    }

    #[tokio::test]
    async fn streams_on_the_connections_task_answer_while_another_waits() {
        for local in [true, false] {
            let release = Arc::new(Notify::new());
            let (mut send, server, _) = serve(StreamExec::new(local), release.clone()).await;
            let waiting = tokio::spawn(get(&mut send, "/wait").await);
            for i in 0..20 {
                let path = format!("/p{i}");
                let answer =
                    tokio::time::timeout(Duration::from_secs(10), get(&mut send, &path).await)
                        .await
                        .expect("a stream waits for another");
                assert_eq!(answer, path);
            }
            assert!(!waiting.is_finished());
            release.notify_one();
            let answer = tokio::time::timeout(Duration::from_secs(10), waiting)
                .await
                .expect("the waiting stream answers once released")
                .unwrap();
            assert_eq!(answer, "/wait");
            server.abort();
        }
    }

    #[tokio::test]
    async fn a_local_stream_ends_with_its_connection() {
        let release = Arc::new(Notify::new());
        let (mut send, server, dropped) = serve(StreamExec::new(true), release).await;
        let waiting = tokio::spawn(get(&mut send, "/wait").await);
        // The stream has started once a later one on the same connection has been answered.
        assert_eq!(get(&mut send, "/after").await.await, "/after");
        assert!(!dropped.load(Ordering::SeqCst));
        server.abort();
        let _ = server.await;
        assert!(
            dropped.load(Ordering::SeqCst),
            "the stream's future was dropped"
        );
        waiting.abort();
    }
}
