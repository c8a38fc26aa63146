//! etcd's busiest unary calls (KV `Put`, `Range`, `Txn`, `DeleteRange`, Lease `LeaseGrant`)
//! answered without tonic's generic server: the same handlers ([`Kv`], [`Lease`] on
//! [`Etcd`]), a leaner envelope.
//!
//! tonic serves a unary call as a stream of one message each way: a decoder with a buffer of
//! its own for the request, an encoder stream with another for the answer, a boxed body and a
//! trailers map, around a call whose request and answer are a few hundred bytes. Here a
//! request's body is taken whole (it is one message, already in hyper's buffer when the
//! stream's one DATA frame ended it), decoded in place, and the answer is one frame and its
//! trailers.
//!
//! # Invariants
//! - What a client sees is what tonic's server would answer for the same request: the same
//!   handler's answer or status, `content-type: application/grpc`, `grpc-status: 0` in the
//!   trailers of an answer, a trailers-only response for a status.
//! - A request that is not exactly one whole, uncompressed message within
//!   [`super::MAX_MESSAGE_BYTES`] is refused with a status (as tonic refuses it), never
//!   handled in part.
//!
//! # What it must not do
//! Decide anything about the call: that is the handlers'.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Response, header};
use axum::routing::post;
use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use leasecore_etcd_api::etcdserverpb::kv_server::Kv;
use leasecore_etcd_api::etcdserverpb::lease_server::Lease;
use tonic::Status;
use tonic::metadata::MetadataMap;

use super::{Etcd, MAX_MESSAGE_BYTES};

/// gRPC's prefix of every message: a compressed flag and a 4-byte length.
const PREFIX: usize = 5;

/// The calls served here, on their gRPC paths, for [`super::router`] to merge in front of
/// tonic's services (a path routed here never reaches them).
pub fn routes(etcd: Etcd) -> Router {
    Router::new()
        .route(
            "/etcdserverpb.KV/Put",
            post(|State(e): State<Etcd>, req: Request| async move {
                unary(req, |r| async move { e.put(r).await }).await
            }),
        )
        .route(
            "/etcdserverpb.KV/Range",
            post(|State(e): State<Etcd>, req: Request| async move {
                unary(req, |r| async move { e.range(r).await }).await
            }),
        )
        .route(
            "/etcdserverpb.KV/Txn",
            post(|State(e): State<Etcd>, req: Request| async move {
                unary(req, |r| async move { e.txn(r).await }).await
            }),
        )
        .route(
            "/etcdserverpb.KV/DeleteRange",
            post(|State(e): State<Etcd>, req: Request| async move {
                unary(req, |r| async move { e.delete_range(r).await }).await
            }),
        )
        .route(
            "/etcdserverpb.Lease/LeaseGrant",
            post(|State(e): State<Etcd>, req: Request| async move {
                unary(req, |r| async move { e.lease_grant(r).await }).await
            }),
        )
        .with_state(etcd)
}

/// One unary call: `req`'s message decoded, handed to `handle`, its answer or status sent.
async fn unary<Req, Resp, F, Fut>(req: Request, handle: F) -> Response<Body>
where
    Req: prost::Message + Default,
    Resp: prost::Message,
    F: FnOnce(tonic::Request<Req>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<Resp>, Status>>,
{
    let (parts, body) = req.into_parts();
    let message = match message_of(&parts.headers, body).await {
        Ok(bytes) => bytes,
        Err(status) => return status.into_http(),
    };
    let message = match Req::decode(message) {
        Ok(m) => m,
        Err(e) => return Status::internal(e.to_string()).into_http(),
    };
    let request = tonic::Request::from_parts(
        MetadataMap::from_headers(parts.headers),
        parts.extensions,
        message,
    );
    match handle(request).await {
        Ok(answer) => answered(answer),
        Err(status) => status.into_http(),
    }
}

/// The one message a unary request's body holds, without its prefix.
async fn message_of(headers: &HeaderMap, body: Body) -> Result<Bytes, Status> {
    // tonic's server accepts no compression unless configured to, and leasecore's is not.
    if let Some(encoding) = headers.get("grpc-encoding")
        && encoding.as_bytes() != b"identity"
    {
        let mut status = Status::unimplemented(format!(
            "Content is compressed with `{}` which isn't supported",
            String::from_utf8_lossy(encoding.as_bytes())
        ));
        status.metadata_mut().insert(
            "grpc-accept-encoding",
            tonic::metadata::MetadataValue::from_static("identity"),
        );
        return Err(status);
    }
    let whole = axum::body::to_bytes(body, PREFIX + MAX_MESSAGE_BYTES)
        .await
        .map_err(|_| {
            Status::out_of_range(format!(
                "Error, decoded message length too large: the limit is: {MAX_MESSAGE_BYTES} bytes"
            ))
        })?;
    if whole.is_empty() {
        return Err(Status::internal("Missing request message."));
    }
    if whole.len() < PREFIX {
        return Err(Status::internal("Unexpected EOF decoding stream."));
    }
    match whole[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding \
                 was specified",
            ));
        }
        f => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {f} (valid \
                 flags are 0 and 1), while sending request"
            )));
        }
    }
    let len = u32::from_be_bytes([whole[1], whole[2], whole[3], whole[4]]) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(Status::out_of_range(format!(
            "Error, decoded message length too large: found {len} bytes, the limit is: \
             {MAX_MESSAGE_BYTES} bytes"
        )));
    }
    if whole.len() != PREFIX + len {
        // Short: the stream ended inside the message. Long: a unary call with a second one.
        return Err(Status::internal(if whole.len() < PREFIX + len {
            "Unexpected EOF decoding stream."
        } else {
            "a unary call carries exactly one message"
        }));
    }
    Ok(whole.slice(PREFIX..))
}

/// A handler's answer as gRPC sends it: headers, one message, `grpc-status: 0`.
fn answered<Resp: prost::Message>(answer: tonic::Response<Resp>) -> Response<Body> {
    let (metadata, message, _) = answer.into_parts();
    let len = message.encoded_len();
    let mut frame = BytesMut::with_capacity(PREFIX + len);
    frame.put_u8(0);
    frame.put_u32(len as u32);
    // Cannot fail: the buffer was sized for the message.
    let _ = message.encode(&mut frame);
    let mut response = Response::new(Body::new(OneMessage {
        message: Some(frame.freeze()),
        trailers: true,
    }));
    let headers = response.headers_mut();
    *headers = metadata.into_headers();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    response
}

/// An answer's body: one DATA frame, then the trailers.
struct OneMessage {
    message: Option<Bytes>,
    trailers: bool,
}

impl http_body::Body for OneMessage {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(message) = self.message.take() {
            return Poll::Ready(Some(Ok(Frame::data(message))));
        }
        if std::mem::take(&mut self.trailers) {
            let mut trailers = HeaderMap::with_capacity(1);
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.message.is_none() && !self.trailers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    async fn message(
        headers: &[(&'static str, &'static str)],
        body: Vec<u8>,
    ) -> Result<Bytes, Status> {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, HeaderValue::from_static(value));
        }
        message_of(&map, Body::from(body)).await
    }

    #[tokio::test]
    async fn one_whole_uncompressed_message_is_taken() {
        let got = message(&[], framed(0, b"hello")).await.unwrap();
        assert_eq!(&got[..], b"hello");
        let got = message(&[("grpc-encoding", "identity")], framed(0, b""))
            .await
            .unwrap();
        assert!(got.is_empty());
    }

    #[tokio::test]
    async fn anything_else_is_refused_as_tonic_refuses_it() {
        let code = |r: Result<Bytes, Status>| r.unwrap_err().code();
        assert_eq!(code(message(&[], Vec::new()).await), tonic::Code::Internal);
        assert_eq!(
            code(message(&[], vec![0, 0, 0]).await),
            tonic::Code::Internal
        );
        let mut short = framed(0, b"hello");
        short.pop();
        assert_eq!(code(message(&[], short).await), tonic::Code::Internal);
        let mut two = framed(0, b"a");
        two.extend(framed(0, b"b"));
        assert_eq!(code(message(&[], two).await), tonic::Code::Internal);
        assert_eq!(
            code(message(&[], framed(1, b"x")).await),
            tonic::Code::Internal
        );
        assert_eq!(
            code(message(&[], framed(7, b"x")).await),
            tonic::Code::Internal
        );
        let gzip = message(&[("grpc-encoding", "gzip")], framed(1, b"x")).await;
        assert_eq!(code(gzip), tonic::Code::Unimplemented);
        let mut huge = vec![0u8];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(code(message(&[], huge).await), tonic::Code::OutOfRange);
        let too_long = framed(0, &vec![b'x'; MAX_MESSAGE_BYTES + 1]);
        assert_eq!(code(message(&[], too_long).await), tonic::Code::OutOfRange);
    }

    #[tokio::test]
    async fn an_answer_is_one_message_then_grpc_status_zero() {
        use leasecore_etcd_api::etcdserverpb::PutResponse;
        let answer = PutResponse::default();
        let response = answered(tonic::Response::new(answer.clone()));
        assert_eq!(
            response.headers().get(header::CONTENT_TYPE).unwrap(),
            "application/grpc"
        );
        let mut body = response.into_body();
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(frame) =
            std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx)).await
        {
            match frame.unwrap().into_data() {
                Ok(d) => data.extend_from_slice(&d),
                Err(f) => trailers = f.into_trailers().ok(),
            }
        }
        assert_eq!(data, framed(0, &prost::Message::encode_to_vec(&answer)));
        assert_eq!(trailers.unwrap().get("grpc-status").unwrap(), "0");
    }
}
