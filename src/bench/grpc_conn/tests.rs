//! The load generator's gRPC client against tonic's server (a server nobody here wrote).

use std::time::Duration;

use futures::Stream;
use leasecore_etcd_api::etcdserverpb::kv_server::{Kv, KvServer};
use leasecore_etcd_api::etcdserverpb::lease_server::{Lease, LeaseServer};
use leasecore_etcd_api::etcdserverpb::{
    CompactionRequest, CompactionResponse, DeleteRangeRequest, DeleteRangeResponse,
    LeaseGrantRequest, LeaseGrantResponse, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseLeasesRequest, LeaseLeasesResponse, LeaseRevokeRequest, LeaseRevokeResponse,
    LeaseTimeToLiveRequest, LeaseTimeToLiveResponse, PutRequest, PutResponse, RangeRequest,
    RangeResponse, ResponseHeader, TxnRequest, TxnResponse,
};
use leasecore_etcd_api::mvccpb::KeyValue;
use tonic::{Request, Response, Status, Streaming};

use super::*;

struct Mock;

#[tonic::async_trait]
impl Kv for Mock {
    /// `missing/...` is NotFound with a message that needs percent-encoding; `slow/...` never
    /// answers; `big/...` is one key of a 3 MiB value; anything else is one key whose value is
    /// the key repeated to 2,000 bytes.
    async fn range(&self, req: Request<RangeRequest>) -> Result<Response<RangeResponse>, Status> {
        let key = req.into_inner().key;
        if key.starts_with(b"missing/") {
            return Err(Status::not_found("no such key: «missing» 100%"));
        }
        if key.starts_with(b"slow/") {
            std::future::pending::<()>().await;
        }
        let len = if key.starts_with(b"big/") {
            3 << 20
        } else {
            2_000
        };
        let value = key.iter().copied().cycle().take(len).collect();
        Ok(Response::new(RangeResponse {
            kvs: vec![KeyValue {
                key,
                value,
                ..KeyValue::default()
            }],
            count: 1,
            ..RangeResponse::default()
        }))
    }

    /// Answers with the value's length as the revision.
    async fn put(&self, req: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        Ok(Response::new(PutResponse {
            header: Some(ResponseHeader {
                revision: req.get_ref().value.len() as i64,
                ..ResponseHeader::default()
            }),
            prev_kv: None,
        }))
    }

    async fn delete_range(
        &self,
        _: Request<DeleteRangeRequest>,
    ) -> Result<Response<DeleteRangeResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn txn(&self, _: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn compact(
        &self,
        _: Request<CompactionRequest>,
    ) -> Result<Response<CompactionResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }
}

type KeepAliveAnswers =
    std::pin::Pin<Box<dyn Stream<Item = Result<LeaseKeepAliveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Lease for Mock {
    async fn lease_grant(
        &self,
        _: Request<LeaseGrantRequest>,
    ) -> Result<Response<LeaseGrantResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn lease_revoke(
        &self,
        _: Request<LeaseRevokeRequest>,
    ) -> Result<Response<LeaseRevokeResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    type LeaseKeepAliveStream = KeepAliveAnswers;

    /// Answers each keepalive with its id and a TTL of the id times two; id 0 ends the stream
    /// with an error.
    async fn lease_keep_alive(
        &self,
        req: Request<Streaming<LeaseKeepAliveRequest>>,
    ) -> Result<Response<KeepAliveAnswers>, Status> {
        let answers = futures::stream::unfold(req.into_inner(), |mut inbound| async move {
            match inbound.message().await {
                Ok(Some(r)) if r.id == 0 => Some((Err(Status::invalid_argument("id 0")), inbound)),
                Ok(Some(r)) => Some((
                    Ok(LeaseKeepAliveResponse {
                        id: r.id,
                        ttl: r.id * 2,
                        header: None,
                    }),
                    inbound,
                )),
                _ => None,
            }
        });
        Ok(Response::new(Box::pin(answers)))
    }

    async fn lease_time_to_live(
        &self,
        _: Request<LeaseTimeToLiveRequest>,
    ) -> Result<Response<LeaseTimeToLiveResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn lease_leases(
        &self,
        _: Request<LeaseLeasesRequest>,
    ) -> Result<Response<LeaseLeasesResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }
}

/// A tonic server of the mock on a loopback port, for the test's lifetime.
async fn serve() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvServer::new(Mock))
            .add_service(LeaseServer::new(Mock))
            .serve_with_incoming(incoming),
    );
    format!("http://{addr}")
}

const RANGE: &str = "/etcdserverpb.KV/Range";

/// A Range of one key on `conn`.
async fn range(conn: &mut GrpcConn, key: &[u8]) -> Result<RangeResponse, CallError> {
    let req = RangeRequest {
        key: key.to_vec(),
        ..RangeRequest::default()
    };
    conn.unary(RANGE, &req).await
}

#[tokio::test]
async fn unary_calls_get_their_own_answers() {
    let url = serve().await;
    let mut conn = GrpcConn::connect(&url, Duration::from_secs(10))
        .await
        .unwrap();
    // One answer larger than a stream's receive window (2 MiB): it arrives only if what is
    // read is released as it is read.
    let big = range(&mut conn, b"big/x").await.unwrap();
    assert_eq!(big.kvs[0].value.len(), 3 << 20);
    for i in 0..3_000usize {
        let key = format!("key/{i}").into_bytes();
        let r = range(&mut conn, &key).await.unwrap();
        assert_eq!(r.kvs[0].key, key);
        assert_eq!(r.kvs[0].value.len(), 2_000);
        let p: PutResponse = conn
            .unary(
                "/etcdserverpb.KV/Put",
                &PutRequest {
                    key,
                    value: vec![7; i % 1000],
                    ..PutRequest::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(p.header.unwrap().revision, (i % 1000) as i64);
    }
}

#[tokio::test]
async fn a_status_is_an_error_with_its_code_and_message() {
    let url = serve().await;
    let mut conn = GrpcConn::connect(&url, Duration::from_secs(10))
        .await
        .unwrap();
    let err = range(&mut conn, b"missing/x").await.unwrap_err();
    assert_eq!(
        err,
        CallError::Status {
            code: tonic::Code::NotFound,
            message: "no such key: «missing» 100%".into()
        }
    );
    let err = conn
        .unary::<_, TxnResponse>("/etcdserverpb.KV/Txn", &TxnRequest::default())
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        CallError::Status {
            code: tonic::Code::Unimplemented,
            ..
        }
    ));
    // The connection goes on after errors.
    let r = range(&mut conn, b"k").await.unwrap();
    assert_eq!(r.count, 1);
}

#[tokio::test]
async fn a_call_without_an_answer_times_out() {
    let url = serve().await;
    let mut conn = GrpcConn::connect(&url, Duration::from_millis(200))
        .await
        .unwrap();
    let err = range(&mut conn, b"slow/x").await.unwrap_err();
    assert_eq!(err, CallError::Timeout(Duration::from_millis(200)));
}

#[tokio::test]
async fn a_stream_exchanges_message_for_message() {
    let url = serve().await;
    let mut conn = GrpcConn::connect(&url, Duration::from_secs(10))
        .await
        .unwrap();
    let path = "/etcdserverpb.Lease/LeaseKeepAlive";
    let mut stream = conn.open_stream(path).await.unwrap();
    for id in 1..=500 {
        let r: LeaseKeepAliveResponse = conn
            .exchange(&mut stream, &LeaseKeepAliveRequest { id })
            .await
            .unwrap();
        assert_eq!((r.id, r.ttl), (id, id * 2));
    }
    // The server ends the stream with a status: the exchange says which.
    let err = conn
        .exchange::<_, LeaseKeepAliveResponse>(&mut stream, &LeaseKeepAliveRequest { id: 0 })
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        CallError::Status {
            code: tonic::Code::InvalidArgument,
            ..
        }
    ));
    // A stream that failed takes no more exchanges; a new stream on the same connection works.
    assert!(
        conn.exchange::<_, LeaseKeepAliveResponse>(&mut stream, &LeaseKeepAliveRequest { id: 5 })
            .await
            .is_err()
    );
    let mut again = conn.open_stream(path).await.unwrap();
    let r: LeaseKeepAliveResponse = conn
        .exchange(&mut again, &LeaseKeepAliveRequest { id: 9 })
        .await
        .unwrap();
    assert_eq!(r.id, 9);
}

#[test]
fn a_message_is_taken_only_once_whole() {
    let mut buf = BytesMut::new();
    assert_eq!(take_message(&mut buf), Ok(None));
    buf.extend_from_slice(&[0, 0, 0, 0, 3, b'a']);
    assert_eq!(take_message(&mut buf), Ok(None));
    buf.extend_from_slice(b"bc");
    buf.extend_from_slice(&[0, 0, 0, 0, 0]);
    assert_eq!(take_message(&mut buf), Ok(Some(Bytes::from_static(b"abc"))));
    assert_eq!(take_message(&mut buf), Ok(Some(Bytes::new())));
    assert!(buf.is_empty());
    let mut compressed = BytesMut::from(&[1u8, 0, 0, 0, 1, b'x'][..]);
    assert!(take_message(&mut compressed).is_err());
    let mut huge = BytesMut::from(&[0u8, 0xff, 0xff, 0xff, 0xff][..]);
    assert!(take_message(&mut huge).is_err());
}
