//! A randomized model of leases across leader changes: the real `LeaseTracker` on every node and
//! the real `KvState` as the log, driven by seeded random steps (register, attach, refresh,
//! time, leader changes with lost or late entries, expiry and checkpoint ticks).
//!
//! After every applied entry it checks the safety property of DESIGN.md section 4: no lease (and
//! so no key attached to it) disappears before `send time of its last acknowledged refresh +
//! ttl`, in true time, across any leader change. At the end it checks liveness: once refreshes
//! stop and a leader is stable, every lease is gone within `ttl + extension + retry`. Each node
//! reads the lease clock as the real tracker shell does: the highest stamp applied and when it
//! applied it (a random, later time for the node that becomes leader).
//!
//! A second model keeps leaders changing while nothing refreshes, and checks that an abandoned
//! lease is gone within one failover of its TTL, whatever the number of leader changes.
//!
//! A failing seed is printed; rerun one with `LEASE_MODEL_SEED=<seed>`.

use std::collections::{BTreeMap, VecDeque};

use leasecore::domain::command::{Command, Response};
use leasecore::domain::kv::KvState;
use leasecore::domain::lease::{
    ClearTicket, ClockReading, LeaseTracker, TrackerConfig, checkpoint_command, clear_command,
    expire_command,
};
use leasecore::domain::types::{MonoMillis, Revision};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const NODES: usize = 3;
const EXTENSION: u64 = 250;
const CFG: TrackerConfig = TrackerConfig {
    promote_extension_ms: EXTENSION,
    retry_ms: 2000,
    checkpoints: true,
};
const TTLS: [u64; 3] = [1500, 3000, 6000];
const NAMES: [&str; 4] = ["a", "b", "c", "d"];

/// What a proposal is for, so its application can be judged.
enum Purpose {
    Expire,
    Checkpoint,
    /// A refresh's checkpoint clear: the refresh is acknowledged when it applies (if the
    /// proposing leader still leads).
    Clear {
        ticket: ClearTicket,
        sent: u64,
        ttl: u64,
    },
}

struct Proposal {
    cmd: Command,
    purpose: Purpose,
    apply_at: u64,
}

struct Model {
    rng: StdRng,
    /// True time, in ms.
    now: u64,
    offsets: [u64; NODES],
    trackers: Vec<LeaseTracker>,
    leader: Option<usize>,
    log: KvState,
    /// The leader's proposals not yet applied, in log order.
    pending: VecDeque<Proposal>,
    /// (name, revision) -> latest send time of an acknowledged refresh (or registration) and ttl.
    acked: BTreeMap<(String, Revision), (u64, u64)>,
    checks: u64,
    /// Deliberately broken: acknowledge refreshes without clearing checkpoints.
    ignore_clears: bool,
    /// The lease clock's highest stamp and the true time it was applied.
    clock_seen: (u64, u64),
    /// Deliberately broken: new leaders read the lease clock this far ahead of what they saw.
    clock_ahead_ms: u64,
    /// The worst lateness of an expiry (true time after the last acknowledged send + ttl).
    worst_lateness: u64,
}

impl Model {
    fn new(seed: u64) -> Model {
        let mut rng = StdRng::seed_from_u64(seed);
        let offsets = [
            rng.random_range(0..1_000_000),
            rng.random_range(0..1_000_000),
            rng.random_range(0..1_000_000),
        ];
        let mut m = Model {
            rng,
            now: 0,
            offsets,
            trackers: (0..NODES).map(|_| LeaseTracker::new(CFG)).collect(),
            leader: None,
            log: KvState::new(),
            pending: VecDeque::new(),
            acked: BTreeMap::new(),
            checks: 0,
            ignore_clears: false,
            clock_seen: (0, 0),
            clock_ahead_ms: 0,
            worst_lateness: 0,
        };
        m.elect(0);
        m
    }

    fn mono(&self, node: usize) -> MonoMillis {
        MonoMillis(self.now + self.offsets[node])
    }

    /// Apply one command to the log and tell the leader's tracker, checking safety.
    fn apply(&mut self, cmd: &Command) -> Response {
        let before: BTreeMap<String, Revision> = self
            .log
            .leases()
            .iter()
            .map(|(n, l)| (n.clone(), l.revision))
            .collect();
        let out = self.log.apply(cmd);
        for (name, revision) in &before {
            if self.log.lease(name).map(|l| l.revision) != Some(*revision)
                && let Some((sent, ttl)) = self.acked.get(&(name.clone(), *revision))
            {
                self.checks += 1;
                assert!(
                    self.now >= sent + ttl,
                    "lease {name}@{revision} removed at {} but a refresh sent at {sent} promised {ttl} ms",
                    self.now
                );
                if matches!(cmd, Command::ExpireLeases { .. } | Command::Batch { .. }) {
                    self.worst_lateness = self.worst_lateness.max(self.now - (sent + ttl));
                }
            }
        }
        if self.log.lease_clock_ms() > self.clock_seen.0 {
            self.clock_seen = (self.log.lease_clock_ms(), self.now);
        }
        if let Some(l) = self.leader {
            let now = self.mono(l);
            for change in &out.lease_changes {
                match change {
                    leasecore::domain::command::LeaseChange::Registered {
                        name,
                        revision,
                        ttl_ms,
                        checkpointed,
                    } => {
                        self.trackers[l].on_registered(name, *revision, *ttl_ms, now, *checkpointed)
                    }
                    leasecore::domain::command::LeaseChange::Removed { name, .. } => {
                        self.trackers[l].on_removed(name)
                    }
                }
            }
        }
        out.response
    }

    fn propose(&mut self, cmd: Command, purpose: Purpose) {
        let delay = self.rng.random_range(1..80);
        let last = self.pending.back().map_or(0, |p| p.apply_at);
        self.pending.push_back(Proposal {
            cmd,
            purpose,
            apply_at: last.max(self.now + delay),
        });
    }

    /// Apply the pending proposals that are due, in order.
    fn deliver(&mut self) {
        while self.pending.front().is_some_and(|p| p.apply_at <= self.now) {
            let p = self.pending.pop_front().unwrap();
            self.apply(&p.cmd);
            if let (Purpose::Clear { ticket, sent, ttl }, Some(l)) = (p.purpose, self.leader) {
                // The clear committed: the refresh is acknowledged now.
                self.trackers[l].on_cleared(&ticket);
                self.ack(&ticket.name, ticket.revision, sent, ttl);
            }
        }
    }

    fn ack(&mut self, name: &str, revision: Revision, sent: u64, ttl: u64) {
        let e = self
            .acked
            .entry((name.to_string(), revision))
            .or_insert((sent, ttl));
        e.0 = e.0.max(sent);
    }

    /// A leader change: the old leader's unapplied entries are lost or committed by the new
    /// leader (before its own first entry); then the new leader promotes.
    fn elect(&mut self, gap: u64) {
        if let Some(old) = self.leader.take() {
            self.trackers[old].demote();
        }
        let pending: Vec<Proposal> = self.pending.drain(..).collect();
        for p in pending {
            if self.rng.random_bool(0.5) {
                self.apply(&p.cmd); // committed late, under the new leader: no acknowledgement
            }
        }
        self.now += gap;
        let l = self.rng.random_range(0..NODES);
        self.promote(l);
    }

    /// `l` becomes the leader. It applied the latest lease clock stamp when it was made or
    /// later (never before), and promotes now.
    fn promote(&mut self, l: usize) {
        let now = self.mono(l);
        let (value, applied) = self.clock_seen;
        let applied = (applied + self.rng.random_range(0..100)).min(self.now);
        let reading = ClockReading {
            value: value + self.clock_ahead_ms,
            seen_at: MonoMillis(applied + self.offsets[l]),
        };
        self.trackers[l].promote(now, reading, self.log.lease_facts());
        self.leader = Some(l);
    }

    fn step(&mut self) {
        self.now += self.rng.random_range(0..250);
        self.deliver();
        let Some(l) = self.leader else { return };
        match self.rng.random_range(0..100) {
            0..10 => {
                let name = NAMES[self.rng.random_range(0..NAMES.len())];
                let ttl = TTLS[self.rng.random_range(0..TTLS.len())];
                let sent = self.now.saturating_sub(self.rng.random_range(0..30));
                // The leader stamps most registrations with its lease clock (not while it is
                // not yet tracking, which the model does not distinguish: half of them, then).
                let clock_ms = self
                    .rng
                    .random_bool(0.5)
                    .then(|| self.trackers[l].clock_at(self.mono(l)));
                if let Response::LeaseRegistered { revision } =
                    self.apply(&Command::RegisterLease {
                        name: name.into(),
                        ttl_ms: ttl,
                        clock_ms,
                    })
                {
                    self.ack(name, revision, sent, ttl);
                }
            }
            10..20 => {
                let name = NAMES[self.rng.random_range(0..NAMES.len())];
                let key = format!("{name}/{}", self.rng.random_range(0..3));
                self.apply(&Command::Put {
                    key,
                    value: "v".into(),
                    lease: Some(name.into()),
                    prev_revision: None,
                });
            }
            20..60 => {
                // A refresh, sent a little before it arrives.
                let name = NAMES[self.rng.random_range(0..NAMES.len())];
                let sent = self.now.saturating_sub(self.rng.random_range(0..30));
                let now = self.mono(l);
                if let Ok(r) = self.trackers[l].refresh(name, now) {
                    match r.clear {
                        None => self.ack(name, r.revision, sent, r.ttl_ms),
                        Some(_) if self.ignore_clears => self.ack(name, r.revision, sent, r.ttl_ms),
                        Some(ticket) => {
                            let cmd = clear_command(&ticket);
                            let ttl = r.ttl_ms;
                            self.propose(cmd, Purpose::Clear { ticket, sent, ttl });
                        }
                    }
                }
            }
            60..90 => self.tick(l),
            _ => {
                let gap = self.rng.random_range(0..2 * EXTENSION);
                self.elect(gap);
            }
        }
    }

    /// The leader's driver: propose what is due.
    fn tick(&mut self, l: usize) {
        let now = self.mono(l);
        let expired = self.trackers[l].expired(now, 1000);
        if !expired.is_empty() {
            self.propose(expire_command(&expired), Purpose::Expire);
        }
        let due = self.trackers[l].checkpoints_due(now, 1000);
        if !due.is_empty() {
            self.propose(checkpoint_command(due), Purpose::Checkpoint);
        }
    }

    /// Refreshes stop; a stable leader expires everything in bounded time.
    fn drain(&mut self) {
        let l = self.leader.unwrap();
        let bound = self.now + TTLS[2] + EXTENSION + CFG.retry_ms + 200;
        while self.now < bound && !self.log.leases().is_empty() {
            self.now += 50;
            self.deliver();
            self.tick(l);
        }
        self.now += 200;
        self.deliver();
        assert!(
            self.log.leases().is_empty(),
            "leases still alive long after their last refresh: {:?}",
            self.log.leases().keys().collect::<Vec<_>>()
        );
    }
}

fn run(seed: u64, steps: usize) -> u64 {
    run_model(Model::new(seed), steps)
}

fn run_model(mut m: Model, steps: usize) -> u64 {
    for _ in 0..steps {
        m.step();
    }
    m.drain();
    m.checks
}

#[test]
fn leases_never_expire_early_across_leader_changes() {
    if let Ok(seed) = std::env::var("LEASE_MODEL_SEED") {
        run(seed.parse().expect("a u64 seed"), 600);
        return;
    }
    let mut checks = 0;
    for seed in 0..2000u64 {
        let result = std::panic::catch_unwind(|| run(seed, 600));
        match result {
            Ok(c) => checks += c,
            Err(e) => {
                eprintln!("lease model failed with seed {seed} (LEASE_MODEL_SEED={seed})");
                std::panic::resume_unwind(e);
            }
        }
    }
    // The property was actually exercised.
    assert!(checks > 10_000, "only {checks} removals checked");
}

/// The checker catches a broken tracker: promoting without the extension and from a stale
/// clock lets a lease expire before a client's view ends.
#[test]
fn the_checker_catches_an_unsafe_promote() {
    let mut m = Model::new(7);
    m.apply(&Command::RegisterLease {
        name: "a".into(),
        ttl_ms: 1500,
        clock_ms: None,
    });
    // Refresh at the leader at true time 0 (sent at 0).
    let l = m.leader.unwrap();
    let now = m.mono(l);
    m.trackers[l].refresh("a", now).unwrap();
    m.ack("a", Revision(1), 0, 1500);
    // A broken new leader: promotes with a clock 1000 ms in the past and no extension.
    let other = (l + 1) % NODES;
    m.trackers[l].demote();
    m.now = 1000;
    let mut broken = LeaseTracker::new(TrackerConfig {
        promote_extension_ms: 0,
        ..CFG
    });
    let reading = ClockReading {
        value: 0,
        seen_at: MonoMillis(0),
    };
    broken.promote(MonoMillis(0), reading, m.log.lease_facts());
    m.trackers[other] = broken;
    m.leader = Some(other);
    let expired = m.trackers[other].expired(MonoMillis(1501), 10);
    let cmd = expire_command(&expired);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.apply(&cmd)));
    assert!(caught.is_err(), "the checker missed an early expiry");
}

/// The checker catches refreshes acknowledged over an uncleared checkpoint: a checkpoint then
/// shortens a lease below what a client was told once the leader changes.
#[test]
fn the_checker_catches_refreshes_that_skip_the_checkpoint_clear() {
    let caught = (0..2000u64).any(|seed| {
        let mut m = Model::new(seed);
        m.ignore_clears = true;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_model(m, 600))).is_err()
    });
    assert!(caught, "no seed exposed the missing checkpoint clear");
}

/// Leaders keep changing (every 300 to 1500 ms of true time, with elections of up to 1 s) and
/// nothing is refreshed after registration: every lease must be gone within one failover of
/// its TTL, however many leaders it outlived (without the promote checkpoint and the lease
/// clock, each leader granted the full TTL again and leases lived for ever under churn).
#[test]
fn abandoned_leases_are_bounded_under_leader_churn() {
    const MAX_GAP: u64 = 1000;
    let mut worst = 0;
    let mut leader_changes = 0u64;
    for seed in 0..500u64 {
        let mut m = Model::new(seed ^ 0x5eed);
        for (i, name) in NAMES.iter().enumerate() {
            let ttl = TTLS[i % TTLS.len()];
            let l = m.leader.unwrap();
            let clock_ms = (i % 2 == 0).then(|| m.trackers[l].clock_at(m.mono(l)));
            if let Response::LeaseRegistered { revision } = m.apply(&Command::RegisterLease {
                name: (*name).into(),
                ttl_ms: ttl,
                clock_ms,
            }) {
                m.ack(name, revision, m.now, ttl);
            }
        }
        let mut next_election = m.now + m.rng.random_range(300..1500);
        while !m.log.leases().is_empty() {
            assert!(
                m.now < 60_000,
                "seed {seed}: leases outlived a minute of churn"
            );
            m.now += 10;
            m.deliver();
            if m.now >= next_election {
                let gap = m.rng.random_range(0..MAX_GAP);
                m.elect(gap);
                leader_changes += 1;
                next_election = m.now + m.rng.random_range(300..1500);
            }
            let l = m.leader.unwrap();
            m.tick(l);
        }
        worst = worst.max(m.worst_lateness);
    }
    // Half the TTL (idle before its checkpoint), one leader's life before that checkpoint
    // commits (80 ms), one election (MAX_GAP), the extension, the drift margin, the node's late
    // view of the clock (100 ms) and a tick.
    let bound = TTLS[2] / 2 + 80 + MAX_GAP + EXTENSION + TTLS[2] / 1000 + 100 + 10;
    assert!(worst <= bound, "worst lateness {worst} ms > {bound} ms");
    assert!(leader_changes > 500, "only {leader_changes} leader changes");
    eprintln!("worst lateness under churn: {worst} ms over {leader_changes} leader changes");
}

/// The checker catches a lease clock that runs ahead of real time: aging a checkpoint by more
/// than the time that really passed expires leases early.
#[test]
fn the_checker_catches_a_lease_clock_that_runs_ahead() {
    let caught = (0..2000u64).any(|seed| {
        let mut m = Model::new(seed);
        m.clock_ahead_ms = 1500;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_model(m, 600))).is_err()
    });
    assert!(caught, "no seed exposed a lease clock running ahead");
}
