//! End-to-end leases on a 3-node cluster over loopback HTTP.
#![allow(clippy::disallowed_methods)] // tests measure real time against real deadlines

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestCluster, eventually};
use leasecore::client::{Client, LeaseKeeper};

/// The shortest TTL with the default timings (1.5 x the 1000 ms election timeout).
const TTL_MS: u64 = 1500;
/// A TTL whose refresh period (1 s) leaves room for an election.
const KEPT_TTL_MS: u64 = 3000;
/// The election timeout (the promote extension).
const ELECTION_MS: u64 = 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refreshed_lease_lives_and_an_abandoned_one_expires_on_time() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = Arc::new(c.client());

    // One lease kept alive by a keeper (refresh every ttl/3), one abandoned after one refresh.
    // The kept one is long enough for the keeper's own view to ride out an election that a
    // loaded test machine may cause (the server side would keep it regardless).
    let keeper = LeaseKeeper::start(client.clone(), "alive", KEPT_TTL_MS, false)
        .await
        .unwrap();
    client
        .put("alive/k", "v", Some("alive"), None)
        .await
        .unwrap();
    client.grant("dead", TTL_MS).await.unwrap();
    client.put("dead/k", "v", Some("dead"), None).await.unwrap();
    let term_before = c.nodes[&c.leader().await].consensus().cluster_view().term;
    let last_send = Instant::now();
    client.refresh("dead", None).await.unwrap();

    // Watch the abandoned key from a follower's applied state, every 10 ms, once the follower
    // has applied its creation (on a loaded machine a follower may lag: a key it has not yet
    // applied is not a key that was deleted).
    let observer = c.client_of(c.leader().await % 3 + 1);
    eventually(
        Duration::from_secs(10),
        "the follower applies the key",
        || async { observer.get("dead/k", true).await.unwrap().map(|_| ()) },
    )
    .await;
    let gone_at = eventually(
        Duration::from_secs(10),
        "the abandoned key is deleted",
        || async {
            let present = observer.get("dead/k", true).await.unwrap().is_some();
            (!present).then(Instant::now)
        },
    )
    .await;
    let after = gone_at.duration_since(last_send);
    assert!(
        after >= Duration::from_millis(TTL_MS),
        "deleted {after:?} after the last acknowledged refresh was sent: before its ttl"
    );
    // Without a leader change the leader expires it on time; a leader change in between (a
    // loaded machine) legitimately extends it by the new leader's promote.
    let leader = c.leader().await;
    if c.nodes[&leader].consensus().cluster_view().term == term_before {
        assert!(
            after <= Duration::from_millis(TTL_MS + ELECTION_MS + 500),
            "deleted only {after:?} after the last refresh"
        );
    }
    assert!(client.lease("dead").await.unwrap().is_none());

    // The kept lease and its key live on for 10 x ttl.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(10 * KEPT_TTL_MS) {
        assert!(
            keeper.is_valid(),
            "the keeper lost its lease: {:?}",
            keeper.status()
        );
        assert!(client.get("alive/k", false).await.unwrap().is_some());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let info = client.lease("alive").await.unwrap().unwrap();
    assert_eq!(info.keys, ["alive/k"]);
    assert!(info.remaining_ms.unwrap() <= KEPT_TTL_MS + ELECTION_MS);
    keeper.stop(true).await.unwrap();
    assert!(client.get("alive/k", false).await.unwrap().is_none());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicate_registrations_have_exactly_one_winner() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let mut tasks = Vec::new();
    for i in 0..9u64 {
        let client = c.client_of(i % 3 + 1);
        tasks.push(tokio::spawn(async move {
            client.grant("contested", 5000).await
        }));
    }
    let mut granted = 0;
    let mut exists = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => granted += 1,
            Err(e) if e.code() == Some("lease_exists") => exists += 1,
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!((granted, exists), (1, 8));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn attach_detach_revoke_and_inspect() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = c.client();
    // Attaching to a lease that does not exist is refused, and writes nothing.
    let err = client.put("k", "v", Some("ghost"), None).await.unwrap_err();
    assert_eq!(err.code(), Some("lease_not_found"));
    assert!(client.get("k", false).await.unwrap().is_none());

    let granted = client.grant("l", 60_000).await.unwrap();
    assert!(granted.revision.0 > 0);
    for k in ["l/b", "l/a", "l/c"] {
        client.put(k, "v", Some("l"), None).await.unwrap();
    }
    // Re-putting without a lease detaches.
    client.put("l/c", "free", None, None).await.unwrap();
    let info = c.client_of(2).lease("l").await.unwrap().unwrap();
    assert_eq!(info.keys, ["l/a", "l/b"]);
    assert_eq!(info.revision, granted.revision);
    assert!(info.remaining_ms.is_some_and(|r| r > 50_000));
    let listed = c.client_of(3).leases("", None).await.unwrap();
    assert_eq!(listed.leases.len(), 1);

    // A TTL out of bounds is refused.
    // The longest is etcd's, 9,000,000,000 s.
    for ttl in [0, 10, 9_000_000_000 * 1000 + 1] {
        let e = client.grant("bad", ttl).await.unwrap_err();
        assert_eq!(e.code(), Some("invalid_argument"), "ttl {ttl}");
    }

    let revoked = client.revoke("l").await.unwrap();
    assert_eq!(revoked.deleted_keys, ["l/a", "l/b"]);
    assert!(client.get("l/a", false).await.unwrap().is_none());
    assert!(client.get("l/c", false).await.unwrap().is_some());
    assert_eq!(
        client.refresh("l", None).await.unwrap_err().code(),
        Some("lease_not_found")
    );
    assert_eq!(
        client.revoke("l").await.unwrap_err().code(),
        Some("lease_not_found")
    );
    // Names with a slash travel percent-encoded.
    client.grant("members/7", 60_000).await.unwrap();
    client.refresh("members/7", None).await.unwrap();
    assert!(client.lease("members/7").await.unwrap().is_some());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refreshed_lease_survives_a_leader_kill_and_an_abandoned_one_expires() {
    // Long enough to ride out a failover (about 2 s) between two refreshes.
    const TTL: u64 = 5000;
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let client = Arc::new(c.client());
    let keeper = LeaseKeeper::start(client.clone(), "kept", TTL, false)
        .await
        .unwrap();
    client.put("kept/k", "v", Some("kept"), None).await.unwrap();
    client.grant("orphan", TTL).await.unwrap();
    client
        .put("orphan/k", "v", Some("orphan"), None)
        .await
        .unwrap();

    c.stop(leader).await;
    let new_leader = c.leader().await;
    assert_ne!(new_leader, leader);
    // The survivors' client: the killed node is gone.
    let survivors = c.client();

    eventually(
        Duration::from_secs(20),
        "the orphan expires on the new leader",
        || async {
            survivors
                .get("orphan/k", false)
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    // The kept lease has outlived the orphan; it keeps living for a few more TTLs.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(2 * TTL) {
        assert!(survivors.get("kept/k", false).await.unwrap().is_some());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(keeper.is_valid(), "{:?}", keeper.status());
    keeper.stop(false).await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partitioned_old_leader_cannot_acknowledge_a_refresh() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    c.client().grant("l", 60_000).await.unwrap();
    // Before the partition the leader acknowledges.
    let direct = Client::with_timeout(&[c.url(leader)], Duration::from_secs(2)).unwrap();
    direct.refresh("l", None).await.unwrap();

    c.partition(leader);
    // The old leader still believes it leads, but cannot confirm it with a quorum.
    let refused = direct.refresh("l", None).await;
    assert!(
        refused.is_err(),
        "a partitioned leader acknowledged a refresh"
    );

    // The majority elects a new leader, which serves the lease.
    let others: Vec<String> = [1u64, 2, 3]
        .into_iter()
        .filter(|id| *id != leader)
        .map(|id| c.url(id))
        .collect();
    let majority = Client::new(&others).unwrap();
    eventually(
        Duration::from_secs(20),
        "the majority refreshes the lease",
        || async { majority.refresh("l", None).await.ok() },
    )
    .await;
    c.heal();
    c.shutdown().await;
}

/// Issue 10, item 4: an isolated leader still believes it leads but does not know leases the
/// new leader registered. It must never answer "not found" for them: only a leader of the
/// current term that confirmed it with a quorum may say a lease does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_isolated_old_leader_never_answers_not_found_for_a_live_lease() {
    let c = TestCluster::start(3).await;
    let old = c.leader().await;
    c.partition(old);
    let others: Vec<String> = [1u64, 2, 3]
        .into_iter()
        .filter(|id| *id != old)
        .map(|id| c.url(id))
        .collect();
    let majority = Client::new(&others).unwrap();
    eventually(
        Duration::from_secs(20),
        "the majority registers a lease",
        || async { majority.grant("fresh", 60_000).await.ok() },
    )
    .await;
    let direct = Client::with_timeout(&[c.url(old)], Duration::from_secs(15)).unwrap();
    for _ in 0..3 {
        let answer = direct.refresh("fresh", None).await;
        let err = answer.expect_err("an isolated node acknowledged a refresh");
        assert_ne!(
            err.code(),
            Some("lease_not_found"),
            "an isolated old leader denied a live lease: {err}"
        );
        assert_ne!(err.status(), Some(404), "{err}");
    }
    // The lease info through the old leader must not claim the lease is unknown either.
    let info = direct.lease("fresh").await;
    assert!(
        !matches!(info, Ok(None)),
        "an isolated old leader said the lease does not exist"
    );
    c.heal();
    c.shutdown().await;
}

/// Issue 10, item 6: the number of leases is capped; past the cap a registration (lease or
/// member) gets 429 `too_many_leases`, and removing one makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registrations_past_the_lease_cap_get_a_clear_429() {
    let c = TestCluster::start_tweaked(3, |cfg| cfg.limits.max_leases = 3).await;
    c.leader().await;
    let client = c.client();
    for i in 0..3 {
        client.grant(&format!("l{i}"), 60_000).await.unwrap();
    }
    // Every node refuses once its applied state holds the cap.
    eventually(
        Duration::from_secs(10),
        "every node applies 3 leases",
        || async {
            c.nodes
                .values()
                .all(|n| n.consensus().view().with_state(|kv| kv.leases().len()) == 3)
                .then_some(())
        },
    )
    .await;
    for id in [1u64, 2, 3] {
        let one = c.client_of(id);
        let refused = one
            .grant("extra", 60_000)
            .await
            .expect_err("a registration past the cap");
        assert_eq!(refused.status(), Some(429), "{refused}");
        assert_eq!(refused.code(), Some("too_many_leases"), "{refused}");
        let member = one
            .register_member("m1", "127.0.0.1:1", 60_000, Default::default())
            .await
            .expect_err("a member registration past the cap");
        assert_eq!(member.status(), Some(429), "{member}");
    }
    client.revoke("l0").await.unwrap();
    eventually(Duration::from_secs(10), "room again", || async {
        client.grant("extra", 60_000).await.ok()
    })
    .await;
    c.shutdown().await;
}

/// Issue 10, item 5: a registration accepted by a new leader before it tracks leases carried no
/// lease clock stamp, so the next leader granted it its whole TTL again from its own promote
/// (an abandoned lease outlived its TTL by a failover more). Every registration applied, also
/// those racing a failover, carries its stamp.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registrations_racing_a_failover_all_carry_the_lease_clock_stamp() {
    let mut c = TestCluster::start(3).await;
    let old = c.leader().await;
    let stop = tokio_util::sync::CancellationToken::new();
    let endpoints: Vec<String> = c.addrs.values().map(|a| format!("http://{a}")).collect();
    let mut writers = Vec::new();
    for w in 0..8 {
        let (stop, client) = (
            stop.clone(),
            Client::with_timeout(&endpoints, Duration::from_secs(2)).unwrap(),
        );
        writers.push(tokio::spawn(async move {
            let mut n = 0u32;
            while !stop.is_cancelled() {
                // Failures (no leader, the old leader stopping) are part of the race.
                let _ = client.grant(&format!("race-{w}-{n}"), 60_000).await;
                n += 1;
            }
        }));
    }
    c.stop(old).await;
    let new = c.leader().await;
    // Keep registering well into the new leader's term.
    let target = c.nodes[&new]
        .consensus()
        .view()
        .with_state(|kv| kv.leases().len())
        + 200;
    eventually(
        Duration::from_secs(30),
        "registrations under the new leader",
        || async {
            (c.nodes[&new]
                .consensus()
                .view()
                .with_state(|kv| kv.leases().len())
                >= target)
                .then_some(())
        },
    )
    .await;
    stop.cancel();
    for w in writers {
        w.await.unwrap();
    }
    let unstamped: Vec<String> = c.nodes[&new].consensus().view().with_state(|kv| {
        kv.lease_facts()
            .into_iter()
            .filter(|f| f.checkpoint_clock_ms.is_none())
            .map(|f| f.name)
            .collect()
    });
    assert!(
        unstamped.is_empty(),
        "registered without a stamp: {unstamped:?}"
    );
    c.shutdown().await;
}

/// A fresh single-node cluster registers a lease with no write before it. The lease driver
/// once read openraft's full metrics after waking on its server metrics, which openraft sends
/// first: it could see "not leader", sleep through its own promotion, and refuse every lease
/// with `no_leader` until some other write applied (every start of the binary here; an
/// in-process cluster hit it only sometimes, so this runs the binary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_single_node_binary_grants_a_lease_at_once() {
    let http = reqwest::Client::new();
    for run in 0..3 {
        let tmp = tempfile::tempdir().unwrap();
        let addr = common::free_node_addrs(1).remove(0);
        let mut node = std::process::Command::new(env!("CARGO_BIN_EXE_leasecore"))
            .args(["serve", "--listen", &addr])
            .arg("--data")
            .arg(tmp.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://{addr}");
        eventually(Duration::from_secs(30), "ready", || async {
            let r = http.get(format!("{url}/readyz")).send().await.ok()?;
            r.status().is_success().then_some(())
        })
        .await;
        let client = Client::with_timeout(&[url.as_str()], Duration::from_secs(5)).unwrap();
        let granted = client.grant("first", 60_000).await;
        node.kill().unwrap();
        node.wait().unwrap();
        assert!(granted.is_ok(), "run {run}: {granted:?}");
    }
}
