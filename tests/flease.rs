//! End-to-end Flease and PaxosLease on 3 real nodes over loopback HTTP.
#![allow(clippy::disallowed_methods)] // tests wait against real deadlines

use crate::common;

use std::time::Duration;

use common::{TestCluster, eventually};
use leasecore::domain::flease::{FleaseConfig, Protocol};

/// Fast timing: 2 s leases, 50 ms skew bound, 100 ms rounds (restart wait about 2.4 s).
fn fast(n: u64) -> impl std::future::Future<Output = TestCluster> {
    TestCluster::start_tweaked(n, |cfg| cfg.flease = FleaseConfig::derived(2000, 50, 100))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flease_racing_owners_renew_release_and_survive_a_node_loss() {
    race_renew_release_and_lose_a_node(Protocol::Flease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paxoslease_racing_owners_renew_release_and_survive_a_node_loss() {
    race_renew_release_and_lose_a_node(Protocol::PaxosLease).await;
}

async fn race_renew_release_and_lose_a_node(proto: Protocol) {
    let mut c = fast(3).await;
    c.leader().await;
    let (a, b) = (c.client_of(1), c.client_of(2));
    // The acceptors wait out their restart wait first.
    eventually(Duration::from_secs(20), "the acceptors answer", || async {
        a.resource_acquire(proto, "warmup", "w")
            .await
            .ok()
            .filter(|v| v.granted == Some(true))
    })
    .await;

    // Two owners race through different nodes: exactly one wins.
    let (ra, rb) = tokio::join!(
        a.resource_acquire(proto, "job", "alice"),
        b.resource_acquire(proto, "job", "bob")
    );
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(
        [ra.granted, rb.granted]
            .iter()
            .filter(|g| **g == Some(true))
            .count(),
        1,
        "{ra:?} {rb:?}"
    );
    let (winner, loser, win) = if ra.granted == Some(true) {
        ("alice", "bob", ra)
    } else {
        ("bob", "alice", rb)
    };
    assert_eq!(win.holder.as_deref(), Some(winner));
    assert!(win.valid_ms > 0 && win.valid_ms <= 2000 - 50);

    // The loser is told who holds it; the winner renews with the same epoch.
    let busy = c
        .client_of(3)
        .resource_acquire(proto, "job", loser)
        .await
        .unwrap();
    assert_eq!(
        (busy.granted, busy.holder.as_deref()),
        (Some(false), Some(winner))
    );
    let renewed = c
        .client_of(3)
        .resource_acquire(proto, "job", winner)
        .await
        .unwrap();
    assert_eq!((renewed.granted, renewed.epoch), (Some(true), win.epoch));

    // The other protocol's resource of the same name is a different resource.
    let other = match proto {
        Protocol::Flease => Protocol::PaxosLease,
        Protocol::PaxosLease => Protocol::Flease,
    };
    let elsewhere = a.resource_acquire(other, "job", loser).await.unwrap();
    assert_eq!(elsewhere.granted, Some(true), "{elsewhere:?}");

    // Release (through a node that did not grant it, then again), then the other owner gets
    // it at once, with a higher epoch.
    assert!(b.resource_release(proto, "job", winner).await.unwrap());
    assert!(!a.resource_release(proto, "job", winner).await.unwrap());
    let next = b.resource_acquire(proto, "job", loser).await.unwrap();
    assert_eq!(next.granted, Some(true));
    assert!(next.epoch > win.epoch);
    let seen = c.client_of(2).resource_get(proto, "job").await.unwrap();
    assert_eq!(seen.holder.as_deref(), Some(loser));
    // A release through the node that granted it takes the one-round-trip path.
    assert!(b.resource_release(proto, "job", loser).await.unwrap());

    // One node down: two of three still grant.
    c.stop(3).await;
    let two = eventually(
        Duration::from_secs(10),
        "a grant with two nodes",
        || async {
            a.resource_acquire(proto, "other", "carol")
                .await
                .ok()
                .filter(|v| v.granted == Some(true))
        },
    )
    .await;
    assert!(two.epoch > 0);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_node_stays_silent_for_the_restart_wait() {
    let both = [Protocol::Flease, Protocol::PaxosLease];
    let mut c = fast(3).await;
    c.leader().await;
    eventually(Duration::from_secs(20), "flease answers", || async {
        c.client_of(1)
            .flease_acquire("r", "x")
            .await
            .ok()
            .filter(|v| v.granted == Some(true))
    })
    .await;
    c.stop(3).await;
    c.restart(3).await;
    let restarted = c.nodes[&3].flease();
    for p in both {
        assert!(
            restarted.stats(p).3,
            "the restarted {p:?} acceptor answers at once"
        );
    }
    // Its acceptors ignore a read while they wait.
    let read = leasecore::domain::flease::Envelope {
        proto: Protocol::Flease,
        resource: "r".into(),
        from: 1,
        to: 3,
        sent_at: leasecore::domain::types::WallMillis(now_ms()),
        body: leasecore::domain::flease::Msg::Read {
            k: leasecore::domain::flease::Ballot {
                era: u64::MAX / 2,
                counter: 0,
                boot: 0,
                node: 1,
            },
        },
    };
    let paxos_read = leasecore::domain::flease::Envelope {
        proto: Protocol::PaxosLease,
        ..read.clone()
    };
    assert_eq!(
        restarted.on_peer_batch(&[read.clone(), paxos_read.clone()]),
        vec![None, None]
    );
    // ... and answer once the wait is over.
    eventually(Duration::from_secs(10), "the wait ends", || async {
        both.iter().all(|p| !restarted.stats(*p).3).then_some(())
    })
    .await;
    let fresh = leasecore::domain::flease::Envelope {
        sent_at: leasecore::domain::types::WallMillis(now_ms()),
        ..read
    };
    let answers = restarted.on_peer_batch(&[fresh, paxos_read]);
    assert!(answers.iter().all(|a| a.is_some()), "{answers:?}");
    c.shutdown().await;
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}
