//! The CLI's exit statuses, run as scripts run it: `flease acquire` (and `paxoslease acquire`)
//! exits 0 when granted and 3 when another owner holds the resource, as `flock -n` fails when
//! the lock is taken, so a script can tell "taken" from an error (1).

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::TestCluster;

fn leasecore(args: &[&str], endpoint: &str) -> i32 {
    Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args(args)
        .args(["--endpoints", endpoint])
        .output()
        .expect("run leasecore")
        .status
        .code()
        .expect("an exit status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_exits_3_when_another_owner_holds_the_resource() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let url = c.url(1);
    for proto in ["flease", "paxoslease"] {
        // The nodes answer 503 (exit 1) during their restart wait after start: retry until
        // the first owner is granted.
        let mut attempts = 150; // 30 s, 200 ms apart
        let first = loop {
            let code = leasecore(&[proto, "acquire", "shard-1", "--owner", "a"], &url);
            attempts -= 1;
            if code != 1 || attempts == 0 {
                break code;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(first, 0, "{proto}: the first owner is granted");
        assert_eq!(
            leasecore(&[proto, "acquire", "shard-1", "--owner", "b"], &url),
            3,
            "{proto}: held by another owner"
        );
        // The holder renews: still 0.
        assert_eq!(
            leasecore(&[proto, "acquire", "shard-1", "--owner", "a"], &url),
            0
        );
    }
    c.shutdown().await;
}
