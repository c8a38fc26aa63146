//! A linearizability checker for a history of operations on one register (one key of a
//! key-value store): reads, writes and compare-and-sets, some of which never returned.
//!
//! The search is Wing and Gong's, with Lowe's just-in-time linearization and memoization (the
//! algorithm porcupine implements): walk the invocations and returns in time order; an
//! invocation may be linearized now if the model accepts its answer from the current state;
//! a return whose operation is not linearized yet means the choices so far were wrong, so
//! undo the last one and try the next candidate. A cache of (set of linearized operations,
//! state) prunes every configuration already explored, which keeps histories of thousands of
//! operations per key at a few steps per operation when they are linearizable.
//!
//! The model is deliberately tiny so that it is obviously right: the state is the key's value
//! (or absent); a write sets it; a read returns it; a compare-and-set whose expected value
//! (absent included) equals the state sets the new value and otherwise changes nothing.
//! Values are unique per write, which is what makes a compare on a *revision* a compare on a
//! value: a value is applied once, so it has exactly one revision.
//!
//! An operation whose outcome is unknown (a timeout, a broken connection, `outcome_unknown`)
//! has no return: it may take effect at any time after its invocation, or never. It is never
//! required to be linearized; a read whose answer is unknown constrains nothing and is
//! dropped. A definite failure (nothing was done) is not an operation at all: the caller
//! leaves it out, so that a value it wrote may never be observed.
//!
//! Real-time order is taken from the caller's times: an operation that returned strictly
//! before another was invoked precedes it. Equal times count as concurrent, so that rounding
//! can only make the check more permissive, never report a false violation.
//!
//! Only the verdict matters for soundness; [`explain`] picks the operations around a
//! violation for a person to read. It must stay pure: no clocks, no I/O, no knowledge of
//! leasecore.
#![allow(dead_code)]

use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;

/// A value, interned by the caller (unique per write).
pub type Value = u32;
/// The register: a value, or absent.
pub type State = Option<Value>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    Read,
    Write(Value),
    /// Set `new` if the register holds `expect` (absent included).
    Cas {
        expect: State,
        new: Value,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A read's answer.
    Read(State),
    /// A write was applied.
    Written,
    /// A compare-and-set found its expected value and wrote.
    Swapped,
    /// A compare-and-set found another value and wrote nothing; what it saw, when the answer
    /// said (`Some(None)`: the key was absent).
    NotSwapped(Option<State>),
    /// No answer: the operation may or may not take effect, at any time after its call.
    Unknown,
}

/// One operation on one key. `ret` is `None` exactly when `output` is [`Output::Unknown`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub call: u64,
    pub ret: Option<u64>,
    pub input: Input,
    pub output: Output,
}

/// The sequential specification: the state after `op`, or `None` if `op` could not have
/// answered what it did from `state`.
pub fn step(state: State, op: &Op) -> Option<State> {
    match (op.input, op.output) {
        (Input::Read, Output::Read(v)) => (state == v).then_some(state),
        (Input::Read, Output::Unknown) => Some(state),
        (Input::Write(v), Output::Written | Output::Unknown) => Some(Some(v)),
        (Input::Cas { expect, new }, Output::Swapped) => (state == expect).then_some(Some(new)),
        (Input::Cas { expect, .. }, Output::NotSwapped(seen)) => {
            (state != expect && seen.is_none_or(|s| s == state)).then_some(state)
        }
        (Input::Cas { expect, new }, Output::Unknown) => {
            Some(if state == expect { Some(new) } else { state })
        }
        (input, output) => panic!("an answer {output:?} cannot come from {input:?}"),
    }
}

/// The search ran out of its step budget: no verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GaveUp;

/// How a search ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    /// `stop` said stop at a state where every completed operation was linearized.
    Stopped,
    /// Every configuration was explored. Each had an operation left whose return is at or
    /// before this time: the observed history (see [`observed_at`]) is linearizable at every
    /// earlier time, so a violation shows first at this time or later.
    Exhausted { frontier: u64 },
}

const NIL: usize = usize::MAX;

/// Lowe's search over `ops`. Each time every completed operation is linearized, `stop` gets
/// the state; the search ends if it answers true, and goes on (linearizing more of the
/// operations that never returned, or backtracking) otherwise. `budget` counts steps.
///
/// Why the frontier bounds the violation from below: a configuration whose first remaining
/// return is at `f` has linearized every operation that returned before `f`, and none called
/// after such a return ahead of it, so its sequence up to them is a linearization of the
/// history observed at any time before `f`.
fn search(
    ops: &[Op],
    budget: &mut u64,
    mut stop: impl FnMut(State) -> bool,
) -> Result<Ended, GaveUp> {
    // Entries: (time, 0 = call / 1 = return, op). At equal times calls come first, so the
    // operations overlap (the permissive reading).
    let mut entries: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * ops.len());
    for (i, op) in ops.iter().enumerate() {
        assert_eq!(
            op.ret.is_none(),
            op.output == Output::Unknown,
            "operation {i}: a return time exactly when the answer is known"
        );
        entries.push((op.call, 0, i));
        if let Some(r) = op.ret {
            assert!(r >= op.call, "operation {i} returns before its call");
            entries.push((r, 1, i));
        }
    }
    entries.sort_unstable();
    // A doubly linked list over the entries; node 0 is the head, entry k is node k + 1.
    let m = entries.len();
    let mut next: Vec<usize> = (1..=m + 1).map(|n| if n > m { NIL } else { n }).collect();
    let mut prev: Vec<usize> = (0..=m).map(|n| n.wrapping_sub(1)).collect();
    let (mut call_node, mut ret_node) = (vec![0; ops.len()], vec![NIL; ops.len()]);
    for (k, &(_, kind, i)) in entries.iter().enumerate() {
        if kind == 0 {
            call_node[i] = k + 1;
        } else {
            ret_node[i] = k + 1;
        }
    }
    let unlink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, n: usize| {
        next[prev[n]] = next[n];
        if next[n] != NIL {
            prev[next[n]] = prev[n];
        }
    };
    // Removals are undone in the reverse order, so a removed node's own links are still right.
    let relink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, n: usize| {
        next[prev[n]] = n;
        if next[n] != NIL {
            prev[next[n]] = n;
        }
    };

    let completed = ops.iter().filter(|o| o.ret.is_some()).count();
    let mut done = 0usize;
    // The set of linearized operations, and one more word for the state: the cache's key, looked
    // up without a copy (only a new configuration is copied in).
    let words = ops.len().div_ceil(64);
    let mut linearized = vec![0u64; words + 1];
    let encode = |s: State| s.map_or(u64::MAX, u64::from);
    let mut cache: HashSet<Vec<u64>> = HashSet::new();
    let mut frontier = 0u64;
    let mut stack: Vec<(usize, State)> = Vec::new();
    let mut state: State = None;
    let mut cur = next[0];
    let mut reached = true;
    loop {
        if reached {
            reached = false;
            if done == completed && stop(state) {
                return Ok(Ended::Stopped);
            }
        }
        if *budget == 0 {
            return Err(GaveUp);
        }
        *budget -= 1;
        let candidate = (cur != NIL)
            .then(|| entries[cur - 1])
            .filter(|&(_, kind, _)| kind == 0);
        if let Some((_, _, i)) = candidate {
            if let Some(after) = step(state, &ops[i]) {
                linearized[i / 64] |= 1 << (i % 64);
                linearized[words] = encode(after);
                if !cache.contains(&linearized[..]) {
                    cache.insert(linearized.clone());
                    stack.push((i, state));
                    state = after;
                    done += usize::from(ops[i].ret.is_some());
                    unlink(&mut next, &mut prev, call_node[i]);
                    if ret_node[i] != NIL {
                        unlink(&mut next, &mut prev, ret_node[i]);
                    }
                    cur = next[0];
                    reached = true;
                    continue;
                }
                linearized[i / 64] &= !(1 << (i % 64));
            }
            cur = next[cur];
            continue;
        }
        // A return whose operation is not linearized (or the end of the list): undo the last
        // choice and try the candidate after it.
        frontier = frontier.max(if cur == NIL {
            u64::MAX
        } else {
            entries[cur - 1].0
        });
        let Some((i, before)) = stack.pop() else {
            return Ok(Ended::Exhausted { frontier });
        };
        if ret_node[i] != NIL {
            relink(&mut next, &mut prev, ret_node[i]);
        }
        relink(&mut next, &mut prev, call_node[i]);
        linearized[i / 64] &= !(1 << (i % 64));
        done -= usize::from(ops[i].ret.is_some());
        state = before;
        cur = next[call_node[i]];
    }
}

/// `ops` without the operations that cannot change the verdict, which would otherwise cost
/// the search a factor of two each (each may be linearized at any point after its call, or
/// not at all): unanswered reads, and unanswered writes and compare-and-sets whose value no
/// operation saw or expected.
///
/// Why leaving such a write of `x` out is sound: take a linearization that has it. Until the
/// next operation that sets the key, nothing reads `x` or compares with it, so the operations
/// in between are unanswered ones (move them to the end, where they change nothing that is
/// observed) or compare-and-sets that failed without saying what they saw. Only the last kind
/// could tell `x` from the value before it, so writes called before such an operation returned
/// are kept.
fn relevant(ops: &[Op]) -> Vec<Op> {
    let mut seen: HashSet<Value> = HashSet::new();
    let mut blind_until: Option<u64> = None;
    for op in ops {
        if let Output::Read(Some(x)) | Output::NotSwapped(Some(Some(x))) = op.output {
            seen.insert(x);
        }
        if let Input::Cas {
            expect: Some(x), ..
        } = op.input
        {
            seen.insert(x);
        }
        if op.output == Output::NotSwapped(None) {
            blind_until = blind_until.max(op.ret);
        }
    }
    ops.iter()
        .filter(|op| match (op.input, op.output) {
            (Input::Read, Output::Unknown) => false,
            (Input::Write(x) | Input::Cas { new: x, .. }, Output::Unknown) => {
                seen.contains(&x) || blind_until.is_some_and(|t| op.call <= t)
            }
            _ => true,
        })
        .copied()
        .collect()
}

/// Whether `ops` (one key's history, starting from an absent key) is linearizable.
pub fn linearizable(ops: &[Op], budget: &mut u64) -> Result<bool, GaveUp> {
    Ok(search(&relevant(ops), budget, |_| true)? == Ended::Stopped)
}

/// [`linearizable`] without leaving anything out: slower, for testing that leaving out
/// changes no verdict.
pub fn linearizable_unpruned(ops: &[Op], budget: &mut u64) -> Result<bool, GaveUp> {
    Ok(search(ops, budget, |_| true)? == Ended::Stopped)
}

/// `None` if `ops` is linearizable, else the frontier of [`Ended::Exhausted`].
fn frontier(ops: &[Op], budget: &mut u64) -> Result<Option<u64>, GaveUp> {
    Ok(match search(&relevant(ops), budget, |_| true)? {
        Ended::Stopped => None,
        Ended::Exhausted { frontier } => Some(frontier),
    })
}

/// Every state the key can hold once every completed operation of `ops` is linearized (some
/// of the unanswered ones too, or not); empty if `ops` is not linearizable.
pub fn possible_states(ops: &[Op], budget: &mut u64) -> Result<BTreeSet<State>, GaveUp> {
    let mut states = BTreeSet::new();
    search(&relevant(ops), budget, |s| {
        states.insert(s);
        false
    })?;
    Ok(states)
}

/// The history as an observer saw it at time `t`: the operations called by then (their
/// indexes in `ops`), those not returned by then without an answer, unanswered reads left
/// out. If a history is linearizable, so is every such prefix of it (the linearization
/// points before `t` are a prefix of its linearization, and what is left unanswered may be
/// placed after them), so the first `t` at which the prefix fails pins the violation.
pub fn observed_at(ops: &[Op], t: u64) -> (Vec<Op>, Vec<usize>) {
    let mut out = Vec::new();
    let mut index = Vec::new();
    for (i, op) in ops.iter().enumerate().filter(|(_, o)| o.call <= t) {
        let mut op = *op;
        if op.ret.is_none_or(|r| r > t) {
            if op.input == Input::Read {
                continue;
            }
            op.ret = None;
            op.output = Output::Unknown;
        }
        out.push(op);
        index.push(i);
    }
    (out, index)
}

/// Where a history stops being linearizable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The first return time at which the observed history is not linearizable.
    pub at: u64,
    /// The operations (indexes in the history) that returned at `at`: one of them cannot be
    /// placed.
    pub culprits: Vec<usize>,
    /// What the key could hold with every other operation answered by `at` linearized (the
    /// culprits left unanswered), when the search could tell within its budget.
    pub possible: Option<BTreeSet<State>>,
}

/// Check `ops`; on a violation, find the earliest return at which it shows.
pub fn check(ops: &[Op], budget: &mut u64) -> Result<Option<Violation>, GaveUp> {
    let Some(frontier) = frontier(ops, budget)? else {
        return Ok(None);
    };
    let mut returns: Vec<u64> = ops.iter().filter_map(|o| o.ret).collect();
    returns.sort_unstable();
    returns.dedup();
    // The prefix at the last return is the whole history (later calls never returned), so it
    // fails; every prefix before the frontier passes. Find the first return whose prefix
    // fails, galloping up from the frontier (usually the answer) and then bisecting, so that
    // few of the exhaustive searches a failing prefix costs are made.
    let last = returns.len() - 1;
    let (mut lo, mut hi) = (returns.partition_point(|r| *r < frontier).min(last), last);
    let mut stride = 1;
    while lo < hi {
        let probe = (lo + stride - 1).min(hi);
        if linearizable(&observed_at(ops, returns[probe]).0, budget)? {
            lo = probe + 1;
            stride *= 2;
        } else {
            hi = probe;
            break;
        }
    }
    while lo < hi {
        let mid = (lo + hi) / 2;
        if linearizable(&observed_at(ops, returns[mid]).0, budget)? {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let at = returns[lo];
    let culprits: Vec<usize> = (0..ops.len()).filter(|i| ops[*i].ret == Some(at)).collect();
    let (mut before, _) = observed_at(ops, at);
    for op in before.iter_mut().filter(|o| o.ret == Some(at)) {
        op.ret = None;
        op.output = Output::Unknown;
    }
    before.retain(|o| !(o.input == Input::Read && o.output == Output::Unknown));
    let mut small = (*budget).min(500_000);
    let possible = possible_states(&before, &mut small).ok();
    Ok(Some(Violation {
        at,
        culprits,
        possible,
    }))
}

/// The operations of `ops` around `v` for a person: the culprits, everything concurrent with
/// them, the last few writes that completed before them, every unanswered operation called
/// before, and the operations that wrote the values the culprits saw or expected. `who`
/// names an operation's process, node and API; `name` prints a value; times are printed in
/// milliseconds as given (the caller's origin).
pub fn explain(
    ops: &[Op],
    v: &Violation,
    who: &dyn Fn(usize) -> String,
    name: &dyn Fn(State) -> String,
) -> String {
    const WRITES_BEFORE: usize = 3;
    const MAX_LINES: usize = 80;
    let first_call = v
        .culprits
        .iter()
        .map(|c| ops[*c].call)
        .min()
        .unwrap_or(v.at);
    let mut writes: Vec<&Op> = ops
        .iter()
        .filter(|o| o.ret.is_some_and(|r| r < first_call))
        .filter(|o| matches!(o.output, Output::Written | Output::Swapped))
        .collect();
    writes.sort_by_key(|o| o.ret);
    let start = writes
        .iter()
        .rev()
        .take(WRITES_BEFORE)
        .map(|o| o.call)
        .chain([first_call])
        .min()
        .unwrap();
    // Unanswered operations called before the window stay open for ever; those that matter
    // wrote a value the culprits saw, and are listed below with where the values came from.
    let mut shown: Vec<usize> = (0..ops.len())
        .filter(|i| ops[*i].call <= v.at && ops[*i].ret.unwrap_or(ops[*i].call) >= start)
        .collect();
    let open_before = (0..ops.len())
        .filter(|i| ops[*i].ret.is_none() && ops[*i].call < start)
        .count();
    shown.sort_by_key(|i| (ops[*i].call, *i));
    let cut = shown.len().saturating_sub(MAX_LINES);
    shown.drain(..cut);

    let seen: BTreeSet<Value> = v
        .culprits
        .iter()
        .flat_map(|c| {
            let got = match ops[*c].output {
                Output::Read(Some(x)) | Output::NotSwapped(Some(Some(x))) => Some(x),
                _ => None,
            };
            let expected = match ops[*c].input {
                Input::Cas { expect, .. } => expect,
                _ => None,
            };
            got.into_iter().chain(expected)
        })
        .collect();
    let writers: Vec<usize> = (0..ops.len())
        .filter(|i| match ops[*i].input {
            Input::Write(x) | Input::Cas { new: x, .. } => seen.contains(&x),
            Input::Read => false,
        })
        .collect();

    let ms = |t: u64| format!("{:10.3}", t as f64 / 1e6);
    let line = |out: &mut String, i: usize| {
        let op = &ops[i];
        let what = match op.input {
            Input::Read => "read".to_string(),
            Input::Write(x) => format!("write {}", name(Some(x))),
            Input::Cas { expect, new } => format!("cas {} -> {}", name(expect), name(Some(new))),
        };
        let answer = match op.output {
            Output::Read(s) => name(s),
            Output::Written => "ok".into(),
            Output::Swapped => "swapped".into(),
            Output::NotSwapped(None) => "not swapped".into(),
            Output::NotSwapped(Some(s)) => format!("not swapped, saw {}", name(s)),
            Output::Unknown => "UNKNOWN (no answer)".into(),
        };
        let ret = op.ret.map_or_else(|| format!("{:>10}", "never"), ms);
        let mark = if v.culprits.contains(&i) {
            "  <== cannot be linearized"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  #{i:<5} {} .. {}  {:<28} {:<40} -> {answer}{mark}",
            ms(op.call),
            ret,
            who(i),
            what
        );
    };

    let mut out = String::new();
    let _ = writeln!(
        out,
        "not linearizable: the history observed at {} ms has no linearization (the one just \
         before has)",
        ms(v.at).trim()
    );
    match &v.possible {
        Some(p) => {
            let p: Vec<String> = p.iter().map(|s| name(*s)).collect();
            let _ = writeln!(
                out,
                "with every other operation answered by then linearized, the key can only \
                 hold: {}",
                p.join(", ")
            );
        }
        None => out.push_str("(the values the key could hold were not computed in budget)\n"),
    }
    let _ = writeln!(
        out,
        "operations from {} ms (call .. return, ms; {} earlier ones not shown, {} of them \
         unanswered, which may take effect at any time after their call):",
        ms(start).trim(),
        cut + (0..ops.len())
            .filter(|i| ops[*i].ret.is_some_and(|r| r < start))
            .count()
            + open_before,
        open_before
    );
    for i in &shown {
        line(&mut out, *i);
    }
    if !writers.is_empty() {
        out.push_str("where the values the culprits saw or expected came from:\n");
        for i in writers {
            line(&mut out, i);
        }
    } else if !seen.is_empty() {
        out.push_str("no operation in the history wrote the values the culprits saw or expected\n");
    }
    out
}
