//! Keys that are bytes, not text, through leasecore's etcd v3 API, as etcd's clients write
//! them (`etcdctl check perf` writes varint-encoded keys; clients pack integers into keys):
//! driven by the Rust `etcd-client` crate and by `etcdctl` 3.4, clients nobody here wrote,
//! against a three-node cluster.
//!
//! - Byte keys (not UTF-8, or beginning with NUL) are written and read back byte-exact through
//!   different nodes; ranges hold exactly the keys whose bytes lie in them, in byte order,
//!   text and binary keys mixed, also when paged with `limit` and at a past revision; a prefix
//!   watch sees their events; compares and delete-range with `prev_kv` find them; the key
//!   length limit counts their bytes.
//! - `/v1` shows a binary key in its stored form (NUL, then the hex of its bytes) and refuses
//!   to write a key of that form.
//! - `etcdctl check perf` (a minute of puts of binary keys from 50 clients, then a
//!   delete of its prefix) passes, compaction and defragmentation included.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::time::Duration;

use common::TestCluster;
use common::etcdctl::{endpoint, endpoints, etcd_cluster, etcdctl_in, have_etcdctl};
use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, SortOrder, SortTarget, Txn,
    TxnOp, WatchOptions,
};

async fn client(c: &TestCluster, id: u64) -> Client {
    Client::connect([endpoint(c, id)], None)
        .await
        .expect("connect")
}

fn keys(kvs: &[etcd_client::KeyValue]) -> Vec<Vec<u8>> {
    kvs.iter().map(|kv| kv.key().to_vec()).collect()
}

/// The keys this test writes under `k/`, text and binary mixed, in byte order.
fn written() -> Vec<Vec<u8>> {
    let mut all: Vec<Vec<u8>> = vec![
        b"k/a".to_vec(),
        b"k/\x7f".to_vec(),
        b"k/\x80".to_vec(),
        b"k/\x80\x01".to_vec(),
        "k/é".as_bytes().to_vec(), // c3 a9: text
        b"k/\xc3\x28".to_vec(),    // c3 then '(': not UTF-8
        "k/\u{10ffff}".as_bytes().to_vec(),
        b"k/\xff".to_vec(),
        b"k/\xff\xff\x00".to_vec(),
        b"k/\x00nul".to_vec(),
    ];
    all.sort();
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_keys_are_keys_like_any_other() {
    let c = etcd_cluster().await;
    let leader = c.leader().await;
    let others: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();
    let mut writer = client(&c, others[0]).await;
    let mut reader = client(&c, others[1]).await;

    // A key outside the prefix on either side, text and binary.
    writer.put(b"k.".to_vec(), "x", None).await.unwrap();
    writer.put(b"j\xff".to_vec(), "x", None).await.unwrap();
    let mut watch = reader
        .watch("k/", Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap();
    let before = writer.get("k.", None).await.unwrap();
    let start = before.header().unwrap().revision();
    for (i, k) in written().into_iter().enumerate() {
        writer.put(k, format!("v{i}"), None).await.unwrap();
    }

    // Every key read back byte-exact, in byte order, through another node.
    let all = reader
        .get("k/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert_eq!(keys(all.kvs()), written());
    for (i, k) in written().into_iter().enumerate() {
        let one = reader.get(k.clone(), None).await.unwrap();
        assert_eq!(keys(one.kvs()), vec![k.clone()]);
        assert_eq!(one.kvs()[0].value(), format!("v{i}").as_bytes());
    }

    // Paged with a limit, each page starting after the last key seen: each key once.
    let mut paged = Vec::new();
    let mut from = b"k/".to_vec();
    loop {
        let page = reader
            .get(
                from.clone(),
                Some(GetOptions::new().with_range("k0").with_limit(3)),
            )
            .await
            .unwrap();
        paged.extend(keys(page.kvs()));
        if !page.more() {
            break;
        }
        from = [paged.last().unwrap().as_slice(), b"\0"].concat();
    }
    assert_eq!(paged, written());

    // A range with binary bounds holds exactly the keys between them.
    let (lo, hi) = (b"k/\x80".to_vec(), b"k/\xc4".to_vec());
    let between = reader
        .get(lo.clone(), Some(GetOptions::new().with_range(hi.clone())))
        .await
        .unwrap();
    let want: Vec<Vec<u8>> = written()
        .into_iter()
        .filter(|k| *k >= lo && *k < hi)
        .collect();
    assert_eq!(keys(between.kvs()), want);
    assert_eq!(between.count() as usize, want.len());
    // Sorted by key, descending: byte order reversed.
    let descending = reader
        .get(
            "k/",
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Key, SortOrder::Descend),
            ),
        )
        .await
        .unwrap();
    let mut reversed = written();
    reversed.reverse();
    assert_eq!(keys(descending.kvs()), reversed);

    // The watch saw every put, keys byte-exact, and nothing outside the prefix.
    let mut seen = Vec::new();
    while seen.len() < written().len() {
        let resp = tokio::time::timeout(Duration::from_secs(20), watch.message())
            .await
            .expect("watch events within 20 s")
            .unwrap()
            .expect("the watch stream stays open");
        for e in resp.events() {
            assert_eq!(e.event_type(), EventType::Put);
            seen.push(e.kv().unwrap().key().to_vec());
        }
    }
    let mut sorted_seen = seen.clone();
    sorted_seen.sort();
    assert_eq!(sorted_seen, written());

    // A compare on a binary key, and a txn put of one.
    let bin = b"k/\xff".to_vec();
    let t = Txn::new()
        .when([Compare::version(bin.clone(), CompareOp::Equal, 1)])
        .and_then([TxnOp::put(b"k/\xfe".to_vec(), "txn", None)]);
    assert!(writer.txn(t).await.unwrap().succeeded());
    let got = reader.get(b"k/\xfe".to_vec(), None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"txn");

    // The range as it was before the puts, and after them.
    let past = reader
        .get(
            "k/",
            Some(GetOptions::new().with_prefix().with_revision(start)),
        )
        .await
        .unwrap();
    assert!(past.kvs().is_empty(), "{:?}", keys(past.kvs()));
    let at_last = reader
        .get(
            "k/",
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_revision(start + written().len() as i64),
            ),
        )
        .await
        .unwrap();
    assert_eq!(keys(at_last.kvs()), written());

    // `/v1` shows binary keys in their stored form and refuses to write one.
    let http = reqwest::Client::new();
    let listed: serde_json::Value = http
        .get(format!("{}/v1/kv?prefix=j", c.url(leader)))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["items"][0]["key"], "\u{0}6aff", "{listed}");
    let refused = http
        .put(format!("{}/v1/kv/%006aff", c.url(leader)))
        .json(&serde_json::json!({"value": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("U+0000"),
        "{body}"
    );

    // The key limit counts bytes, not their stored form.
    let longest = vec![0xffu8; 1024];
    writer.put(longest.clone(), "x", None).await.unwrap();
    assert!(writer.put(vec![0xffu8; 1025], "x", None).await.is_err());
    writer.delete(longest, None).await.unwrap();

    // Delete-range over the prefix finds every key, binary ones included.
    let deleted = writer
        .delete(
            "k/",
            Some(DeleteOptions::new().with_prefix().with_prev_key()),
        )
        .await
        .unwrap();
    let mut gone = written();
    gone.push(b"k/\xfe".to_vec());
    gone.sort();
    assert_eq!(deleted.deleted() as usize, gone.len());
    assert_eq!(keys(deleted.prev_kvs()), gone);
    let left = reader
        .get("", Some(GetOptions::new().with_from_key()))
        .await
        .unwrap();
    assert_eq!(keys(left.kvs()), vec![b"j\xff".to_vec(), b"k.".to_vec()]);
    c.shutdown().await;
}

/// `etcdctl check perf`: a minute of puts of varint keys under `/etcdctl-check-perf/` from 50
/// clients, every one of which must succeed, then a delete of the prefix; with compaction and
/// defragmentation after it. (Whether its throughput and latency pass is up to the machine.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcdctl_check_perf_passes() {
    if !have_etcdctl() {
        return;
    }
    let c = etcd_cluster().await;
    // It runs for a minute: longer than `etcdctl_in` waits.
    let run = tokio::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", endpoints(&c)))
        .args(["check", "perf", "--auto-compact", "--auto-defrag"])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(150), run)
        .await
        .expect("etcdctl check perf within 150 s")
        .expect("run etcdctl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stdout.contains("too many errors") && !stdout.contains("ERROR("),
        "stdout: {stdout}\nstderr: {}",
        stderr.lines().take(20).collect::<Vec<_>>().join("\n")
    );
    // Its throughput and latency verdicts are this machine's business, not this test's.
    assert!(stdout.contains("Throughput"), "stdout: {stdout}");
    let left = etcdctl_in(
        &endpoint(&c, 1),
        &[
            "get",
            "/etcdctl-check-perf/",
            "--prefix",
            "--keys-only",
            "-w",
            "json",
        ],
        "",
    )
    .await;
    let v: serde_json::Value = serde_json::from_slice(&left.stdout).unwrap();
    assert!(v.get("count").is_none(), "keys left under the prefix: {v}");
    c.shutdown().await;
}
