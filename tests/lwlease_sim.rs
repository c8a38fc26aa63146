//! A seeded simulation of the Chockler–Malkhi light-weight lease (`domain::lwlease`): many
//! contenders over one regular register, in simulated time (no real clock, no sleeps).
//!
//! The register is *regular*, the weakest the paper assumes. A read returns the value of the
//! last write completed before the read began, or the value of any write that overlaps the
//! read. Every operation takes a random time. In the stable runs it is always under `δ`, as
//! the paper assumes after stabilization. Contenders start at random times, renew, crash or
//! give up at random.
//!
//! Checked after every run:
//! - Safety (Property 1.1 and Lemma 10): two contenders never hold at once. No one acquires
//!   while another is in the middle of a successful renewal.
//! - Contend progress (Property 1.2): some contender acquires the lease.
//! - Renewal progress (Lemma 11): a correct holder that renews on time never loses the lease.
//!
//! A negative run lets operations take up to 4δ, and the checker must catch an overlap. A
//! failing seed is printed; rerun it with `LWLEASE_SEED=<seed>`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use leasecore::domain::lwlease::{Contender, Stamp, Step, Timing};
use leasecore::domain::types::MonoMillis;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DELTA: u64 = 100;
const LEASE: u64 = 1_000;
const RUN_FOR: u64 = 40 * LEASE;

#[derive(Debug)]
enum Event {
    Start(usize),
    ReadDone { p: usize, invoked: u64 },
    WriteDone(usize),
    Wake(usize),
    HoldEnds(usize),
}

struct Write {
    value: Stamp,
    invoked: u64,
    done: u64,
}

struct Sim {
    rng: StdRng,
    now: u64,
    /// Operations take 1 to `max_op` time units.
    max_op: u64,
    events: BinaryHeap<Reverse<(u64, u64, usize)>>,
    payloads: Vec<Option<Event>>,
    contenders: Vec<Contender>,
    crashed: Vec<bool>,
    writes: Vec<Write>,
    /// (owner, from, to) of every lease held.
    holds: Vec<(usize, u64, u64)>,
    /// (owner, from, to) of every successful renewal (from the renew call to its hold).
    renewals: Vec<(usize, u64, u64)>,
    renewing_since: Vec<Option<u64>>,
    lost_renewals_by_correct: u32,
}

impl Sim {
    fn new(seed: u64, contenders: usize, max_op: u64) -> Sim {
        let timing = Timing::new(DELTA, LEASE).unwrap();
        let mut sim = Sim {
            rng: StdRng::seed_from_u64(seed),
            now: 0,
            max_op,
            events: BinaryHeap::new(),
            payloads: Vec::new(),
            contenders: (0..contenders)
                .map(|i| Contender::new(format!("c{i}"), timing, 0))
                .collect(),
            crashed: vec![false; contenders],
            writes: Vec::new(),
            holds: Vec::new(),
            renewals: Vec::new(),
            renewing_since: vec![None; contenders],
            lost_renewals_by_correct: 0,
        };
        for p in 0..contenders {
            let at = sim.rng.random_range(0..3 * LEASE);
            sim.at(at, Event::Start(p));
        }
        sim
    }

    fn at(&mut self, time: u64, event: Event) {
        let id = self.payloads.len();
        self.payloads.push(Some(event));
        self.events.push(Reverse((time, id as u64, id)));
    }

    fn op_time(&mut self) -> u64 {
        self.rng.random_range(1..self.max_op)
    }

    /// The value a read over `[invoked, done]` may return on a regular register.
    fn read_value(&mut self, invoked: u64, done: u64) -> Option<Stamp> {
        let base = self
            .writes
            .iter()
            .filter(|w| w.done <= invoked)
            .max_by_key(|w| w.done)
            .map(|w| w.value.clone());
        let mut candidates: Vec<Option<Stamp>> = vec![base];
        candidates.extend(
            self.writes
                .iter()
                .filter(|w| w.invoked < done && w.done > invoked)
                .map(|w| Some(w.value.clone())),
        );
        let i = self.rng.random_range(0..candidates.len());
        candidates.swap_remove(i)
    }

    /// Carry out what contender `p` asked for.
    fn perform(&mut self, p: usize, step: Step) {
        match step {
            Step::Read => {
                let d = self.op_time();
                let invoked = self.now;
                self.at(self.now + d, Event::ReadDone { p, invoked });
            }
            Step::Write(value) => {
                let d = self.op_time();
                self.writes.push(Write {
                    value,
                    invoked: self.now,
                    done: self.now + d,
                });
                self.at(self.now + d, Event::WriteDone(p));
            }
            Step::SleepUntil(t) => self.at(t.0, Event::Wake(p)),
            Step::Hold(until) => {
                self.holds.push((p, self.now, until.0));
                if let Some(since) = self.renewing_since[p].take() {
                    self.renewals.push((p, since, self.now));
                }
                self.at(until.0, Event::HoldEnds(p));
            }
            Step::Lost => {
                if self.renewing_since[p].take().is_some() && !self.crashed[p] {
                    self.lost_renewals_by_correct += 1;
                }
                if self.rng.random_bool(0.7) {
                    let step = self.contenders[p].contend();
                    self.perform(p, step);
                }
            }
            Step::Busy => panic!("contender {p} got a report it did not ask for"),
        }
    }

    fn run(&mut self) {
        while let Some(Reverse((time, _, id))) = self.events.pop() {
            if time > RUN_FOR {
                break;
            }
            self.now = time;
            let event = self.payloads[id].take().unwrap();
            let p = match event {
                Event::Start(p)
                | Event::ReadDone { p, .. }
                | Event::WriteDone(p)
                | Event::Wake(p)
                | Event::HoldEnds(p) => p,
            };
            // A crashed contender's operations still complete at the register (a write in
            // flight lands), but it takes no further step.
            if self.crashed[p] {
                continue;
            }
            let now = MonoMillis(self.now);
            let step = match event {
                Event::Start(_) => self.contenders[p].contend(),
                Event::ReadDone { invoked, .. } => {
                    let value = self.read_value(invoked, self.now);
                    self.contenders[p].read_done(value, now)
                }
                Event::WriteDone(_) => self.contenders[p].write_done(now),
                Event::Wake(_) => self.contenders[p].woke(now),
                Event::HoldEnds(_) => {
                    // A holder renews on time, gives up, or crashes.
                    match self.rng.random_range(0..20) {
                        0 => {
                            self.crashed[p] = true;
                            continue;
                        }
                        1 => continue,
                        _ => {
                            self.renewing_since[p] = Some(self.now);
                            self.contenders[p].renew()
                        }
                    }
                }
            };
            self.perform(p, step);
        }
    }

    /// The first pair of holds by different contenders that overlap, or a hold that began
    /// during another's successful renewal.
    fn violation(&self) -> Option<String> {
        for (i, a) in self.holds.iter().enumerate() {
            for b in &self.holds[i + 1..] {
                if a.0 != b.0 && a.1 < b.2 && b.1 < a.2 {
                    return Some(format!("holds overlap: {a:?} and {b:?}"));
                }
            }
            for r in &self.renewals {
                if r.0 != a.0 && r.1 < a.1 && a.1 < r.2 {
                    return Some(format!("hold {a:?} began during renewal {r:?}"));
                }
            }
        }
        None
    }
}

fn stable_run(seed: u64) -> Sim {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = rng.random_range(1..8);
    let mut sim = Sim::new(seed, n, DELTA);
    sim.run();
    sim
}

#[test]
fn one_holder_at_a_time_and_progress_over_thousands_of_seeds() {
    let seeds: Vec<u64> = match std::env::var("LWLEASE_SEED") {
        Ok(s) => vec![s.parse().expect("a u64 seed")],
        Err(_) => (0..2_000).collect(),
    };
    let (mut holds, mut renewals) = (0, 0);
    for seed in seeds {
        let sim = stable_run(seed);
        if let Some(v) = sim.violation() {
            panic!("seed {seed}: {v}");
        }
        assert!(!sim.holds.is_empty(), "seed {seed}: no contender ever held");
        assert_eq!(
            sim.lost_renewals_by_correct, 0,
            "seed {seed}: a correct holder that renewed on time lost the lease"
        );
        holds += sim.holds.len();
        renewals += sim.renewals.len();
    }
    assert!(renewals > 1_000, "too few renewals exercised: {renewals}");
    eprintln!("{holds} holds, {renewals} renewals, no overlap");
}

#[test]
fn the_checker_catches_operations_slower_than_delta() {
    let caught = (0..2_000u64).any(|seed| {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = rng.random_range(3..8);
        let mut sim = Sim::new(seed, n, 4 * DELTA);
        sim.run();
        sim.violation().is_some()
    });
    assert!(
        caught,
        "no seed exposed an overlap with operations up to 4δ"
    );
}
