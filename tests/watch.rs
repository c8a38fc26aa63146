//! End-to-end watches on a 3-node cluster over loopback HTTP.
#![allow(clippy::disallowed_methods)] // tests wait against real deadlines

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestCluster, eventually};
use leasecore::client::{Client, WatchFilter, WatchItem, Watcher};
use leasecore::domain::command::{Cause, EventKind};
use leasecore::domain::history::HistoryLimits;

/// Collect events from `watcher` until `done` says so, checking order and uniqueness.
async fn collect_until(
    watcher: &mut Watcher,
    deadline: Duration,
    mut done: impl FnMut(&[(String, u64)]) -> bool,
) -> Vec<(String, u64)> {
    let mut seen: Vec<(String, u64)> = Vec::new();
    let started = Instant::now();
    while !done(&seen) {
        assert!(
            started.elapsed() < deadline,
            "watch stalled; got {} events",
            seen.len()
        );
        match tokio::time::timeout(deadline, watcher.next()).await {
            Ok(Ok(WatchItem::Event(e))) => {
                if let Some((_, last)) = seen.last() {
                    assert!(
                        e.revision.0 > *last,
                        "out of order or duplicate: {} after {last}",
                        e.revision
                    );
                }
                seen.push((e.key, e.revision.0));
            }
            Ok(Ok(WatchItem::Resync { .. })) => panic!("unexpected resync"),
            Ok(Err(e)) => panic!("watch failed: {e}"),
            Err(_) => panic!("watch gave nothing for {deadline:?}"),
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watch_from_an_old_revision_replays_exactly_the_events_since() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = c.client();
    let mut revs = Vec::new();
    for k in ["w/a", "w/b", "x/other", "w/c"] {
        revs.push(client.put(k, "1", None, None).await.unwrap().revision.0);
    }
    let del = client.delete("w/a", None).await.unwrap().revision.0;
    // From the second write: w/b, w/c and the delete of w/a, nothing else. A follower may
    // answer before it has applied everything: poll on until it has looked far enough.
    let mut got: Vec<(String, u64, EventKind)> = Vec::new();
    let mut from = revs[1];
    let mut through = 0;
    while through < del {
        let r = client
            .watch_once(&WatchFilter::Prefix("w/".into()), Some(from), 1000)
            .await
            .unwrap();
        got.extend(
            r.events
                .iter()
                .map(|e| (e.key.clone(), e.revision.0, e.kind)),
        );
        through = r.revision.0;
        from = from.max(through + 1);
    }
    assert_eq!(
        got,
        vec![
            ("w/b".to_string(), revs[1], EventKind::Put),
            ("w/c".to_string(), revs[3], EventKind::Put),
            ("w/a".to_string(), del, EventKind::Delete),
        ]
    );
    assert_eq!(through, del);
    // Every node answers the same from its own history (once it has applied that far).
    for id in [1u64, 2, 3] {
        let other = c.client_of(id);
        let r = eventually(Duration::from_secs(10), "the node applies w/c", || async {
            let r = other
                .watch_once(&WatchFilter::Key("w/c".into()), Some(1), 1000)
                .await
                .ok()?;
            (!r.events.is_empty()).then_some(r)
        })
        .await;
        assert_eq!(r.events.len(), 1);
        assert_eq!(r.events[0].revision.0, revs[3]);
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocked_watch_wakes_on_a_put_long_before_its_timeout() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = leader % 3 + 1;
    let watcher = c.client_of(follower);
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let r = watcher
            .watch_once(&WatchFilter::Key("wake".into()), None, 30_000)
            .await
            .unwrap();
        (r, started.elapsed())
    });
    // Wait until the watch is parked on the follower, then write.
    let hub = c.nodes[&follower].watch_hub();
    eventually(Duration::from_secs(10), "the watch is parked", || async {
        (hub.stats().3 > 0).then_some(())
    })
    .await;
    let put = c.client().put("wake", "up", None, None).await.unwrap();
    let (r, waited) = waiting.await.unwrap();
    assert_eq!(r.events.len(), 1);
    assert_eq!(r.events[0].revision, put.revision);
    assert!(
        waited < Duration::from_secs(15),
        "woke only after {waited:?}"
    );
    eventually(
        Duration::from_secs(5),
        "the registration is gone",
        || async { (hub.stats().3 == 0).then_some(()) },
    )
    .await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_watchers_each_receive_exactly_their_events() {
    const WATCHERS: usize = 1000;
    const PUTS: usize = 120;
    let c = TestCluster::start(3).await;
    c.leader().await;
    let start = c
        .client()
        .put("warmup", "x", None, None)
        .await
        .unwrap()
        .revision
        .0
        + 1;
    let prefixes: Vec<String> = (0..8).map(|i| format!("p{i}/")).collect();
    // Watcher i follows a prefix, or (every 5th) one exact key.
    let filters: Vec<WatchFilter> = (0..WATCHERS)
        .map(|i| {
            if i % 5 == 0 {
                WatchFilter::Key(format!("p{}/k{}", i % 8, i % 3))
            } else {
                WatchFilter::Prefix(prefixes[i % 8].clone())
            }
        })
        .collect();
    let clients: Vec<Arc<Client>> = [1u64, 2, 3]
        .iter()
        .map(|id| Arc::new(c.client_of(*id)))
        .collect();

    // The writer's acknowledged puts, decided up front: key i goes to prefix i % 8.
    let keys: Vec<String> = (0..PUTS)
        .map(|i| format!("p{}/k{}", i % 8, (i / 8) % 3))
        .collect();
    let expected = |f: &WatchFilter, written: &[(String, u64)]| -> Vec<(String, u64)> {
        written
            .iter()
            .filter(|(k, _)| match f {
                WatchFilter::Key(x) => k == x,
                WatchFilter::Prefix(p) => k.starts_with(p.as_str()),
            })
            .cloned()
            .collect()
    };
    let counts: Vec<usize> = filters
        .iter()
        .map(|f| {
            keys.iter()
                .filter(|k| match f {
                    WatchFilter::Key(x) => *k == x,
                    WatchFilter::Prefix(p) => k.starts_with(p.as_str()),
                })
                .count()
        })
        .collect();
    let mut tasks = Vec::new();
    for (i, f) in filters.iter().enumerate() {
        let mut w =
            Watcher::new(clients[i % 3].clone(), f.clone(), Some(start)).poll_timeout(5_000);
        let want = counts[i];
        tasks.push(tokio::spawn(async move {
            collect_until(&mut w, Duration::from_secs(120), |s| s.len() >= want).await
        }));
    }
    let writer = c.client();
    let mut written = Vec::new();
    for k in &keys {
        written.push((
            k.clone(),
            writer.put(k, "v", None, None).await.unwrap().revision.0,
        ));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let got = t.await.unwrap();
        assert_eq!(
            got,
            expected(&filters[i], &written),
            "watcher {i} ({:?})",
            filters[i]
        );
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watcher_on_a_follower_keeps_its_sequence_through_a_leader_kill() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = leader % 3 + 1;
    let start = c
        .client()
        .put("seq/start", "x", None, None)
        .await
        .unwrap()
        .revision
        .0;
    let mut watcher = Watcher::new(
        Arc::new(c.client_of(follower)),
        WatchFilter::Prefix("seq/".into()),
        Some(start),
    )
    .poll_timeout(1_000);
    let mut acked = vec![("seq/start".to_string(), start)];
    for i in 0..30 {
        if i == 10 {
            c.stop(leader).await;
        }
        // A write whose outcome is unknown may or may not appear; acknowledged ones must.
        if let Ok(r) = c.client().put(&format!("seq/{i}"), "v", None, None).await {
            acked.push((format!("seq/{i}"), r.revision.0));
        }
    }
    let last = acked.last().unwrap().1;
    let seen = collect_until(&mut watcher, Duration::from_secs(30), |s| {
        s.last().is_some_and(|(_, r)| *r >= last)
    })
    .await;
    let seen_set: BTreeSet<(String, u64)> = seen.iter().cloned().collect();
    for a in &acked {
        assert!(
            seen_set.contains(a),
            "acknowledged {a:?} never seen by the watcher"
        );
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compacted_start_is_410_and_the_watcher_resyncs() {
    let c = TestCluster::start_tweaked(3, |cfg| {
        cfg.history = HistoryLimits {
            max_events: 10,
            max_bytes: 1 << 20,
        }
    })
    .await;
    c.leader().await;
    let client = Arc::new(c.client());
    for i in 0..30 {
        client
            .put(&format!("c/{i:02}"), "v", None, None)
            .await
            .unwrap();
    }
    // Memory holds the last 10 events; the rest come from the MVCC store.
    let old = client
        .watch_once(&WatchFilter::Prefix("c/".into()), Some(1), 100)
        .await
        .unwrap();
    assert_eq!(old.events.first().map(|e| e.revision.0), Some(1));
    // Compaction is what makes revisions go.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/compact", c.url(1)))
        .json(&serde_json::json!({ "revision": 20 }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let err = eventually(
        Duration::from_secs(10),
        "the compaction to apply",
        || async {
            client
                .watch_once(&WatchFilter::Prefix("c/".into()), Some(1), 100)
                .await
                .err()
        },
    )
    .await;
    assert_eq!((err.status(), err.code()), (Some(410), Some("compacted")));
    let kept = client
        .watch_once(&WatchFilter::Prefix("c/".into()), Some(21), 100)
        .await
        .unwrap();
    assert_eq!(kept.events.first().map(|e| e.revision.0), Some(21));

    let mut watcher =
        Watcher::new(client.clone(), WatchFilter::Prefix("c/".into()), Some(1)).poll_timeout(1_000);
    let (revision, items) = match watcher.next().await.unwrap() {
        WatchItem::Resync { revision, items } => (revision, items),
        other => panic!("expected a resync, got {other:?}"),
    };
    assert_eq!(items.len(), 30);
    let next = client.put("c/new", "v", None, None).await.unwrap();
    assert!(next.revision > revision);
    match watcher.next().await.unwrap() {
        WatchItem::Event(e) => {
            assert_eq!((e.key.as_str(), e.revision), ("c/new", next.revision));
            assert_eq!(e.cause, Cause::Client);
        }
        other => panic!("expected the new event, got {other:?}"),
    }
    c.shutdown().await;
}

/// Read SSE messages (id, event, data) from `resp` until `n` have arrived.
async fn sse_messages(
    resp: &mut reqwest::Response,
    n: usize,
) -> Vec<(u64, String, serde_json::Value)> {
    let mut text = String::new();
    let mut out = Vec::new();
    while out.len() < n {
        let chunk = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
            .await
            .expect("the stream stalled")
            .expect("the stream failed")
            .expect("the stream ended");
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = text.find("\n\n") {
            let message: String = text.drain(..end + 2).collect();
            let field = |name: &str| {
                message
                    .lines()
                    .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
            };
            if let (Some(id), Some(event), Some(data)) =
                (field("id:"), field("event:"), field("data:"))
            {
                out.push((
                    id.parse().unwrap(),
                    event,
                    serde_json::from_str(&data).unwrap(),
                ));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_stream_carries_many_watches_and_resumes_by_revision() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = c.client();
    let first = client.put("a/1", "v", None, None).await.unwrap().revision.0;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/watches", c.url(2));
    let body = serde_json::json!({
        "from_revision": first,
        "watches": [
            {"id": "all", "prefix": ""},
            {"id": "a", "prefix": "a/"},
            {"id": "b-key", "key": "b"},
            {"id": "none", "key": "zzz"},
        ]
    });
    let mut resp = http
        .post(&url)
        .header("accept", "text/event-stream")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let b = client.put("b", "v", None, None).await.unwrap().revision.0;
    let a2 = client.put("a/2", "v", None, None).await.unwrap().revision.0;
    let del = client.delete("a/1", None).await.unwrap().revision.0;
    let got = sse_messages(&mut resp, 4).await;
    let summary: Vec<(u64, String, Vec<String>)> = got
        .iter()
        .map(|(id, kind, data)| {
            let ids = data["watches"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
                .collect();
            assert_eq!(data["event"]["revision"].as_u64(), Some(*id));
            (*id, kind.clone(), ids)
        })
        .collect();
    let w = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        summary,
        vec![
            (first, "put".into(), w(&["all", "a"])),
            (b, "put".into(), w(&["all", "b-key"])),
            (a2, "put".into(), w(&["all", "a"])),
            (del, "delete".into(), w(&["all", "a"])),
        ]
    );
    // Resuming after `b` (Last-Event-ID wins over from_revision) starts at a/2.
    let mut again = http
        .post(&url)
        .header("accept", "text/event-stream")
        .header("last-event-id", b.to_string())
        .json(&body)
        .send()
        .await
        .unwrap();
    let resumed = sse_messages(&mut again, 1).await;
    assert_eq!(resumed[0].0, a2);
    // Bad requests are 400s with a JSON error.
    for bad in [
        serde_json::json!({"watches": []}),
        serde_json::json!({"watches": [{"id": "x", "prefix": ""}, {"id": "x", "key": "k"}]}),
        serde_json::json!({"watches": [{"id": "x", "prefix": "a", "key": "k"}]}),
        serde_json::json!({"watches": [{"id": "x"}]}),
        serde_json::json!({"watches": [{"id": "", "key": "k"}]}),
        serde_json::json!({"watches": [{"id": "x", "key": "k"}], "from_revision": 0}),
        serde_json::json!({"watches": [{"id": "x", "key": ""}]}),
        serde_json::json!({"watchez": []}),
    ] {
        let r = http.post(&url).json(&bad).send().await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let e: serde_json::Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "invalid_argument", "{bad}");
    }
    c.shutdown().await;
}

/// A lease's revoke is one request: all its keys go at one revision. A long poll with
/// `limit=1` still answers that revision whole, an SSE stream gives an `id` only to its last
/// message (a resumed stream never starts half-way through it), and the client's `Watcher`
/// delivers every event of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revision_with_many_events_is_delivered_whole() {
    let c = TestCluster::start(1).await;
    c.leader().await;
    let client = Arc::new(c.client());
    eventually(Duration::from_secs(20), "a lease", || async {
        match client.grant("group", 60_000).await {
            Ok(_) => Some(()),
            // A retry after an answer that was lost.
            Err(e) if e.code() == Some("lease_exists") => Some(()),
            Err(_) => None,
        }
    })
    .await;
    for k in ["w/a", "w/b", "w/c"] {
        client.put(k, "v", Some("group"), None).await.unwrap();
    }
    let revoked = client.revoke("group").await.unwrap();
    let r = revoked.revision.0;
    let http = reqwest::Client::new();
    let poll: serde_json::Value = http
        .get(format!(
            "{}/v1/watch?prefix=w/&from_revision={r}&limit=1&timeout_ms=0",
            c.url(1)
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let revs: Vec<u64> = poll["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["revision"].as_u64().unwrap())
        .collect();
    assert_eq!(revs, vec![r, r, r], "{poll}");
    assert_eq!(poll["revision"], r);

    let mut sse = http
        .get(format!("{}/v1/watch?prefix=w/&from_revision={r}", c.url(1)))
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    let mut text = String::new();
    while text.matches("event: delete").count() < 3 {
        let chunk = tokio::time::timeout(Duration::from_secs(10), sse.chunk())
            .await
            .expect("the stream stalled")
            .unwrap()
            .expect("the stream ended");
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let ids: Vec<&str> = text.lines().filter(|l| l.starts_with("id:")).collect();
    assert_eq!(ids, vec![format!("id: {r}")], "{text}");
    // The id belongs to the last of the three messages.
    let last_message = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last_message.contains(&format!("id: {r}")), "{text}");

    let mut watcher = Watcher::new(client.clone(), WatchFilter::Prefix("w/".into()), Some(r));
    let mut keys = Vec::new();
    while keys.len() < 3 {
        match tokio::time::timeout(Duration::from_secs(10), watcher.next()).await {
            Ok(Ok(WatchItem::Event(e))) => {
                assert_eq!(
                    (e.kind, e.revision.0, e.cause),
                    (EventKind::Delete, r, Cause::LeaseRevoked)
                );
                keys.push(e.key);
            }
            other => panic!("expected the revoke's events, got {other:?}"),
        }
    }
    assert_eq!(keys, ["w/a", "w/b", "w/c"]);
    c.shutdown().await;
}
