//! One HTTP/2 connection as a gRPC transport for the load generator, without a dispatch task
//! of its own.
//!
//! tonic's `Channel` puts a buffer in front of every connection: each request goes through an
//! mpsc queue to a worker task, which hands it to the connection task. That costs the client a
//! task hand-off per request on the very cores the servers run on, and so lowers every measured
//! system's throughput alike, flattening the ratios between them. A load generator with one
//! request in flight per connection needs none of it: this service hands the request straight
//! to hyper's HTTP/2 client (the connection task stays: it drives the socket).
//!
//! The same transport drives every system measured, so it changes no comparison's fairness;
//! it only leaves more of the machine to the servers.
//!
//! # What it must not do
//! Retry, reconnect or queue: a failed request is a failed request, counted by the caller.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::uri::{Authority, Scheme};
use axum::http::{self, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// A gRPC transport over one HTTP/2 connection (cheap to clone: clones share it).
#[derive(Clone)]
pub struct H2Conn {
    send: SendRequest<tonic::body::Body>,
    authority: Authority,
    /// How long a response's head may take.
    timeout: Duration,
}

impl H2Conn {
    /// Connect to `url` (`http://host:port`) and complete the HTTP/2 handshake, within
    /// `timeout`; each request then fails if its response has not begun within `timeout`.
    pub async fn connect(url: &str, timeout: Duration) -> Result<H2Conn, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{url}: no host:port"))?;
        let connect = async {
            let tcp = tokio::net::TcpStream::connect(authority.as_str())
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            tcp.set_nodelay(true).map_err(|e| format!("{url}: {e}"))?;
            hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| format!("{url}: HTTP/2 handshake: {e}"))
        };
        let (send, conn) = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| format!("{url}: no connection within {timeout:?}"))??;
        // The connection task ends when every clone of `send` is dropped or the peer closes.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(H2Conn {
            send,
            authority,
            timeout,
        })
    }
}

impl tower::Service<http::Request<tonic::body::Body>> for H2Conn {
    type Response = http::Response<Incoming>;
    type Error = tonic::codegen::StdError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.send.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: http::Request<tonic::body::Body>) -> Self::Future {
        // tonic's generated clients send the path only; HTTP/2 needs scheme and authority.
        let mut parts = req.uri().clone().into_parts();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        if let Ok(uri) = Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
        let sent = self.send.send_request(req);
        let timeout = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(timeout, sent).await {
                Ok(answer) => answer.map_err(Into::into),
                Err(_) => Err(format!("no response within {timeout:?}").into()),
            }
        })
    }
}
