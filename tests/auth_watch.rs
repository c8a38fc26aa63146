//! Watches under auth: a watch needs read on its whole range, and every event is checked again
//! when it is delivered, so a prefix grant never leaks an event outside it and a revoked role
//! stops the events of watches already open (long poll, SSE, and `POST /v1/watches`).
#![allow(clippy::disallowed_methods)] // tests wait against real deadlines

use crate::common;
use crate::support;

use common::TestCluster;
use leasecore::domain::auth::PermKind::{Read, Readwrite};
use reqwest::Method;
use serde_json::json;
use support::{Sse, assert_error, enable_auth, raw, user_with};

async fn one_node() -> TestCluster {
    let c = TestCluster::start(1).await;
    c.leader().await;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_poll_watch_needs_read_on_its_whole_range_and_sees_only_it() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "u", &[(Read, "a/", true)]).await;
    let token = u.authenticate("u", "u-pw").await.unwrap().token;
    let from = root.put("a/1", "v", None, None).await.unwrap().revision.0;
    root.put("b/1", "v", None, None).await.unwrap();
    let base = c.url(1);
    for q in ["prefix=", "prefix=a", "key=b/1"] {
        let url = format!("{base}/v1/watch?{q}&timeout_ms=0");
        assert_error(
            &raw(Method::GET, &url, Some(&token), None).await,
            403,
            "permission_denied",
        );
    }
    let url = format!("{base}/v1/watch?prefix=a/&from_revision={from}&timeout_ms=0");
    let (status, doc) = raw(Method::GET, &url, Some(&token), None).await;
    assert_eq!(status, 200, "{doc}");
    let keys: Vec<&str> = doc["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, vec!["a/1"]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_sse_watch_outside_the_grant_is_refused() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "u", &[(Read, "a/", true)]).await;
    let token = u.authenticate("u", "u-pw").await.unwrap().token;
    let url = format!("{}/v1/watch?prefix=", c.url(1));
    let Err(refused) = Sse::try_open(&url, Some(&token), None).await else {
        panic!("a watch of every key was allowed");
    };
    assert_error(&refused, 403, "permission_denied");
    let Err(anon) = Sse::try_open(&url, None, None).await else {
        panic!("an anonymous watch was allowed");
    };
    assert_error(&anon, 401, "unauthenticated");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revoking_a_role_stops_the_events_of_an_open_sse_watch() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    // Role u reads a/; role marker reads the one key a/marker.
    let u = user_with(&c, &root, "u", &[(Read, "a/", true)]).await;
    root.role_add("marker").await.unwrap();
    root.role_grant("marker", Read, "a/marker", false)
        .await
        .unwrap();
    root.user_grant_role("u", "marker").await.unwrap();
    let token = u.authenticate("u", "u-pw").await.unwrap().token;
    let mut sse = Sse::open(
        &format!("{}/v1/watch?prefix=a/", c.url(1)),
        Some(&token),
        None,
    )
    .await;
    root.put("a/1", "v", None, None).await.unwrap();
    assert_eq!(sse.next_event().await["key"], "a/1");
    root.user_revoke_role("u", "u").await.unwrap();
    // Applied on this (only) node before the next put is even proposed: a/2 is checked at
    // delivery against a state without the role, and a/marker (later) is the next event.
    root.put("a/2", "v", None, None).await.unwrap();
    root.put("a/marker", "v", None, None).await.unwrap();
    assert_eq!(sse.next_event().await["key"], "a/marker");
    // A new watch of the whole prefix is now refused.
    let url = format!("{}/v1/watch?prefix=a/&timeout_ms=0", c.url(1));
    assert_error(
        &raw(Method::GET, &url, Some(&token), None).await,
        403,
        "permission_denied",
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_multi_watch_stream_needs_every_range_and_drops_revoked_events() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "u", &[(Readwrite, "a/", true)]).await;
    root.role_add("b").await.unwrap();
    root.role_grant("b", Read, "b/", true).await.unwrap();
    root.user_grant_role("u", "b").await.unwrap();
    let token = u.authenticate("u", "u-pw").await.unwrap().token;
    let url = format!("{}/v1/watches", c.url(1));
    let outside = json!({"watches": [{"id": "a", "prefix": "a/"}, {"id": "all", "prefix": ""}]});
    let Err(refused) = Sse::try_open(&url, Some(&token), Some(outside)).await else {
        panic!("a multi-watch with a range outside the grants was allowed");
    };
    assert_error(&refused, 403, "permission_denied");
    let body = json!({"watches": [{"id": "a", "prefix": "a/"}, {"id": "b", "prefix": "b/"}]});
    let mut sse = Sse::open(&url, Some(&token), Some(body)).await;
    root.put("c/1", "v", None, None).await.unwrap();
    root.put("a/1", "v", None, None).await.unwrap();
    let first = sse.next_event().await;
    assert_eq!(first["event"]["key"], "a/1");
    assert_eq!(first["watches"], json!(["a"]));
    root.role_delete("u").await.unwrap();
    root.put("a/2", "v", None, None).await.unwrap();
    root.put("b/1", "v", None, None).await.unwrap();
    let next = sse.next_event().await;
    assert_eq!(
        next["event"]["key"], "b/1",
        "a/2 was delivered after the role went"
    );
    c.shutdown().await;
}
