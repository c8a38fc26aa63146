//! Every bad input a client (or a confused peer) can send gets a clear JSON error with the
//! right status and code, and changes nothing.

use crate::common;

use common::TestCluster;
use reqwest::Method;
use serde_json::Value;

const MAX_VALUE: usize = 1000;

/// A request and the refusal it must get: method, path, body, status, code.
type Case = (Method, String, Option<Vec<u8>>, u16, &'static str);

struct Probe {
    http: reqwest::Client,
    base: String,
}

impl Probe {
    /// Send a raw request; return the status and the decoded error code.
    async fn send(&self, method: Method, path: &str, body: Option<Vec<u8>>) -> (u16, String) {
        let mut req = self.http.request(method, format!("{}{}", self.base, path));
        if let Some(b) = body {
            req = req.body(b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let doc: Value = resp.json().await.expect("every error is a JSON document");
        let code = doc["error"]["code"].as_str().unwrap_or("").to_string();
        assert!(
            status < 400 || !doc["error"]["message"].as_str().unwrap_or("").is_empty(),
            "error without a message: {doc}"
        );
        (status, code)
    }
}

/// The whole store as the leader sees it: revision plus every key.
async fn store_fingerprint(c: &TestCluster) -> Value {
    let list = c.client().list("", None, false).await.unwrap();
    serde_json::to_value(list).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_client_input_is_refused_with_its_code_and_changes_nothing() {
    let c = TestCluster::start_full(3, 10_000, Some(MAX_VALUE)).await;
    c.leader().await;
    c.client().put("existing", "v", None, None).await.unwrap();
    let before = store_fingerprint(&c).await;
    let p = Probe {
        http: reqwest::Client::new(),
        base: c.url(2),
    };
    let json = |s: &str| Some(s.as_bytes().to_vec());
    let long_key = "k".repeat(1025);
    let cases: Vec<Case> = vec![
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json("{not json"),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json(r#"{"value": 5}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json(r#"{"value": "x", "ttl": 3}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json(r#"{}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json(r#"[]"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            None,
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            Some(b"{\"value\": \"\xff\"}".to_vec()),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/".into(),
            json(r#"{"value": "x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            format!("/v1/kv/{long_key}"),
            json(r#"{"value": "x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::GET,
            format!("/v1/kv/{long_key}"),
            None,
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a%FF".into(),
            json(r#"{"value": "x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            Some(format!(r#"{{"value": "{}"}}"#, "x".repeat(MAX_VALUE + 1)).into_bytes()),
            413,
            "too_large",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            Some(format!(r#"{{"value": "{}"}}"#, "x".repeat(MAX_VALUE * 6 + 100_000)).into_bytes()),
            413,
            "too_large",
        ),
        (
            Method::PUT,
            "/v1/kv/a?prev_revision=abc".into(),
            json(r#"{"value": "x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a?prev_revison=1".into(),
            json(r#"{"value": "x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/a?prev_revision=-1".into(),
            json(r#"{"value": "x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/kv/existing?prev_revision=0".into(),
            json(r#"{"value": "x"}"#),
            409,
            "revision_mismatch",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json(r#"{"value": "x", "lease": "nope"}"#),
            404,
            "lease_not_found",
        ),
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json(r#"{"value": "x", "lease": ""}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::DELETE,
            "/v1/kv/existing?prev_revision=999".into(),
            None,
            409,
            "revision_mismatch",
        ),
        (
            Method::GET,
            "/v1/kv/a?consistency=eventual".into(),
            None,
            400,
            "invalid_argument",
        ),
        (
            Method::GET,
            "/v1/kv/missing".into(),
            None,
            404,
            "key_not_found",
        ),
        (
            Method::GET,
            "/v1/kv?limit=0".into(),
            None,
            400,
            "invalid_argument",
        ),
        (
            Method::GET,
            "/v1/kv?limit=many".into(),
            None,
            400,
            "invalid_argument",
        ),
        (
            Method::POST,
            "/v1/kv/a".into(),
            json(r#"{"value": "x"}"#),
            405,
            "method_not_allowed",
        ),
        (Method::GET, "/v2/kv/a".into(), None, 404, "not_found"),
        (
            Method::POST,
            "/v1/cluster/nodes".into(),
            json(r#"{"id": 9, "address": "http://x/"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::POST,
            "/v1/cluster/nodes".into(),
            json(r#"{"id": "nine", "address": "h:1"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::DELETE,
            "/v1/cluster/nodes/99".into(),
            None,
            404,
            "node_not_found",
        ),
        (
            Method::DELETE,
            "/v1/cluster/nodes/abc".into(),
            None,
            400,
            "invalid_argument",
        ),
        // A value that begins with U+0000 (the stored form of an etcd binary value), wherever
        // `/v1` writes one.
        (
            Method::PUT,
            "/v1/kv/a".into(),
            json(r#"{"value": "\u0000AAH/"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::POST,
            "/v1/txn".into(),
            json(
                r#"{"success": [{"put": {"key": "a", "value": "ok"}},
                                 {"txn": {"failure": [{"put": {"key": "b", "value": "\u0000"}}]}}]}"#,
            ),
            400,
            "invalid_argument",
        ),
        (
            Method::POST,
            "/v1/locks/db".into(),
            json(r#"{"lease": "l", "value": "\u0000x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::POST,
            "/v1/elections/e/campaign".into(),
            json(r#"{"lease": "l", "value": "\u0000x"}"#),
            400,
            "invalid_argument",
        ),
        (
            Method::PUT,
            "/v1/elections/e/proclaim".into(),
            json(r#"{"lease": "l", "value": "\u0000x"}"#),
            400,
            "invalid_argument",
        ),
    ];
    for (method, path, body, status, code) in cases {
        let shown = format!("{method} {}", &path[..path.len().min(60)]);
        let got = p.send(method, &path, body).await;
        assert_eq!(got, (status, code.to_string()), "{shown}");
    }
    assert_eq!(
        store_fingerprint(&c).await,
        before,
        "bad input changed the store"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_peer_messages_are_refused_without_harming_the_node() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    c.client().put("existing", "v", None, None).await.unwrap();
    let before = store_fingerprint(&c).await;
    for target in [1u64, 2, 3] {
        // Peer routes live on the peer port only, and hear members only: these name another
        // member, so that what is refused is the body.
        let member = if target == 1 { 2 } else { 1 };
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert("x-leasecore-node", member.to_string().parse().unwrap());
        let p = Probe {
            http: reqwest::Client::builder()
                .default_headers(headers)
                .build()
                .unwrap(),
            base: c.peer_url(target),
        };
        let garbage: Vec<(&str, Vec<u8>)> = vec![
            ("/raft/append", b"\xc1\x00garbage".to_vec()),
            ("/raft/append", Vec::new()),
            ("/raft/vote", b"{}".to_vec()),
            ("/raft/vote", b"{\"vote\": 1".to_vec()),
            ("/raft/snapshot", b"\x00\x00".to_vec()),
            (
                "/raft/snapshot",
                [&u64::MAX.to_be_bytes()[..], b"{}"].concat(),
            ),
            ("/raft/snapshot", [&2u64.to_be_bytes()[..], b"{}"].concat()),
            ("/raft/propose", b"{\"op\": \"explode\"}".to_vec()),
            ("/raft/propose_batch", b"{\"op\": \"explode\"}".to_vec()),
            ("/raft/propose_batch", b"[{\"op\": \"explode\"}]".to_vec()),
            ("/raft/propose_batch", b"[]".to_vec()),
            (
                "/raft/propose_batch_applied",
                b"[{\"op\": \"explode\"}]".to_vec(),
            ),
            ("/raft/propose_batch_applied", b"[]".to_vec()),
            ("/raft/admin", b"{\"op\": \"add_node\"}".to_vec()),
            ("/raft/add_learner", b"{\"id\": 7}".to_vec()),
            (
                "/raft/add_learner",
                b"{\"id\": 7, \"address\": \"a b\"}".to_vec(),
            ),
            ("/flease/msg", b"\xc1\x00garbage".to_vec()),
            ("/flease/msg", b"[{\"msg\": \"read\"}]".to_vec()),
            ("/flease/msg", Vec::new()),
        ];
        for (path, body) in garbage {
            let (status, code) = p.send(Method::POST, path, Some(body)).await;
            assert_eq!((status, code.as_str()), (400, "invalid_argument"), "{path}");
        }
    }
    // Nothing changed and the cluster still serves writes under the same leader.
    assert_eq!(store_fingerprint(&c).await, before);
    c.client().put("after", "ok", None, None).await.unwrap();
    assert_eq!(c.leader().await, leader);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn boundary_sizes_are_accepted() {
    let c = TestCluster::start_full(1, 10_000, Some(MAX_VALUE)).await;
    c.leader().await;
    let client = c.client();
    let key = "k".repeat(1024);
    client
        .put(&key, &"v".repeat(MAX_VALUE), None, None)
        .await
        .unwrap();
    let got = client.get(&key, false).await.unwrap().unwrap();
    assert_eq!(got.kv.value.len(), MAX_VALUE);
    // Reserved characters survive the round trip through the path.
    let odd = "dir/a b?c#d%e&f=g+h/é/\u{1F600}";
    client.put(odd, "odd", None, None).await.unwrap();
    assert_eq!(client.get(odd, false).await.unwrap().unwrap().kv.key, odd);
    assert_eq!(
        client.list("dir/", None, false).await.unwrap().items[0].key,
        odd
    );
    // An empty value is a value.
    client.put("empty", "", None, None).await.unwrap();
    assert_eq!(
        client.get("empty", false).await.unwrap().unwrap().kv.value,
        ""
    );
    c.shutdown().await;
}
