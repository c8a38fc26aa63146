//! The proposer's rounds against real acceptors: grants and renewals, busy and in-doubt
//! resources, NACKs and quorum accounting, releases (full and fast), and PaxosLease's
//! timespans and epochs.
//!
//! # Invariants
//! - Every round runs against [`Acceptor`]s through their messages, as the shell delivers them,
//!   on the test clock (`test_at`).
//!
//! # What it must not do
//! Set a round's or an acceptor's fields directly: a state no message sequence can reach proves
//! nothing.

use super::*;
use crate::domain::flease::Acceptor;

const CFG: FleaseConfig = super::super::TEST_CONFIG;

use crate::domain::flease::test_at as at;

fn k(node: NodeId, counter: u32) -> Ballot {
    Ballot {
        era: 1,
        counter,
        boot: 0,
        node,
    }
}

/// Three acceptors past their restart wait.
fn acceptors() -> Vec<Acceptor> {
    (1..=3).map(|i| Acceptor::new(i, CFG, at(0))).collect()
}

/// Deliver `msgs` to the acceptors in `order` and the replies to the round, in order.
fn run(round: &mut Round, acc: &mut [Acceptor], msgs: Vec<Envelope>, t: u64) -> RoundEvent {
    let mut pending = msgs;
    loop {
        let mut next = Vec::new();
        for m in pending {
            let reply = acc[(m.to - 1) as usize].on_message(&m, at(t));
            if let Some(r) = reply {
                match round.on_reply(&r, at(t)) {
                    RoundEvent::Send(more) => next.extend(more),
                    RoundEvent::Pending => {}
                    done => return done,
                }
            }
        }
        if next.is_empty() {
            return RoundEvent::Pending;
        }
        pending = next;
    }
}

fn acquire(acc: &mut [Acceptor], node: NodeId, owner: &str, ballot: Ballot, t: u64) -> RoundEvent {
    let (mut r, msgs) = Round::start(node, "r", owner, &[1, 2, 3], ballot, CFG, at(t));
    run(&mut r, acc, msgs, t)
}

#[test]
fn an_uncontended_acquire_is_granted_and_renewal_keeps_the_epoch() {
    let mut acc = acceptors();
    let RoundEvent::Granted(g) = acquire(&mut acc, 1, "alice", k(1, 1), 3000) else {
        panic!("not granted")
    };
    assert_eq!(g.expires, WallMillis(5000));
    assert_eq!(g.valid_until, MonoMillis(3000 + 2000 - 50));
    assert_eq!(g.epoch, 3_000_000);
    // The holder renews through another node: same epoch, later expiry.
    let RoundEvent::Granted(r) = acquire(&mut acc, 2, "alice", k(2, 2), 4000) else {
        panic!("not renewed")
    };
    assert_eq!((r.epoch, r.expires), (g.epoch, WallMillis(6000)));
    assert!(r.renewal && !g.renewal);
}

#[test]
fn a_held_lease_is_written_back_and_reported_busy() {
    let mut acc = acceptors();
    acquire(&mut acc, 1, "alice", k(1, 1), 3000);
    assert_eq!(
        acquire(&mut acc, 2, "bob", k(2, 2), 3500),
        RoundEvent::Busy {
            owner: "alice".into(),
            expires: WallMillis(5000),
            epoch: 3_000_000
        }
    );
}

#[test]
fn the_doubt_window_waits_and_then_a_new_epoch_is_granted() {
    let mut acc = acceptors();
    acquire(&mut acc, 1, "alice", k(1, 1), 3000); // expires at 5000
    for t in [5000, 5050] {
        assert!(matches!(
            acquire(&mut acc, 2, "bob", k(2, t as u32), t),
            RoundEvent::Retry {
                why: RetryWhy::InDoubt,
                not_before: Some(WallMillis(5051)),
                ..
            }
        ));
    }
    let RoundEvent::Granted(g) = acquire(&mut acc, 2, "bob", k(2, 9000), 5051) else {
        panic!("not granted after the doubt window")
    };
    assert!(g.epoch > 3_000_000);
}

#[test]
fn a_single_nack_aborts_whatever_the_arrival_order() {
    // Acceptor 3 promised a higher ballot; acceptors 1 and 2 would acknowledge.
    for nack_first in [true, false] {
        let mut acc = acceptors();
        let high = Envelope {
            proto: Protocol::Flease,
            resource: "r".into(),
            from: 2,
            to: 3,
            sent_at: WallMillis(3000),
            body: Msg::Read { k: k(2, 50) },
        };
        acc[2].on_message(&high, at(3000));
        let (mut round, msgs) = Round::start(1, "r", "alice", &[1, 2, 3], k(1, 1), CFG, at(3000));
        let mut replies: Vec<Envelope> = msgs
            .iter()
            .filter_map(|m| acc[(m.to - 1) as usize].on_message(m, at(3000)))
            .collect();
        if nack_first {
            replies.reverse();
        }
        // Deliver only the NACK and one ACK: no quorum of ACKs, and the NACK aborts.
        let mut outcome = RoundEvent::Pending;
        for r in replies.iter().filter(|r| r.from != 2) {
            match round.on_reply(r, at(3000)) {
                RoundEvent::Pending => {}
                e => {
                    outcome = e;
                    break;
                }
            }
        }
        assert!(
            matches!(outcome, RoundEvent::Retry { why: RetryWhy::Nack, seen, .. } if seen == k(2, 50)),
            "nack_first={nack_first}: {outcome:?}"
        );
        // Late replies to a finished round change nothing.
        assert_eq!(round.on_reply(&replies[0], at(3000)), RoundEvent::Pending);
    }
}

#[test]
fn duplicate_and_foreign_acks_do_not_make_a_quorum() {
    let mut acc = acceptors();
    let (mut round, msgs) = Round::start(1, "r", "alice", &[1, 2, 3], k(1, 1), CFG, at(3000));
    let ack = acc[0].on_message(&msgs[0], at(3000)).unwrap();
    assert_eq!(round.on_reply(&ack, at(3000)), RoundEvent::Pending);
    assert_eq!(round.on_reply(&ack, at(3000)), RoundEvent::Pending);
    let foreign = Envelope {
        from: 7,
        ..ack.clone()
    };
    assert_eq!(round.on_reply(&foreign, at(3000)), RoundEvent::Pending);
    // The deadline passes: retry.
    assert!(matches!(
        round.on_timeout(at(3100)),
        RoundEvent::Retry {
            why: RetryWhy::Timeout,
            ..
        }
    ));
}

#[test]
fn release_frees_the_owners_lease_for_the_next_owner_at_once() {
    let mut acc = acceptors();
    let RoundEvent::Granted(g) = acquire(&mut acc, 1, "alice", k(1, 1), 3000) else {
        panic!("not granted")
    };
    let release = |acc: &mut [Acceptor], owner: &str, b: Ballot| {
        let (mut r, msgs) = Round::start_in(
            Protocol::Flease,
            Intent::Release,
            2,
            "r",
            owner,
            &[1, 2, 3],
            b,
            CFG,
            at(3100),
        );
        run(&mut r, acc, msgs, 3100)
    };
    // Someone else cannot release alice's lease.
    assert_eq!(release(&mut acc, "bob", k(2, 2)), RoundEvent::NotHeld);
    assert_eq!(
        release(&mut acc, "alice", k(2, 3)),
        RoundEvent::Released { epoch: g.epoch }
    );
    // Bob acquires long before alice's lease would have expired, with a higher epoch.
    let RoundEvent::Granted(b) = acquire(&mut acc, 3, "bob", k(3, 4), 3200) else {
        panic!("not granted after release")
    };
    assert!(b.epoch > g.epoch);
}

#[test]
fn renewing_too_close_to_expiry_lets_it_lapse() {
    let mut acc = acceptors();
    acquire(&mut acc, 1, "alice", k(1, 1), 3000); // expires at 5000
    assert!(matches!(
        acquire(&mut acc, 1, "alice", k(1, 2), 4800),
        RoundEvent::Retry {
            why: RetryWhy::TooLate,
            ..
        }
    ));
}

/// Three PaxosLease acceptors past their restart wait.
fn paxos_acceptors() -> Vec<Acceptor> {
    (1..=3)
        .map(|i| Acceptor::for_protocol(Protocol::PaxosLease, i, CFG, at(0)))
        .collect()
}

fn paxos(
    acc: &mut [Acceptor],
    intent: Intent,
    node: NodeId,
    owner: &str,
    ballot: Ballot,
    t: u64,
) -> RoundEvent {
    paxos_reaching(acc, intent, node, owner, ballot, t, &[1, 2, 3])
}

/// A PaxosLease round whose messages reach only the acceptors in `reached`.
fn paxos_reaching(
    acc: &mut [Acceptor],
    intent: Intent,
    node: NodeId,
    owner: &str,
    ballot: Ballot,
    t: u64,
    reached: &[NodeId],
) -> RoundEvent {
    let (mut r, msgs) = Round::start_in(
        Protocol::PaxosLease,
        intent,
        node,
        "r",
        owner,
        &[1, 2, 3],
        ballot,
        CFG,
        at(t),
    );
    let msgs = msgs
        .into_iter()
        .filter(|m| reached.contains(&m.to))
        .collect();
    run(&mut r, acc, msgs, t)
}

#[test]
fn paxoslease_grants_extends_refuses_and_ignores_wall_clocks() {
    let mut acc = paxos_acceptors();
    let RoundEvent::Granted(g) = paxos(&mut acc, Intent::Acquire, 1, "alice", k(1, 1), 3000) else {
        panic!("not granted")
    };
    // Valid from the round's start for the lease time minus the drift margin.
    assert_eq!(g.valid_until, MonoMillis(3000 + 2000 - 50));
    // Each acceptor times the value on its own clock, from receipt.
    assert!(matches!(
        acc[0].accepted("r"),
        Some(Slot::Timed {
            until: MonoMillis(5000),
            ..
        })
    ));
    // Someone else is refused, and nothing is written for it.
    let busy = paxos(&mut acc, Intent::Acquire, 2, "bob", k(2, 2), 4000);
    assert!(
        matches!(&busy, RoundEvent::Busy { owner, epoch, .. } if owner == "alice" && *epoch == g.epoch),
        "{busy:?}"
    );
    // The holder extends: same epoch, a new timer.
    let RoundEvent::Granted(r) = paxos(&mut acc, Intent::Acquire, 3, "alice", k(3, 3), 4500) else {
        panic!("not extended")
    };
    assert_eq!(r.epoch, g.epoch);
    assert!(matches!(
        acc[1].accepted("r"),
        Some(Slot::Timed {
            until: MonoMillis(6500),
            ..
        })
    ));
    // Once every acceptor's timer fired, the resource is free: a new tenure, a new epoch.
    let RoundEvent::Granted(b) = paxos(&mut acc, Intent::Acquire, 2, "bob", k(2, 9), 6500) else {
        panic!("not free after the acceptors' timers")
    };
    assert!(b.epoch > g.epoch);
    // Messages stamped with any wall clock are answered (no synchronization assumed).
    let far = Envelope {
        proto: Protocol::PaxosLease,
        resource: "r".into(),
        from: 2,
        to: 1,
        sent_at: WallMillis(1),
        body: Msg::Read { k: k(2, 99) },
    };
    assert!(matches!(
        acc[0].on_message(&far, at(6600)).map(|e| e.body),
        Some(Msg::ReadAck { .. })
    ));
}

#[test]
fn paxoslease_release_frees_at_once_and_only_for_the_holder() {
    let mut acc = paxos_acceptors();
    let RoundEvent::Granted(g) = paxos(&mut acc, Intent::Acquire, 1, "alice", k(1, 1), 3000) else {
        panic!("not granted")
    };
    assert_eq!(
        paxos(&mut acc, Intent::Release, 2, "bob", k(2, 2), 3100),
        RoundEvent::NotHeld
    );
    assert_eq!(
        paxos(&mut acc, Intent::Release, 2, "alice", k(2, 3), 3100),
        RoundEvent::Released { epoch: g.epoch }
    );
    let RoundEvent::Granted(b) = paxos(&mut acc, Intent::Acquire, 3, "bob", k(3, 4), 3200) else {
        panic!("not granted after release")
    };
    assert!(b.epoch > g.epoch);
}

/// A PaxosLease write of `owner`'s value (2 s, `epoch`) at ballot `b`, to acceptor `to`.
fn span_write(to: NodeId, owner: &str, b: Ballot, epoch: u64) -> Envelope {
    Envelope {
        proto: Protocol::PaxosLease,
        resource: "r".into(),
        from: 1,
        to,
        sent_at: WallMillis(0),
        body: Msg::Write {
            k: b,
            value: Slot::Span {
                owner: owner.into(),
                span_ms: 2000,
                epoch,
            },
        },
    }
}

#[test]
fn a_stale_own_value_after_another_tenure_starts_a_new_epoch() {
    // Alice's write reached acceptor 3 late (at 3500), after Bob's tenure was written to
    // acceptors 1 and 2 at 3000: her value outlives his by 500 ms there. (Bob's epoch is
    // above any wall-clock fallback here, so only the rule under test can pass it.)
    const BOB: u64 = 1 << 40;
    let mut acc = paxos_acceptors();
    for to in [1, 2] {
        acc[(to - 1) as usize].on_message(&span_write(to, "bob", k(2, 2), BOB), at(3000));
    }
    // Alice's round (ballot k(1, 1)) started before Bob's.
    acc[2].on_message(&span_write(3, "alice", k(1, 1), 5), at(3500));
    // While Bob's value lives, Alice is refused.
    let ev = paxos(&mut acc, Intent::Acquire, 1, "alice", k(1, 5), 3100);
    assert!(matches!(ev, RoundEvent::Busy { .. }), "{ev:?}");
    // At 5000 Bob's value expired; read by acceptors 2 and 3 only, acceptor 3 still reports
    // Alice's (epoch 5) beside Bob's later write remembered by acceptor 2: a new tenure
    // above Bob's epoch, not a renewal of 5.
    let ev = paxos_reaching(
        &mut acc,
        Intent::Acquire,
        1,
        "alice",
        k(1, 7),
        5000,
        &[2, 3],
    );
    let RoundEvent::Granted(g) = ev else {
        panic!("not granted")
    };
    assert_eq!(g.epoch, BOB + 1);
}

#[test]
fn a_live_own_value_beside_an_older_expired_write_with_a_higher_ballot_is_renewed() {
    // Found by the simulation (FLEASE_SEED=6186, wall clocks an hour apart): acceptor 2
    // accepted bob's write long ago with a ballot of a far-ahead wall clock (era 9); it
    // expired there. Acceptors 1 and 3 restarted since, and alice's tenure (epoch 7) was
    // written to them with era-1 ballots. Her renewal reads acceptors 1 and 2: her live
    // value under a lower ballot, and bob's expired write under a higher one, which
    // remembers epoch 6, below hers: it cannot be a later tenure (that would have started
    // above 7). Her tenure goes on (epoch 7).
    let mut acc = paxos_acceptors();
    let far_ahead = Ballot { era: 9, ..k(2, 1) };
    acc[1].on_message(&span_write(2, "bob", far_ahead, 6), at(3000));
    for to in [1, 3] {
        acc[(to - 1) as usize].on_message(&span_write(to, "alice", k(1, 3), 7), at(5500));
    }
    let ballot = Ballot { era: 10, ..k(1, 4) };
    let ev = paxos_reaching(&mut acc, Intent::Acquire, 1, "alice", ballot, 6000, &[1, 2]);
    let RoundEvent::Granted(g) = ev else {
        panic!("not granted")
    };
    assert_eq!((g.epoch, g.renewal), (7, true));
}

#[test]
fn fast_release_needs_a_quorum_of_released_acks() {
    let mut acc = acceptors();
    let RoundEvent::Granted(g) = acquire(&mut acc, 1, "alice", k(1, 1), 3000) else {
        panic!("not granted")
    };
    let (mut fr, msgs) = FastRelease::start(
        Protocol::Flease,
        1,
        "r",
        "alice",
        &[1, 2, 3],
        g.ballot,
        at(3100),
    );
    let replies: Vec<Envelope> = msgs
        .iter()
        .filter_map(|m| acc[(m.to - 1) as usize].on_message(m, at(3100)))
        .collect();
    assert_eq!(fr.on_reply(&replies[0]), None);
    assert_eq!(fr.on_reply(&replies[0]), None, "a duplicate counts once");
    assert_eq!(fr.on_reply(&replies[1]), Some(true));
    // A release at a ballot no acceptor holds cannot reach a quorum.
    let (mut stale, msgs) = FastRelease::start(
        Protocol::Flease,
        1,
        "r",
        "alice",
        &[1, 2, 3],
        k(1, 0),
        at(3100),
    );
    let mut outcome = None;
    for m in &msgs {
        if let Some(r) = acc[(m.to - 1) as usize].on_message(m, at(3100)) {
            outcome = outcome.or(stale.on_reply(&r));
        }
    }
    assert_eq!(outcome, Some(false));
}
