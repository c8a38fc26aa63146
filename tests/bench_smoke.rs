//! The benchmark suite cannot rot: run `scripts/bench.sh --smoke` (leasecore only, a few seconds
//! per workload, small counts) against the binary cargo built for the tests, and require it to
//! succeed: every workload ran, no response failed, and every stored-count check held.
//!
//! The script starts its own 3-node cluster on 127.0.0.1 at a base port chosen here (three free
//! ports below the ephemeral range) and always tears it down. Skipped, with a message, only where
//! bash or python3 is missing.
//!
//! `leasecore bench --etcd` is also run directly, every workload for a moment, against an
//! in-process cluster's etcd API.

use crate::common;

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::Duration;

/// The longest the smoke run may take before it is stopped (it takes well under 2 minutes).
const LIMIT: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_millis(100);

fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A base port with three consecutive free ports on 127.0.0.1, in 17000..21000 (below the
/// ephemeral range, so that other tests' port-0 listeners and client sockets do not take them).
fn free_base_port() -> u16 {
    let first = (std::process::id() % 400) as u16;
    (0..400u16)
        .map(|i| 17_000 + ((first + i) % 400) * 10)
        // Each node's client port, its peer port (+ 1000) and its etcd API port (+ 2000, every
        // other port: scripts/cluster.sh's layout).
        .find(|&base| {
            (base..base + 3)
                .chain(base + 1000..base + 1003)
                .chain([base + 2000, base + 2002, base + 2004])
                .all(|p| TcpListener::bind(("127.0.0.1", p)).is_ok())
        })
        .expect("three free port pairs in 17000..22000")
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

#[test]
fn bench_smoke_runs_every_workload_and_its_checks() {
    for program in ["bash", "python3"] {
        if !have(program) {
            eprintln!(
                "SKIPPED bench_smoke: {program} is not installed (scripts/bench.sh needs it)"
            );
            return;
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let run_dir: PathBuf =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("bench-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).expect("a run directory");
    let log_path = run_dir.join("bench.log");
    let log = File::create(&log_path).expect("a log file");
    let base = free_base_port();

    let mut child = Command::new("bash")
        .arg(root.join("scripts/bench.sh"))
        .arg("--smoke")
        .current_dir(root)
        .env("LEASECORE_BIN", env!("CARGO_BIN_EXE_leasecore"))
        .env("BENCH_LEASECORE_PORT", base.to_string())
        .env("BENCH_RUN_DIR", &run_dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("a second handle"))
        .stderr(log)
        .spawn()
        .expect("bash starts");

    let mut waited = Duration::ZERO;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for bench.sh") {
            break Some(status);
        }
        if waited >= LIMIT {
            break None;
        }
        sleep(POLL);
        waited += POLL;
    };
    let status = status.unwrap_or_else(|| {
        // SIGTERM lets the script's trap stop its cluster; SIGKILL if it does not end.
        signal(child.id(), "-TERM");
        for _ in 0..300 {
            if let Ok(Some(s)) = child.try_wait() {
                return s;
            }
            sleep(POLL);
        }
        signal(child.id(), "-KILL");
        child.wait().expect("bench.sh ends")
    });
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    println!("{output}");
    assert!(
        waited < LIMIT,
        "scripts/bench.sh --smoke took over {LIMIT:?} and was stopped"
    );
    assert!(
        status.success(),
        "scripts/bench.sh --smoke failed ({status}); its output is above, its data in {}",
        run_dir.display()
    );
    assert!(
        output.contains("all checks passed"),
        "scripts/bench.sh --smoke did not report its checks"
    );
    let _ = std::fs::remove_dir_all(&run_dir);
}

/// `leasecore bench --etcd` drives every workload through a cluster's etcd API: each run
/// succeeds, fails no response, and (for the writes) finds its writes in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_etcd_mode_runs_every_workload_against_the_etcd_api() {
    let cluster = common::TestCluster::start_tweaked(3, |cfg| {
        cfg.etcd_listen = Some("127.0.0.1:0".into());
    })
    .await;
    let leader = cluster.leader().await;
    let endpoint = cluster.nodes[&leader]
        .etcd_addr()
        .expect("an etcd listener")
        .to_string();
    for workload in leasecore::bench::etcd::EtcdWorkload::ALL {
        let name = workload.name();
        let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .args(["bench", "--etcd", &endpoint, name, "-c", "4", "-d", "0.2"])
            .args(["--keys", "40", "--json"])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        // A bound, not a measurement: a hung run fails here instead of hanging the suite.
        let out = tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .unwrap_or_else(|_| panic!("bench --etcd {name} did not finish within 120 s"))
            .expect("leasecore runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "bench --etcd {name} failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: serde_json::Value =
            serde_json::from_str(stdout.lines().last().unwrap_or_default()).expect("one JSON line");
        assert_eq!(r["workload"], name, "{r}");
        assert_eq!(r["server_version"], leasecore::etcd::ETCD_VERSION, "{r}");
        assert_eq!(r["errors"], 0, "{name}: {r}");
        assert!(r["ok"].as_u64().unwrap_or(0) > 0, "{name}: {r}");
        let writes = matches!(name, "put" | "txn" | "lease-grant");
        let expected_check = if writes { "ok" } else { "n/a" };
        assert_eq!(r["stored_check"], expected_check, "{name}: {r}");
    }
    cluster.shutdown().await;
}
