//! gRPC's standard services on the etcd port, driven by tonic's own health and reflection
//! clients: `grpc.health.v1.Health` (what `grpc_health_probe`, Kubernetes' `grpc` probes and
//! load balancers ask) follows the node's readiness, also on a `Watch` stream, and is open with
//! auth on; server reflection (`v1` and `v1alpha`, what `grpcurl` asks) lists and describes
//! etcd's services.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::etcdctl::{endpoint, etcd_cluster};
use common::eventually;
use futures::StreamExt;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const WAIT: Duration = Duration::from_secs(30);

async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap()
}

async fn check(client: &mut HealthClient<Channel>, service: &str) -> Result<i32, tonic::Status> {
    client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|r| r.into_inner().status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_health_follows_readiness_and_watch_reports_the_change() {
    let mut c = etcd_cluster().await;
    let leader = c.leader().await;
    let ids: Vec<u64> = c.nodes.keys().copied().collect();
    let serving = ServingStatus::Serving as i32;
    for id in &ids {
        let mut client = HealthClient::new(channel(&endpoint(&c, *id)).await);
        let status = eventually(WAIT, "SERVING on every node", || {
            let mut client = client.clone();
            async move { check(&mut client, "").await.ok().filter(|s| *s == serving) }
        })
        .await;
        assert_eq!(status, serving, "node {id}");
        assert_eq!(
            check(&mut client, "etcdserverpb.KV").await.unwrap(),
            serving
        );
        assert_eq!(check(&mut client, "v3lockpb.Lock").await.unwrap(), serving);
        let unknown = check(&mut client, "no.such.Service").await.unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::NotFound, "{unknown:?}");
    }

    // A watch of an unknown service says so, and stays open.
    let last = *ids.iter().find(|id| **id != leader).unwrap();
    let mut client = HealthClient::new(channel(&endpoint(&c, last)).await);
    let mut unknown = client
        .watch(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = unknown.next().await.unwrap().unwrap();
    assert_eq!(first.status, ServingStatus::ServiceUnknown as i32);
    drop(unknown);

    // A watch sends the status now, then its change when the node loses its quorum.
    let mut watch = client
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(WAIT, watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.status, serving);
    for id in ids.iter().filter(|id| **id != last) {
        c.stop(*id).await;
    }
    let next = tokio::time::timeout(WAIT, watch.next())
        .await
        .expect("the change arrives within the deadline")
        .expect("the stream stays open")
        .unwrap();
    assert_eq!(next.status, ServingStatus::NotServing as i32);
    assert_eq!(
        check(&mut client, "").await.unwrap(),
        ServingStatus::NotServing as i32
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_health_is_open_with_auth_on() {
    let c = etcd_cluster().await;
    let leader = c.leader().await;
    let anon = leasecore::client::Client::new(&[c.addrs[&leader].clone()]).unwrap();
    anon.user_add("root", "root-pw-1").await.unwrap();
    anon.user_grant_role("root", "root").await.unwrap();
    anon.auth_enable().await.unwrap();
    let mut client = HealthClient::new(channel(&endpoint(&c, leader)).await);
    assert_eq!(
        check(&mut client, "").await.unwrap(),
        ServingStatus::Serving as i32
    );
    c.shutdown().await;
}

/// The names of the services a reflection service lists, through one version of its API
/// (`v1` and `v1alpha` have the same messages in two packages).
macro_rules! listed_through {
    ($version:ident, $addr:expr) => {{
        use tonic_reflection::pb::$version::ServerReflectionRequest;
        use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
        let mut client = ServerReflectionClient::new(channel($addr).await);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut answers = client
            .server_reflection_info(futures::stream::iter([request]))
            .await
            .unwrap()
            .into_inner();
        match answers.next().await.unwrap().unwrap().message_response {
            Some(MessageResponse::ListServicesResponse(list)) => list
                .service
                .into_iter()
                .map(|s| s.name)
                .collect::<Vec<String>>(),
            other => panic!("not a service list: {other:?}"),
        }
    }};
}

async fn listed(addr: &str, v1: bool) -> Vec<String> {
    if v1 {
        listed_through!(v1, addr)
    } else {
        listed_through!(v1alpha, addr)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reflection_lists_and_describes_the_etcd_services() {
    let c = etcd_cluster().await;
    let addr = endpoint(&c, c.leader().await);
    for v1 in [true, false] {
        let services = listed(&addr, v1).await;
        for want in [
            "etcdserverpb.KV",
            "etcdserverpb.Watch",
            "etcdserverpb.Lease",
            "etcdserverpb.Cluster",
            "etcdserverpb.Maintenance",
            "etcdserverpb.Auth",
            "v3lockpb.Lock",
            "v3electionpb.Election",
            "grpc.health.v1.Health",
        ] {
            assert!(
                services.iter().any(|s| s == want),
                "v1={v1}: {want} not in {services:?}"
            );
        }
    }

    // A symbol's file, with what a tool needs to build a call: the method and its messages.
    use prost::Message;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut client = ServerReflectionClient::new(channel(&addr).await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(
            "etcdserverpb.KV".into(),
        )),
    };
    let mut answers = client
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let files = match answers.next().await.unwrap().unwrap().message_response {
        Some(MessageResponse::FileDescriptorResponse(files)) => files.file_descriptor_proto,
        other => panic!("not a file descriptor: {other:?}"),
    };
    let described: Vec<prost_types::FileDescriptorProto> = files
        .iter()
        .map(|bytes| prost_types::FileDescriptorProto::decode(bytes.as_slice()).unwrap())
        .collect();
    let kv = described
        .iter()
        .flat_map(|f| &f.service)
        .find(|s| s.name() == "KV")
        .expect("the KV service is described");
    let range = kv
        .method
        .iter()
        .find(|m| m.name() == "Range")
        .expect("KV.Range");
    assert_eq!(range.input_type(), ".etcdserverpb.RangeRequest");
    assert_eq!(range.output_type(), ".etcdserverpb.RangeResponse");
    c.shutdown().await;
}
