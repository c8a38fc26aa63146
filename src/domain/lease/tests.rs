//! The tracker against the protocol: the promote condition, deadlines and refreshes, expiry and
//! its retries, demotion, checkpoints and their clears, aging by the lease clock, back-to-back
//! failovers, and the clock ticks.
//!
//! # Invariants
//! - Time is passed in, never read: each test drives the tracker with explicit monotonic
//!   readings, and a lease log is a real `KvState` changed through `apply`.
//!
//! # What it must not do
//! Set the tracker's fields directly: a state the driver cannot reach proves nothing.

use super::*;
use crate::domain::command::Command;

const CFG: TrackerConfig = TrackerConfig {
    promote_extension_ms: 1000,
    retry_ms: 500,
    checkpoints: false,
    clock_tick_ms: 0,
};

fn facts(name: &str, ttl: u64) -> LeaseFacts {
    LeaseFacts {
        name: name.into(),
        revision: Revision(1),
        ttl_ms: ttl,
        checkpoint_ms: None,
        checkpoint_clock_ms: None,
    }
}

/// A lease clock reading of `value` applied at local time `seen_at`.
fn clock(value: u64, seen_at: u64) -> ClockReading {
    ClockReading {
        value,
        seen_at: MonoMillis(seen_at),
    }
}

fn names(v: Vec<Expired>) -> Vec<String> {
    v.into_iter().map(|e| e.name).collect()
}

fn primary() -> LeaseTracker {
    let mut t = LeaseTracker::new(CFG);
    t.promote(MonoMillis(0), clock(0, 0), []);
    t
}

#[test]
fn tracking_starts_only_after_applying_an_entry_of_the_own_term() {
    assert!(!should_track(false, 3, 3));
    assert!(!should_track(true, 3, 2));
    assert!(should_track(true, 3, 3));
}

#[test]
fn expires_exactly_at_the_deadline_and_not_a_millisecond_before() {
    let mut t = primary();
    t.on_registered("a", Revision(1), 3000, MonoMillis(100), false);
    assert!(t.expired(MonoMillis(3099), 10).is_empty());
    assert_eq!(names(t.expired(MonoMillis(3100), 10)), ["a"]);
}

#[test]
fn promote_gives_ttl_plus_extension_then_retries_until_removed() {
    let mut t = LeaseTracker::new(TrackerConfig {
        checkpoints: true,
        ..CFG
    });
    t.promote(MonoMillis(0), clock(0, 0), [facts("a", 3000)]);
    // The deadline is recorded at once (ttl + 0.1% drift margin + extension)...
    assert_eq!(t.next_wakeup(), Some(MonoMillis(0)));
    let due = t.checkpoints_due(MonoMillis(0), 10);
    assert_eq!(
        (due.len(), due[0].remaining_ms, due[0].clock_ms),
        (1, 4003, 0)
    );
    // ... once: aging keeps it exact, until a refresh.
    assert_eq!(t.next_wakeup(), Some(MonoMillis(4003)));
    assert!(t.expired(MonoMillis(4002), 10).is_empty());
    assert_eq!(names(t.expired(MonoMillis(4003), 10)), ["a"]);
    // Re-armed for a retry, not before.
    assert!(t.expired(MonoMillis(4502), 10).is_empty());
    assert_eq!(names(t.expired(MonoMillis(4503), 10)), ["a"]);
    t.on_removed("a");
    assert!(t.expired(MonoMillis(99_999), 10).is_empty());
    assert_eq!(t.next_wakeup(), None);
}

#[test]
fn refresh_moves_the_deadline() {
    let mut t = primary();
    t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
    let r = t.refresh("a", MonoMillis(800)).unwrap();
    assert_eq!((r.ttl_ms, r.clear), (1000, None));
    assert!(t.expired(MonoMillis(1799), 10).is_empty());
    assert_eq!(t.remaining("a", MonoMillis(1000)), Some(800));
    assert_eq!(names(t.expired(MonoMillis(1800), 10)), ["a"]);
}

#[test]
fn a_lease_decided_to_expire_refuses_refresh() {
    let mut t = primary();
    t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
    assert_eq!(names(t.expired(MonoMillis(1000), 10)), ["a"]);
    assert_eq!(
        t.refresh("a", MonoMillis(1001)),
        Err(RefreshError::NotFound)
    );
    assert_eq!(t.remaining("a", MonoMillis(1001)), Some(0));
}

#[test]
fn demote_clears_everything_and_followers_track_nothing() {
    let mut t = primary();
    t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
    t.demote();
    assert_eq!(t.refresh("a", MonoMillis(1)), Err(RefreshError::NotPrimary));
    assert!(t.expired(MonoMillis(99_999), 10).is_empty());
    assert_eq!(t.next_wakeup(), None);
    // A follower ignores registrations.
    t.on_registered("b", Revision(2), 1000, MonoMillis(0), false);
    assert!(t.is_empty());
}

#[test]
fn next_wakeup_follows_earlier_registrations() {
    let mut t = primary();
    t.on_registered("slow", Revision(1), 10_000, MonoMillis(0), false);
    assert_eq!(t.next_wakeup(), Some(MonoMillis(10_000)));
    t.on_registered("fast", Revision(2), 2_000, MonoMillis(100), false);
    assert_eq!(t.next_wakeup(), Some(MonoMillis(2_100)));
    t.on_removed("fast");
    assert_eq!(t.next_wakeup(), Some(MonoMillis(10_000)));
}

#[test]
fn unknown_leases_and_limits() {
    let mut t = primary();
    assert_eq!(
        t.refresh("nope", MonoMillis(0)),
        Err(RefreshError::NotFound)
    );
    for i in 0..5 {
        t.on_registered(&format!("l{i}"), Revision(i), 100, MonoMillis(0), false);
    }
    assert_eq!(t.expired(MonoMillis(100), 3).len(), 3);
    assert_eq!(t.expired(MonoMillis(100), 3).len(), 2);
}

#[test]
fn registration_is_idempotent_per_revision_and_replaced_by_a_new_one() {
    let mut t = primary();
    t.on_registered("a", Revision(1), 1000, MonoMillis(0), false);
    t.on_registered("a", Revision(1), 1000, MonoMillis(500), false);
    assert_eq!(t.remaining("a", MonoMillis(0)), Some(1000));
    t.on_registered("a", Revision(7), 1000, MonoMillis(500), false);
    let e = t.expired(MonoMillis(1500), 10);
    assert_eq!(
        (e[0].revision, e[0].deadline),
        (Revision(7), MonoMillis(1500))
    );
}

#[test]
fn checkpoints_bound_promote_and_a_refresh_must_clear_them() {
    let cfg = TrackerConfig {
        checkpoints: true,
        ..CFG
    };
    let mut t = LeaseTracker::new(cfg);
    t.promote(MonoMillis(0), clock(0, 0), []);
    t.on_registered("long", Revision(3), 10_000, MonoMillis(0), false);
    t.on_registered("short", Revision(4), 3_000, MonoMillis(0), false);
    assert_eq!(t.next_wakeup(), Some(MonoMillis(1500)));
    // A healthy client (refreshing at a third of the TTL) is never idle: no checkpoint, no
    // log write.
    for at in [1000, 2000, 3000, 4000, 4900] {
        assert_eq!(t.refresh("short", MonoMillis(at)).unwrap().clear, None);
        assert!(t.checkpoints_due(MonoMillis(at), 10).is_empty());
    }
    // An idle one (half its TTL without refresh) is checkpointed once.
    let due = t.checkpoints_due(MonoMillis(5000), 10);
    assert_eq!(
        due,
        vec![Checkpoint {
            name: "long".into(),
            revision: Revision(3),
            remaining_ms: 5000,
            clock_ms: 5000,
        }]
    );
    assert!(t.checkpoints_due(MonoMillis(5400), 10).is_empty());
    // A refresh after that decision carries a ticket; until it is cleared, every refresh does.
    let r = t.refresh("long", MonoMillis(5500)).unwrap();
    let ticket = r.clear.expect("must clear the checkpoint");
    assert_eq!(ticket.seq, 1);
    assert!(t.refresh("long", MonoMillis(5600)).unwrap().clear.is_some());
    // A checkpoint decided after the ticket is not cleared by it.
    let due = t.checkpoints_due(MonoMillis(10_600), 10);
    assert!(due.iter().any(|c| c.name == "long"), "{due:?}");
    t.on_cleared(&ticket);
    assert_eq!(
        t.refresh("long", MonoMillis(10_700))
            .unwrap()
            .clear
            .map(|c| c.seq),
        Some(2)
    );
    t.on_cleared(&ClearTicket { seq: 2, ..ticket });
    assert_eq!(t.refresh("long", MonoMillis(10_800)).unwrap().clear, None);

    // A new leader promotes a checkpointed lease with remaining + extension, and the first
    // refresh after promote must clear the checkpoint.
    let mut next = LeaseTracker::new(cfg);
    next.promote(
        MonoMillis(50_000),
        clock(0, 50_000),
        [LeaseFacts {
            name: "long".into(),
            revision: Revision(3),
            ttl_ms: 10_000,
            checkpoint_ms: Some(4_000),
            checkpoint_clock_ms: None,
        }],
    );
    assert_eq!(next.remaining("long", MonoMillis(50_000)), Some(5_004));
    assert!(
        next.refresh("long", MonoMillis(50_001))
            .unwrap()
            .clear
            .is_some()
    );
}

#[test]
fn a_new_leader_ages_a_checkpoint_by_the_lease_clock() {
    let cfg = TrackerConfig {
        checkpoints: true,
        ..CFG
    };
    // Stamped at clock 10_000 with 3_000 left. This node applied clock 12_000 at its local
    // 500 and promotes at its local 1_000: the clock reads 12_500, so 500 ms are left.
    let mut t = LeaseTracker::new(cfg);
    t.promote(
        MonoMillis(1_000),
        clock(12_000, 500),
        [LeaseFacts {
            checkpoint_ms: Some(3_000),
            checkpoint_clock_ms: Some(10_000),
            ..facts("a", 5_000)
        }],
    );
    assert_eq!(t.remaining("a", MonoMillis(1_000)), Some(500));
    assert_eq!(t.clock_at(MonoMillis(1_600)), 13_100);
    // A checkpoint in force is not re-recorded at promote (aging keeps it exact).
    assert!(t.checkpoints_due(MonoMillis(1_000), 10).is_empty());
    // Fully aged: nothing left (and no underflow).
    let mut t = LeaseTracker::new(cfg);
    t.promote(
        MonoMillis(0),
        clock(99_000, 0),
        [LeaseFacts {
            checkpoint_ms: Some(3_000),
            checkpoint_clock_ms: Some(10_000),
            ..facts("a", 5_000)
        }],
    );
    assert_eq!(t.remaining("a", MonoMillis(0)), Some(0));
}

#[test]
fn back_to_back_failovers_do_not_extend_an_abandoned_lease() {
    // Leaders change every 900 ms of true time, each promoting 300 ms after the previous
    // one applied its checkpoints. The lease is never refreshed: without the promote
    // checkpoint and the clock, each leader would grant the full TTL again.
    let cfg = TrackerConfig {
        checkpoints: true,
        ..CFG
    };
    let mut log = crate::domain::kv::KvState::new();
    log.apply(&Command::RegisterLease {
        name: "a".into(),
        ttl_ms: 3_000,
        clock_ms: None,
    });
    let mut now = 0u64; // true time; every node's monotonic clock reads it + its offset
    let mut seen = clock(0, 0);
    let mut gone_at = None;
    for round in 0..20u64 {
        let offset = round * 7_777;
        let local = |t: u64| MonoMillis(t + offset);
        let mut t = LeaseTracker::new(cfg);
        // This node saw the latest stamp when it was applied (true time seen.seen_at).
        let reading = clock(seen.value, seen.seen_at.0 + offset);
        t.promote(local(now), reading, log.lease_facts());
        let due = t.checkpoints_due(local(now), 10);
        if !due.is_empty() {
            log.apply(&checkpoint_command(due));
            seen = clock(log.lease_clock_ms(), now);
        }
        let end = now + 900;
        while now < end {
            now += 10;
            let expired = t.expired(local(now), 10);
            if !expired.is_empty() {
                log.apply(&expire_command(&expired));
                gone_at.get_or_insert(now);
            }
        }
        if gone_at.is_some() {
            break;
        }
        now += 300; // the election
    }
    let gone_at = gone_at.expect("the abandoned lease was never expired");
    // Abandoned at 0 with ttl 3 s: one extension, one drift margin and the elections it
    // could not see are all it may add.
    assert!(gone_at >= 3_000, "expired early, at {gone_at}");
    assert!(
        gone_at <= 3_000 + 1_000 + 3 + 300 + 20,
        "expired at {gone_at}"
    );
}

#[test]
fn a_stamped_registration_is_a_checkpoint() {
    let cfg = TrackerConfig {
        checkpoints: true,
        ..CFG
    };
    let mut log = crate::domain::kv::KvState::new();
    let mut t = LeaseTracker::new(cfg);
    t.promote(MonoMillis(0), clock(0, 0), []);
    let stamp = t.clock_at(MonoMillis(400));
    let out = log.apply(&Command::RegisterLease {
        name: "a".into(),
        ttl_ms: 3000,
        clock_ms: Some(stamp),
    });
    assert_eq!(log.lease_clock_ms(), 400);
    let crate::domain::command::LeaseChange::Registered { checkpointed, .. } = out.lease_changes[0]
    else {
        panic!("not a registration")
    };
    assert!(checkpointed);
    t.on_registered("a", Revision(1), 3000, MonoMillis(450), checkpointed);
    // Nothing to record: the registration is the checkpoint...
    assert!(t.checkpoints_due(MonoMillis(10_000), 10).is_empty());
    // ... and the first refresh must clear it before it is acknowledged.
    assert!(t.refresh("a", MonoMillis(1000)).unwrap().clear.is_some());
    // A leader that never saw a refresh ages it from the stamp: 3000 ms from clock 400.
    let mut next = LeaseTracker::new(cfg);
    next.promote(MonoMillis(77), clock(400, 50), log.lease_facts());
    assert_eq!(next.remaining("a", MonoMillis(77)), Some(3000 - 27 + 2));
}

#[test]
fn the_leader_ticks_its_clock_into_the_log_only_while_a_checkpoint_is_in_force() {
    let mut t = LeaseTracker::new(TrackerConfig {
        checkpoints: true,
        clock_tick_ms: 500,
        ..CFG
    });
    t.promote(MonoMillis(0), clock(100, 0), []);
    // Nothing to age: no tick, and the next look is a tick later.
    assert_eq!(t.clock_tick_due(MonoMillis(0)), None);
    // A stamped registration is a checkpoint in force; its stamp counts as a tick.
    let stamp = t.stamp(MonoMillis(200));
    assert_eq!(stamp, 300);
    t.on_registered("a", Revision(1), 3000, MonoMillis(210), true);
    assert_eq!(t.next_wakeup(), Some(MonoMillis(700)));
    assert_eq!(t.clock_tick_due(MonoMillis(699)), None);
    assert_eq!(t.clock_tick_due(MonoMillis(700)), Some(800));
    assert_eq!(t.clock_tick_due(MonoMillis(1100)), None);
    assert_eq!(t.clock_tick_due(MonoMillis(1200)), Some(1300));
    // The client refreshes and the clear commits: nothing in force, no more ticks.
    let ticket = t.refresh("a", MonoMillis(1300)).unwrap().clear.unwrap();
    t.on_cleared(&ticket);
    assert_eq!(t.clock_tick_due(MonoMillis(5000)), None);
    // A follower never ticks.
    t.demote();
    assert_eq!(t.clock_tick_due(MonoMillis(9000)), None);
}
