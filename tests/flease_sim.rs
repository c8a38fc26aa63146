//! A seeded, deterministic simulation of Flease and PaxosLease: no real time, no sockets.
//!
//! 3 or 5 nodes run the real `Acceptor` and `Round`s for owners that acquire, renew and release
//! two resources, over a network that loses, delays, reorders and duplicates messages, with
//! partitions, per-node wall-clock offsets within epsilon (moving during the run), and crashes and
//! restarts. After every step it checks, in true time:
//! - I1 exclusivity: tenures of different epochs of one resource never overlap;
//! - I2 fencing: a new tenure's epoch is above every earlier tenure's epoch of the resource.
//!
//! A tenure runs from the grant to the holder's `valid_until` on its monotonic clock, or to its
//! release or crash; renewals extend it. A failing seed is printed; rerun one with
//! `FLEASE_SEED=<seed> FLEASE_NODES=<n>` (and `FLEASE_PROTO=paxoslease`); search another range of
//! seeds with `FLEASE_SEEDS=<from>..<to>`. Every iteration order is fixed (no hash maps are
//! iterated), so a seed replays exactly. Negative runs break the
//! skew bound (Flease) or the rate-drift bound (PaxosLease) and must be caught.
//!
//! PaxosLease runs with wall clocks far apart (up to 8 eps, where Flease fails; and up to an hour
//! with the fencing check off, as its epochs after total amnesia rely on wall clocks) and with
//! monotonic clocks running up to 1% fast or slow.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use leasecore::domain::flease::proposer::RoundEvent;
use leasecore::domain::flease::{
    Acceptor, Ballot, BallotGen, Envelope, FleaseConfig, Intent, Msg, Now, Protocol, Round,
};
use leasecore::domain::types::{MonoMillis, NodeId, WallMillis};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CFG: FleaseConfig = FleaseConfig {
    eps_ms: 50,
    t_max_ms: 2000,
    round_timeout_ms: 100,
    msg_max_age_ms: 300,
    renew_lead_ms: 1000,
    renew_min_remaining_ms: 250,
    restart_wait_ms: 2500,
    cell_gc_idle_ms: 4000,
    ballot_era_ms: 100,
};
const RESOURCES: [&str; 2] = ["r0", "r1"];
/// Virtual duration of one run.
const RUN_MS: u64 = 15_000;

#[derive(Clone, Debug)]
struct Tenure {
    resource: String,
    owner: String,
    epoch: u64,
    start: u64,
    end: u64,
}

struct Holding {
    epoch: u64,
    grant_k: Ballot,
    tenure: usize,
}

struct Node {
    id: NodeId,
    alive: bool,
    /// wall = true time + offset.
    offset: u64,
    /// mono = base + (true time - life start) * (1 + rate_ppm / 10^6).
    mono_base: u64,
    life_start: u64,
    rate_ppm: i64,
    acceptor: Acceptor,
    ballots: BallotGen,
    rounds: BTreeMap<(String, String), Round>,
    holding: BTreeMap<(String, String), Holding>,
    /// (resource, owner) -> true time before which no new round starts.
    next_try: BTreeMap<(String, String), u64>,
    seen: Ballot,
}

/// What a run varies.
#[derive(Clone, Copy, Debug)]
struct Params {
    proto: Protocol,
    nodes: u64,
    /// Wall clocks differ by up to this.
    max_skew: u64,
    /// Monotonic clocks run up to this fast or slow (parts per million).
    max_drift_ppm: i64,
    /// Check I2 (fencing epochs) as well as I1.
    check_fencing: bool,
}

impl Params {
    /// Whether a holder may be granted a new epoch while its previous one runs (I1 then
    /// compares different owners only). Only without fencing: with wall clocks an hour
    /// apart and acceptors restarting, neither ballots nor epochs order the writes a renewal
    /// reads, and a renewal may come back as a fresh tenure (a higher epoch for the same
    /// holder). Its lease is unaffected; fencing is not claimed in that mode.
    fn regrant_allowed(&self) -> bool {
        !self.check_fencing
    }
}

impl Params {
    fn flease(nodes: u64) -> Params {
        Params {
            proto: Protocol::Flease,
            nodes,
            max_skew: CFG.eps_ms,
            max_drift_ppm: 0,
            check_fencing: true,
        }
    }

    fn paxos(nodes: u64) -> Params {
        Params {
            proto: Protocol::PaxosLease,
            nodes,
            max_skew: 8 * CFG.eps_ms,
            max_drift_ppm: 10_000,
            check_fencing: true,
        }
    }
}

struct Sim {
    rng: StdRng,
    now: u64,
    p: Params,
    nodes: Vec<Node>,
    members: Vec<NodeId>,
    /// (deliver at, sequence) -> message, earliest first.
    net: BinaryHeap<Reverse<(u64, u64)>>,
    in_flight: HashMap<u64, Envelope>,
    seq: u64,
    cut: Vec<(NodeId, NodeId)>,
    tenures: Vec<Tenure>,
    grants: u64,
}

impl Sim {
    fn new(seed: u64, p: Params) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let members: Vec<NodeId> = (1..=p.nodes).collect();
        let nodes = members
            .iter()
            .map(|id| {
                let offset = rng.random_range(0..=p.max_skew);
                let mono_base = rng.random_range(0..100_000);
                let rate_ppm = rng.random_range(-p.max_drift_ppm..=p.max_drift_ppm);
                // Started long ago: past their restart wait.
                let now = Now {
                    wall: WallMillis(10_000_000 + offset),
                    mono: MonoMillis(mono_base),
                };
                let past = Now {
                    wall: now.wall,
                    mono: MonoMillis(0),
                };
                Node {
                    id: *id,
                    alive: true,
                    offset,
                    mono_base,
                    life_start: 10_000_000,
                    rate_ppm,
                    acceptor: Acceptor::for_protocol(p.proto, *id, CFG, past),
                    ballots: BallotGen::new(*id, now.wall.0, CFG.ballot_era_ms),
                    rounds: BTreeMap::new(),
                    holding: BTreeMap::new(),
                    next_try: BTreeMap::new(),
                    seen: Ballot::default(),
                }
            })
            .collect();
        Sim {
            rng,
            now: 10_000_000,
            p,
            nodes,
            members,
            net: BinaryHeap::new(),
            in_flight: HashMap::new(),
            seq: 0,
            cut: Vec::new(),
            tenures: Vec::new(),
            grants: 0,
        }
    }

    fn clock(&self, i: usize) -> Now {
        let n = &self.nodes[i];
        let lived = (self.now - n.life_start) as i128;
        let ran = lived * (1_000_000 + n.rate_ppm as i128) / 1_000_000;
        Now {
            wall: WallMillis(self.now + n.offset),
            mono: MonoMillis(n.mono_base + 3000 + ran as u64),
        }
    }

    /// The first true time at which node `i`'s monotonic clock reads `mono` or more.
    fn true_time_of_mono(&self, i: usize, mono: MonoMillis) -> u64 {
        let n = &self.nodes[i];
        let ran = mono.0.saturating_sub(n.mono_base + 3000) as i128;
        let rate = 1_000_000 + n.rate_ppm as i128;
        // Smallest `lived` with lived * rate / 10^6 >= ran.
        let lived = (ran * 1_000_000 + rate - 1) / rate;
        n.life_start + lived as u64
    }

    fn send(&mut self, msgs: Vec<Envelope>) {
        for m in msgs {
            if self.cut.contains(&(m.from, m.to)) || self.rng.random_bool(0.05) {
                continue; // lost
            }
            let copies = if self.rng.random_bool(0.03) { 2 } else { 1 };
            for _ in 0..copies {
                let delay = if self.rng.random_bool(0.05) {
                    self.rng.random_range(100..400)
                } else {
                    self.rng.random_range(1..40)
                };
                self.seq += 1;
                self.net.push(Reverse((self.now + delay, self.seq)));
                self.in_flight.insert(self.seq, m.clone());
            }
        }
    }

    fn index(&self, id: NodeId) -> usize {
        (id - 1) as usize
    }

    /// Apply one round's outcome at node `i`.
    fn outcome(&mut self, i: usize, key: (String, String), ev: RoundEvent) {
        match ev {
            RoundEvent::Pending => {}
            RoundEvent::Send(msgs) => self.send(msgs),
            RoundEvent::Granted(g) => {
                self.nodes[i].rounds.remove(&key);
                self.grants += 1;
                let end = self.true_time_of_mono(i, g.valid_until);
                if let Some(h) = self.nodes[i]
                    .holding
                    .get(&key)
                    .filter(|h| h.epoch == g.epoch)
                {
                    // A renewal: the same tenure goes on.
                    let t = h.tenure;
                    self.tenures[t].end = self.tenures[t].end.max(end);
                    self.nodes[i].holding.get_mut(&key).unwrap().grant_k = g.ballot;
                    self.check(t);
                } else {
                    // The latest tenure of this resource. The same owner finding its own lease
                    // still in the register (its release was lost, or its node restarted) renews
                    // it: the same epoch, and nobody else held the resource in between.
                    let latest = self
                        .tenures
                        .iter()
                        .filter(|t| t.resource == g.resource)
                        .max_by_key(|t| t.epoch);
                    if let Some(e) = latest.filter(|_| self.p.check_fencing) {
                        assert!(
                            g.epoch > e.epoch || (g.epoch == e.epoch && g.owner == e.owner),
                            "I2: epoch {} granted to {} on {} after epoch {} of {}",
                            g.epoch,
                            g.owner,
                            g.resource,
                            e.epoch,
                            e.owner
                        );
                    }
                    self.tenures.push(Tenure {
                        resource: g.resource.clone(),
                        owner: g.owner.clone(),
                        epoch: g.epoch,
                        start: self.now,
                        end,
                    });
                    let t = self.tenures.len() - 1;
                    self.nodes[i].holding.insert(
                        key.clone(),
                        Holding {
                            epoch: g.epoch,
                            grant_k: g.ballot,
                            tenure: t,
                        },
                    );
                    self.check(t);
                }
                // Renew when the lead time before expiry is reached.
                let renew_at = end.saturating_sub(CFG.renew_lead_ms - CFG.eps_ms);
                self.nodes[i].next_try.insert(key, renew_at);
            }
            RoundEvent::Busy { .. } | RoundEvent::Released { .. } | RoundEvent::NotHeld => {
                self.nodes[i].rounds.remove(&key);
                let later = self.now + self.rng.random_range(100..1500);
                self.nodes[i].next_try.insert(key, later);
            }
            RoundEvent::Retry {
                seen, not_before, ..
            } => {
                self.nodes[i].rounds.remove(&key);
                let n = &mut self.nodes[i];
                n.seen = n.seen.max(seen);
                let backoff = self.now + self.rng.random_range(10..150);
                let offset = self.nodes[i].offset;
                let at = match not_before {
                    Some(w) => backoff.max(w.0.saturating_sub(offset)),
                    None => backoff,
                };
                self.nodes[i].next_try.insert(key, at);
            }
        }
    }

    /// I1: tenure `t` overlaps no tenure of another epoch on its resource.
    fn check(&self, t: usize) {
        let a = &self.tenures[t];
        for (j, b) in self.tenures.iter().enumerate() {
            if j == t || b.resource != a.resource || b.epoch == a.epoch {
                continue;
            }
            if self.p.regrant_allowed() && a.owner == b.owner {
                continue;
            }
            assert!(
                a.start.max(b.start) >= a.end.min(b.end),
                "I1: {} held {} (epoch {}) during [{}, {}) and {} (epoch {}) during [{}, {})",
                a.resource,
                a.owner,
                a.epoch,
                a.start,
                a.end,
                b.owner,
                b.epoch,
                b.start,
                b.end
            );
        }
    }

    fn step(&mut self) {
        self.now += self.rng.random_range(1..20);
        // Deliver what is due, in delivery order (reordering comes from the random delays).
        let mut delivered = Vec::new();
        while let Some(Reverse((at, seq))) = self.net.peek().copied() {
            if at > self.now {
                break;
            }
            self.net.pop();
            if let Some(m) = self.in_flight.remove(&seq) {
                delivered.push(m);
            }
        }
        for m in delivered {
            let i = self.index(m.to);
            if !self.nodes[i].alive {
                continue;
            }
            let now = self.clock(i);
            match &m.body {
                Msg::Read { .. } | Msg::Write { .. } | Msg::Release { .. } => {
                    if let Some(reply) = self.nodes[i].acceptor.on_message(&m, now) {
                        self.send(vec![reply]);
                    }
                }
                _ => {
                    let keys: Vec<(String, String)> = self.nodes[i]
                        .rounds
                        .keys()
                        .filter(|(r, _)| *r == m.resource)
                        .cloned()
                        .collect();
                    for key in keys {
                        if let Some(round) = self.nodes[i].rounds.get_mut(&key) {
                            let ev = round.on_reply(&m, now);
                            self.outcome(i, key, ev);
                        }
                    }
                }
            }
        }
        // Round deadlines and scheduled tries.
        for i in 0..self.nodes.len() {
            if !self.nodes[i].alive {
                continue;
            }
            let now = self.clock(i);
            let expired: Vec<(String, String)> = self.nodes[i]
                .rounds
                .iter()
                .filter(|(_, r)| now.mono >= r.deadline())
                .map(|(k, _)| k.clone())
                .collect();
            for key in expired {
                let ev = self.nodes[i].rounds.get_mut(&key).unwrap().on_timeout(now);
                self.outcome(i, key, ev);
            }
            if self.nodes[i].next_try.is_empty() {
                continue;
            }
            let due: Vec<(String, String)> = self.nodes[i]
                .next_try
                .iter()
                .filter(|(k, at)| **at <= self.now && !self.nodes[i].rounds.contains_key(*k))
                .map(|(k, _)| k.clone())
                .collect();
            for key in due {
                self.nodes[i].next_try.remove(&key);
                self.start_round(i, key);
            }
        }
        self.random_action();
    }

    fn start_round(&mut self, i: usize, key: (String, String)) {
        let now = self.clock(i);
        let random = self.rng.random::<u32>();
        let n = &mut self.nodes[i];
        let k = n.ballots.next(now.wall, n.seen, random);
        let (round, msgs) = Round::start_in(
            self.p.proto,
            Intent::Acquire,
            n.id,
            &key.0,
            &key.1,
            &self.members,
            k,
            CFG,
            now,
        );
        n.rounds.insert(key, round);
        self.send(msgs);
    }

    fn random_action(&mut self) {
        let r = self.rng.random_range(0..1000);
        let i = self.rng.random_range(0..self.nodes.len());
        match r {
            // An owner of node i wants a resource.
            0..40 if self.nodes[i].alive => {
                let owner = format!("n{}-{}", i + 1, self.rng.random_range(0..2));
                let res = RESOURCES[self.rng.random_range(0..RESOURCES.len())].to_string();
                let key = (res, owner);
                if !self.nodes[i].rounds.contains_key(&key)
                    && !self.nodes[i].holding.contains_key(&key)
                {
                    self.start_round(i, key);
                }
            }
            // A holder releases: it stops first, then tells the acceptors.
            40..48 => {
                if let Some(key) = self.nodes[i].holding.keys().next().cloned() {
                    let h = self.nodes[i].holding.remove(&key).unwrap();
                    self.nodes[i].next_try.remove(&key);
                    self.nodes[i].rounds.remove(&key);
                    let t = h.tenure;
                    self.tenures[t].end = self.tenures[t].end.min(self.now);
                    let now = self.clock(i);
                    let msgs = self
                        .members
                        .iter()
                        .map(|to| Envelope {
                            proto: self.p.proto,
                            resource: key.0.clone(),
                            from: self.nodes[i].id,
                            to: *to,
                            sent_at: now.wall,
                            body: Msg::Release {
                                grant_k: h.grant_k,
                                owner: key.1.clone(),
                            },
                        })
                        .collect();
                    self.send(msgs);
                }
            }
            // A crash: the node stops acting at once; its state is gone.
            48..50 if self.nodes[i].alive && self.nodes.iter().filter(|n| n.alive).count() > 1 => {
                let n = &mut self.nodes[i];
                n.alive = false;
                for (_, h) in std::mem::take(&mut n.holding) {
                    self.tenures[h.tenure].end = self.tenures[h.tenure].end.min(self.now);
                }
                n.rounds.clear();
                n.next_try.clear();
            }
            // A restart: a blank acceptor that waits, a new boot, a new monotonic origin.
            50..56 if !self.nodes[i].alive => {
                let base = self.rng.random_range(0..100_000);
                self.nodes[i].mono_base = base;
                self.nodes[i].life_start = self.now;
                let drift = self.p.max_drift_ppm;
                self.nodes[i].rate_ppm = self.rng.random_range(-drift..=drift);
                self.nodes[i].alive = true;
                let now = self.clock(i);
                let id = self.nodes[i].id;
                self.nodes[i].acceptor = Acceptor::for_protocol(self.p.proto, id, CFG, now);
                self.nodes[i].ballots = BallotGen::new(id, now.wall.0, CFG.ballot_era_ms);
                self.nodes[i].seen = Ballot::default();
            }
            // Partitions come and go.
            56..60 => {
                let a = self.members[i];
                let b = self.members[self.rng.random_range(0..self.members.len())];
                if a != b {
                    self.cut.push((a, b));
                    self.cut.push((b, a));
                }
            }
            60..64 => self.cut.clear(),
            // A clock moves, staying within the skew bound.
            64..70 => {
                self.nodes[i].offset = self.rng.random_range(0..=self.p.max_skew);
            }
            _ => {}
        }
    }
}

fn run(seed: u64, p: Params) -> u64 {
    let mut sim = Sim::new(seed, p);
    let end = sim.now + RUN_MS;
    while sim.now < end {
        sim.step();
    }
    sim.grants
}

fn run_seeds(p: Params, seeds: std::ops::Range<u64>) -> u64 {
    if let (Ok(seed), Ok(n)) = (std::env::var("FLEASE_SEED"), std::env::var("FLEASE_NODES")) {
        let proto = std::env::var("FLEASE_PROTO").unwrap_or_default();
        if n.parse() == Ok(p.nodes) && (proto == "paxoslease") == (p.proto == Protocol::PaxosLease)
        {
            return run(seed.parse().unwrap(), p).max(u64::MAX / 2);
        }
    }
    // FLEASE_SEEDS=<from>..<to> runs another range of seeds (a search for failing ones).
    let seeds = match std::env::var("FLEASE_SEEDS")
        .ok()
        .and_then(|r| r.split_once("..").map(|(a, b)| (a.parse(), b.parse())))
    {
        Some((Ok(from), Ok(to))) => from..to,
        _ => seeds,
    };
    let mut grants = 0;
    for seed in seeds {
        match std::panic::catch_unwind(|| run(seed, p)) {
            Ok(g) => grants += g,
            Err(e) => {
                eprintln!(
                    "simulation failed: FLEASE_SEED={seed} FLEASE_NODES={} FLEASE_PROTO={} ({p:?})",
                    p.nodes,
                    p.proto.name()
                );
                std::panic::resume_unwind(e);
            }
        }
    }
    grants
}

/// Whether any of `seeds` exposes a violation (for the negative runs).
fn any_caught(p: Params, seeds: std::ops::Range<u64>) -> bool {
    seeds
        .into_iter()
        .any(|seed| std::panic::catch_unwind(|| run(seed, p)).is_err())
}

#[test]
fn three_nodes_never_grant_overlapping_leases() {
    let grants = run_seeds(Params::flease(3), 0..1000);
    assert!(
        grants > 10_000,
        "the simulation granted only {grants} leases"
    );
}

#[test]
fn five_nodes_never_grant_overlapping_leases() {
    let grants = run_seeds(Params::flease(5), 1000..1400);
    assert!(
        grants > 5_000,
        "the simulation granted only {grants} leases"
    );
}

/// With clocks further apart than epsilon, the checker must find an overlap: it is known to
/// work.
#[test]
fn the_checker_catches_overlaps_when_the_skew_bound_is_broken() {
    let p = Params {
        max_skew: 20 * CFG.eps_ms,
        ..Params::flease(3)
    };
    assert!(
        any_caught(p, 0..500),
        "no seed exposed an overlap with clocks 20 eps apart"
    );
}

#[test]
fn paxoslease_three_nodes_never_grant_overlapping_leases() {
    let grants = run_seeds(Params::paxos(3), 0..1000);
    assert!(
        grants > 10_000,
        "the simulation granted only {grants} leases"
    );
}

#[test]
fn paxoslease_five_nodes_never_grant_overlapping_leases() {
    let grants = run_seeds(Params::paxos(5), 2000..2400);
    assert!(
        grants > 5_000,
        "the simulation granted only {grants} leases"
    );
}

/// Exclusivity needs no clock synchronization at all: wall clocks up to an hour apart (two
/// owners never overlap; see `Params::regrant_allowed` for one holder).
#[test]
fn paxoslease_is_exclusive_with_unsynchronized_wall_clocks() {
    let p = Params {
        max_skew: 3_600_000,
        check_fencing: false,
        ..Params::paxos(3)
    };
    let grants = run_seeds(p, 5000..5300);
    assert!(
        grants > 3_000,
        "the simulation granted only {grants} leases"
    );
}

/// With monotonic clocks drifting far beyond the margin, the checker must find an overlap.
#[test]
fn the_checker_catches_overlaps_when_the_drift_bound_is_broken() {
    let p = Params {
        max_drift_ppm: 300_000,
        ..Params::paxos(3)
    };
    assert!(
        any_caught(p, 0..500),
        "no seed exposed an overlap with clocks drifting 30%"
    );
}
