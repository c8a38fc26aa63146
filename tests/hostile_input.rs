//! Hostile input against running nodes: requests that are small on the wire but ask a node (or
//! every node) for far more than it can answer. Each test reproduces one finding of a
//! black-box campaign against the real binary: the node must refuse such a request with a
//! clear error before it builds the answer, and a refusal must mean nothing was done.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::etcdctl::{endpoint, etcd_cluster_tweaked};
use leasecore_etcd_api::etcdserverpb::kv_client::KvClient;
use leasecore_etcd_api::etcdserverpb::{
    PutRequest, RangeRequest, RequestOp, TxnRequest, request_op,
};
use tonic::Code;
use tonic::transport::Channel;

/// Values of 1 MiB (the largest a value may be) under `big/`.
const BIG_VALUES: usize = 6;

async fn kv_client(addr: &str) -> KvClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(20))
        .connect()
        .await
        .unwrap();
    // The client accepts any answer: a refusal must come from the server.
    KvClient::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

fn range_of_big() -> RangeRequest {
    RangeRequest {
        key: b"big/".to_vec(),
        range_end: b"big0".to_vec(),
        ..Default::default()
    }
}

fn op_range(r: RangeRequest) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestRange(r)),
    }
}

fn op_put(key: &str, value: &str) -> RequestOp {
    RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
            ..Default::default()
        })),
    }
}

/// A Txn of a few hundred bytes whose ranges read the same 6 MiB sixteen times made every node
/// build 96 MiB of answer while applying it (a hundred such ranges over 60 MiB took every node
/// of a local cluster to 6.8 GB and cost the leader its leadership); the answer then failed to
/// encode (`OutOfRange`, over the 4 MiB message limit) although its put had been applied. Now
/// a transaction whose results would pass [`leasecore::domain::range::MAX_RESULT_BYTES`] is
/// refused before it changes anything, and so are a Range and a read-only Txn that large;
/// narrowed (a limit, keys only) they are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_larger_than_the_result_limit_are_refused_before_anything_is_done() {
    // A read's budget at its least, 4 MiB, as a write's (a node's default lets a read
    // answer 256 MiB, which Kubernetes' lists need).
    let c = etcd_cluster_tweaked(|cfg| cfg.limits.max_read_answer_bytes = 4 << 20).await;
    let mut kv = kv_client(&endpoint(&c, 1)).await;
    for i in 0..BIG_VALUES {
        kv.put(PutRequest {
            key: format!("big/{i}").into_bytes(),
            value: vec![b'x'; 1 << 20],
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let mut success = vec![op_put("marker", "written")];
    success.extend((0..16).map(|_| op_range(range_of_big())));
    let err = kv
        .txn(TxnRequest {
            success,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("too large"), "{err:?}");
    // A refusal: the put of the same transaction was not applied (on any node).
    for id in [1, 2, 3] {
        let mut kv = kv_client(&endpoint(&c, id)).await;
        let marker = kv
            .range(RangeRequest {
                key: b"marker".to_vec(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(marker.kvs.is_empty(), "node {id}: the refused txn wrote");
    }

    // A transaction that only reads, and a plain Range, as large: refused too.
    let err = kv
        .txn(TxnRequest {
            success: (0..16).map(|_| op_range(range_of_big())).collect(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let err = kv.range(range_of_big()).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");

    // Narrowed, they are answered: a limit, keys only, a count.
    let some = kv
        .range(RangeRequest {
            limit: 2,
            ..range_of_big()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((some.kvs.len(), some.more, some.count), (2, true, 6));
    let keys = kv
        .range(RangeRequest {
            keys_only: true,
            ..range_of_big()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(keys.kvs.len(), BIG_VALUES);
    let mut success = vec![op_put("marker", "written")];
    success.extend((0..16).map(|_| {
        op_range(RangeRequest {
            count_only: true,
            ..range_of_big()
        })
    }));
    let ok = kv
        .txn(TxnRequest {
            success,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ok.succeeded);
    c.shutdown().await;
}
