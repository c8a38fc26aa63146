//! A leader that loses the newest entries of its own Raft log, as a crash of the machine loses
//! writes that were never synced, comes back, catches up, and nothing acknowledged is lost.
//!
//! The leader acknowledges its own entries to its Raft core before they are synced and sends
//! them to its followers meanwhile (`raft::durability`), so a crash can take from its log
//! entries the followers hold; a disk that drops writes can take more. Here the cut is made by
//! hand on the killed leader's newest segment file: its last records go, whole, as if they had
//! never reached the disk. That leaves the node with a state applied past the end of its log:
//! it must start, rejoin as a follower and serve every acknowledged write. And it must not lead
//! the same term again (`raft::log_store::vote_to_restart_with`): it would write new entries
//! under the log ids of those it lost, which the followers hold and would keep.

// Tests wait for conditions against real deadlines.
#![allow(clippy::disallowed_methods)]

use std::path::Path;

use etcd_client::GetOptions;

use crate::common::processes::{Cluster, WAIT};

/// Acknowledged puts before the cut, and how many of the log's last records the cut takes:
/// most of them, so that the cut reaches below what the node's state had persisted (sled
/// writes it every 100 ms) and the node opens with a state applied past its log's end.
const PUTS: usize = 200;
const RECORDS_LOST: usize = 150;

/// The offset of each whole record in a segment file (`raft::segment_log`'s layout: length,
/// checksum and index, then the payload), up to its first empty or short record.
fn record_offsets(data: &[u8]) -> Vec<usize> {
    let mut offsets = Vec::new();
    let mut at = 0;
    while at + 16 <= data.len() {
        let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize;
        if len == 0 || at + 16 + len > data.len() {
            break;
        }
        offsets.push(at);
        at += 16 + len;
    }
    offsets
}

/// Remove the last `records` whole records of the newest segment in `dir`: the file ends where
/// the first of them began. Returns how many were removed.
fn cut_newest_segment(dir: &Path, records: usize) -> usize {
    let newest = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .max()
        .expect("a segment file");
    let data = std::fs::read(&newest).unwrap();
    let offsets = record_offsets(&data);
    let keep = offsets.len().saturating_sub(records).max(1);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&newest)
        .unwrap();
    file.set_len(offsets[keep] as u64).unwrap();
    file.sync_all().unwrap();
    offsets.len() - keep
}

/// A cluster whose leader acknowledged `PUTS` puts under `prefix` (`<prefix>NNNN` = `vN`), was
/// then killed and lost its log's newest records; with `pause_followers`, both followers were
/// paused (SIGSTOP) before the kill, so that nobody else can be elected. Returns the cluster,
/// the old leader and its followers.
async fn leader_lost_its_newest_entries(
    prefix: &str,
    pause_followers: bool,
) -> (Cluster, usize, (usize, usize)) {
    let mut c = Cluster::start().await;
    let leader = c.leader().await;
    let mut client = c.client(&[leader]).await;
    for i in 0..PUTS {
        client
            .put(format!("{prefix}{i:04}"), format!("v{i}"), None)
            .await
            .expect("a put through the leader");
    }
    let followers = c.followers(leader);
    if pause_followers {
        c.signal(followers.0, "STOP");
        c.signal(followers.1, "STOP");
    }
    c.kill(leader);
    let lost = cut_newest_segment(&c.data_dir(leader).join("raft-log"), RECORDS_LOST);
    assert!(lost >= RECORDS_LOST / 2, "the cut took {lost} records");
    (c, leader, followers)
}

/// What node `id` holds under `prefix`, read locally (serializable), once it holds `count`
/// keys there: (key, value) pairs in key order.
async fn held_once_it_has(
    c: &Cluster,
    id: usize,
    prefix: &str,
    count: usize,
    what: &str,
) -> Vec<(String, String)> {
    let one = c.client(&[id]).await;
    let opts = GetOptions::new().with_prefix().with_serializable();
    let seen = crate::common::eventually(WAIT, what, || {
        let (mut one, opts) = (one.clone(), opts.clone());
        async move {
            let r = one.get(prefix, Some(opts)).await.ok()?;
            (r.kvs().len() == count).then_some(r)
        }
    })
    .await;
    seen.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().into(), kv.value_str().unwrap().into()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_lost_its_logs_newest_entries_rejoins_and_loses_nothing_acknowledged() {
    let (mut c, leader, (a, b)) = leader_lost_its_newest_entries("tail/", false).await;

    // The other two elect a leader and take writes meanwhile.
    let survivors = c.client(&[a, b]).await;
    crate::common::eventually(WAIT, "a write to the two others", || {
        let mut s = survivors.clone();
        async move { s.put("tail/after", "x", None).await.ok() }
    })
    .await;

    c.restart(leader);
    // The node that lost its tail serves every acknowledged write, and the later one, from its
    // own state (serializable reads are answered locally).
    let seen = held_once_it_has(
        &c,
        leader,
        "tail/",
        PUTS + 1,
        "the restarted node to catch up",
    )
    .await;
    for (i, (key, value)) in seen.iter().take(PUTS).enumerate() {
        assert_eq!(key, &format!("tail/{i:04}"));
        assert_eq!(value, &format!("v{i}"));
    }
    // And it takes part again: a write through it is acknowledged and read back everywhere.
    c.client(&[leader])
        .await
        .put("tail/last", "y", None)
        .await
        .expect("a put through the restarted node");
    for id in [a, b, leader] {
        let got = held_once_it_has(&c, id, "tail/last", 1, "the last write on every node").await;
        assert_eq!(got[0].1, "y");
    }
}

/// The followers are paused before the leader dies and resumed only after it restarted, so
/// that nobody else can be elected meanwhile: a node that came back as the leader of its old
/// term would now write under the ids of the entries it lost, and its followers, which hold
/// those, would acknowledge the new entries without taking them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_lost_entries_never_writes_new_ones_under_their_ids() {
    let (mut c, leader, (a, b)) = leader_lost_its_newest_entries("ids/", true).await;
    c.restart(leader);
    // A write through the restarted node: it waits for the others, which are paused.
    let writer = {
        let ep = c.endpoint(leader);
        tokio::spawn(async move {
            let opts = etcd_client::ConnectOptions::new()
                .with_connect_timeout(std::time::Duration::from_secs(2))
                .with_timeout(std::time::Duration::from_secs(5));
            let deadline = std::time::Instant::now() + WAIT;
            while std::time::Instant::now() < deadline {
                if let Ok(mut w) =
                    etcd_client::Client::connect([ep.clone()], Some(opts.clone())).await
                    && w.put("ids/new", "n", None).await.is_ok()
                {
                    return true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            false
        })
    };
    // Give the restarted node the time to lead again if it would (it would at once).
    crate::common::eventually(WAIT, "the restarted node to answer", || {
        let ep = c.endpoint(leader);
        async move {
            let mut s = etcd_client::Client::connect([ep], None).await.ok()?;
            s.status().await.ok()
        }
    })
    .await;
    c.signal(a, "CONT");
    c.signal(b, "CONT");
    assert!(
        writer.await.unwrap(),
        "the write through the restarted node was acknowledged"
    );

    // Every node holds the same: the acknowledged write, and every earlier one.
    let mut views = Vec::new();
    for id in [leader, a, b] {
        views.push(
            held_once_it_has(&c, id, "ids/", PUTS + 1, "every node to hold the new write").await,
        );
    }
    assert_eq!(views[0], views[1]);
    assert_eq!(views[0], views[2]);
}
