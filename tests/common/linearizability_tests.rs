//! Tests of the linearizability checker (`linearizability.rs`) on histories whose answer is
//! known: a few written by hand, thousands generated from a sequential execution with random
//! overlapping intervals (linearizable by construction: each operation's interval contains
//! the moment it took effect), and the same with one operation added that no execution could
//! produce (a stale read, a read or compare-and-set that misses an acknowledged write, a value
//! nobody wrote). The checker must accept the first kind and reject the second, pinning the
//! added operation.
//!
//! Nothing here touches a cluster: every history is data, and a seed reproduces it.

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::checker::{
    Input, Op, Output, State, check, explain, linearizable, linearizable_unpruned,
};

const BUDGET: u64 = 50_000_000;

fn done(call: u64, ret: u64, input: Input, output: Output) -> Op {
    Op {
        call,
        ret: Some(ret),
        input,
        output,
    }
}

fn unanswered(call: u64, input: Input) -> Op {
    Op {
        call,
        ret: None,
        input,
        output: Output::Unknown,
    }
}

fn ok(ops: &[Op]) -> bool {
    let verdict = linearizable(ops, &mut budget()).expect("a verdict within the budget");
    let unpruned = linearizable_unpruned(ops, &mut budget()).expect("a verdict within the budget");
    assert_eq!(
        verdict, unpruned,
        "leaving operations out changed the verdict"
    );
    verdict
}

fn budget() -> u64 {
    BUDGET
}

/// Failures print their seed; nothing is written next to this file (proptest cannot place
/// its regression files for a module outside a crate root).
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

#[test]
fn hand_written_histories() {
    use Input::{Cas, Read, Write};
    // Sequential write then read.
    assert!(ok(&[
        done(0, 1, Write(1), Output::Written),
        done(2, 3, Read, Output::Read(Some(1))),
    ]));
    // A read after an acknowledged write that returns the older value.
    assert!(!ok(&[
        done(0, 1, Write(1), Output::Written),
        done(2, 3, Write(2), Output::Written),
        done(4, 5, Read, Output::Read(Some(1))),
    ]));
    // The same read concurrent with the second write may see either.
    assert!(ok(&[
        done(0, 1, Write(1), Output::Written),
        done(2, 6, Write(2), Output::Written),
        done(4, 5, Read, Output::Read(Some(1))),
    ]));
    // Two reads in order cannot see the new value and then the old one.
    assert!(!ok(&[
        done(0, 1, Write(1), Output::Written),
        done(2, 20, Write(2), Output::Written),
        done(4, 5, Read, Output::Read(Some(2))),
        done(6, 7, Read, Output::Read(Some(1))),
    ]));
    // An unanswered write may take effect long after its call, or never.
    assert!(ok(&[
        unanswered(0, Write(1)),
        done(5, 6, Read, Output::Read(None)),
        done(10, 11, Read, Output::Read(Some(1))),
    ]));
    assert!(ok(&[
        unanswered(0, Write(1)),
        done(5, 6, Write(2), Output::Written),
        done(10, 11, Read, Output::Read(Some(2))),
    ]));
    // ... but not before its call.
    assert!(!ok(&[
        done(0, 1, Read, Output::Read(Some(1))),
        unanswered(5, Write(1)),
    ]));
    // ... and only once: its value cannot come back after another write.
    assert!(!ok(&[
        unanswered(0, Write(1)),
        done(2, 3, Read, Output::Read(Some(1))),
        done(4, 5, Write(2), Output::Written),
        done(6, 7, Read, Output::Read(Some(1))),
    ]));
    // A value no operation wrote (a write that failed definitely is left out).
    assert!(!ok(&[done(0, 1, Read, Output::Read(Some(9)))]));
    // Compare-and-set on the absent key, then on the value read.
    assert!(ok(&[
        done(0, 1, Read, Output::Read(None)),
        done(
            2,
            3,
            Cas {
                expect: None,
                new: 1
            },
            Output::Swapped
        ),
        done(
            4,
            5,
            Cas {
                expect: None,
                new: 2
            },
            Output::NotSwapped(Some(Some(1)))
        ),
        done(
            6,
            7,
            Cas {
                expect: Some(1),
                new: 3
            },
            Output::Swapped
        ),
        done(8, 9, Read, Output::Read(Some(3))),
    ]));
    // Two compare-and-sets from the same value cannot both succeed.
    assert!(!ok(&[
        done(0, 1, Write(1), Output::Written),
        done(
            2,
            5,
            Cas {
                expect: Some(1),
                new: 2
            },
            Output::Swapped
        ),
        done(
            3,
            6,
            Cas {
                expect: Some(1),
                new: 3
            },
            Output::Swapped
        ),
    ]));
    // A failed compare-and-set that saw a value proves the value was there.
    assert!(!ok(&[
        done(0, 1, Write(1), Output::Written),
        done(
            2,
            3,
            Cas {
                expect: None,
                new: 2
            },
            Output::NotSwapped(Some(None))
        ),
    ]));
    // An unanswered compare-and-set takes effect only if its compare holds.
    assert!(ok(&[
        done(0, 1, Write(1), Output::Written),
        unanswered(
            2,
            Cas {
                expect: Some(1),
                new: 2
            }
        ),
        done(5, 6, Read, Output::Read(Some(2))),
    ]));
    assert!(!ok(&[
        done(0, 1, Write(1), Output::Written),
        unanswered(
            2,
            Cas {
                expect: None,
                new: 2
            }
        ),
        done(5, 6, Read, Output::Read(Some(2))),
    ]));
}

/// A linearizable history of `n` operations: a sequential execution, one operation every
/// 100 time units, each given an interval reaching up to `spread` either side of the moment
/// it took effect. Some writes and compare-and-sets are unanswered; of those, some took effect
/// and some never did. With `blind`, half the failed compare-and-sets do not say what they saw.
fn generate(rng: &mut StdRng, n: usize, spread: u64, blind: bool) -> Vec<Op> {
    let mut ops = Vec::with_capacity(n);
    let mut state: State = None;
    let mut written: Vec<u32> = Vec::new();
    let mut next_value = 1u32;
    for i in 0..n {
        let at = 1_000 + 100 * i as u64;
        let call = at - rng.random_range(0..=spread);
        let ret = at + rng.random_range(0..=spread);
        let unknown = rng.random_bool(0.08);
        let took_effect = !unknown || rng.random_bool(0.5);
        let choice = rng.random_range(0..10);
        let (input, output) = if choice < 4 {
            (Input::Read, Output::Read(state))
        } else if choice < 7 {
            let v = next_value;
            next_value += 1;
            if took_effect {
                state = Some(v);
                written.push(v);
            }
            (Input::Write(v), Output::Written)
        } else {
            let new = next_value;
            next_value += 1;
            let expect = if rng.random_bool(0.5) || written.is_empty() {
                state
            } else if rng.random_bool(0.2) {
                None
            } else {
                Some(written[rng.random_range(0..written.len())])
            };
            if expect == state {
                if took_effect {
                    state = Some(new);
                    written.push(new);
                }
                (Input::Cas { expect, new }, Output::Swapped)
            } else {
                let seen = (!blind || rng.random_bool(0.5)).then_some(state);
                (Input::Cas { expect, new }, Output::NotSwapped(seen))
            }
        };
        if unknown && input != Input::Read {
            ops.push(unanswered(call, input));
        } else if !unknown {
            ops.push(done(call, ret, input, output));
        }
        // An unanswered read constrains nothing and is left out, as the harness does.
    }
    ops
}

/// Add to a linearizable history one operation no execution could answer as it does; its
/// index is the last. `None` if the history offers no place for the chosen kind.
fn inject(rng: &mut StdRng, ops: &mut Vec<Op>) -> Option<&'static str> {
    let effective: Vec<usize> = (0..ops.len())
        .filter(|i| matches!(ops[*i].output, Output::Written | Output::Swapped))
        .collect();
    let new_value = |ops: &Vec<Op>| {
        ops.iter()
            .filter_map(|o| match o.input {
                Input::Write(v) | Input::Cas { new: v, .. } => Some(v),
                Input::Read => None,
            })
            .max()
            .unwrap_or(0)
            + 1
    };
    let value_of = |op: &Op| match op.input {
        Input::Write(v) | Input::Cas { new: v, .. } => v,
        Input::Read => unreachable!(),
    };
    if effective.is_empty() {
        return None;
    }
    let kind = rng.random_range(0..4);
    let (after, input, output, what) = match kind {
        // A stale read: the value of a write that an acknowledged write followed.
        0 => {
            let a = effective[rng.random_range(0..effective.len())];
            let later = effective
                .iter()
                .copied()
                .find(|b| ops[*b].call > ops[a].ret.unwrap())?;
            let v = value_of(&ops[a]);
            (
                ops[later].ret.unwrap(),
                Input::Read,
                Output::Read(Some(v)),
                "stale read",
            )
        }
        // A lost write: after an acknowledged write `w`, a read or a compare-and-set that finds
        // the value from before it: the newest of the writes that returned before `w` was
        // called (or absent if none did). That write precedes `w` in every linearization and is
        // the only one to write its value, and nothing deletes, so the value cannot be back.
        1 | 2 => {
            let w = effective[rng.random_range(0..effective.len())];
            let before: State = effective
                .iter()
                .copied()
                .filter(|p| ops[*p].ret.unwrap() < ops[w].call)
                .max_by_key(|p| ops[*p].ret)
                .map(|p| value_of(&ops[p]));
            let after = ops[w].ret.unwrap();
            if kind == 1 {
                (
                    after,
                    Input::Read,
                    Output::Read(before),
                    "lost write (read)",
                )
            } else {
                let new = new_value(ops);
                (
                    after,
                    Input::Cas {
                        expect: before,
                        new,
                    },
                    Output::Swapped,
                    "lost write (compare-and-set)",
                )
            }
        }
        // A value nobody wrote.
        _ => {
            let v = new_value(ops);
            (0, Input::Read, Output::Read(Some(v)), "value never written")
        }
    };
    let call = after + 1 + rng.random_range(0..50);
    ops.push(done(call, call + rng.random_range(0..300), input, output));
    Some(what)
}

proptest! {
    #![proptest_config(config(2_000))]

    #[test]
    fn histories_from_a_sequential_execution_are_linearizable(
        seed in any::<u64>(), n in 1usize..150, spread in 0u64..400, blind in any::<bool>(),
    ) {
        let ops = generate(&mut StdRng::seed_from_u64(seed), n, spread, blind);
        let verdict = check(&ops, &mut budget()).expect("a verdict within the budget");
        prop_assert!(verdict.is_none(), "seed {seed}: rejected: {verdict:?}");
    }

    #[test]
    fn an_impossible_answer_is_rejected_and_pinned(
        seed in any::<u64>(), n in 2usize..150, spread in 0u64..400, blind in any::<bool>(),
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut ops = generate(&mut rng, n, spread, blind);
        let Some(what) = inject(&mut rng, &mut ops) else { return Ok(()) };
        let added = ops.len() - 1;
        let verdict = check(&ops, &mut budget()).expect("a verdict within the budget");
        let Some(v) = verdict else {
            return Err(TestCaseError::fail(format!("seed {seed}: {what} accepted: {:?}", ops[added])));
        };
        prop_assert_eq!(v.at, ops[added].ret.unwrap(), "seed {}: {}", seed, what);
        prop_assert!(v.culprits.contains(&added), "seed {seed}: {what}: culprits {:?}", v.culprits);
        // What the key could hold instead: never what the impossible read returned. (Failed
        // compare-and-sets that do not say what they saw keep every unanswered write in the
        // search, so listing the states may run out of its budget then.)
        if let Output::Read(x) = ops[added].output {
            prop_assert!(blind || v.possible.is_some(), "seed {seed}: not computed in budget");
            if let Some(possible) = &v.possible {
                prop_assert!(!possible.is_empty() && !possible.contains(&x), "seed {seed}: {possible:?}");
            }
        }
    }
}

proptest! {
    #![proptest_config(config(500))]

    /// Leaving out the unanswered operations that cannot matter never changes a verdict
    /// (small histories, so that the full search stays cheap).
    #[test]
    fn leaving_operations_out_changes_no_verdict(
        seed in any::<u64>(), n in 2usize..40, spread in 0u64..400, bad in any::<bool>(),
    ) {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut ops = generate(&mut rng, n, spread, true);
        if bad {
            inject(&mut rng, &mut ops);
        }
        let pruned = linearizable(&ops, &mut budget()).expect("a verdict within the budget");
        let full = linearizable_unpruned(&ops, &mut budget()).expect("a verdict within the budget");
        prop_assert_eq!(pruned, full, "seed {}", seed);
    }
}

/// More operations per key than the cluster test produces, more concurrency and more
/// unanswered operations than it has, and failed compare-and-sets that say what they saw (as
/// the test's do): the check must stay fast (a few steps per operation), and a violation at
/// the end must be found and explained in budget.
#[test]
fn thousands_of_overlapping_operations_check_quickly() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut ops = generate(&mut rng, 4_000, 300, false);
    let mut budget = BUDGET;
    assert_eq!(check(&ops, &mut budget), Ok(None));
    let used = BUDGET - budget;
    eprintln!("4,000 operations checked in {used} steps");
    assert!(used < 200 * 4_000, "{used} steps for 4,000 operations");

    // A stale read at the end: the value of the first write, read after the last one.
    let first = ops
        .iter()
        .position(|o| o.output == Output::Written)
        .unwrap();
    let Input::Write(v) = ops[first].input else {
        unreachable!()
    };
    let last = ops.iter().filter_map(|o| o.ret).max().unwrap();
    ops.push(done(last + 1, last + 2, Input::Read, Output::Read(Some(v))));
    let mut budget = BUDGET;
    let began = std::time::Instant::now();
    let violation = check(&ops, &mut budget)
        .expect("a verdict within the budget")
        .expect("the stale read is rejected");
    eprintln!(
        "the stale read found in {} steps, {:?}",
        BUDGET - budget,
        began.elapsed()
    );
    assert_eq!(violation.culprits, vec![ops.len() - 1]);
    let text = explain(&ops, &violation, &|i| format!("op {i}"), &|s| {
        s.map_or("(absent)".into(), |v| format!("v{v}"))
    });
    eprintln!("what a violation looks like:\n{text}");
    assert!(text.contains("<== cannot be linearized"), "{text}");
    assert!(text.contains(&format!("write v{v}")), "{text}");
    assert!(text.lines().count() < 100, "{text}");
}
