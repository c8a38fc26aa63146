//! One HTTP/2 connection as the load generator's gRPC client, driven by the task that makes
//! its calls.
//!
//! The generator runs on the same two cores as the servers it measures, so what it spends
//! per call is taken from them. It costs every measured system the same, so it flattens the
//! ratios between them. tonic's client over hyper spent about as much CPU per call as
//! leasecore's three nodes did to answer a read. It wrote each unary request in three system
//! calls: the HEADERS alone (hyper flushes them before the body's task runs), the DATA, then
//! an empty DATA to end the stream. It also handed every call between tasks twice, once
//! through hyper's dispatch and once back from its connection task.
//!
//! Here a call queues its HEADERS and its one DATA frame (which ends the stream) together, so
//! they leave in one write, as grpc-go's clients send them. The same task then polls the
//! connection (`h2`'s [`Connection`]) while it waits for the answer, so no other task is
//! woken for a call.
//!
//! # Invariants
//! - An answer counts only with HTTP status 200, `grpc-status` 0 and exactly one whole,
//!   uncompressed message of at most [`MAX_MESSAGE`] bytes (a stream's answers: one message
//!   each). Anything else is a [`CallError`].
//! - Every call is bounded by the connection's timeout.
//! - Received bytes are released to the flow-control window as they are read, so a long run
//!   never stalls on a full window.
//!
//! # What it must not do
//! Retry, reconnect or queue: a failed call is a failed call, counted by the caller.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use h2::RecvStream;
use h2::client::{Connection, ResponseFuture, SendRequest};
use prost::Message;
use tokio::net::TcpStream;

/// The largest message an answer may carry.
pub const MAX_MESSAGE: usize = 64 << 20;

/// gRPC's frame in front of every message: a compressed flag and a 4-byte length.
const PREFIX: usize = 5;

/// Receive windows as hyper's client advertises them (2 MiB a stream, 5 MiB the
/// connection), so that window updates stay rare for either server. (Like hyper's client,
/// this one also refuses server push.)
const STREAM_WINDOW: u32 = 2 << 20;
const CONNECTION_WINDOW: u32 = 5 << 20;

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The server answered with a gRPC status other than OK.
    #[error("{code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection or the stream failed, or the answer broke gRPC's rules.
    #[error("{0}")]
    Transport(String),
}

fn transport(e: impl std::fmt::Display) -> CallError {
    CallError::Transport(e.to_string())
}

/// A gRPC client over one HTTP/2 connection; one call at a time.
pub struct GrpcConn {
    send: SendRequest<Bytes>,
    driver: Driver,
    authority: Authority,
    timeout: Duration,
}

/// The connection's I/O, polled by whichever call is waiting.
struct Driver {
    /// `None` once the connection ended (its streams then fail on their own).
    conn: Option<Pin<Box<Connection<TcpStream, Bytes>>>>,
}

impl Driver {
    /// Wait for `fut` while driving the connection: it sends what the call queued and reads
    /// what the server sent.
    async fn run<F: Future>(&mut self, fut: F) -> F::Output {
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| {
            if let Some(conn) = self.conn.as_mut()
                && conn.as_mut().poll(cx).is_ready()
            {
                self.conn = None;
            }
            fut.as_mut().poll(cx)
        })
        .await
    }
}

impl GrpcConn {
    /// Connect to `url` (`http://host:port`) within `timeout`; each call then fails if it has
    /// not been answered within `timeout`.
    pub async fn connect(url: &str, timeout: Duration) -> Result<GrpcConn, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("{url}: no host:port"))?;
        let connect = async {
            let tcp = TcpStream::connect(authority.as_str())
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            tcp.set_nodelay(true).map_err(|e| format!("{url}: {e}"))?;
            h2::client::Builder::new()
                .enable_push(false)
                .initial_window_size(STREAM_WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .handshake::<_, Bytes>(tcp)
                .await
                .map_err(|e| format!("{url}: HTTP/2 handshake: {e}"))
        };
        let (send, conn) = tokio::time::timeout(timeout, connect)
            .await
            .map_err(|_| format!("{url}: no connection within {timeout:?}"))??;
        Ok(GrpcConn {
            send,
            driver: Driver {
                conn: Some(Box::pin(conn)),
            },
            authority,
            timeout,
        })
    }

    /// A unary call of `path` (`/package.Service/Method`).
    pub async fn unary<Q: Message, R: Message + Default>(
        &mut self,
        path: &'static str,
        req: &Q,
    ) -> Result<R, CallError> {
        let head = self.head(path);
        let body = encode(req)?;
        let timeout = self.timeout;
        let (send, driver) = (&mut self.send, &mut self.driver);
        let call = async {
            let (answer, mut stream) = open(send, driver, head).await?;
            stream.send_data(body, true).map_err(transport)?;
            let answer = driver.run(answer).await.map_err(transport)?;
            let mut body = answered(answer)?;
            let mut buf = BytesMut::new();
            while let Some(chunk) = driver.run(body.data()).await {
                let chunk = chunk.map_err(transport)?;
                let _ = body.flow_control().release_capacity(chunk.len());
                if buf.len() + chunk.len() > PREFIX + MAX_MESSAGE {
                    return Err(transport("the answer is larger than any message taken"));
                }
                buf.extend_from_slice(&chunk);
            }
            let trailers = driver.run(body.trailers()).await.map_err(transport)?;
            status(trailers.as_ref())?;
            match take_message(&mut buf)? {
                Some(message) if buf.is_empty() => decode(message),
                _ => Err(transport("the answer is not exactly one message")),
            }
        };
        within(timeout, call).await
    }

    /// Whether the connection has ended: every call on it fails at once from then on.
    pub fn is_closed(&self) -> bool {
        self.driver.conn.is_none()
    }

    /// Open a bidirectional stream of `path`; its messages go with [`GrpcConn::exchange`].
    pub async fn open_stream(&mut self, path: &'static str) -> Result<GrpcStream, CallError> {
        let head = self.head(path);
        let timeout = self.timeout;
        let (send, driver) = (&mut self.send, &mut self.driver);
        let (answer, stream) = within(timeout, open(send, driver, head)).await?;
        Ok(GrpcStream {
            send: stream,
            answer: Some(answer),
            body: None,
            buf: BytesMut::new(),
            failed: false,
        })
    }

    /// Send one message on `stream` and wait for the next message the server sends on it.
    /// After any failure (a timeout among them) the stream takes no more: a late answer would
    /// be taken for the next request's.
    pub async fn exchange<Q: Message, R: Message + Default>(
        &mut self,
        stream: &mut GrpcStream,
        req: &Q,
    ) -> Result<R, CallError> {
        if stream.failed {
            return Err(transport("the stream failed before"));
        }
        let result = self.exchange_once(stream, req).await;
        stream.failed = result.is_err();
        result
    }

    async fn exchange_once<Q: Message, R: Message + Default>(
        &mut self,
        stream: &mut GrpcStream,
        req: &Q,
    ) -> Result<R, CallError> {
        stream
            .send
            .send_data(encode(req)?, false)
            .map_err(transport)?;
        let timeout = self.timeout;
        let driver = &mut self.driver;
        let call = async {
            if let Some(answer) = stream.answer.take() {
                // A server may send the stream's headers only with its first answer.
                let answer = driver.run(answer).await.map_err(transport)?;
                stream.body = Some(answered(answer)?);
            }
            let Some(body) = stream.body.as_mut() else {
                return Err(transport("the stream has no answer"));
            };
            loop {
                if let Some(message) = take_message(&mut stream.buf)? {
                    return decode(message);
                }
                match driver.run(body.data()).await {
                    Some(Ok(chunk)) => {
                        let _ = body.flow_control().release_capacity(chunk.len());
                        stream.buf.extend_from_slice(&chunk);
                    }
                    Some(Err(e)) => return Err(transport(e)),
                    None => {
                        let trailers = driver.run(body.trailers()).await.map_err(transport)?;
                        status(trailers.as_ref())?;
                        return Err(transport("the stream ended"));
                    }
                }
            }
        };
        within(timeout, call).await
    }

    fn head(&self, path: &'static str) -> Request<()> {
        let mut parts = axum::http::uri::Parts::default();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = Some(PathAndQuery::from_static(path));
        let mut req = Request::new(());
        *req.method_mut() = Method::POST;
        if let Ok(uri) = Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
        let headers = req.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        req
    }
}

/// A bidirectional gRPC stream of a [`GrpcConn`].
pub struct GrpcStream {
    send: h2::SendStream<Bytes>,
    /// The answer's head, until it came.
    answer: Option<ResponseFuture>,
    body: Option<RecvStream>,
    /// Received bytes not yet taken as a message.
    buf: BytesMut,
    /// An exchange failed: the stream is out of step with its requests.
    failed: bool,
}

async fn within<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or(Err(CallError::Timeout(timeout)))
}

/// Start a request: its HEADERS are queued, and leave with whatever the caller queues next.
async fn open(
    send: &mut SendRequest<Bytes>,
    driver: &mut Driver,
    head: Request<()>,
) -> Result<(ResponseFuture, h2::SendStream<Bytes>), CallError> {
    driver
        .run(std::future::poll_fn(|cx| send.poll_ready(cx)))
        .await
        .map_err(transport)?;
    send.send_request(head, false).map_err(transport)
}

/// The answer's body, if its head says the call goes on (a head with `grpc-status` is the
/// whole answer: "trailers only").
fn answered(answer: Response<RecvStream>) -> Result<RecvStream, CallError> {
    if answer.status() != StatusCode::OK {
        return Err(transport(format!("HTTP status {}", answer.status())));
    }
    if answer.headers().contains_key("grpc-status") {
        status(Some(answer.headers()))?;
        return Err(transport("the answer has no message"));
    }
    Ok(answer.into_body())
}

/// The call's gRPC status, from the trailers.
fn status(trailers: Option<&HeaderMap>) -> Result<(), CallError> {
    let Some(t) = trailers else {
        return Err(transport("the answer has no trailers"));
    };
    let code = t
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .ok_or_else(|| transport("the trailers have no grpc-status"))?;
    if code == 0 {
        return Ok(());
    }
    let message = t
        .get("grpc-message")
        .map(|v| {
            percent_encoding::percent_decode(v.as_bytes())
                .decode_utf8_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    Err(CallError::Status {
        code: tonic::Code::from_i32(code),
        message,
    })
}

fn encode<Q: Message>(req: &Q) -> Result<Bytes, CallError> {
    let len = req.encoded_len();
    let framed = u32::try_from(len).map_err(|_| transport("the request is too large"))?;
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(framed);
    req.encode(&mut buf).map_err(transport)?;
    Ok(buf.freeze())
}

/// The next whole message at the front of `buf`, if it has arrived.
fn take_message(buf: &mut BytesMut) -> Result<Option<Bytes>, CallError> {
    if buf.len() < PREFIX {
        return Ok(None);
    }
    if buf[0] != 0 {
        return Err(transport("a compressed message (none was asked for)"));
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(transport(format!("a message of {len} bytes")));
    }
    if buf.len() < PREFIX + len {
        return Ok(None);
    }
    buf.advance(PREFIX);
    Ok(Some(buf.split_to(len).freeze()))
}

fn decode<R: Message + Default>(message: Bytes) -> Result<R, CallError> {
    R::decode(message).map_err(transport)
}

#[cfg(test)]
mod tests;
