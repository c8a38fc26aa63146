//! Filling in the MVCC history a snapshot install cut off. Pure.
//!
//! A node that installs a snapshot at revision `S` keeps its state but not the history before
//! `S`: its reads at older revisions, and its watches resuming below `S`, answer `compacted`
//! while its peers still answer them. The *fill* copies that span from a peer whose history
//! reaches lower, page by page, then adopts it: afterwards this node answers every revision
//! above the new floor `F` as its peers do (etcd's members all hold the same history, since
//! its snapshots carry the whole database).
//!
//! What is copied is exactly what this node would have written had it applied the entries:
//! - the live keys at `F` (each as a *base* version at its `mod_revision`), read from the
//!   source at revision `F`, in key order;
//! - every event of `(F, S]`, from the source's history, which become versions and event
//!   records as the apply path makes them.
//!
//! # Invariants
//! - A plan asks only for what the source holds: `F` is at or above the source's floor and
//!   this node's compaction mark, and below `S`; the source's history reaches `S`.
//! - Every page is validated before it is staged: keys strictly ascending and after the
//!   cursor, versions no newer than `F`, events inside the asked span in revision order, and
//!   progress on every page (a source cannot keep a fill busy with empty pages).
//! - Nothing is adopted unless the staged history, replayed to `S`, gives exactly the live
//!   keys this node holds at `S` (checked by the storage adapter). That catches a source
//!   whose history does not lead to this node's state, not one that invents a consistent
//!   past: the source is a member, which replicates everything anyway (peer routes admit
//!   members only), and the fill trusts it as much as a snapshot from it.
//! - Bounded: each answer (by the transport), and the whole fill (the driver stops past the
//!   storage quota), so a source cannot fill this node's disk.
//!
//! # What it must not do
//! Touch storage or the network: the runtime fetches pages and the storage adapter stages and
//! adopts them; this module decides what to ask and whether an answer is acceptable.

use serde::{Deserialize, Serialize};

use super::command::{Event, EventKind};
use super::kv::Versioned;
use super::types::{NodeId, Revision};

/// The most keys or events a source puts in one page.
pub const MAX_PAGE_ITEMS: usize = 1_024;
/// The bytes of keys and values after which a source ends a page (a revision's events are
/// never split, so a page may pass it by one revision's worth).
pub const PAGE_BYTES: usize = 4 << 20;
/// The largest answer a fill takes from a source: a page, or one revision's events (at most
/// a transaction of puts of the largest values, or a revoke's deletes of many keys).
pub const MAX_ANSWER_BYTES: usize = 256 << 20;

/// A node's answer to "how far back does your history reach".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryReach {
    /// Reads at this revision and later, and watches from after it, are answered.
    pub floor: Revision,
    /// The node's applied revision.
    pub revision: Revision,
}

/// This node's history, as a fill needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalHistory {
    /// Where this node's history starts (`S`: the last snapshot it installed).
    pub start: Revision,
    /// Its compaction mark.
    pub compacted: Revision,
}

impl LocalHistory {
    /// Whether there is history below this node's floor that the cluster may still hold:
    /// the start is above the compaction mark.
    pub fn has_gap(&self) -> bool {
        self.start > self.compacted
    }
}

/// A request for one page.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PageAsk {
    /// Live keys at `revision`, after `after` (from the first key when `None`).
    Keys {
        revision: Revision,
        after: Option<String>,
        limit: usize,
    },
    /// Events from `from` through `through`.
    Events {
        from: Revision,
        through: Revision,
        limit: usize,
    },
}

/// A page of live keys at a revision.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeysPage {
    pub keys: Vec<(String, Versioned)>,
    /// No key after the last one.
    pub done: bool,
}

/// A page of events: every event from the asked `from` through `through`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsPage {
    pub events: Vec<Event>,
    pub through: Revision,
}

/// A source's answer to a [`PageAsk`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PageAnswer {
    Keys(KeysPage),
    Events(EventsPage),
}

/// Why a page was refused (the fill is abandoned; the source is not trusted again for it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadPage {
    #[error("the page answers a question that was not asked")]
    Unasked,
    #[error("the page holds more than {MAX_PAGE_ITEMS} items beyond one revision's")]
    TooLong,
    #[error("key {0:?} is not after the previous key")]
    KeyOrder(String),
    #[error("key {key:?}: {why}")]
    BadVersion { key: String, why: &'static str },
    #[error("an event at revision {0} is outside the span asked or out of order")]
    EventOrder(Revision),
    #[error("event of {key:?} at {revision}: {why}")]
    BadEvent {
        key: String,
        revision: Revision,
        why: &'static str,
    },
    #[error("the page makes no progress")]
    NoProgress,
}

/// Where a fill is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Stage {
    Keys { after: Option<String> },
    Events { next: Revision },
    Done,
}

/// One fill: from `source`, the keys at `floor`, then the events through `start`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FillPlan {
    pub source: NodeId,
    /// `F`: the history's new start.
    pub floor: Revision,
    /// `S`: where this node's history starts now.
    pub start: Revision,
    stage: Stage,
}

impl FillPlan {
    /// The fill to run, if any: from the peer reaching lowest (a node that has applied at
    /// least to `S`), to the lowest revision it and this node's compaction allow.
    pub fn choose(local: LocalHistory, peers: &[(NodeId, HistoryReach)]) -> Option<FillPlan> {
        if !local.has_gap() {
            return None;
        }
        let (source, reach) = peers
            .iter()
            .filter(|(_, r)| r.revision >= local.start && r.floor <= r.revision)
            .min_by_key(|(id, r)| (r.floor, *id))?;
        let floor = reach.floor.max(local.compacted);
        (floor < local.start).then_some(FillPlan {
            source: *source,
            floor,
            start: local.start,
            stage: Stage::Keys { after: None },
        })
    }

    /// The next page to ask for; `None` once everything is staged.
    pub fn ask(&self) -> Option<PageAsk> {
        match &self.stage {
            Stage::Keys { after } => Some(PageAsk::Keys {
                revision: self.floor,
                after: after.clone(),
                limit: MAX_PAGE_ITEMS,
            }),
            Stage::Events { next } => Some(PageAsk::Events {
                from: *next,
                through: self.start,
                limit: MAX_PAGE_ITEMS,
            }),
            Stage::Done => None,
        }
    }

    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// Take a page of keys: validated, it is what to stage as base versions.
    pub fn on_keys(&mut self, page: KeysPage) -> Result<Vec<(String, Versioned)>, BadPage> {
        let Stage::Keys { after } = &self.stage else {
            return Err(BadPage::Unasked);
        };
        if page.keys.len() > MAX_PAGE_ITEMS {
            return Err(BadPage::TooLong);
        }
        if page.keys.is_empty() && !page.done {
            return Err(BadPage::NoProgress);
        }
        let mut previous = after.as_deref();
        for (key, v) in &page.keys {
            if key.is_empty() || previous.is_some_and(|p| key.as_str() <= p) {
                return Err(BadPage::KeyOrder(key.clone()));
            }
            check_version(key, v, self.floor)?;
            previous = Some(key);
        }
        self.stage = if page.done {
            Stage::Events {
                next: self.floor.next(),
            }
        } else {
            Stage::Keys {
                after: previous.map(str::to_string),
            }
        };
        Ok(page.keys)
    }

    /// Take a page of events: validated, they are what to stage as the apply path records
    /// them.
    pub fn on_events(&mut self, page: EventsPage) -> Result<Vec<Event>, BadPage> {
        let Stage::Events { next } = self.stage else {
            return Err(BadPage::Unasked);
        };
        // A source ends a page at a revision's end: past the item cap only to finish one
        // revision (a revoke deletes every key of its lease at one revision). The answer's
        // size is bounded by the transport ([`MAX_ANSWER_BYTES`]).
        if let Some(last) = page.events.get(MAX_PAGE_ITEMS.saturating_sub(1))
            && page.events[MAX_PAGE_ITEMS..]
                .iter()
                .any(|e| e.revision != last.revision)
        {
            return Err(BadPage::TooLong);
        }
        if page.through < next || page.through > self.start {
            return Err(BadPage::NoProgress);
        }
        let mut previous = next;
        for e in &page.events {
            if e.revision < previous || e.revision > page.through {
                return Err(BadPage::EventOrder(e.revision));
            }
            check_event(e)?;
            previous = e.revision;
        }
        self.stage = if page.through == self.start {
            Stage::Done
        } else {
            Stage::Events {
                next: page.through.next(),
            }
        };
        Ok(page.events)
    }
}

fn check_version(key: &str, v: &Versioned, at: Revision) -> Result<(), BadPage> {
    let bad = |why| {
        Err(BadPage::BadVersion {
            key: key.to_string(),
            why,
        })
    };
    if v.mod_revision > at {
        return bad("modified after the revision asked");
    }
    if v.create_revision.0 == 0 || v.create_revision > v.mod_revision {
        return bad("created after its last change");
    }
    if v.version == 0 {
        return bad("version 0 of a live key");
    }
    Ok(())
}

fn check_event(e: &Event) -> Result<(), BadPage> {
    let bad = |why| {
        Err(BadPage::BadEvent {
            key: e.key.clone(),
            revision: e.revision,
            why,
        })
    };
    if e.key.is_empty() {
        return bad("no key");
    }
    match e.kind {
        EventKind::Put => {
            if e.value.is_none() {
                return bad("a put without a value");
            }
            if e.create_revision
                .is_some_and(|c| c.0 == 0 || c > e.revision)
            {
                return bad("created after the put");
            }
            if e.version == Some(0) {
                return bad("version 0");
            }
        }
        EventKind::Delete => {
            if e.value.is_some() {
                return bad("a delete with a value");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::Cause;
    use proptest::prelude::*;

    fn reach(floor: u64, revision: u64) -> HistoryReach {
        HistoryReach {
            floor: Revision(floor),
            revision: Revision(revision),
        }
    }

    fn local(start: u64, compacted: u64) -> LocalHistory {
        LocalHistory {
            start: Revision(start),
            compacted: Revision(compacted),
        }
    }

    fn version(create: u64, m: u64) -> Versioned {
        Versioned {
            value: format!("v{m}"),
            create_revision: Revision(create),
            mod_revision: Revision(m),
            version: m.saturating_sub(create) + 1,
            lease: None,
        }
    }

    fn put(key: &str, rev: u64) -> Event {
        Event {
            kind: EventKind::Put,
            key: key.into(),
            value: Some("x".into()),
            revision: Revision(rev),
            lease: None,
            cause: Cause::Client,
            create_revision: Some(Revision(rev)),
            version: Some(1),
        }
    }

    #[test]
    fn the_source_reaching_lowest_is_chosen_down_to_the_compaction() {
        // No gap: the floor is the compaction mark already.
        assert_eq!(FillPlan::choose(local(50, 50), &[(2, reach(0, 90))]), None);
        let peers = [(2, reach(30, 90)), (3, reach(10, 95)), (4, reach(0, 40))];
        let plan = FillPlan::choose(local(50, 20), &peers).unwrap();
        // Node 4 has not applied up to 50; node 3 reaches lowest; the compaction bounds it.
        assert_eq!(
            (plan.source, plan.floor, plan.start),
            (3, Revision(20), Revision(50))
        );
        // No peer reaches below this node's start.
        assert_eq!(FillPlan::choose(local(50, 20), &[(2, reach(50, 90))]), None);
        assert_eq!(FillPlan::choose(local(50, 20), &[]), None);
    }

    #[test]
    fn a_fill_asks_the_keys_then_the_events_then_stops() {
        let mut plan = FillPlan::choose(local(10, 0), &[(2, reach(4, 12))]).unwrap();
        assert!(matches!(
            plan.ask(),
            Some(PageAsk::Keys { after: None, .. })
        ));
        let page = KeysPage {
            keys: vec![("a".into(), version(1, 3)), ("b".into(), version(2, 4))],
            done: false,
        };
        assert_eq!(plan.on_keys(page).unwrap().len(), 2);
        assert!(matches!(plan.ask(), Some(PageAsk::Keys { after: Some(k), .. }) if k == "b"));
        // Not after the cursor.
        let again = KeysPage {
            keys: vec![("b".into(), version(2, 4))],
            done: true,
        };
        assert_eq!(
            plan.clone().on_keys(again),
            Err(BadPage::KeyOrder("b".into()))
        );
        plan.on_keys(KeysPage {
            keys: vec![],
            done: true,
        })
        .unwrap();
        assert_eq!(
            plan.ask(),
            Some(PageAsk::Events {
                from: Revision(5),
                through: Revision(10),
                limit: MAX_PAGE_ITEMS
            })
        );
        let page = EventsPage {
            events: vec![put("c", 5), put("d", 7)],
            through: Revision(7),
        };
        plan.on_events(page).unwrap();
        assert!(matches!(
            plan.ask(),
            Some(PageAsk::Events {
                from: Revision(8),
                ..
            })
        ));
        plan.on_events(EventsPage {
            events: vec![],
            through: Revision(10),
        })
        .unwrap();
        assert!(plan.is_done());
        assert_eq!(plan.ask(), None);
    }

    #[test]
    fn pages_that_lie_are_refused() {
        let plan = FillPlan::choose(local(10, 0), &[(2, reach(4, 12))]).unwrap();
        let keys = |keys: Vec<(&str, Versioned)>, done| KeysPage {
            keys: keys.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            done,
        };
        let refused = |page: KeysPage| plan.clone().on_keys(page).unwrap_err();
        assert_eq!(refused(keys(vec![], false)), BadPage::NoProgress);
        assert!(matches!(
            refused(keys(vec![("a", version(1, 5))], true)),
            BadPage::BadVersion { .. }
        ));
        assert!(matches!(
            refused(keys(vec![("a", version(3, 2))], true)),
            BadPage::BadVersion { .. }
        ));
        assert_eq!(
            refused(keys(vec![("b", version(1, 1)), ("a", version(1, 1))], true)),
            BadPage::KeyOrder("a".into())
        );
        let long = (0..=MAX_PAGE_ITEMS)
            .map(|i| (format!("k{i:05}"), version(1, 1)))
            .collect();
        assert_eq!(
            plan.clone().on_keys(KeysPage {
                keys: long,
                done: true
            }),
            Err(BadPage::TooLong)
        );
        // Events asked before the keys are done.
        assert_eq!(
            plan.clone().on_events(EventsPage {
                events: vec![],
                through: Revision(10)
            }),
            Err(BadPage::Unasked)
        );
        let mut events = plan.clone();
        events
            .on_keys(KeysPage {
                keys: vec![],
                done: true,
            })
            .unwrap();
        let refused = |events_page: EventsPage| events.clone().on_events(events_page).unwrap_err();
        let page = |events, through| EventsPage {
            events,
            through: Revision(through),
        };
        assert_eq!(
            refused(page(vec![put("a", 4)], 6)),
            BadPage::EventOrder(Revision(4))
        );
        assert_eq!(
            refused(page(vec![put("a", 7)], 6)),
            BadPage::EventOrder(Revision(7))
        );
        assert_eq!(
            refused(page(vec![put("a", 6), put("b", 5)], 6)),
            BadPage::EventOrder(Revision(5))
        );
        assert_eq!(refused(page(vec![], 4)), BadPage::NoProgress);
        assert_eq!(refused(page(vec![], 11)), BadPage::NoProgress);
        let mut delete_with_value = put("a", 5);
        delete_with_value.kind = EventKind::Delete;
        assert!(matches!(
            refused(page(vec![delete_with_value], 5)),
            BadPage::BadEvent { .. }
        ));
    }

    #[test]
    fn a_page_may_pass_the_item_cap_only_to_finish_one_revision() {
        let mut plan = FillPlan::choose(local(10, 0), &[(2, reach(4, 12))]).unwrap();
        plan.on_keys(KeysPage {
            keys: vec![],
            done: true,
        })
        .unwrap();
        // A revoke at revision 6 deleted 3,000 keys: one revision, one page.
        let revoke: Vec<Event> = (0..3_000)
            .map(|i| {
                let mut e = put(&format!("k{i}"), 6);
                e.kind = EventKind::Delete;
                e.value = None;
                e
            })
            .collect();
        let mut page = vec![put("a", 5)];
        page.extend(revoke.clone());
        assert_eq!(
            plan.clone()
                .on_events(EventsPage {
                    events: page.clone(),
                    through: Revision(6)
                })
                .map(|e| e.len()),
            Ok(3_001)
        );
        // Another revision after the cap is refused.
        page.push(put("b", 7));
        assert_eq!(
            plan.on_events(EventsPage {
                events: page,
                through: Revision(7)
            }),
            Err(BadPage::TooLong)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Whatever a source answers, a fill never panics, never accepts a page that breaks
        /// the rules, and ends after at most one page per revision and key.
        #[test]
        fn any_answer_is_checked_and_a_fill_always_ends(
            start in 1u64..40,
            floor in 0u64..40,
            answers in proptest::collection::vec(
                (proptest::collection::vec((0u8..8, 0u64..45, 0u64..45, any::<bool>()), 0..6),
                 any::<bool>(), 0u64..45),
                1..30),
        ) {
            let Some(mut plan) = FillPlan::choose(local(start, 0), &[(2, reach(floor, start))]) else {
                prop_assert!(floor >= start);
                return Ok(());
            };
            let mut last_key: Option<String> = None;
            let mut last_rev = plan.floor;
            for (items, done, through) in answers {
                match plan.ask() {
                    None => break,
                    Some(PageAsk::Keys { .. }) => {
                        let keys: Vec<(String, Versioned)> = items.iter().map(|(k, c, m, _)| {
                            (format!("k{k}"), Versioned {
                                value: String::new(),
                                create_revision: Revision(*c),
                                mod_revision: Revision(*m),
                                version: 1,
                                lease: None,
                            })
                        }).collect();
                        if let Ok(accepted) = plan.on_keys(KeysPage { keys, done }) {
                            for (k, v) in &accepted {
                                prop_assert!(last_key.as_ref().is_none_or(|l| k > l));
                                prop_assert!(v.mod_revision <= plan.floor);
                                prop_assert!(v.create_revision <= v.mod_revision);
                                last_key = Some(k.clone());
                            }
                        }
                    }
                    Some(PageAsk::Events { from, .. }) => {
                        let events: Vec<Event> = items.iter().map(|(k, _, r, delete)| {
                            let mut e = put(&format!("k{k}"), *r);
                            if *delete {
                                e.kind = EventKind::Delete;
                                e.value = None;
                            }
                            e
                        }).collect();
                        let page = EventsPage { events, through: Revision(through) };
                        if let Ok(accepted) = plan.on_events(page) {
                            for e in &accepted {
                                prop_assert!(e.revision >= from && e.revision >= last_rev);
                                prop_assert!(e.revision <= plan.start);
                                last_rev = e.revision;
                            }
                        }
                    }
                }
            }
        }
    }
}
