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
    ClearTicket, ClockReading, ClockWitness, LeaseTracker, TrackerConfig, checkpoint_command,
    clear_command, expire_command,
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
    clock_tick_ms: 500,
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
    /// Its log index.
    index: u64,
}

/// How long a follower may take to learn that an entry committed (the leader's next append).
const HEARTBEAT: u64 = 100;

/// The most a follower's copy of an entry arrives after the leader stamped it.
const MAX_RECEIPT_DELAY: u64 = 40;

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
    /// Each node's lease clock witness (as the real tracker shell keeps it).
    witnesses: Vec<ClockWitness>,
    /// The last log index written (applied or pending).
    last_index: u64,
    /// Per node: entries committed that it has not applied yet (index, clock after it, due).
    unapplied: Vec<VecDeque<(u64, u64, u64)>>,
    /// Deliberately broken: new leaders read the lease clock this far ahead of what they saw.
    clock_ahead_ms: u64,
    /// The worst lateness of an expiry (true time after the last acknowledged send + ttl).
    worst_lateness: u64,
    /// Every expiry's lateness.
    latenesses: Vec<u64>,
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
            witnesses: (0..NODES).map(|_| ClockWitness::new()).collect(),
            last_index: 0,
            unapplied: vec![VecDeque::new(); NODES],
            clock_ahead_ms: 0,
            worst_lateness: 0,
            latenesses: Vec::new(),
        };
        m.elect(0);
        m
    }

    fn mono(&self, node: usize) -> MonoMillis {
        MonoMillis(self.now + self.offsets[node])
    }

    /// Write `cmd` to every node's log at index `last_index + 1`: each node receives it at a
    /// random time within `max_delay` of now (never before the leader stamped it).
    fn append(&mut self, cmd: &Command, max_delay: u64) -> u64 {
        self.last_index += 1;
        let index = self.last_index;
        let stamp = cmd.lease_clock_stamp().map(|s| (index, s));
        for n in 0..NODES {
            let at = self.now + self.rng.random_range(0..=max_delay.min(MAX_RECEIPT_DELAY));
            self.witnesses[n].received(index, index, stamp, MonoMillis(at + self.offsets[n]));
        }
        index
    }

    /// Followers apply what they have learnt is committed (`all`: everything, as the next
    /// leader's first entry tells them).
    fn catch_up_followers(&mut self, all: bool) {
        for n in 0..NODES {
            while let Some(&(index, value, due)) = self.unapplied[n].front() {
                if !all && due > self.now {
                    break;
                }
                self.unapplied[n].pop_front();
                let now = self.mono(n);
                self.witnesses[n].applied(index, value, false, now);
            }
        }
    }

    /// Commit and apply one command at once.
    fn apply(&mut self, cmd: &Command) -> Response {
        let index = self.append(cmd, 0);
        self.apply_at(cmd, index)
    }

    /// Apply the entry at `index` on every node and tell the leader's tracker, checking safety.
    fn apply_at(&mut self, cmd: &Command, index: u64) -> Response {
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
                    let late = self.now - (sent + ttl);
                    self.worst_lateness = self.worst_lateness.max(late);
                    self.latenesses.push(late);
                }
            }
        }
        // The leader applies at once; a follower learns of the commit with the leader's next
        // append (within a heartbeat), or from the next leader if this one dies first.
        let value = self.log.lease_clock_ms();
        for n in 0..NODES {
            if Some(n) == self.leader {
                let now = self.mono(n);
                self.witnesses[n].applied(index, value, false, now);
            } else {
                let due = self.now + self.rng.random_range(0..HEARTBEAT);
                self.unapplied[n].push_back((index, value, due));
            }
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
        let index = self.append(&cmd, delay);
        self.pending.push_back(Proposal {
            cmd,
            purpose,
            apply_at: last.max(self.now + delay),
            index,
        });
    }

    /// Apply the pending proposals that are due, in order.
    fn deliver(&mut self) {
        self.catch_up_followers(false);
        while self.pending.front().is_some_and(|p| p.apply_at <= self.now) {
            let p = self.pending.pop_front().unwrap();
            self.apply_at(&p.cmd, p.index);
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

    /// A leader change: after the election (`gap`), a prefix of the old leader's unapplied
    /// entries is committed by the new leader's first entry, and the rest is truncated; then
    /// the new leader promotes. Sometimes a follower restarts meanwhile (its witness is lost).
    fn elect(&mut self, gap: u64) {
        if let Some(old) = self.leader.take() {
            self.trackers[old].demote();
        }
        self.now += gap;
        self.catch_up_followers(true);
        let pending: Vec<Proposal> = self.pending.drain(..).collect();
        let kept = self.rng.random_range(0..=pending.len());
        if let Some(lost) = pending.get(kept) {
            for w in &mut self.witnesses {
                w.truncated(lost.index);
            }
            self.last_index = lost.index - 1;
        }
        for p in pending.into_iter().take(kept) {
            // Committed late, under the new leader: no acknowledgement.
            self.apply_at(&p.cmd, p.index);
        }
        if self.rng.random_bool(0.1) {
            let n = self.rng.random_range(0..NODES);
            self.witnesses[n] = ClockWitness::new();
        }
        let l = self.rng.random_range(0..NODES);
        self.apply(&Command::Batch { commands: vec![] }); // the new leader's first entry
        self.promote(l);
    }

    /// `l` becomes the leader and promotes now, with its witness's reading of the lease clock.
    fn promote(&mut self, l: usize) {
        let now = self.mono(l);
        let mut reading = self.witnesses[l].reading(self.log.lease_clock_ms(), now);
        reading.value += self.clock_ahead_ms;
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
                let mono = self.mono(l);
                let clock_ms = self
                    .rng
                    .random_bool(0.5)
                    .then(|| self.trackers[l].stamp(mono));
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
        if let Some(clock_ms) = self.trackers[l].clock_tick_due(now) {
            self.propose(Command::LeaseClock { clock_ms }, Purpose::Checkpoint);
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
    let mut late = Vec::new();
    let mut leader_changes = 0u64;
    for seed in 0..500u64 {
        let mut m = Model::new(seed ^ 0x5eed);
        for (i, name) in NAMES.iter().enumerate() {
            let ttl = TTLS[i % TTLS.len()];
            let l = m.leader.unwrap();
            let mono = m.mono(l);
            let clock_ms = Some(m.trackers[l].stamp(mono));
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
        late.extend(m.latenesses);
    }
    late.sort_unstable();
    let pct = |p: usize| late[(late.len() * p / 100).min(late.len() - 1)];
    let (p50, p99, worst) = (pct(50), pct(99), late[late.len() - 1]);
    eprintln!(
        "lateness under churn: p50 {p50} ms, p99 {p99} ms, max {worst} ms over {} expiries and {leader_changes} leader changes",
        late.len()
    );
    assert!(leader_changes > 500, "only {leader_changes} leader changes");
    assert!(
        p99 <= 2 * MAX_GAP,
        "p99 lateness {p99} ms > two elections ({} ms)",
        2 * MAX_GAP
    );
    // Worst case: a lease due in one election gap, its leader replaced by a node that has
    // just restarted and so dates the clock from its start: that gap, the tick before it, and
    // the next election; plus the commit delays (80 ms each), the receipt delays of the
    // leaders it outlived and a step.
    let bound = 2 * MAX_GAP + CFG.clock_tick_ms + 2 * 80 + 8 * MAX_RECEIPT_DELAY + 10;
    assert!(worst <= bound, "worst lateness {worst} ms > {bound} ms");
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
