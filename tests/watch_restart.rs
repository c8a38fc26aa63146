//! Watch history across a node restart: the MVCC history is on disk with the state, so a watch
//! resuming from any revision before the restart gets every event, snapshots or not; only a
//! start at or before the compaction mark is `410 compacted`.
//! In-process nodes (graceful restart) and the real binary (SIGKILL).
// Tests wait for conditions and processes against real deadlines.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TestCluster, eventually};
use leasecore::client::{Client, ClientError, WatchFilter};
use leasecore::domain::command::{Event, EventKind};
use leasecore::raft::state_machine::decode_payload;
use leasecore::storage::snapshot_file::SnapshotFile;

/// Every event from `from` through `upto` on one node (polling until it has looked that
/// far), or the error of the first poll.
async fn events_from(c: &Client, from: u64, upto: u64) -> Result<Vec<Event>, ClientError> {
    let mut got = Vec::new();
    let mut next = from;
    let all = WatchFilter::Prefix(String::new());
    let started = std::time::Instant::now();
    loop {
        let r = c.watch_once(&all, Some(next), 500).await?;
        got.extend(r.events);
        // Every matching event through `r.revision` is in the answer (a lagging node answers
        // less far: poll on).
        next = next.max(r.revision.0 + 1);
        if next > upto {
            return Ok(got);
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the watch never reached {upto} (at {next})"
        );
    }
}

/// The compaction mark of a 410, or a panic with what came instead.
fn compact_revision(r: Result<Vec<Event>, ClientError>) -> u64 {
    match r {
        Err(e @ ClientError::Api { .. }) if e.status() == Some(410) => {
            let ClientError::Api { body, .. } = &e else {
                unreachable!()
            };
            body["error"]["compact_revision"]
                .as_u64()
                .unwrap_or_else(|| panic!("410 without compact_revision: {body}"))
        }
        other => panic!("expected 410 compacted, got {other:?}"),
    }
}

/// The store revision of the snapshot in a (stopped) node's data dir.
fn snapshot_revision(dir: &Path) -> u64 {
    snapshot_on_disk(dir).expect("the node took a snapshot")
}

/// The store revision of the snapshot in a node's data dir, if it has one (the file is
/// replaced whole, so a running node's can be read too).
fn snapshot_on_disk(dir: &Path) -> Option<u64> {
    let (_, data) = SnapshotFile::new(dir).read().ok()??;
    Some(decode_payload(&data).ok()?.revision.0)
}

fn summary(events: &[Event]) -> Vec<(u64, String, EventKind)> {
    events
        .iter()
        .map(|e| (e.revision.0, e.key.clone(), e.kind))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gracefully_restarted_node_still_serves_the_events_before_its_restart() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = leader % 3 + 1;
    let client = c.client();
    let mut last = 0;
    for i in 0..20 {
        last = client
            .put(&format!("w/{i:02}"), &format!("v{i}"), None, None)
            .await
            .unwrap()
            .revision
            .0;
    }
    client.grant("l", 60_000).await.unwrap();
    client.put("w/leased", "x", Some("l"), None).await.unwrap();
    client.delete("w/00", None).await.unwrap();
    last = last.max(client.revoke("l").await.unwrap().revision.0);
    // The leader never restarts: its history is the reference.
    let want = events_from(&c.client_of(leader), 1, last).await.unwrap();
    assert_eq!(want.first().map(|e| e.revision.0), Some(1));
    assert!(want.len() >= 23, "{want:?}");
    // The follower has applied everything, then restarts; more is written while it is down.
    let f = c.client_of(follower);
    events_from(&f, last, last).await.unwrap();
    c.stop(follower).await;
    let mut want_after = want.clone();
    for i in 0..5 {
        let r = client.put(&format!("w/down{i}"), "d", None, None).await;
        last = r.unwrap().revision.0;
    }
    want_after.extend(
        events_from(
            &c.client_of(leader),
            want.last().unwrap().revision.0 + 1,
            last,
        )
        .await
        .unwrap(),
    );
    c.restart(follower).await;

    let f = c.client_of(follower);
    let got = events_from(&f, 1, last).await.unwrap();
    assert_eq!(summary(&got), summary(&want_after));
    assert_eq!(got, want_after, "values, leases and causes too");
    // And from the middle, exactly the later events.
    let mid = want[10].revision.0;
    let got = events_from(&f, mid, last).await.unwrap();
    assert_eq!(got, want_after[10..].to_vec());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_restart_the_revisions_before_the_snapshot_are_still_served() {
    let mut c = TestCluster::start_with(3, 20).await;
    let leader = c.leader().await;
    let follower = leader % 3 + 1;
    let client = c.client();
    // The compaction driver snapshots on its own schedule (every 20 entries here, looked at
    // every 200 ms): write in rounds of 5 until the follower's latest snapshot is 5 to 12
    // revisions behind the last write, so that the last writes are in its log only and no
    // further snapshot is due (the threshold is 20).
    let dir = c.data_dir(follower);
    let follower_snapshot = || {
        SnapshotFile::new(&dir)
            .read()
            .ok()
            .flatten()
            .map(|(_, data)| decode_payload(&data).unwrap().revision.0)
    };
    let mut last = 0;
    let mut written = 0;
    for round in 0.. {
        assert!(
            round < 100,
            "no follower snapshot 5 to 12 revisions behind the writes"
        );
        for _ in 0..5 {
            last = client
                .put(&format!("s/{written:03}"), "v", None, None)
                .await
                .unwrap()
                .revision
                .0;
            written += 1;
        }
        if follower_snapshot().is_some_and(|s| (5..=12).contains(&(last - s))) {
            break;
        }
    }
    let want = events_from(&c.client_of(leader), 1, last).await.unwrap();
    events_from(&c.client_of(follower), last, last)
        .await
        .unwrap();
    c.stop(follower).await;
    let snap = snapshot_revision(&c.data_dir(follower));
    assert!(
        snap > 0 && snap + 5 <= last,
        "snapshot at {snap}, last {last}"
    );
    c.restart(follower).await;

    let f = c.client_of(follower);
    assert_eq!(events_from(&f, 1, last).await.unwrap(), want);
    let got = events_from(&f, snap, last).await.unwrap();
    assert_eq!(got.first().map(|e| e.revision.0), Some(snap));
    // Compaction (replicated) is what makes old revisions go, on every node alike.
    let mark = snap + 5;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/compact", c.url(leader)))
        .json(&serde_json::json!({ "revision": mark }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    for node in [leader, follower] {
        let n = c.client_of(node);
        let gone = eventually(Duration::from_secs(10), "the mark to apply", || async {
            match events_from(&n, mark, last).await {
                Ok(_) => None,
                other => Some(other),
            }
        })
        .await;
        assert_eq!(compact_revision(gone), mark);
        let kept = events_from(&n, mark + 1, last).await.unwrap();
        let expected: Vec<Event> = want
            .iter()
            .filter(|e| e.revision.0 > mark)
            .cloned()
            .collect();
        assert_eq!(kept, expected);
    }
    c.shutdown().await;
}

/// A `leasecore serve` process, killed (SIGKILL) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(addr: &str, data: &Path, log: &Path) -> Proc {
    let log = std::fs::File::create(log).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args(["serve", "--id", "1", "--listen", addr])
        .arg("--data")
        .arg(data)
        .args(["--snapshot-threshold", "50"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn the leasecore binary");
    Proc(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_binary_rebuilds_its_watch_history_on_restart() {
    let tmp = tempfile::TempDir::new().unwrap();
    let addr = common::free_node_addrs(1).remove(0);
    let data = tmp.path().join("node-1");
    let client = Client::new(&[format!("http://{addr}")]).unwrap();
    let mut node = serve(&addr, &data, &tmp.path().join("run-1.log"));
    // Writes until a snapshot is on disk (the compaction driver looks every 200 ms), then 10
    // more: the next snapshot is not due for 50 entries, so the node dies with its snapshot
    // behind its last write (one being built when it was seen is behind it too).
    let mut last = 0;
    let mut stop_at = None;
    for i in 0..2000 {
        if stop_at.is_none() {
            stop_at = snapshot_on_disk(&data).map(|s| s + 10);
        }
        if stop_at.is_some_and(|end| last >= end) {
            break;
        }
        let put = eventually(Duration::from_secs(20), "the node takes writes", || async {
            client.put(&format!("k/{i:04}"), "v", None, None).await.ok()
        })
        .await;
        last = put.revision.0;
    }
    assert!(stop_at.is_some(), "no snapshot after {last} writes");
    let want = events_from(&client, 1, last).await.unwrap();
    assert_eq!(want.len() as u64, last);
    node.0.kill().unwrap();
    node.0.wait().unwrap();
    let snap = snapshot_revision(&data);
    assert!(snap > 0 && snap < last, "snapshot at {snap}, last {last}");

    let _node = serve(&addr, &data, &tmp.path().join("run-2.log"));
    let got = eventually(
        Duration::from_secs(20),
        "the restarted node answers",
        || async {
            match events_from(&client, 1, last).await {
                Err(ClientError::Unavailable(_)) => None,
                other => Some(other),
            }
        },
    )
    .await;
    let log = std::fs::read_to_string(tmp.path().join("run-2.log")).unwrap_or_default();
    let got = got.unwrap_or_else(|e| panic!("{e}; log:\n{log}"));
    assert_eq!(got, want, "every event, from before the snapshot too");
}
