//! When to log a peer going down and coming back: once each, not once per failed RPC.
//!
//! openraft retries an unreachable peer every few hundred milliseconds; logging each failure
//! buried the one fact an operator needs ("node 2 is down since 10:41") under several ERROR
//! lines a second. [`PeerLink`] is the per-peer state that turns the stream of RPC outcomes into
//! at most: one report when a peer has been failing for `grace_ms` (a restart that takes less
//! is not news), a reminder every `remind_ms` while it stays down, and one report when it
//! answers again after a reported outage.
//!
//! # Invariants
//! - A `CameBack` follows only a `WentDown`: nothing is said about an outage nobody was told of.
//! - Between reports about one outage, at least `remind_ms` passes.
//!
//! # What it must not do
//! Read a clock, or log: the network adapter passes `now` and logs what comes back.

use super::types::MonoMillis;

/// What the adapter should log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkReport {
    /// The peer has failed every call for `for_ms` (`failures` of them).
    WentDown { for_ms: u64, failures: u64 },
    /// It is still down: `for_ms` since its first failure, `failures` in all.
    StillDown { for_ms: u64, failures: u64 },
    /// It answered again after a reported outage of `after_ms`.
    CameBack { after_ms: u64, failures: u64 },
}

/// The outage bookkeeping of one peer.
#[derive(Clone, Debug, Default)]
pub struct PeerLink {
    outage: Option<Outage>,
}

#[derive(Clone, Debug)]
struct Outage {
    since: MonoMillis,
    failures: u64,
    /// When it was last reported (None: not yet).
    reported: Option<MonoMillis>,
}

/// How patient the reports are.
#[derive(Clone, Copy, Debug)]
pub struct LinkPolicy {
    /// An outage is reported once it has lasted this long.
    pub grace_ms: u64,
    /// A reported outage is reported again this often while it lasts.
    pub remind_ms: u64,
}

impl Default for LinkPolicy {
    fn default() -> Self {
        LinkPolicy {
            grace_ms: 2_000,
            remind_ms: 60_000,
        }
    }
}

impl PeerLink {
    /// A call to the peer failed at `now`.
    pub fn failed(&mut self, now: MonoMillis, policy: LinkPolicy) -> Option<LinkReport> {
        let outage = self.outage.get_or_insert(Outage {
            since: now,
            failures: 0,
            reported: None,
        });
        outage.failures += 1;
        let for_ms = outage.since.until(now);
        match outage.reported {
            None if for_ms >= policy.grace_ms => {
                outage.reported = Some(now);
                Some(LinkReport::WentDown {
                    for_ms,
                    failures: outage.failures,
                })
            }
            Some(last) if last.until(now) >= policy.remind_ms => {
                outage.reported = Some(now);
                Some(LinkReport::StillDown {
                    for_ms,
                    failures: outage.failures,
                })
            }
            _ => None,
        }
    }

    /// A call to the peer got an answer at `now`.
    pub fn answered(&mut self, now: MonoMillis) -> Option<LinkReport> {
        let outage = self.outage.take()?;
        outage.reported.map(|_| LinkReport::CameBack {
            after_ms: outage.since.until(now),
            failures: outage.failures,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const POLICY: LinkPolicy = LinkPolicy {
        grace_ms: 2_000,
        remind_ms: 60_000,
    };

    fn at(ms: u64) -> MonoMillis {
        MonoMillis(ms)
    }

    #[test]
    fn a_short_blip_is_not_news() {
        let mut link = PeerLink::default();
        assert_eq!(link.failed(at(0), POLICY), None);
        assert_eq!(link.failed(at(1_500), POLICY), None);
        assert_eq!(link.answered(at(1_900)), None);
        // A new outage starts its own grace.
        assert_eq!(link.failed(at(5_000), POLICY), None);
        assert_eq!(link.failed(at(6_999), POLICY), None);
    }

    #[test]
    fn an_outage_is_reported_once_then_reminded_then_its_end() {
        let mut link = PeerLink::default();
        assert_eq!(link.failed(at(1_000), POLICY), None);
        assert_eq!(
            link.failed(at(3_000), POLICY),
            Some(LinkReport::WentDown {
                for_ms: 2_000,
                failures: 2
            })
        );
        for t in (3_500..63_000).step_by(500) {
            assert_eq!(link.failed(at(t), POLICY), None, "at {t}");
        }
        assert!(matches!(
            link.failed(at(63_000), POLICY),
            Some(LinkReport::StillDown { for_ms: 62_000, .. })
        ));
        assert!(matches!(
            link.answered(at(64_000)),
            Some(LinkReport::CameBack {
                after_ms: 63_000,
                ..
            })
        ));
        assert_eq!(link.answered(at(64_500)), None);
    }

    proptest! {
        /// Whatever the sequence of outcomes: every `CameBack` closes a reported outage, and
        /// reports about one outage are at least `remind_ms` apart.
        #[test]
        fn reports_are_rate_limited_and_balanced(
            steps in proptest::collection::vec((0u64..5_000, any::<bool>()), 0..400)
        ) {
            let mut link = PeerLink::default();
            let mut now = 0u64;
            let mut open_reported = false;
            let mut last_report: Option<u64> = None;
            for (dt, ok) in steps {
                now += dt;
                let report = if ok {
                    link.answered(at(now))
                } else {
                    link.failed(at(now), POLICY)
                };
                match report {
                    Some(LinkReport::WentDown { .. }) => {
                        prop_assert!(!open_reported);
                        open_reported = true;
                        last_report = Some(now);
                    }
                    Some(LinkReport::StillDown { .. }) => {
                        prop_assert!(open_reported);
                        prop_assert!(now - last_report.unwrap() >= POLICY.remind_ms);
                        last_report = Some(now);
                    }
                    Some(LinkReport::CameBack { .. }) => {
                        prop_assert!(open_reported);
                        open_reported = false;
                        last_report = None;
                    }
                    None => {}
                }
                if ok {
                    // An answer always closes the outage, reported or not.
                    open_reported = false;
                }
            }
        }
    }
}
