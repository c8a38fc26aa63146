//! leasecore's etcd v3 API driven by etcd's own command-line client, `etcdctl` 3.4 (see
//! `common::etcdctl`), against a three-node cluster: every command goes through a real gRPC
//! client nobody here wrote, and `-w json` outputs are parsed and checked. (Auth, membership
//! and Observe: `tests/etcd_admin.rs`.)
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use base64::Engine;
use common::etcdctl::{b64, endpoint, endpoints, etcd_cluster, etcdctl_in, have_etcdctl, json, ok};
use common::{TestCluster, eventually};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

async fn cluster() -> TestCluster {
    etcd_cluster().await
}

/// Whether `etcdctl txn -i` reported the success branch (its prompts come first on stdout).
fn txn_succeeded(stdout: &[u8]) -> bool {
    String::from_utf8_lossy(stdout)
        .lines()
        .any(|l| l == "SUCCESS")
}

fn kvs(v: &Value) -> Vec<(String, String)> {
    v["kvs"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|kv| {
                    (
                        b64(&kv["key"]),
                        kv.get("value").map(b64).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_reads_and_writes_through_every_node() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2, e3) = (endpoint(&c, 1), endpoint(&c, 2), endpoint(&c, 3));
    assert_eq!(ok(&e1, &["put", "app/a", "1"]).await.trim(), "OK");
    // A linearizable read through another node sees it at once.
    assert_eq!(ok(&e2, &["get", "app/a"]).await, "app/a\n1\n");
    let put = json(&e3, &["put", "app/a", "2", "--prev-kv"]).await;
    assert_eq!(b64(&put["prev_kv"]["value"]), "1");
    ok(&e1, &["put", "app/b", "3"]).await;
    ok(&e1, &["put", "zzz", "4"]).await;

    let all = json(&e2, &["get", "app/", "--prefix"]).await;
    assert_eq!(
        kvs(&all),
        [("app/a".into(), "2".into()), ("app/b".into(), "3".into())]
    );
    assert_eq!(all["count"], 2);
    let a = &all["kvs"][0];
    assert_eq!(
        (a["version"].as_i64(), a["create_revision"].as_i64()),
        (Some(2), Some(1))
    );
    assert!(all["header"]["revision"].as_i64().unwrap() >= 4);
    assert!(all["header"]["member_id"].as_u64().is_some());

    let limited = json(&e3, &["get", "app/", "--prefix", "--limit", "1"]).await;
    assert_eq!(
        (kvs(&limited).len(), limited["more"].as_bool()),
        (1, Some(true))
    );
    let from = ok(&e1, &["get", "--from-key", "app/b", "--keys-only"]).await;
    assert_eq!(
        from.split_whitespace().collect::<Vec<_>>(),
        ["app/b", "zzz"]
    );
    let desc = json(&e1, &["get", "app/", "--prefix", "--order=DESCEND"]).await;
    assert_eq!(kvs(&desc)[0].0, "app/b");

    // A delete of a range: one revision, every key, the old values on request.
    let del = json(&e2, &["del", "app/", "--prefix", "--prev-kv"]).await;
    assert_eq!(del["deleted"], 2);
    assert_eq!(del["prev_kvs"].as_array().unwrap().len(), 2);
    assert_eq!(ok(&e3, &["get", "app/", "--prefix"]).await, "");

    // The past is still held: the range as it was at revision 1.
    assert_eq!(
        ok(&e1, &["get", "app/", "--prefix", "--rev", "1"]).await,
        "app/a\n1\n"
    );
    let status = json(&endpoints(&c), &["endpoint", "status"]).await;
    let statuses = status.as_array().unwrap();
    assert_eq!(statuses.len(), 3);
    let leaders: Vec<u64> = statuses
        .iter()
        .map(|s| s["Status"]["leader"].as_u64().unwrap())
        .collect();
    assert!(
        leaders.iter().all(|l| *l == leaders[0] && *l != 0),
        "{leaders:?}"
    );
    assert!(
        statuses
            .iter()
            .all(|s| s["Status"]["version"].as_str().unwrap().starts_with("3.5"))
    );
    // etcdctl 3.4 prints health to stderr.
    let health = etcdctl_in(&endpoints(&c), &["endpoint", "health"], "").await;
    assert!(health.status.success());
    let text = String::from_utf8_lossy(&health.stderr).to_string()
        + &String::from_utf8_lossy(&health.stdout);
    assert_eq!(text.matches("is healthy").count(), 3, "{text}");
    let members = json(&e1, &["member", "list"]).await;
    assert_eq!(members["members"].as_array().unwrap().len(), 3);

    // `etcdctl snapshot save` (which checks etcd's trailing hash) stores a backup that
    // leasecore's own tools read.
    let tmp = tempfile::TempDir::new().unwrap();
    let file = tmp.path().join("snap.db");
    ok(&e2, &["snapshot", "save", file.to_str().unwrap()]).await;
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args(["snapshot", "status"])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success() && text.contains("keys 1"), "{text}");
    c.shutdown().await;
}

/// A value that is not UTF-8, given to `etcdctl put` as raw bytes on its command line (as
/// `etcdctl put k "$(printf '\xff\xfe')"` gives it), reads back byte-exact through another
/// node: in `-w json` (base64) and as the bytes themselves (`--print-value-only`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_writes_and_reads_binary_values() {
    use std::os::unix::ffi::OsStrExt;
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    let raw: &[u8] = &[0xff, 0xfe, b'b', 0x80, 0x01];
    let put = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={e1}"))
        .arg("--command-timeout=10s")
        .args(["put", "bin"])
        .arg(std::ffi::OsStr::from_bytes(raw))
        .output()
        .await
        .unwrap();
    assert!(
        put.status.success(),
        "{}",
        String::from_utf8_lossy(&put.stderr)
    );
    let got = json(&e2, &["get", "bin"]).await;
    let value = base64::engine::general_purpose::STANDARD
        .decode(got["kvs"][0]["value"].as_str().unwrap())
        .unwrap();
    assert_eq!(value, raw);
    let printed = etcdctl_in(&e2, &["get", "bin", "--print-value-only"], "").await;
    assert_eq!(printed.stdout, [raw, b"\n"].concat());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_transactions_and_leases() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    // etcdctl's interactive txn: compares, a blank line, success ops, a blank line, failure
    // ops, a blank line.
    let create = "create(\"cfg\") = \"0\"\n\nput cfg one\n\nget cfg\n\n";
    let first = etcdctl_in(&e1, &["txn", "-i"], create).await;
    assert!(
        first.status.success() && txn_succeeded(&first.stdout),
        "{first:?}"
    );
    let second = etcdctl_in(&e2, &["txn", "-i", "-w", "json"], create).await;
    let out = String::from_utf8_lossy(&second.stdout);
    let v: Value = serde_json::from_str(&out[out.find('{').expect("a JSON answer")..]).unwrap();
    assert_eq!(
        v.get("succeeded"),
        None,
        "the key exists: the failure branch runs"
    );
    let range = &v["responses"][0]["Response"]["ResponseRange"];
    assert_eq!(kvs(range), [("cfg".into(), "one".into())]);
    // A transaction may not write one key twice (etcd's own refusal).
    let twice = etcdctl_in(&e1, &["txn", "-i"], "\nput d 1\nput d 2\n\n\n").await;
    assert!(!twice.status.success());
    assert!(String::from_utf8_lossy(&twice.stderr).contains("duplicate key given in txn request"));

    let granted = ok(&e1, &["lease", "grant", "60"]).await;
    let id = granted.split_whitespace().nth(1).unwrap().to_string();
    ok(&e2, &["put", "owned", "x", &format!("--lease={id}")]).await;
    let ttl = json(&e2, &["lease", "timetolive", &id, "--keys"]).await;
    assert_eq!(ttl["granted-ttl"], 60);
    assert!((50..=60).contains(&ttl["ttl"].as_i64().unwrap()), "{ttl}");
    assert_eq!(b64(&ttl["keys"][0]), "owned");
    let list = ok(&e1, &["lease", "list"]).await;
    assert!(list.contains(&id), "{list}");
    let kept = ok(&e2, &["lease", "keep-alive", "--once", &id]).await;
    assert!(kept.contains("keepalived with TTL(60)"), "{kept}");
    let owned = json(&e1, &["get", "owned"]).await;
    assert_eq!(
        format!("{:016x}", owned["kvs"][0]["lease"].as_i64().unwrap()),
        id
    );
    ok(&e1, &["lease", "revoke", &id]).await;
    assert_eq!(
        ok(&e2, &["get", "owned"]).await,
        "",
        "revoking deletes the lease's keys"
    );
    let gone = ok(&e1, &["lease", "timetolive", &id]).await;
    assert!(gone.contains("already expired"), "{gone}");
    let missing = etcdctl_in(&e1, &["lease", "revoke", &id], "").await;
    assert!(String::from_utf8_lossy(&missing.stderr).contains("requested lease not found"));
    // A put naming a lease that is gone is refused, with or without --prev-kv.
    for extra in [&[][..], &["--prev-kv"][..]] {
        let args: Vec<&str> = ["put", "orphan", "v", "--lease", &id]
            .into_iter()
            .chain(extra.iter().copied())
            .collect();
        let refused = etcdctl_in(&e1, &args, "").await;
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains("requested lease not found"),
            "{args:?}: {}",
            String::from_utf8_lossy(&refused.stderr)
        );
    }
    // A short lease expires by itself, and its key goes with it.
    let short = ok(&e1, &["lease", "grant", "2"]).await;
    let short = short.split_whitespace().nth(1).unwrap().to_string();
    ok(&e1, &["put", "ephemeral", "x", &format!("--lease={short}")]).await;
    let started = Instant::now();
    eventually(
        Duration::from_secs(10),
        "the short lease's key to go",
        || {
            let e = e2.clone();
            async move { ok(&e, &["get", "ephemeral"]).await.is_empty().then_some(()) }
        },
    )
    .await;
    assert!(started.elapsed() >= Duration::from_millis(1500));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_watches_see_every_event_and_resume_from_a_revision() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    let mut watch = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={e2}"))
        .args(["watch", "w/", "--prefix", "-w", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    // Writes start once the watch is in place: a marker put, repeated until the watch shows it.
    let mut first_rev = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    'ready: while Instant::now() < deadline {
        ok(&e1, &["put", "w/ready", "1"]).await;
        while let Ok(Ok(Some(line))) =
            tokio::time::timeout(Duration::from_millis(500), lines.next_line()).await
        {
            let v: Value = serde_json::from_str(&line).unwrap();
            if let Some(ev) = v["Events"].as_array().and_then(|e| e.first()) {
                first_rev = ev["kv"]["mod_revision"].as_i64().unwrap();
                break 'ready;
            }
        }
    }
    assert!(first_rev > 0, "the watch never saw the marker");
    for i in 0..5 {
        ok(&e1, &["put", &format!("w/{i}"), &i.to_string()]).await;
    }
    ok(&e1, &["del", "w/", "--prefix"]).await;
    ok(&e1, &["put", "elsewhere", "x"]).await;
    // Until the range delete's six deletes (the marker and w/0..w/4) have arrived.
    let mut seen = Vec::new();
    while seen.iter().filter(|(kind, _)| kind == "DELETE").count() < 6 {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the watch stalled")
            .unwrap()
            .expect("the watch ended");
        let v: Value = serde_json::from_str(&line).unwrap();
        for ev in v["Events"].as_array().into_iter().flatten() {
            // etcdctl's JSON is Go's encoding of the protobuf struct: the type is a number
            // (DELETE = 1) and PUT (0) is left out.
            let kind = match ev.get("type").and_then(Value::as_i64) {
                Some(1) => "DELETE",
                _ => "PUT",
            };
            seen.push((kind.to_string(), b64(&ev["kv"]["key"])));
        }
    }
    let puts: Vec<&str> = seen
        .iter()
        .filter(|(kind, key)| kind == "PUT" && key != "w/ready")
        .map(|(_, k)| k.as_str())
        .collect();
    assert_eq!(puts, ["w/0", "w/1", "w/2", "w/3", "w/4"], "{seen:?}");
    assert!(seen.iter().all(|(_, k)| k != "elsewhere"));
    drop(watch);

    // A new watch from the marker's revision replays the same history, through another node.
    let mut replay = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={e1}"))
        .args(["watch", "w/", "--prefix", "--rev", &first_rev.to_string()])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(replay.stdout.take().unwrap()).lines();
    let mut text = Vec::new();
    while text.iter().filter(|l: &&String| *l == "DELETE").count() < 6 {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the replay stalled")
            .unwrap()
            .expect("the replay ended");
        text.push(line);
    }
    assert_eq!(&text[..3], ["PUT", "w/ready", "1"]);
    assert!(text.iter().filter(|l| *l == "PUT").count() >= 6, "{text:?}");
    for i in 0..5 {
        assert!(text.contains(&format!("w/{i}")), "{text:?}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn txn_increments_through_different_nodes_never_lose_an_update() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    ok(&endpoint(&c, 1), &["put", "counter", "0"]).await;
    const WORKERS: u64 = 3;
    const EACH: u64 = 6;
    let mut tasks = Vec::new();
    for w in 1..=WORKERS {
        let ep = endpoint(&c, w);
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            let mut conflicts = 0;
            while done < EACH {
                let cur = json(&ep, &["get", "counter"]).await;
                let kv = &cur["kvs"][0];
                let value: u64 = b64(&kv["value"]).parse().unwrap();
                let rev = kv["mod_revision"].as_i64().unwrap();
                let script = format!(
                    "mod(\"counter\") = \"{rev}\"\n\nput counter {}\n\n\n",
                    value + 1
                );
                let out = etcdctl_in(&ep, &["txn", "-i"], &script).await;
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                if txn_succeeded(&out.stdout) {
                    done += 1;
                } else {
                    conflicts += 1;
                }
            }
            conflicts
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let v = json(&endpoint(&c, 2), &["get", "counter"]).await;
    assert_eq!(b64(&v["kvs"][0]["value"]), (WORKERS * EACH).to_string());
    c.shutdown().await;
}

/// A key's whole history through etcdctl: reads at past revisions through every node (a
/// follower's serializable read too), watches replaying with the previous values, and a
/// compaction that makes the old revisions answer etcd's `compacted` while the newer ones
/// stay readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_reads_the_past_and_compaction_forgets_it() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2, e3) = (endpoint(&c, 1), endpoint(&c, 2), endpoint(&c, 3));
    let rev = |v: Value| v["header"]["revision"].as_i64().unwrap();
    let r1 = rev(json(&e1, &["put", "h", "one"]).await);
    let r2 = rev(json(&e2, &["put", "h", "two"]).await);
    let r3 = rev(json(&e3, &["del", "h"]).await);
    let r4 = rev(json(&e1, &["put", "h", "four"]).await);
    assert!(r1 < r2 && r2 < r3 && r3 < r4);
    for (at, want) in [
        (r1, "h\none\n"),
        (r2, "h\ntwo\n"),
        (r3, ""),
        (r4, "h\nfour\n"),
    ] {
        let at = at.to_string();
        assert_eq!(ok(&e2, &["get", "h", "--rev", &at]).await, want, "at {at}");
        let local = ok(&e3, &["get", "h", "--rev", &at, "--consistency=s"]).await;
        assert_eq!(local, want, "serializable at {at}");
    }
    let at_r1 = json(&e1, &["get", "h", "--rev", &r1.to_string()]).await;
    assert_eq!(
        (
            at_r1["kvs"][0]["version"].as_i64(),
            rev(at_r1.clone()) >= r4
        ),
        (Some(1), true),
        "the version as it was, the header at the store's revision: {at_r1}"
    );
    let future = etcdctl_in(&e1, &["get", "h", "--rev", &(r4 + 100).to_string()], "").await;
    assert!(String::from_utf8_lossy(&future.stderr).contains("future revision"));

    // A watch from the first revision replays every change with the value before it.
    let mut watch = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={e3}"))
        .args([
            "watch",
            "h",
            "--prev-kv",
            "--rev",
            &r1.to_string(),
            "-w",
            "json",
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the replay stalled")
            .unwrap()
            .expect("the watch ended");
        let v: Value = serde_json::from_str(&line).unwrap();
        for ev in v["Events"].as_array().into_iter().flatten() {
            let value = ev["kv"].get("value").map(b64).unwrap_or_default();
            let prev = ev
                .get("prev_kv")
                .and_then(|p| p.get("value"))
                .map(b64)
                .unwrap_or_default();
            seen.push((value, prev));
        }
    }
    drop(watch);
    let pairs: Vec<(&str, &str)> = seen.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    assert_eq!(
        pairs,
        [("one", ""), ("two", "one"), ("", "two"), ("four", "")]
    );

    // Compaction: revisions below the mark are gone on every node, the mark itself stays.
    ok(&e2, &["compaction", &r3.to_string()]).await;
    for e in [&e1, &e2, &e3] {
        let old = etcdctl_in(e, &["get", "h", "--rev", &r2.to_string()], "").await;
        assert!(
            String::from_utf8_lossy(&old.stderr).contains("required revision has been compacted"),
            "{}",
            String::from_utf8_lossy(&old.stderr)
        );
        assert_eq!(ok(e, &["get", "h", "--rev", &r3.to_string()]).await, "");
        assert_eq!(
            ok(e, &["get", "h", "--rev", &r4.to_string()]).await,
            "h\nfour\n"
        );
    }
    let again = etcdctl_in(&e1, &["compaction", &r2.to_string()], "").await;
    assert!(
        !again.status.success(),
        "compacting below the mark is refused"
    );
    // A watch from below the mark is cancelled as compacted, naming the mark (as etcd).
    let gone = etcdctl_in(
        &e1,
        &["watch", "h", "--rev", &r1.to_string(), "-w", "json"],
        "",
    )
    .await;
    let text =
        String::from_utf8_lossy(&gone.stdout).to_string() + &String::from_utf8_lossy(&gone.stderr);
    assert!(text.contains("compacted"), "{text}");
    assert!(
        text.contains(&format!("\"CompactRevision\":{r3},")),
        "the compaction's own revision: {text}"
    );
    // The mark itself is kept: a watch from it delivers its event, on every node.
    for e in [&e1, &e2, &e3] {
        let mut watch = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={e}"))
            .args(["watch", "h", "--rev", &r3.to_string(), "-w", "json"])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
        // The delete at the mark (etcd's JSON names a delete `"type":1`), then the put after.
        let mut events = Vec::new();
        while events.len() < 2 {
            let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
                .await
                .expect("no event from the compaction's revision")
                .unwrap()
                .expect("the watch ended");
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["Canceled"], Value::Bool(false), "{e}: {line}");
            events.extend(v["Events"].as_array().cloned().unwrap_or_default());
        }
        drop(watch);
        let seen: Vec<(i64, Option<i64>)> = events
            .iter()
            .map(|ev| {
                (
                    ev["type"].as_i64().unwrap_or(0),
                    ev["kv"]["mod_revision"].as_i64(),
                )
            })
            .collect();
        assert_eq!(seen, [(1, Some(r3)), (0, Some(r4))], "{e}: {events:?}");
    }
    c.shutdown().await;
}

/// etcdctl's `lock` and `elect` (etcd's client-side recipes, built on txn, sorted ranges and
/// watches): two locked commands never overlap, and an elected candidate is who a listener
/// sees. Then the Lock service itself through the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_lock_and_elect() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    let tmp = tempfile::TempDir::new().unwrap();
    let marker = tmp.path().join("held");
    // Each holder creates the marker and removes it: if both held at once, one mkdir fails.
    let script = format!(
        "mkdir {m} && sleep 0.3 && rmdir {m} && echo done",
        m = marker.display()
    );
    let args = ["lock", "jobs", "--", "sh", "-c", script.as_str()];
    let (a, b) = tokio::join!(etcdctl_in(&e1, &args, ""), etcdctl_in(&e2, &args, ""));
    for out in [&a, &b] {
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("done"),
            "{out:?}"
        );
    }

    let mut leader = etcdctl_spawn(&e1, &["elect", "pick", "alpha"]);
    let key = first_line(&mut leader, "elected").await;
    assert!(key.starts_with("pick/"), "{key}");
    let seen = ok(&e2, &["get", "pick/", "--prefix"]).await;
    assert!(seen.contains("alpha"), "{seen}");
    // The Election service sees etcdctl's leader, and a campaign through it waits: one
    // leadership per name, whichever client campaigns, as in etcd.
    let http = reqwest::Client::new();
    let base = format!("http://{e2}");
    let post = |path: &str, body: Value, timeout: Duration| {
        http.post(format!("{base}{path}"))
            .timeout(timeout)
            .json(&body)
            .send()
    };
    let long = Duration::from_secs(20);
    let answer = |r: Result<reqwest::Response, reqwest::Error>| async move {
        r.expect("answered").json::<Value>().await.unwrap()
    };
    let leader_of =
        answer(post("/v3/election/leader", json!({"name": b64_of("pick")}), long).await).await;
    assert_eq!(b64(&leader_of["kv"]["value"]), "alpha", "{leader_of}");
    assert_eq!(b64(&leader_of["kv"]["key"]), key, "{leader_of}");
    let grant = answer(post("/v3/lease/grant", json!({"TTL": "30"}), long).await).await;
    let lease = grant["ID"].clone();
    let campaign = json!({"name": b64_of("pick"), "lease": lease, "value": b64_of("beta")});
    let campaign = post("/v3/election/campaign", campaign, Duration::from_secs(2)).await;
    assert!(
        campaign.is_err(),
        "a second leader was elected: {campaign:?}"
    );
    drop(leader);

    // The Lock service (v3lock) through the JSON gateway: lock, then unlock, by key. (The
    // campaign above left its queue when its call ended: the lease is free to use.)
    let lock = |name: &str, lease: &Value, timeout: Duration| {
        post(
            "/v3/lock/lock",
            json!({"name": b64_of(name), "lease": lease}),
            timeout,
        )
    };
    let locked = answer(lock("svc", &lease, long).await).await;
    let key = b64(&locked["key"]);
    // etcd's mutex layout: `<name>/<lease id in hex>`.
    let id: i64 = lease.as_str().unwrap().parse().unwrap();
    assert_eq!(key, format!("svc/{id:x}"), "{locked}");
    // It excludes etcd's client-side mutex on the same name (`etcdctl lock`), as etcd's
    // Lock service does: both held at once under leasecore's own layout.
    let mut waiter = etcdctl_spawn(&e1, &["lock", "svc", "--", "echo", "acquired"]);
    let waited = tokio::time::timeout(Duration::from_secs(2), waiter.wait()).await;
    assert!(
        waited.is_err(),
        "etcdctl lock got a lock the Lock service holds"
    );
    let r = post("/v3/lock/unlock", json!({"key": locked["key"]}), long)
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let out = tokio::time::timeout(long, waiter.wait_with_output())
        .await
        .expect("etcdctl lock acquires once unlocked")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("acquired"),
        "{out:?}"
    );
    assert_eq!(ok(&e1, &["get", &key]).await, "");

    // The other way: a lock `etcdctl lock` holds keeps the Lock service waiting.
    let mut holder = etcdctl_spawn(&e1, &["lock", "svc2"]);
    let held = first_line(&mut holder, "etcdctl lock holds").await;
    assert!(held.starts_with("svc2/"), "{held}");
    assert!(
        lock("svc2", &lease, Duration::from_secs(2)).await.is_err(),
        "the Lock service granted a lock etcdctl holds"
    );
    // SIGINT: etcdctl closes its session, which revokes its lease and frees the lock.
    let pid = holder.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .await
            .unwrap()
            .success()
    );
    // Another lease: the call that timed out leaves its queue (its key deleted) when it
    // ends, which could delete the same lease's key again after a new call reused it.
    let other = answer(post("/v3/lease/grant", json!({"TTL": "30"}), long).await).await;
    let r = lock("svc2", &other["ID"], long)
        .await
        .expect("locked once etcdctl let go");
    assert_eq!(r.status(), 200);
    c.shutdown().await;
}

/// `text`'s base64, as the gateway's bytes fields carry it.
fn b64_of(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// `etcdctl ARGS...` on `ep`, running, its output piped (killed when dropped).
fn etcdctl_spawn(ep: &str, args: &[&str]) -> tokio::process::Child {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={ep}"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// The first line a running etcdctl prints (within 10 s).
async fn first_line(child: &mut tokio::process::Child, what: &str) -> String {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within 10 s"))
        .unwrap()
        .unwrap_or_else(|| panic!("{what}: etcdctl ended"))
}

/// With leasecore's auth on, `etcdctl --user` authenticates through etcd's `Authenticate` and
/// its token is honoured on every call; without it, calls are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_authenticates_with_leasecore_users() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let e2 = endpoint(&c, 2);
    let http = reqwest::Client::new();
    let base = c.url(1);
    for (method, path, body) in [
        (
            "POST",
            "/v1/auth/users",
            Some(serde_json::json!({"name": "root", "password": "root-pw"})),
        ),
        ("PUT", "/v1/auth/users/root/roles/root", None),
        ("POST", "/v1/auth/enable", None),
    ] {
        let mut req = http.request(method.parse().unwrap(), format!("{base}{path}"));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        assert!(
            r.status().is_success(),
            "{path}: {}",
            r.text().await.unwrap()
        );
    }
    let refused = etcdctl_in(&e2, &["put", "k", "v"], "").await;
    assert!(!refused.status.success());
    assert_eq!(
        ok(&e2, &["--user=root:root-pw", "put", "k", "v"])
            .await
            .trim(),
        "OK"
    );
    assert_eq!(
        ok(&e2, &["--user=root:root-pw", "get", "k"]).await,
        "k\nv\n"
    );
    let wrong = etcdctl_in(&e2, &["--user=root:nope", "get", "k"], "").await;
    assert!(
        String::from_utf8_lossy(&wrong.stderr).contains("authentication failed"),
        "{}",
        String::from_utf8_lossy(&wrong.stderr)
    );
    c.shutdown().await;
}

/// The longest lease is etcd's, 9,000,000,000 s: granted, read back and kept alive as such;
/// a second more is etcd's own `too large lease TTL` (leasecore's longest used to be 7 days).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_grants_leases_as_long_as_etcds_longest() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    let week_and_a_second = ok(&e1, &["lease", "grant", "604801"]).await;
    assert!(
        week_and_a_second.contains("granted with TTL(604801s)"),
        "{week_and_a_second}"
    );
    let longest = ok(&e1, &["lease", "grant", "9000000000"]).await;
    assert!(
        longest.contains("granted with TTL(9000000000s)"),
        "{longest}"
    );
    let id = longest.split_whitespace().nth(1).unwrap().to_string();
    let ttl = json(&e2, &["lease", "timetolive", &id]).await;
    assert_eq!(ttl["granted-ttl"], 9_000_000_000i64, "{ttl}");
    let left = ttl["ttl"].as_i64().unwrap();
    assert!(
        (9_000_000_000 - 60..=9_000_000_000).contains(&left),
        "{ttl}"
    );
    let kept = ok(&e2, &["lease", "keep-alive", "--once", &id]).await;
    assert!(kept.contains("keepalived with TTL(9000000000)"), "{kept}");
    let over = etcdctl_in(&e2, &["lease", "grant", "9000000001"], "").await;
    assert!(!over.status.success());
    let err = String::from_utf8_lossy(&over.stderr);
    assert!(
        err.contains("Error: failed to grant lease (etcdserver: too large lease TTL)"),
        "{err}"
    );
    c.shutdown().await;
}

/// `etcdctl endpoint hashkv` at node `ep`, at revision `at` (0: the present): the hash and
/// the revision of its header, or etcdctl's error output.
async fn hashkv(ep: &str, at: i64) -> Result<(u64, i64), String> {
    let at = at.to_string();
    let out = etcdctl_in(ep, &["endpoint", "hashkv", "--rev", &at, "-w", "json"], "").await;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).to_string());
    }
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let answer = &v[0]["HashKV"];
    // Go's JSON leaves a zero hash out.
    let hash = answer["hash"].as_u64().unwrap_or(0);
    Ok((hash, answer["header"]["revision"].as_i64().unwrap()))
}

/// `endpoint hashkv --rev R` hashes the keys as they were at any revision still held, as etcd:
/// the same on every node, the same as the present hash was when `R` was the present, and
/// unchanged by later writes and by a compaction up to `R`. Below the compaction mark it is
/// etcd's `compacted`, after the present its `future revision`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_hashkv_hashes_any_revision_still_held() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let eps: Vec<String> = (1..=3).map(|id| endpoint(&c, id)).collect();
    let rev = |v: Value| v["header"]["revision"].as_i64().unwrap();
    let r1 = rev(json(&eps[0], &["put", "a", "1"]).await);
    let r2 = rev(json(&eps[1], &["put", "b", "2"]).await);
    let r3 = rev(json(&eps[2], &["put", "a", "3"]).await);
    // The present hash while r3 is the present (a node answers once it has applied r3).
    let now_at_r3 = eventually(Duration::from_secs(10), "node 1 at r3", || {
        let ep = eps[0].clone();
        async move {
            match hashkv(&ep, 0).await {
                Ok((hash, at)) if at == r3 => Some(hash),
                _ => None,
            }
        }
    })
    .await;
    // Every node, at every revision: one hash per revision.
    let mut at_rev = Vec::new();
    for r in [r1, r2, r3] {
        let mut hashes = Vec::new();
        for ep in &eps {
            let hash = eventually(Duration::from_secs(10), "a hash at a past revision", || {
                let ep = ep.clone();
                async move { hashkv(&ep, r).await.ok().map(|(h, _)| h) }
            })
            .await;
            hashes.push(hash);
        }
        assert!(hashes.iter().all(|h| *h == hashes[0]), "at {r}: {hashes:?}");
        at_rev.push(hashes[0]);
    }
    assert_eq!(at_rev[2], now_at_r3, "the hash at r3, then and later");
    assert!(
        at_rev[0] != at_rev[1] && at_rev[1] != at_rev[2],
        "{at_rev:?}"
    );

    // Later writes change the present hash, not the past ones.
    ok(&eps[0], &["put", "c", "4"]).await;
    let r5 = rev(json(&eps[1], &["del", "a"]).await);
    let later = eventually(Duration::from_secs(10), "node 2 at r5", || {
        let ep = eps[1].clone();
        async move {
            match hashkv(&ep, 0).await {
                Ok((hash, at)) if at == r5 => Some(hash),
                _ => None,
            }
        }
    })
    .await;
    assert!(!at_rev.contains(&later), "{later} {at_rev:?}");
    for ep in &eps {
        assert_eq!(hashkv(ep, r1).await.unwrap().0, at_rev[0], "{ep}");
        assert_eq!(hashkv(ep, r3).await.unwrap().0, at_rev[2], "{ep}");
    }

    // Compaction to r2: r2 and after keep their hashes, below is compacted.
    ok(&eps[2], &["compaction", &r2.to_string()]).await;
    for ep in &eps {
        let err = eventually(Duration::from_secs(10), "the compaction to apply", || {
            let ep = ep.clone();
            async move { hashkv(&ep, r1).await.err() }
        })
        .await;
        assert!(
            err.contains("etcdserver: mvcc: required revision has been compacted"),
            "{ep}: {err}"
        );
        assert_eq!(hashkv(ep, r2).await.unwrap().0, at_rev[1], "{ep}");
        assert_eq!(hashkv(ep, r3).await.unwrap().0, at_rev[2], "{ep}");
    }
    let err = hashkv(&eps[0], r5 + 100).await.unwrap_err();
    assert!(
        err.contains("etcdserver: mvcc: required revision is a future revision"),
        "{err}"
    );
    c.shutdown().await;
}

/// A running `etcdctl watch ... -w json` and its output lines.
fn spawn_watch(
    ep: &str,
    args: &[&str],
) -> (
    tokio::process::Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut child = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={ep}"))
        .arg("watch")
        .args(args)
        .args(["-w", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// The keys and values of the events of one watch response line.
fn events_of(line: &str) -> Vec<(String, String)> {
    let v: Value = serde_json::from_str(line).unwrap();
    v["Events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|ev| {
            let value = ev["kv"].get("value").map(b64).unwrap_or_default();
            (b64(&ev["kv"]["key"]), value)
        })
        .collect()
}

/// The keys of a watch's next events, through the put of `last` (within a deadline).
async fn keys_through(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    last: &(String, String),
) -> Vec<String> {
    let mut events = Vec::new();
    while events.last() != Some(last) {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("the watch stalled")
            .unwrap()
            .expect("the watch ended");
        events.extend(events_of(&line));
    }
    events.into_iter().map(|(k, _)| k).collect()
}

/// etcd's empty-key watches: an empty key is "\0" to etcd (its smallest key), so `watch ""`
/// follows the key "\0", `watch "" b` every key below `b`, and `watch --prefix ""` (which
/// etcdctl sends as "\0" to "\0") every key. leasecore refused the empty key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_watches_from_the_empty_key_as_etcd() {
    use leasecore_etcd_api::etcdserverpb::PutRequest;
    use leasecore_etcd_api::etcdserverpb::kv_client::KvClient;

    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    // etcdctl cannot name the key "\0" (an argument cannot hold NUL): a gRPC client can.
    let mut kv = KvClient::connect(format!("http://{e1}")).await.unwrap();
    let put_nul = |value: &'static str| PutRequest {
        key: vec![0],
        value: value.as_bytes().to_vec(),
        ..Default::default()
    };
    let nul = "\0".to_string();
    let mut watches = [
        spawn_watch(&e2, &[""]),
        spawn_watch(&e2, &["", "b"]),
        spawn_watch(&e2, &["--prefix", ""]),
    ];
    // "\0" is in all three: written until each watch shows it (each starts in its own time).
    let mut ready = [false; 3];
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready.iter().all(|r| *r) && Instant::now() < deadline {
        kv.put(put_nul("marker")).await.unwrap();
        for (i, (_, lines)) in watches.iter_mut().enumerate() {
            while !ready[i] {
                match tokio::time::timeout(Duration::from_millis(300), lines.next_line()).await {
                    Ok(Ok(Some(line))) => ready[i] = events_of(&line).iter().any(|e| e.0 == nul),
                    Ok(_) => panic!("watch {i} ended: it was refused"),
                    Err(_) => break,
                }
            }
        }
    }
    assert_eq!(ready, [true; 3], "the watches never saw the key \"\\0\"");
    ok(&e1, &["put", "c", "1"]).await;
    ok(&e1, &["put", "a", "2"]).await;
    kv.put(put_nul("last")).await.unwrap();
    let last = (nul.clone(), "last".to_string());
    let mut seen = Vec::new();
    for (_, lines) in watches.iter_mut() {
        let keys = keys_through(lines, &last).await;
        // Without the markers still on their way.
        seen.push(keys.into_iter().filter(|k| *k != nul).collect::<Vec<_>>());
    }
    assert!(seen[0].is_empty(), "watch \"\" sees only \"\\0\": {seen:?}");
    assert_eq!(seen[1], ["a"], "watch \"\" b: {seen:?}");
    assert_eq!(seen[2], ["c", "a"], "watch --prefix \"\": {seen:?}");
    c.shutdown().await;
}

/// A key longer than leasecore holds (1024 bytes) is, to etcd's clients, what etcd answers for
/// a request over its size limit: `etcdserver: request is too large` (etcd's keys are bounded
/// only by the request size, 1.5 MiB). 1024 bytes are fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_is_told_a_too_long_key_makes_the_request_too_large() {
    if !have_etcdctl() {
        return;
    }
    let c = cluster().await;
    let e1 = endpoint(&c, 1);
    let longest = "k".repeat(1024);
    assert_eq!(ok(&e1, &["put", &longest, "v"]).await.trim(), "OK");
    let long = "k".repeat(1025);
    let out = etcdctl_in(&e1, &["put", &long, "v"], "").await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines()
            .any(|l| l == "Error: etcdserver: request is too large"),
        "{err}"
    );
    let txn = etcdctl_in(&e1, &["txn", "-i"], &format!("\nput {long} v\n\n\n")).await;
    assert!(!txn.status.success());
    let err = String::from_utf8_lossy(&txn.stderr);
    assert!(
        err.lines()
            .any(|l| l == "Error: etcdserver: request is too large"),
        "{err}"
    );
    c.shutdown().await;
}

/// Past the storage quota an etcd client gets etcd's own error for a write that grows the
/// store (`ResourceExhausted`, "etcdserver: mvcc: database space exceeded", which clientv3
/// knows as `ErrNoSpace`), and can still delete and read, as the error tells it to: `etcdctl
/// del` and a read-only `txn` were refused (`Internal`, and HTTP 500 on the gateway) because
/// every transaction counted as growing the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_quota_etcd_clients_get_no_space_and_can_still_delete_and_read() {
    use leasecore_etcd_api::etcdserverpb::PutRequest;
    use leasecore_etcd_api::etcdserverpb::kv_client::KvClient;

    if !have_etcdctl() {
        return;
    }
    let c = common::etcdctl::etcd_cluster_tweaked(|cfg| {
        cfg.quota = leasecore::domain::resources::Quota {
            max_bytes: 64 << 10,
        };
        cfg.snapshot_log_bytes = 16 << 10;
    })
    .await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    let mut kv = KvClient::connect(format!("http://{e1}")).await.unwrap();
    let mut written = Vec::new();
    let mut refused = None;
    for i in 0..1000 {
        let key = format!("q/{i:04}");
        let put = PutRequest {
            key: key.clone().into_bytes(),
            value: vec![b'x'; 1024],
            ..Default::default()
        };
        match kv.put(put).await {
            Ok(_) => written.push(key),
            Err(status) => {
                refused = Some(status);
                break;
            }
        }
    }
    let status = refused.expect("the quota never refused a put");
    assert_eq!(
        (status.code(), status.message()),
        (
            tonic::Code::ResourceExhausted,
            "etcdserver: mvcc: database space exceeded"
        )
    );
    // Through a follower too. The use counted includes the Raft log, which a snapshot then
    // purges (every 16 KiB here): a put may fit again until the keys alone fill the quota.
    let mut err = None;
    for i in 0..200 {
        let key = format!("q/more/{i:03}");
        let out = etcdctl_in(&e2, &["put", &key, &"y".repeat(1024)], "").await;
        if out.status.success() {
            written.push(key);
        } else {
            err = Some(String::from_utf8_lossy(&out.stderr).into_owned());
            break;
        }
    }
    let err = err.expect("puts through a follower past the quota were never refused");
    assert!(err.contains("database space exceeded"), "{err}");
    // A read-only transaction (a get in the success branch) is answered.
    let out = etcdctl_in(&e2, &["txn", "-i"], &format!("\nget {}\n\n\n", written[0])).await;
    assert!(
        out.status.success(),
        "read-only txn: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&written[0]));
    // Deletes work, through any node, until the store is back under its quota.
    assert_eq!(ok(&e2, &["del", &written[0]]).await.trim(), "1");
    assert_eq!(
        ok(&e1, &["del", "q/", "--prefix"]).await.trim(),
        (written.len() - 1).to_string()
    );
    eventually(Duration::from_secs(20), "puts accepted again", || async {
        let out = etcdctl_in(&e1, &["put", "q/again", "x"], "").await;
        out.status.success().then_some(())
    })
    .await;
    c.shutdown().await;
}

/// etcd's Lock and Election services hold a lock or a leadership asked for without a lease
/// under a session lease of their own (60 s, as `concurrency.NewSession`), and answer its id
/// in the key (Lock) or the leader key (Campaign). leasecore refused them with `requested
/// lease not found` (a black-box comparison with etcd 3.4 found it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_and_campaign_without_a_lease_hold_under_a_session_lease_of_their_own() {
    let c = cluster().await;
    let base = format!("http://{}", endpoint(&c, 2));
    let http = reqwest::Client::new();
    let post = |path: &'static str, body: Value| {
        let req = http
            .post(format!("{base}{path}"))
            .timeout(Duration::from_secs(20))
            .json(&body)
            .send();
        async move {
            let r = req.await.expect("answered");
            assert_eq!(r.status(), 200, "{path}");
            r.json::<Value>().await.unwrap()
        }
    };
    let ttl_of = |id: i64| post("/v3/lease/timetolive", json!({"ID": id.to_string()}));

    let locked = post("/v3/lock/lock", json!({"name": b64_of("no-lease")})).await;
    let key = b64(&locked["key"]);
    let hex = key.strip_prefix("no-lease/").expect("etcd's mutex layout");
    let id = i64::from_str_radix(hex, 16).unwrap();
    assert!(id > 0, "{locked}");
    let ttl = ttl_of(id).await;
    assert_eq!(ttl["grantedTTL"], "60", "{ttl}");
    let unlocked = post("/v3/lock/unlock", json!({"key": locked["key"]})).await;
    assert!(unlocked["header"].is_object(), "{unlocked}");

    let campaign = json!({"name": b64_of("no-lease-election"), "value": b64_of("v")});
    let elected = post("/v3/election/campaign", campaign).await;
    let lease: i64 = elected["leader"]["lease"]
        .as_str()
        .expect("the leader key names its lease")
        .parse()
        .unwrap();
    assert!(lease > 0, "{elected}");
    let ttl = ttl_of(lease).await;
    assert_eq!(ttl["grantedTTL"], "60", "{ttl}");
}
