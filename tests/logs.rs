//! What a node's log looks like to an operator (issue 12, item 6), from real processes: no
//! colour codes in a file, `--log-format json` gives one JSON object per line, openraft's
//! retry noise stays out, and a peer that is down is reported once (with reminders a minute
//! apart), not several ERROR lines a second.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{eventually, free_node_addrs};
use leasecore::client::Client;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(id: usize, addrs: &[String], data: &Path, log: &Path, extra: &[&str]) -> Proc {
    let all: Vec<usize> = (1..=addrs.len()).collect();
    spawn_listing(id, addrs, &all, data, log, extra)
}

/// Start node `id` with `--peers` naming only the ids in `listed`.
fn spawn_listing(
    id: usize,
    addrs: &[String],
    listed: &[usize],
    data: &Path,
    log: &Path,
    extra: &[&str],
) -> Proc {
    let peers: Vec<String> = listed
        .iter()
        .map(|i| format!("{i}={}", addrs[i - 1]))
        .collect();
    let file = std::fs::File::create(log).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args(["serve", "--id", &id.to_string(), "--listen", &addrs[id - 1]])
        .arg("--data")
        .arg(data.join(format!("node-{id}")))
        .args(["--peers", &peers.join(",")])
        .args(extra)
        .env_remove("LEASECORE_LOG")
        .env_remove("LEASECORE_LOG_FORMAT")
        .env_remove("NO_COLOR")
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("spawn the leasecore binary");
    Proc(child)
}

fn read(log: &PathBuf) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_plain_in_files_json_on_request_and_report_a_down_peer_once() {
    let tmp = tempfile::tempdir().unwrap();
    let addrs = free_node_addrs(3);
    let json_log = tmp.path().join("node-1.log");
    let text_log = tmp.path().join("node-2.log");
    // Node 3 never starts: both running nodes keep trying to reach it.
    let _n1 = spawn(1, &addrs, tmp.path(), &json_log, &["--log-format", "json"]);
    let _n2 = spawn(2, &addrs, tmp.path(), &text_log, &[]);
    let client = Client::new(&[
        format!("http://{}", addrs[0]),
        format!("http://{}", addrs[1]),
    ])
    .unwrap();
    eventually(Duration::from_secs(60), "a first write", || async {
        client.put("k", "0", None, None).await.ok()
    })
    .await;
    // Whoever leads tries node 3 all along; wait until both logs have said it is down.
    let unreachable = |log: &PathBuf| {
        read(log)
            .lines()
            .filter(|l| l.contains("peer unreachable") && l.contains(&addrs[2]))
            .count()
    };
    eventually(Duration::from_secs(60), "node 3 reported down", || async {
        (unreachable(&json_log) + unreachable(&text_log) > 0).then_some(())
    })
    .await;
    // Keep the cluster busy for a while (hundreds of failed calls to node 3 meanwhile).
    for i in 0..100 {
        client.put("k", &i.to_string(), None, None).await.unwrap();
    }
    for log in [&json_log, &text_log] {
        let text = read(log);
        assert!(unreachable(log) <= 1, "one report per outage:\n{text}");
        assert!(
            !text.contains('\u{1b}'),
            "no colour codes in a file:\n{text}"
        );
        assert!(
            !text.contains("ERROR"),
            "a down peer is not an error:\n{text}"
        );
        assert!(
            !text.contains("openraft"),
            "openraft noise stays out:\n{text}"
        );
        assert!(
            !text.contains("error sending request"),
            "causes are named:\n{text}"
        );
        assert!(
            !text.contains("other voters"),
            "the same --peers lists everywhere:\n{text}"
        );
    }
    for line in read(&json_log).lines() {
        let doc: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            doc["level"].is_string() && doc["fields"].is_object(),
            "{line}"
        );
    }
    assert!(
        read(&text_log).contains(" INFO "),
        "text lines: {}",
        read(&text_log)
    );
}

/// An operator who gives the nodes different `--peers` lists is told so by the node whose list
/// differs from the cluster that formed. Here node 2 forgot node 3, which never starts: node 1
/// waits for node 3 before it forms a cluster of its list, node 2 has no one to wait for, so
/// the cluster forms with node 2's list and node 1 warns (which list wins depends on such
/// timings; that the node with the other list says so does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_peer_list_differs_from_the_formed_cluster_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let addrs = free_node_addrs(3);
    let log1 = tmp.path().join("node-1.log");
    let log2 = tmp.path().join("node-2.log");
    let _n1 = spawn_listing(1, &addrs, &[1, 2, 3], tmp.path(), &log1, &[]);
    let _n2 = spawn_listing(2, &addrs, &[1, 2], tmp.path(), &log2, &[]);
    let warns = |log: &PathBuf| {
        read(log)
            .lines()
            .any(|l| l.contains("WARN") && l.contains("other voters than this node's --peers"))
    };
    let warner = eventually(
        Duration::from_secs(60),
        "a node warns of the lists",
        || async {
            match (warns(&log1), warns(&log2)) {
                (true, false) => Some(1),
                (false, true) => Some(2),
                (true, true) => panic!("both warned:\n{}\n{}", read(&log1), read(&log2)),
                _ => None,
            }
        },
    )
    .await;
    let client = Client::new(&[format!("http://{}", addrs[0])]).unwrap();
    let voters: Vec<u64> = eventually(Duration::from_secs(30), "the formed cluster", || async {
        let v = client.cluster_status().await.ok()?;
        let mut ids: Vec<u64> = v.nodes.iter().filter(|n| n.voter).map(|n| n.id).collect();
        ids.sort();
        (!ids.is_empty()).then_some(ids)
    })
    .await;
    let (warner_list, other_list): (&[u64], &[u64]) = match warner {
        1 => (&[1, 2, 3], &[1, 2]),
        _ => (&[1, 2], &[1, 2, 3]),
    };
    assert_ne!(voters, warner_list, "node {warner} warned of its own list");
    assert_eq!(
        voters, other_list,
        "the cluster formed from the other node's list"
    );
}
