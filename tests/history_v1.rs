//! `/v1`'s share of issue 14: transactions (`POST /v1/txn`), reads at a past revision
//! (`?revision=`) and compaction (`POST /v1/compact`), through followers, with the error
//! codes a user can cause.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually};
use serde_json::{Value, json};

async fn call(
    http: &reqwest::Client,
    method: &str,
    url: String,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = http.request(method.parse().unwrap(), url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactions_past_reads_and_compaction_over_v1() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let f = c.url(leader % 3 + 1);
    let http = reqwest::Client::new();
    // Something first, so that the revision before the transaction is a real one (0 is "now").
    call(
        &http,
        "PUT",
        format!("{f}/v1/kv/other"),
        Some(json!({"value": "x"})),
    )
    .await;

    // Create-if-absent, twice: the second runs the failure branch and reads the winner.
    let create = json!({
        "compare": [{"key": "cfg/leader", "target": "mod_revision", "value": 0}],
        "success": [{"put": {"key": "cfg/leader", "value": "n1"}},
                    {"put": {"key": "cfg/term", "value": "1"}}],
        "failure": [{"get": {"key": "cfg/", "prefix": true}}],
    });
    let (s, first) = call(&http, "POST", format!("{f}/v1/txn"), Some(create.clone())).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["succeeded"], true);
    let r1 = first["revision"].as_u64().unwrap();
    let (_, second) = call(&http, "POST", format!("{f}/v1/txn"), Some(create)).await;
    assert_eq!(second["succeeded"], false);
    assert_eq!(
        second["revision"], r1,
        "a read-only branch changes no revision"
    );
    let items = &second["results"][0]["get"]["items"];
    assert_eq!(items.as_array().unwrap().len(), 2);
    assert_eq!(items[0]["mod_revision"], r1, "both puts share one revision");
    assert_eq!(items[1]["mod_revision"], r1);

    // Errors a user can cause: each a 4xx with its code, nothing done.
    for (body, status, code) in [
        (
            json!({"success": [{"put": {"key": "d", "value": "1"}}, {"put": {"key": "d", "value": "2"}}]}),
            400,
            "invalid_argument",
        ),
        (
            json!({"success": [{"put": {"key": "x", "value": "1", "lease": "nope"}}]}),
            404,
            "lease_not_found",
        ),
        (
            json!({"success": [{"put": {"key": "nokey", "ignore_value": true}}]}),
            404,
            "key_not_found",
        ),
        (
            json!({"compare": [{"key": "a", "target": "version", "value": "one"}]}),
            400,
            "invalid_argument",
        ),
        (
            json!({"success": [{"frobnicate": {}}]}),
            400,
            "invalid_argument",
        ),
    ] {
        let (s, e) = call(&http, "POST", format!("{f}/v1/txn"), Some(body.clone())).await;
        assert_eq!(
            (s, e["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}: {e}"
        );
    }

    // The past: the key as it was, at each revision.
    let (_, upd) = call(
        &http,
        "PUT",
        format!("{f}/v1/kv/cfg/leader"),
        Some(json!({"value": "n2"})),
    )
    .await;
    let r2 = upd["revision"].as_u64().unwrap();
    let (s, old) = call(
        &http,
        "GET",
        format!("{f}/v1/kv/cfg/leader?revision={r1}"),
        None,
    )
    .await;
    assert_eq!((s, old["value"].as_str()), (200, Some("n1")), "{old}");
    assert_eq!(
        old["revision"].as_u64(),
        Some(r2),
        "the answer's revision is the store's"
    );
    let (_, list) = call(
        &http,
        "GET",
        format!("{f}/v1/kv?prefix=cfg/&revision={r1}"),
        None,
    )
    .await;
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    let (s, before) = call(
        &http,
        "GET",
        format!("{f}/v1/kv/cfg/leader?revision={}", r1 - 1),
        None,
    )
    .await;
    assert_eq!(
        (s, before["error"]["code"].as_str()),
        (404, Some("key_not_found"))
    );
    let (s, e) = call(
        &http,
        "GET",
        format!("{f}/v1/kv/cfg/leader?revision={}", r2 + 100),
        None,
    )
    .await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("future_revision"))
    );

    // Compaction: below the mark is gone (410 with the mark), at it still answers.
    let (s, done) = call(
        &http,
        "POST",
        format!("{f}/v1/compact"),
        Some(json!({"revision": r2})),
    )
    .await;
    assert_eq!(
        (s, done["compact_revision"].as_u64()),
        (200, Some(r2)),
        "{done}"
    );
    let (s, e) = call(
        &http,
        "POST",
        format!("{f}/v1/compact"),
        Some(json!({"revision": r1})),
    )
    .await;
    assert_eq!((s, e["error"]["code"].as_str()), (410, Some("compacted")));
    for id in 1..=3 {
        let url = c.url(id);
        let gone = eventually(Duration::from_secs(10), "the compaction to apply", || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let (s, e) = call(
                    &http,
                    "GET",
                    format!("{url}/v1/kv/cfg/leader?revision={r1}&consistency=local"),
                    None,
                )
                .await;
                (s == 410).then_some(e)
            }
        })
        .await;
        assert_eq!(gone["error"]["compact_revision"].as_u64(), Some(r2));
        let (s, now) = call(
            &http,
            "GET",
            format!("{url}/v1/kv/cfg/leader?revision={r2}&consistency=local"),
            None,
        )
        .await;
        assert_eq!((s, now["value"].as_str()), (200, Some("n2")));
    }
    c.shutdown().await;
}

/// A follower cut off while the leader compacted its log catches up by installing a
/// snapshot, which carries no history; it then fills the history in from a peer, so that its
/// local reads at old revisions, and its watches from old revisions, answer as the leader's
/// (etcd's members all hold the same history).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_that_installed_a_snapshot_fills_in_the_history() {
    let c = TestCluster::start_with(3, 20).await;
    let leader = c.leader().await;
    let lagging = leader % 3 + 1;
    let http = reqwest::Client::new();
    let l = c.url(leader);
    let mut revisions = Vec::new();
    for i in 0..30 {
        let (s, put) = call(
            &http,
            "PUT",
            format!("{l}/v1/kv/h/{}", i % 7),
            Some(json!({"value": format!("v{i}")})),
        )
        .await;
        assert_eq!(s, 200, "{put}");
        revisions.push(put["revision"].as_u64().unwrap());
        if i % 5 == 4 {
            call(&http, "DELETE", format!("{l}/v1/kv/h/{}", i % 7), None).await;
        }
    }
    let compact_at = revisions[3];
    let (s, e) = call(
        &http,
        "POST",
        format!("{l}/v1/compact"),
        Some(json!({"revision": compact_at})),
    )
    .await;
    assert_eq!(s, 200, "{e}");
    c.partition(lagging);
    for i in 0..120 {
        let (s, put) = call(
            &http,
            "PUT",
            format!("{l}/v1/kv/later/{}", i % 10),
            Some(json!({"value": "x"})),
        )
        .await;
        assert_eq!(s, 200, "{put}");
    }
    let last = revisions[29];
    eventually(
        Duration::from_secs(20),
        "the leader purges the log the lagging node needs",
        || async {
            let m = c.nodes[&leader]
                .consensus()
                .raft()
                .metrics()
                .borrow()
                .clone();
            m.purged.filter(|p| p.index > 40).map(|_| ())
        },
    )
    .await;
    c.heal();
    let node = &c.nodes[&lagging];
    eventually(
        Duration::from_secs(30),
        "the lagging node installs a snapshot",
        || async {
            let m = node.consensus().raft().metrics().borrow().clone();
            m.snapshot.filter(|s| s.index > 40).map(|_| ())
        },
    )
    .await;
    let lagging_url = c.url(lagging);
    // Until it is filled in, a read there at an old revision is compacted; afterwards it
    // answers as the leader does, at every revision from the compaction on.
    eventually(
        Duration::from_secs(30),
        "the history to be filled in",
        || {
            let (http, url) = (http.clone(), lagging_url.clone());
            async move {
                let (s, _) = call(
                    &http,
                    "GET",
                    format!("{url}/v1/kv?prefix=h/&revision={compact_at}&consistency=local"),
                    None,
                )
                .await;
                (s == 200).then_some(())
            }
        },
    )
    .await;
    for r in compact_at..=last + 1 {
        let list = |url: String| {
            let http = http.clone();
            async move {
                let (s, v) = call(
                    &http,
                    "GET",
                    format!("{url}/v1/kv?prefix=h/&revision={r}&consistency=local"),
                    None,
                )
                .await;
                assert_eq!(s, 200, "at {r}: {v}");
                v["items"].clone()
            }
        };
        assert_eq!(
            list(l.clone()).await,
            list(lagging_url.clone()).await,
            "at {r}"
        );
    }
    let watch = |url: String| {
        let http = http.clone();
        async move {
            let (s, v) = call(
                &http,
                "GET",
                format!(
                    "{url}/v1/watch?prefix=h/&from_revision={}&timeout_ms=1000",
                    compact_at + 1
                ),
                None,
            )
            .await;
            assert_eq!(s, 200, "{v}");
            v["events"].clone()
        }
    };
    // Operators see it in the metrics: the same floor as the leader's, the compaction mark,
    // and the size of the history in the key index (at least a version per key, on the
    // leader and on the filled node).
    let gauge = |url: String, name: &'static str| {
        let http = http.clone();
        async move {
            let text = http
                .get(format!("{url}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no gauge {name}"))
        }
    };
    let floor = |url: String| gauge(url, "leasecore_history_floor_revision");
    assert_eq!(floor(lagging_url.clone()).await, compact_at as f64);
    for url in [l.clone(), lagging_url.clone()] {
        let versions = gauge(url.clone(), "leasecore_history_versions").await;
        let keys = gauge(url, "leasecore_history_keys").await;
        assert!(
            versions >= keys && keys > 0.0,
            "{versions} versions of {keys} keys"
        );
    }
    assert_eq!(floor(l.clone()).await, compact_at as f64);
    let events = watch(lagging_url.clone()).await;
    assert!(events.as_array().is_some_and(|e| e.len() > 20), "{events}");
    assert_eq!(events, watch(l.clone()).await);
    c.shutdown().await;
}
