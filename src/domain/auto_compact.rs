//! Automatic MVCC compaction, as etcd's `--auto-compaction-mode` and
//! `--auto-compaction-retention`: when the leader should compact, and to which revision. Pure:
//! the driver (`runtime::auto_compact`) gives it the time and the store revision, and proposes
//! what it answers.
//!
//! - `periodic`: keep the history of the last `retention`. The store revision is sampled every
//!   tenth of the retention (etcd's granularity); each check compacts to the newest sample at
//!   least `retention` old.
//! - `revision`: keep the last `retention` revisions; checked every 5 minutes (etcd's period),
//!   compacting to `current - retention`.
//!
//! # Invariants
//! - Never proposes a revision at or below one it already proposed, or above the current one.
//! - A new leader starts with no samples: its first periodic compaction comes one retention
//!   after it took over (it never compacts history younger than the retention).
//!
//! # What it must not do
//! Read a clock or know about Raft: it answers "compact to r" and nothing else.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;

use super::types::Revision;

/// How often `revision` mode looks (etcd: every 5 minutes).
pub const REVISION_MODE_PERIOD_MS: u64 = 5 * 60 * 1000;

/// What to keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retention {
    /// The history of the last this many milliseconds.
    Periodic { ms: u64 },
    /// The last this many revisions.
    Revisions { count: u64 },
}

/// Why a mode or retention was refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadRetention(String);

impl Retention {
    /// etcd's flags: mode `periodic` with a duration (`1h`, `30m`, `90s`, or a bare number of
    /// hours), mode `revision` with a count. A zero retention turns it off (`None`).
    pub fn parse(mode: &str, retention: &str) -> Result<Option<Retention>, BadRetention> {
        let retention = retention.trim();
        match mode {
            "periodic" => {
                let ms = parse_duration_ms(retention)?;
                Ok((ms > 0).then_some(Retention::Periodic { ms }))
            }
            "revision" => {
                let count = u64::from_str(retention).map_err(|_| {
                    BadRetention(format!(
                        "--auto-compaction-retention {retention:?}: revision mode takes a number of revisions"
                    ))
                })?;
                Ok((count > 0).then_some(Retention::Revisions { count }))
            }
            other => Err(BadRetention(format!(
                "--auto-compaction-mode {other:?}: expected periodic or revision"
            ))),
        }
    }

    /// How often the driver should call [`AutoCompaction::tick`].
    pub fn tick_ms(&self) -> u64 {
        match self {
            Retention::Periodic { ms } => (ms / 10).max(1),
            Retention::Revisions { .. } => REVISION_MODE_PERIOD_MS,
        }
    }
}

impl fmt::Display for Retention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Retention::Periodic { ms } => write!(f, "periodic, keep {ms} ms"),
            Retention::Revisions { count } => write!(f, "revision, keep {count} revisions"),
        }
    }
}

/// A duration as etcd's flag takes it: a bare number is hours; else digits and a unit
/// (`ms`, `s`, `m`, `h`), possibly several (`1h30m`).
fn parse_duration_ms(text: &str) -> Result<u64, BadRetention> {
    let bad = || {
        BadRetention(format!(
            "--auto-compaction-retention {text:?}: expected a duration such as 1h, 30m, 90s (a bare number is hours)"
        ))
    };
    if let Ok(hours) = u64::from_str(text) {
        return hours.checked_mul(3_600_000).ok_or_else(bad);
    }
    let mut total: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n = u64::from_str(&rest[..digits]).map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let per = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return Err(bad()),
        };
        total = n
            .checked_mul(per)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

/// The leader's auto-compaction state (start afresh at each term).
#[derive(Debug)]
pub struct AutoCompaction {
    retention: Retention,
    /// `(time, revision)` samples, oldest first (periodic mode).
    samples: VecDeque<(u64, Revision)>,
    /// The highest revision proposed (or known compacted).
    done: Revision,
}

impl AutoCompaction {
    pub fn new(retention: Retention) -> Self {
        AutoCompaction {
            retention,
            samples: VecDeque::new(),
            done: Revision(0),
        }
    }

    /// One check at `now_ms`, with the store at `current` and compacted to `compacted`:
    /// the revision to compact to, if any.
    pub fn tick(
        &mut self,
        now_ms: u64,
        current: Revision,
        compacted: Revision,
    ) -> Option<Revision> {
        self.done = self.done.max(compacted);
        let target = match self.retention {
            Retention::Periodic { ms } => {
                self.samples.push_back((now_ms, current));
                // Before one retention has passed, no sample is old enough.
                let old_enough = now_ms.checked_sub(ms)?;
                // The newest sample at least `ms` old; older ones are no longer needed.
                let mut target = None;
                while let Some(&(t, r)) = self.samples.front() {
                    if t > old_enough {
                        break;
                    }
                    target = Some(r);
                    self.samples.pop_front();
                }
                if let Some(r) = target {
                    // Keep it as the candidate floor for the next check.
                    self.samples.push_front((old_enough, r));
                }
                target
            }
            Retention::Revisions { count } => {
                Some(Revision(current.0.saturating_sub(count))).filter(|r| r.0 > 0)
            }
        }?;
        if target <= self.done || target > current {
            return None;
        }
        self.done = target;
        Some(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn flags_as_etcds() {
        assert_eq!(
            Retention::parse("periodic", "1h"),
            Ok(Some(Retention::Periodic { ms: 3_600_000 }))
        );
        assert_eq!(
            Retention::parse("periodic", "2"),
            Ok(Some(Retention::Periodic { ms: 7_200_000 }))
        );
        assert_eq!(
            Retention::parse("periodic", "1m30s"),
            Ok(Some(Retention::Periodic { ms: 90_000 }))
        );
        assert_eq!(
            Retention::parse("revision", "1000"),
            Ok(Some(Retention::Revisions { count: 1000 }))
        );
        assert_eq!(Retention::parse("periodic", "0"), Ok(None));
        assert!(Retention::parse("periodic", "1x").is_err());
        assert!(Retention::parse("periodic", "h").is_err());
        assert!(Retention::parse("revision", "1h").is_err());
        assert!(Retention::parse("weekly", "1").is_err());
    }

    #[test]
    fn revision_mode_keeps_the_last_revisions() {
        let mut a = AutoCompaction::new(Retention::Revisions { count: 100 });
        assert_eq!(a.tick(0, Revision(50), Revision(0)), None);
        assert_eq!(a.tick(1, Revision(150), Revision(0)), Some(Revision(50)));
        assert_eq!(a.tick(2, Revision(150), Revision(50)), None);
        assert_eq!(a.tick(3, Revision(400), Revision(50)), Some(Revision(300)));
    }

    #[test]
    fn periodic_mode_compacts_to_what_the_store_was_a_retention_ago() {
        let mut a = AutoCompaction::new(Retention::Periodic { ms: 1000 });
        // Samples every 100 ms, 10 revisions each.
        let mut got = Vec::new();
        for i in 0..=30u64 {
            if let Some(r) = a.tick(i * 100, Revision(i * 10), Revision(0)) {
                got.push((i * 100, r));
            }
        }
        // First at t = 1100 (at t = 1000 the store was at 0 a retention ago: nothing to do),
        // then at every tick.
        assert_eq!(got[0], (1100, Revision(10)));
        for (t, r) in &got {
            assert_eq!(r.0, (t - 1000) / 10, "at {t}");
        }
    }

    proptest! {
        /// Whatever the times and revisions: proposals only grow, never pass the current
        /// revision, and (periodic) never drop history younger than the retention.
        #[test]
        fn proposals_grow_and_keep_the_retention(
            steps in proptest::collection::vec((0u64..500, 0u64..50), 1..200),
            ms in 1u64..2000,
        ) {
            let mut a = AutoCompaction::new(Retention::Periodic { ms });
            let (mut now, mut rev, mut last) = (0u64, 0u64, 0u64);
            let mut history: Vec<(u64, u64)> = Vec::new();
            for (dt, dr) in steps {
                now += dt;
                rev += dr;
                history.push((now, rev));
                if let Some(r) = a.tick(now, Revision(rev), Revision(last)) {
                    prop_assert!(r.0 > last && r.0 <= rev);
                    // The store was at or past r at least `ms` ago.
                    prop_assert!(history.iter().any(|(t, hr)| *t + ms <= now && *hr >= r.0));
                    last = r.0;
                }
            }
        }
    }
}
