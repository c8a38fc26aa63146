//! etcd's gRPC-JSON gateway on the etcd port, over plain HTTP/1.1 as curl and gateway clients
//! speak it: the JSON conventions (proto field names, base64 bytes, int64 as strings, zero
//! values left out, enums by name), streams as `{"result": ...}` lines, errors with etcd's
//! codes and messages, and `GET /version`. The shapes are those of etcd's own documentation
//! and gateway tests.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use base64::Engine;
use common::TestCluster;
use serde_json::{Value, json};

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn unb64(v: &Value) -> String {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(v.as_str().expect("base64 text"))
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

struct Gateway {
    http: reqwest::Client,
    base: String,
}

impl Gateway {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    async fn ok(&self, path: &str, body: Value) -> Value {
        let (status, v) = self.post(path, body).await;
        assert_eq!(status, 200, "{path}: {v}");
        v
    }
}

/// The next `{"result": ...}` line of a streamed answer.
async fn next_result(resp: &mut reqwest::Response, buf: &mut String) -> Value {
    loop {
        if let Some(i) = buf.find('\n') {
            let line: String = buf.drain(..=i).collect();
            let v: Value = serde_json::from_str(line.trim()).unwrap();
            return v.get("result").cloned().unwrap_or_else(|| panic!("{v}"));
        }
        let chunk = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
            .await
            .expect("the stream stalled")
            .unwrap()
            .expect("the stream ended");
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_json_gateway_speaks_etcds_conventions() {
    let c = TestCluster::start_tweaked(3, |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
    })
    .await;
    let leader = c.leader().await;
    let follower = leader % 3 + 1;
    let g = Gateway {
        http: reqwest::Client::new(),
        base: format!("http://{}", c.nodes[&follower].etcd_addr().unwrap()),
    };

    let version: Value = g
        .http
        .get(format!("{}/version", g.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(version["etcdserver"], "3.5.17");
    assert_eq!(version["etcdcluster"], "3.5.0");

    let put = g
        .ok(
            "/v3/kv/put",
            json!({"key": b64("foo"), "value": b64("bar")}),
        )
        .await;
    let rev = put["header"]["revision"]
        .as_str()
        .expect("int64 as a string");
    assert!(put["header"]["cluster_id"].is_string());
    assert!(put["header"]["raft_term"].is_string());

    let range = g.ok("/v3/kv/range", json!({"key": b64("foo")})).await;
    assert_eq!(range["count"], "1");
    let kv = &range["kvs"][0];
    assert_eq!(
        (unb64(&kv["key"]), unb64(&kv["value"])),
        ("foo".into(), "bar".into())
    );
    assert_eq!(kv["create_revision"], rev);
    assert_eq!(kv["version"], "1");
    assert!(kv.get("lease").is_none(), "zero values are left out: {kv}");
    // Unknown fields are ignored, as etcd's gateway does; an empty range has no kvs.
    let none = g
        .ok(
            "/v3/kv/range",
            json!({"key": b64("nothing"), "no_such_field": 1}),
        )
        .await;
    assert!(
        none.get("kvs").is_none() && none.get("count").is_none(),
        "{none}"
    );

    // A txn: the key exists, so the failure branch runs (no `succeeded` at all).
    let txn = g
        .ok(
            "/v3/kv/txn",
            json!({
                "compare": [{"target": "CREATE", "key": b64("foo"), "create_revision": "0"}],
                "success": [{"request_put": {"key": b64("foo"), "value": b64("new")}}],
                "failure": [{"request_range": {"key": b64("foo")}}],
            }),
        )
        .await;
    assert!(txn.get("succeeded").is_none(), "{txn}");
    assert_eq!(
        unb64(&txn["responses"][0]["response_range"]["kvs"][0]["value"]),
        "bar"
    );

    // Errors: etcd's gRPC code and message, the HTTP status grpc-gateway gives it.
    let (status, err) = g
        .post(
            "/v3/kv/range",
            json!({"key": b64("foo"), "revision": "99999"}),
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(err["code"], 11, "OutOfRange: {err}");
    assert_eq!(
        err["message"],
        "etcdserver: mvcc: required revision is a future revision"
    );
    let (status, err) = g.post("/v3/kv/range", json!({"key": 12})).await;
    assert_eq!((status, err["code"].as_i64()), (400, Some(3)), "{err}");

    // Leases: `ID` and `TTL` as etcd spells them.
    let grant = g.ok("/v3/lease/grant", json!({"TTL": "20"})).await;
    let id = grant["ID"].as_str().expect("the lease id").to_string();
    assert_eq!(grant["TTL"], "20");
    let mut ka = g
        .http
        .post(format!("{}/v3/lease/keepalive", g.base))
        .json(&json!({"ID": id}))
        .send()
        .await
        .unwrap();
    let mut buf = String::new();
    let kept = next_result(&mut ka, &mut buf).await;
    assert_eq!(
        (kept["ID"].as_str(), kept["TTL"].as_str()),
        (Some(id.as_str()), Some("20"))
    );
    let ttl = g
        .ok("/v3/lease/timetolive", json!({"ID": id, "keys": true}))
        .await;
    assert_eq!(ttl["grantedTTL"], "20");
    let leases = g.ok("/v3/lease/leases", json!({})).await;
    assert_eq!(leases["leases"][0]["ID"], id.as_str());
    g.ok("/v3/lease/revoke", json!({"ID": id})).await;
    let (status, err) = g.post("/v3/lease/revoke", json!({"ID": id})).await;
    assert_eq!(status, 404);
    assert_eq!(err["message"], "etcdserver: requested lease not found");

    // A watch: `created`, then each change (a PUT has no `type`, a DELETE says so).
    let mut watch = g
        .http
        .post(format!("{}/v3/watch", g.base))
        .json(&json!({"create_request": {"key": b64("w"), "prev_kv": true}}))
        .send()
        .await
        .unwrap();
    let mut buf = String::new();
    let created = next_result(&mut watch, &mut buf).await;
    assert_eq!(created["created"], true);
    g.ok("/v3/kv/put", json!({"key": b64("w"), "value": b64("1")}))
        .await;
    g.ok("/v3/kv/deleterange", json!({"key": b64("w")})).await;
    let mut events = Vec::new();
    while events.len() < 2 {
        let r = next_result(&mut watch, &mut buf).await;
        events.extend(r["events"].as_array().cloned().unwrap_or_default());
    }
    assert!(events[0].get("type").is_none(), "{}", events[0]);
    assert_eq!(unb64(&events[0]["kv"]["value"]), "1");
    assert_eq!(events[1]["type"], "DELETE");
    assert_eq!(unb64(&events[1]["prev_kv"]["value"]), "1");
    drop(watch);

    let compacted = g.ok("/v3/kv/compaction", json!({"revision": rev})).await;
    assert!(compacted["header"]["revision"].is_string());
    let status = g.ok("/v3/maintenance/status", json!({})).await;
    assert_eq!(status["version"], "3.5.17");
    // Nothing to defragment: all of the storage is in use (live data read as 99% fragmented).
    assert!(status["dbSize"].is_string(), "{status}");
    assert_eq!(status["dbSizeInUse"], status["dbSize"], "{status}");
    let members = g.ok("/v3/cluster/member/list", json!({})).await;
    assert_eq!(members["members"].as_array().unwrap().len(), 3);
    c.shutdown().await;
}

/// Binary values through the gateway: the base64 of bytes that are not UTF-8 goes in and comes
/// back the same (range, a txn's compare on it); `/v1` shows the stored form (NUL, then the
/// base64) and refuses to write a value of that form.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn binary_values_round_trip_through_the_gateway() {
    let c = TestCluster::start_tweaked(3, |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
    })
    .await;
    let leader = c.leader().await;
    let follower = leader % 3 + 1;
    let g = Gateway {
        http: reqwest::Client::new(),
        base: format!("http://{}", c.nodes[&follower].etcd_addr().unwrap()),
    };
    let raw = [0x00u8, 0xff, 0xfe, 0x80, 0x01, 0xc3, 0x28];
    let value = base64::engine::general_purpose::STANDARD.encode(raw);

    g.ok("/v3/kv/put", json!({"key": b64("bin"), "value": value}))
        .await;
    let range = g.ok("/v3/kv/range", json!({"key": b64("bin")})).await;
    assert_eq!(range["kvs"][0]["value"], value.as_str(), "{range}");
    let txn = g
        .ok(
            "/v3/kv/txn",
            json!({
                "compare": [{"target": "VALUE", "key": b64("bin"), "value": value}],
                "success": [{"request_put": {"key": b64("copy"), "value": value}}],
            }),
        )
        .await;
    assert_eq!(txn["succeeded"], true, "{txn}");
    let copy = g.ok("/v3/kv/range", json!({"key": b64("copy")})).await;
    assert_eq!(copy["kvs"][0]["value"], value.as_str(), "{copy}");

    // `/v1` reads the stored form, and will not write one.
    let http = reqwest::Client::new();
    let v1: Value = http
        .get(format!("{}/v1/kv/bin", c.url(leader)))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v1["value"], format!("\u{0}{value}"));
    let refused = http
        .put(format!("{}/v1/kv/bin", c.url(leader)))
        .json(&json!({"value": format!("\u{0}{value}")}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    let err: Value = refused.json().await.unwrap();
    assert_eq!(err["error"]["code"], "invalid_argument", "{err}");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("U+0000"),
        "{err}"
    );
    c.shutdown().await;
}

/// The paths around the gateway, as etcd 3.4 answers them (checked against etcd 3.4.23 with
/// curl): every route under `/v3beta` too; `/v3alpha` and unknown paths a plain 404 (an HTTP
/// client must not get a 200 with an empty body), while a gRPC call to an unknown method
/// still gets gRPC's `Unimplemented`; the maintenance routes etcd's gateway has.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_answers_etcds_paths_and_refuses_others_plainly() {
    let c = TestCluster::start_tweaked(1, |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
    })
    .await;
    c.leader().await;
    let base = format!("http://{}", c.nodes[&1].etcd_addr().unwrap());
    let g = Gateway {
        http: reqwest::Client::new(),
        base: base.clone(),
    };

    // etcd 3.4's `/v3beta` (etcd3gw pinned to it, clients written against 3.3).
    g.ok(
        "/v3beta/kv/put",
        json!({"key": b64("beta"), "value": b64("b")}),
    )
    .await;
    let range = g.ok("/v3/kv/range", json!({"key": b64("beta")})).await;
    assert_eq!(unb64(&range["kvs"][0]["value"]), "b", "{range}");
    let range = g.ok("/v3beta/kv/range", json!({"key": b64("beta")})).await;
    assert_eq!(unb64(&range["kvs"][0]["value"]), "b", "{range}");
    let status = g.ok("/v3beta/maintenance/status", json!({})).await;
    assert!(
        status["version"].as_str().unwrap().starts_with("3."),
        "{status}"
    );

    for path in ["/v3alpha/kv/range", "/v3/no/such/path", "/nothing"] {
        let r = g
            .http
            .post(format!("{base}{path}"))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 404, "{path}");
        assert_eq!(r.text().await.unwrap(), "404 page not found\n", "{path}");
    }
    // A route that exists, asked with the wrong method: 405, as etcd's gateway.
    let r = g
        .http
        .get(format!("{base}/v3/kv/range"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    // A gRPC call to a method nobody serves is still gRPC's Unimplemented (status 12).
    let addr = c.nodes[&1].etcd_addr().unwrap();
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let call = hyper::Request::post(format!("http://{addr}/etcdserverpb.KV/NoSuchMethod"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(axum::body::Body::empty())
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), h2.send_request(call))
        .await
        .expect("the gRPC call was answered")
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["grpc-status"], "12");

    // The maintenance routes of etcd's gateway.
    g.ok("/v3/maintenance/defragment", json!({})).await;
    let (status, err) = g
        .post(
            "/v3/maintenance/transfer-leadership",
            json!({"targetID": "77"}),
        )
        .await;
    // FailedPrecondition is 412, as etcd 3.4's gateway answers it (grpc-gateway v1).
    assert_eq!(status, 412, "{err}");
    assert_eq!(err["message"], "etcdserver: bad leader transferee", "{err}");
    g.ok("/v3/lease/grant", json!({"TTL": 60, "ID": 777})).await;
    let (status, err) = g
        .post("/v3/lease/grant", json!({"TTL": 60, "ID": 777}))
        .await;
    assert_eq!((status, err["code"].as_i64()), (412, Some(9)), "{err}");
    assert_eq!(err["message"], "etcdserver: lease already exists", "{err}");
    let (status, err) = g
        .post("/v3/lease/grant", json!({"TTL": "9000000001"}))
        .await;
    assert_eq!((status, err["code"].as_i64()), (400, Some(11)), "{err}");
    let snapshot = g
        .http
        .post(format!("{base}/v3/maintenance/snapshot"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(snapshot.status().as_u16(), 200);
    let text = snapshot.text().await.unwrap();
    let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert!(first["result"]["blob"].is_string(), "{first}");

    // No alarm can be raised (leasecore has none): a clear refusal, not a silent success.
    let (status, err) = g
        .post(
            "/v3/maintenance/alarm",
            json!({"action": "ACTIVATE", "alarm": "NOSPACE"}),
        )
        .await;
    assert_eq!(status, 501, "{err}");
    assert_eq!(err["code"], 12, "{err}");
    let listed = g
        .ok("/v3/maintenance/alarm", json!({"action": "GET"}))
        .await;
    assert!(listed.get("alarms").is_none(), "{listed}");
    c.shutdown().await;
}

/// A streamed route answers (HTTP headers included) with its first message, as etcd's
/// gateway does: a client whose request returned knows its watch exists, so a write it makes
/// next is seen. Shown with Observe, whose first message waits for a leader: etcd 3.4 sends
/// no headers before one campaigns (curl checked), and leasecore answered 200 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateway_streams_answer_with_their_first_message() {
    let c = TestCluster::start_tweaked(1, |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
    })
    .await;
    c.leader().await;
    let base = format!("http://{}", c.nodes[&1].etcd_addr().unwrap());
    let g = Gateway {
        http: reqwest::Client::new(),
        base: base.clone(),
    };
    let observe = g
        .http
        .post(format!("{base}/v3/election/observe"))
        .json(&json!({"name": b64("first-message")}))
        .send();
    let mut observe = Box::pin(observe);
    // No leader yet: no answer. (A bounded wait for something that must not come.)
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut observe)
            .await
            .is_err(),
        "observe answered before there was a leader to send"
    );
    let lease = g.ok("/v3/lease/grant", json!({"TTL": "30"})).await;
    g.ok(
        "/v3/election/campaign",
        json!({"name": b64("first-message"), "lease": lease["ID"], "value": b64("me")}),
    )
    .await;
    let mut resp = tokio::time::timeout(Duration::from_secs(10), observe)
        .await
        .expect("observe answered once a leader campaigned")
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut buf = String::new();
    let first = next_result(&mut resp, &mut buf).await;
    assert_eq!(unb64(&first["kv"]["value"]), "me", "{first}");

    // A watch's answer comes with its `created` message.
    let mut watch = g
        .http
        .post(format!("{base}/v3/watch"))
        .json(&json!({"create_request": {"key": b64("w")}}))
        .send()
        .await
        .unwrap();
    let mut buf = String::new();
    let created = next_result(&mut watch, &mut buf).await;
    assert_eq!(created["created"], true, "{created}");
    g.ok("/v3/kv/put", json!({"key": b64("w"), "value": b64("1")}))
        .await;
    let event = next_result(&mut watch, &mut buf).await;
    assert_eq!(unb64(&event["events"][0]["kv"]["value"]), "1", "{event}");
    c.shutdown().await;
}

/// What etcd's gateway reads and leasecore's refused (a comparison with etcd 3.4 found both):
/// a `null` field is the field's default (proto3's JSON mapping; some clients' serialisers
/// write every unset field so), and a streamed route's body may hold several messages one
/// after another (a watch's creates, several keepalives).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_reads_nulls_and_several_messages_per_stream_body() {
    let c = TestCluster::start_tweaked(3, |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
    })
    .await;
    let leader = c.leader().await;
    let g = Gateway {
        http: reqwest::Client::new(),
        base: format!("http://{}", c.nodes[&leader].etcd_addr().unwrap()),
    };
    g.ok(
        "/v3/kv/put",
        json!({"key": b64("n"), "value": b64("1"), "lease": null, "prev_kv": null}),
    )
    .await;
    let got = g
        .ok(
            "/v3/kv/range",
            json!({"key": b64("n"), "limit": null, "range_end": null}),
        )
        .await;
    assert_eq!(unb64(&got["kvs"][0]["value"]), "1");
    let grant = g
        .ok("/v3/lease/grant", json!({"TTL": "30", "ID": null}))
        .await;
    // A null message is the default message.
    let status = g.ok("/v3/maintenance/status", Value::Null).await;
    assert!(status["version"].is_string(), "{status}");
    let id = grant["ID"].clone();
    let txn = g
        .ok(
            "/v3/kv/txn",
            json!({"compare": null, "success": [{"request_range": {"key": b64("n"), "limit": null}}]}),
        )
        .await;
    assert_eq!(txn["succeeded"], true);

    // Each operation's header holds the revision it saw and nothing else, as etcd's applier
    // writes them: a read before the transaction's put the revision before, everything after
    // it the transaction's own; a nested transaction's answer has no header at all.
    g.ok("/v3/kv/put", json!({"key": b64("hx"), "value": b64("1")}))
        .await;
    let range = |key: &str| json!({"request_range": {"key": b64(key)}});
    let t = g
        .ok(
            "/v3/kv/txn",
            json!({"success": [
                range("hx"),
                {"request_put": {"key": b64("hx"), "value": b64("2")}},
                range("hx"),
                {"request_txn": {"success": [range("hx")]}},
            ]}),
        )
        .await;
    let rev: i64 = t["header"]["revision"].as_str().unwrap().parse().unwrap();
    let only = |r: i64| json!({"revision": r.to_string()});
    let ops = &t["responses"];
    assert_eq!(ops[0]["response_range"]["header"], only(rev - 1), "{t}");
    assert_eq!(ops[0]["response_range"]["kvs"][0]["value"], b64("1"));
    assert_eq!(ops[1]["response_put"]["header"], only(rev), "{t}");
    assert_eq!(ops[2]["response_range"]["header"], only(rev), "{t}");
    assert_eq!(ops[2]["response_range"]["kvs"][0]["value"], b64("2"));
    let nested = &ops[3]["response_txn"];
    assert!(nested.get("header").is_none(), "{t}");
    assert_eq!(
        nested["responses"][0]["response_range"]["header"],
        only(rev)
    );

    // Two creates in one watch body: two watches, each created and each told of its key.
    let body = format!(
        "{}\n{}",
        json!({"create_request": {"key": b64("wa"), "watch_id": "1"}}),
        json!({"create_request": {"key": b64("wb"), "watch_id": "2"}})
    );
    let mut watch = g
        .http
        .post(format!("{}/v3/watch", g.base))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(watch.status(), 200);
    let mut buf = String::new();
    let mut created = Vec::new();
    while created.len() < 2 {
        let r = next_result(&mut watch, &mut buf).await;
        assert_eq!(r["created"], true, "{r}");
        created.push(r["watch_id"].as_str().unwrap_or("0").to_string());
    }
    created.sort();
    assert_eq!(created, ["1", "2"]);
    g.ok("/v3/kv/put", json!({"key": b64("wb"), "value": b64("x")}))
        .await;
    let told = next_result(&mut watch, &mut buf).await;
    assert_eq!(told["watch_id"], "2", "{told}");
    drop(watch);

    // Two keepalives in one body: two answers.
    let body = format!("{}{}", json!({"ID": id}), json!({"ID": id}));
    let mut alive = g
        .http
        .post(format!("{}/v3/lease/keepalive", g.base))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(alive.status(), 200);
    let mut buf = String::new();
    for _ in 0..2 {
        let r = next_result(&mut alive, &mut buf).await;
        assert_eq!(r["ID"], id, "{r}");
    }
    // Peer URLs etcd refuses too get etcd's exact text, which Go's clientv3 maps to its typed
    // error (etcdctl refuses them itself, before it calls).
    for urls in [json!([]), json!(["http://127.0.0.1:9001/path"])] {
        let (status, refused) = g
            .post("/v3/cluster/member/add", json!({ "peerURLs": urls }))
            .await;
        assert_eq!(status, 400, "{urls}: {refused}");
        assert_eq!(
            refused["message"], "etcdserver: given member URLs are invalid",
            "{urls}: {refused}"
        );
    }
    // An empty keepalive body is no request: the stream ends at once with nothing in it, as
    // etcd's does (it answered for lease 0).
    let empty = g
        .http
        .post(format!("{}/v3/lease/keepalive", g.base))
        .send()
        .await
        .unwrap();
    assert_eq!(empty.status(), 200);
    assert_eq!(empty.text().await.unwrap(), "");
    c.shutdown().await;
}
