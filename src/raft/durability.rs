//! How far this node's Raft log is durable, how far the leader knows its entries durable on a
//! quorum, and the leader's early acknowledgement of its own appends.
//!
//! openraft 0.9's core awaits the flush of every append before it does anything else. On the
//! leader that put its own fdatasync and the followers' one after the other, and held the core
//! (no replication sent, no acknowledgement handled) for the leader's. So the leader
//! acknowledges its own appends to its core at once and syncs them meanwhile, on the sync
//! thread. openraft's commit then counts the leader's copy before it is on disk, so what
//! depends on the commit is held back until the entry is durable on a quorum of voters, the
//! leader counted only as far as its own log is synced (the *committable* mark):
//! - the state machine applies an entry only once it is committable
//!   ([`DurableView::wait_for`]): clients are answered, reads served and watches woken only from
//!   applied state;
//! - the commit index the leader sends to followers is cut to the committable entry
//!   ([`DurableView::cap_commit`], in `raft::network`), so no follower applies it before;
//! - only normal entries that this node wrote as the leader of its current vote are acknowledged
//!   early ([`may_acknowledge_early`]): blank and membership entries wait for their sync, since
//!   openraft moves a membership change on when its entry commits, not when it applies.
//!
//! The followers' acknowledgements count because a follower syncs before it acknowledges. So
//! where both followers of three acknowledged an entry, it is committable before the leader's
//! own copy is on disk, and the leader's sync of it is not needed at all
//! ([`Durability::followers_hold`]: the sync thread then skips it). That is Raft's rule for a
//! leader's own log (the leader counts once its copy is durable; the thesis, 10.2.1), with the
//! leader's sync taken off the path of every write.
//!
//! An entry therefore becomes visible only once a majority holds it durably. A leader that
//! crashes may lose entries of its own log that others hold; it restarts with a shorter log (or
//! with a state applied past its log's end, which openraft's start handles by purging up to
//! the applied entry) and catches up as a follower, as after any crash.
//!
//! # Invariants
//! - The own mark only rises, except when the log is cut ([`Durability::truncated`]): then it
//!   falls to the last entry kept, and syncs of writes made before the cut no longer raise it
//!   (a generation, changed under the same lock, tells them apart).
//! - A failed sync is final: neither mark ever rises again and every waiter gets an error
//!   (after a failed fdatasync the kernel may have dropped the data while reporting later
//!   syncs fine).
//! - Followers' acknowledgements count only for the leadership they answered (the vote of the
//!   append, which must be this node's current, committed one), and only against the voter
//!   sets of the last membership entry in this node's log; where that is not known, or the node
//!   does not lead, the committable mark is the own mark (a follower applies only what its own
//!   log holds durably).
//! - Within one leadership the committable mark never falls (a voter added later does not take
//!   back what a quorum of the earlier voters held).
//!
//! # What it must not do
//! Decide what is committed: openraft does. This only holds back what openraft's commit would
//! expose before a quorum holds it on disk.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::{EntryPayload, Vote};
use tokio::sync::watch;

use super::{Entry, LogId, NodeId};
use crate::domain::log_reversion::LeaderKey;

/// The last entry known to be on disk (on this node, or on a quorum), and whether a sync ever
/// failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DurableMark {
    pub last: Option<LogId>,
    pub failed: bool,
}

/// The highest entry durable on a majority of every voter set of `configs` (a joint
/// membership has two), where `durable(node)` says how far a node's log is known durable.
/// `None` when no entry is, or there is no voter set.
pub fn quorum_durable(
    configs: &[BTreeSet<NodeId>],
    durable: impl Fn(NodeId) -> Option<LogId>,
) -> Option<LogId> {
    let mut lowest: Option<Option<LogId>> = None;
    for voters in configs {
        if voters.is_empty() {
            return None;
        }
        let mut held: Vec<Option<LogId>> = voters.iter().map(|&n| durable(n)).collect();
        // Highest first: the majority-th of them is held by a majority.
        held.sort_by_key(|h| std::cmp::Reverse(index_of(*h)));
        let this = held[voters.len() / 2];
        lowest = Some(match lowest {
            Some(l) if index_of(l) <= index_of(this) => l,
            _ => this,
        });
    }
    lowest.flatten()
}

/// An entry's place, `None` (nothing) below every entry.
fn index_of(id: Option<LogId>) -> Option<u64> {
    id.map(|l| l.index)
}

fn higher(a: Option<LogId>, b: Option<LogId>) -> Option<LogId> {
    if index_of(b) > index_of(a) { b } else { a }
}

/// What the committable mark is computed from: one owner, behind [`Shared::track`].
#[derive(Default)]
struct Track {
    /// This node (set once the log store knows it).
    me: Option<NodeId>,
    /// The own mark, as last published.
    own: DurableMark,
    /// The leadership this node holds (its current vote, committed, for itself), if any.
    leading: Option<LeaderKey>,
    /// How far each follower acknowledged (so durably holds) this leadership's entries.
    acks: BTreeMap<NodeId, LogId>,
    /// The membership entries in this node's log, oldest first: (index, voter sets). The last
    /// one is in effect (openraft's rule: a membership applies once it is in the log).
    configs: Vec<(u64, Vec<BTreeSet<NodeId>>)>,
    /// The committable mark's floor within this leadership.
    floor: Option<LogId>,
}

impl Track {
    /// The quorum's durable entry from the followers' acknowledgements and, if `with_own`, this
    /// node's own mark; `None` where it cannot be told (not leading, membership unknown).
    fn quorum(&self, with_own: bool) -> Option<Option<LogId>> {
        let (me, _, (_, configs)) = (self.me?, self.leading?, self.configs.last()?);
        Some(quorum_durable(configs, |n| match n == me {
            true if with_own => self.own.last,
            true => None,
            false => self.acks.get(&n).copied(),
        }))
    }

    fn committable(&mut self) -> DurableMark {
        let last = match self.quorum(true) {
            Some(q) => {
                self.floor = higher(self.floor, q);
                self.floor
            }
            None => self.own.last,
        };
        DurableMark {
            last,
            failed: self.own.failed,
        }
    }

    /// A new leadership (or none): what the last one's followers acknowledged counts no more.
    fn lead(&mut self, leading: Option<LeaderKey>) {
        if self.leading != leading {
            self.leading = leading;
            self.acks.clear();
            self.floor = None;
        }
    }
}

/// Shared by the writer and every view.
struct Shared {
    track: Mutex<Track>,
    committable: watch::Sender<DurableMark>,
}

impl Shared {
    fn track(&self) -> MutexGuard<'_, Track> {
        self.track.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Recompute the committable mark from `track` (held) and publish it if it changed.
    fn publish(&self, track: &mut Track) {
        let mark = track.committable();
        self.committable.send_if_modified(|m| {
            let changed = *m != mark;
            *m = mark;
            changed
        });
    }
}

/// The writer's side: the sync thread and the log store move the marks.
#[derive(Clone)]
pub struct Durability {
    own: Arc<watch::Sender<DurableMark>>,
    generation: Arc<AtomicU64>,
    capped: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

impl Durability {
    /// Everything up to `last` is on disk (a log just opened and synced).
    pub fn new(last: Option<LogId>) -> Durability {
        let mark = DurableMark {
            last,
            failed: false,
        };
        let (own, _) = watch::channel(mark);
        let (committable, _) = watch::channel(mark);
        let track = Track {
            own: mark,
            ..Track::default()
        };
        Durability {
            own: Arc::new(own),
            generation: Arc::new(AtomicU64::new(0)),
            capped: Arc::new(AtomicBool::new(false)),
            shared: Arc::new(Shared {
                track: Mutex::new(track),
                committable,
            }),
        }
    }

    /// The committable mark's view: the state machine's and the peer network's.
    pub fn view(&self) -> DurableView {
        DurableView {
            rx: self.shared.committable.subscribe(),
            capped: self.capped.clone(),
            shared: self.shared.clone(),
        }
    }

    /// A view of this node's own durable log, whoever else holds its entries (the vote hold's:
    /// it must know what this node itself will still have after a crash).
    pub fn own_view(&self) -> DurableView {
        DurableView {
            rx: self.own.subscribe(),
            capped: Arc::new(AtomicBool::new(false)),
            shared: self.shared.clone(),
        }
    }

    /// The generation a write made now belongs to.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Set the own mark under the track's lock (so the two marks move together).
    fn set_own(&self, change: impl FnOnce(&mut DurableMark) -> bool) {
        let mut track = self.shared.track();
        let mut mark = track.own;
        if change(&mut mark) {
            track.own = mark;
            self.own.send_replace(mark);
            self.shared.publish(&mut track);
        }
    }

    /// Writes of `generation` up to `last` are on disk.
    pub fn synced(&self, last: LogId, generation: u64) {
        self.set_own(|mark| {
            let current = self.generation.load(Ordering::Acquire) == generation;
            let higher = mark.last.is_none_or(|m| m.index < last.index);
            if current && higher && !mark.failed {
                mark.last = Some(last);
                true
            } else {
                false
            }
        });
    }

    /// A sync failed: nothing more is ever durable.
    pub fn failed(&self) {
        self.set_own(|mark| {
            mark.failed = true;
            true
        });
    }

    /// Entries from `from` on were removed; `kept` is the last one left (if any).
    pub fn truncated(&self, from: u64, kept: Option<LogId>) {
        let mut track = self.shared.track();
        self.generation.fetch_add(1, Ordering::AcqRel);
        let mut mark = track.own;
        if mark.last.is_some_and(|m| m.index >= from) {
            mark.last = kept;
        }
        track.own = mark;
        self.own.send_replace(mark);
        track.configs.retain(|(index, _)| *index < from);
        // A leader never cuts its own log; whatever cut it, the acknowledgements and the
        // floor were of a log that is no more.
        track.acks.clear();
        track.floor = None;
        self.shared.publish(&mut track);
    }

    /// This node's id: its own vote tells whether it leads.
    pub fn set_me(&self, me: NodeId) {
        self.shared.track().me = Some(me);
    }

    /// The vote was saved: this node leads for it, or no longer does.
    pub fn vote_saved(&self, vote: &Vote<NodeId>) {
        let mut track = self.shared.track();
        let Some(me) = track.me else { return };
        let leader = vote.leader_id();
        let leading = (vote.committed && leader.node_id == me).then_some((leader.term, me));
        track.lead(leading);
        self.shared.publish(&mut track);
    }

    /// A membership entry at `index` is in the log (appended now, or found there when the node
    /// started: `configs` are its voter sets). One no newer than the last known is ignored.
    pub fn membership(&self, index: u64, configs: Vec<BTreeSet<NodeId>>) {
        let mut track = self.shared.track();
        if track.configs.last().is_some_and(|(last, _)| *last >= index) {
            return;
        }
        track.configs.push((index, configs));
        self.shared.publish(&mut track);
    }

    /// Whether the followers alone (without this node's own copy) hold everything up to
    /// `index` on a quorum: then this node's sync of it is not needed for any commit.
    pub fn followers_hold(&self, index: u64) -> bool {
        let track = self.shared.track();
        track
            .quorum(false)
            .flatten()
            .is_some_and(|q| q.index >= index)
    }
}

/// A reader's side: the state machine and the peer network.
#[derive(Clone)]
pub struct DurableView {
    rx: watch::Receiver<DurableMark>,
    /// Set when a commit told to followers was cut: once the mark rises, tell them again
    /// ([`DurableView::recommit_when_durable`]) rather than at the next heartbeat.
    capped: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

/// A sync failed: the log cannot be trusted any more.
#[derive(Debug, thiserror::Error)]
#[error("a sync of the raft log failed; this node stops applying")]
pub struct SyncFailed;

impl DurableView {
    /// The mark now.
    pub fn current(&self) -> DurableMark {
        *self.rx.borrow()
    }

    /// Wait until the mark changes (`Err`: the writer side is gone).
    pub async fn changed(&mut self) -> Result<(), SyncFailed> {
        self.rx.changed().await.map_err(|_| SyncFailed)
    }

    /// Wait until the mark reaches `index`.
    pub async fn wait_for(&mut self, index: u64) -> Result<(), SyncFailed> {
        let reached = self
            .rx
            .wait_for(|m| m.failed || m.last.is_some_and(|l| l.index >= index))
            .await
            .map_err(|_| SyncFailed)?;
        if reached.failed {
            Err(SyncFailed)
        } else {
            Ok(())
        }
    }

    /// `target` answered an append of the leadership `vote` with a match up to `matched`: it
    /// holds this node's log that far, durably (a follower syncs before it answers).
    pub fn acknowledged(&self, target: NodeId, vote: &Vote<NodeId>, matched: LogId) {
        let mut track = self.shared.track();
        let leader = vote.leader_id();
        if !vote.committed || track.leading != Some((leader.term, leader.node_id)) {
            return;
        }
        let ack = track.acks.entry(target).or_insert(matched);
        if ack.index < matched.index {
            *ack = matched;
        }
        self.shared.publish(&mut track);
    }

    /// The commit to tell followers: `commit`, cut to the committable entry.
    pub fn cap_commit(&self, commit: Option<LogId>) -> Option<LogId> {
        let capped = cap_commit(commit, self.current());
        if capped != commit {
            self.capped.store(true, Ordering::Release);
        }
        capped
    }

    /// Each time the mark rises after a commit was cut, call `tell` (the leader's heartbeat,
    /// which carries the commit): followers learn it within a round, not a heartbeat interval
    /// later. Ends when the writer side is gone.
    pub async fn recommit_when_durable<F, Fut>(mut self, mut tell: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        while self.rx.changed().await.is_ok() {
            if self.capped.swap(false, Ordering::AcqRel) {
                tell().await;
            }
        }
    }
}

/// `commit`, no higher than the durable entry (and none at all after a failed sync).
pub fn cap_commit(commit: Option<LogId>, durable: DurableMark) -> Option<LogId> {
    let commit = commit?;
    if durable.failed {
        return None;
    }
    match durable.last {
        Some(d) if d.index >= commit.index => Some(commit),
        d => d,
    }
}

/// Whether this node may acknowledge `entries` to its own core before they are synced: it
/// wrote them as the leader of its current vote, and they are all normal entries.
pub fn may_acknowledge_early(me: NodeId, vote: Option<&Vote<NodeId>>, entries: &[Entry]) -> bool {
    let Some(vote) = vote else {
        return false;
    };
    vote.committed
        && vote.leader_id.node_id == me
        && !entries.is_empty()
        && entries.iter().all(|e| {
            e.log_id.leader_id == vote.leader_id && matches!(e.payload, EntryPayload::Normal(_))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::command::Command;
    use openraft::{CommittedLeaderId, Membership};

    fn id(term: u64, node: NodeId, index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(term, node), index)
    }

    fn normal(term: u64, node: NodeId, index: u64) -> Entry {
        Entry {
            log_id: id(term, node, index),
            payload: EntryPayload::Normal(
                Command::Delete {
                    key: "k".into(),
                    prev_revision: None,
                }
                .into(),
            ),
        }
    }

    fn leader_vote(term: u64, node: NodeId) -> Vote<NodeId> {
        let mut v = Vote::new(term, node);
        v.commit();
        v
    }

    #[test]
    fn only_a_leaders_own_normal_entries_of_its_term_are_acknowledged_early() {
        let me = 1;
        let mine = vec![normal(3, me, 10), normal(3, me, 11)];
        assert!(may_acknowledge_early(me, Some(&leader_vote(3, me)), &mine));
        // A candidate's vote, another leader's vote, no vote.
        assert!(!may_acknowledge_early(me, Some(&Vote::new(3, me)), &mine));
        assert!(!may_acknowledge_early(me, Some(&leader_vote(3, 2)), &mine));
        assert!(!may_acknowledge_early(me, None, &mine));
        // Entries this node wrote as leader of an older term, sent back by a newer leader.
        assert!(!may_acknowledge_early(me, Some(&leader_vote(4, me)), &mine));
        // A follower of leader 2 appending leader 2's entries.
        let theirs = vec![normal(3, 2, 10)];
        assert!(!may_acknowledge_early(
            me,
            Some(&leader_vote(3, 2)),
            &theirs
        ));
        // Blank and membership entries wait for their sync.
        let blank = Entry {
            log_id: id(3, me, 12),
            payload: EntryPayload::Blank,
        };
        let membership = Entry {
            log_id: id(3, me, 13),
            payload: EntryPayload::Membership(Membership::new(vec![[1, 2, 3].into()], None)),
        };
        for odd in [blank, membership] {
            let batch = vec![normal(3, me, 11), odd];
            assert!(!may_acknowledge_early(
                me,
                Some(&leader_vote(3, me)),
                &batch
            ));
        }
        assert!(!may_acknowledge_early(me, Some(&leader_vote(3, me)), &[]));
    }

    #[test]
    fn the_commit_told_to_followers_never_passes_the_durable_entry() {
        let durable = |last: Option<LogId>| DurableMark {
            last,
            failed: false,
        };
        let c = Some(id(3, 1, 10));
        assert_eq!(cap_commit(c, durable(Some(id(3, 1, 12)))), c);
        assert_eq!(cap_commit(c, durable(Some(id(3, 1, 10)))), c);
        assert_eq!(cap_commit(c, durable(Some(id(3, 1, 7)))), Some(id(3, 1, 7)));
        assert_eq!(cap_commit(c, durable(None)), None);
        assert_eq!(cap_commit(None, durable(Some(id(3, 1, 12)))), None);
        let failed = DurableMark {
            last: Some(id(3, 1, 12)),
            failed: true,
        };
        assert_eq!(cap_commit(c, failed), None);
    }

    fn voters(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// Against the definition: an entry is durable on a quorum exactly when, in every voter
        /// set, a majority holds it.
        #[test]
        fn the_quorum_mark_is_the_highest_entry_a_majority_of_every_voter_set_holds(
            first in proptest::collection::btree_set(1u64..7, 1..6),
            second in proptest::option::of(proptest::collection::btree_set(1u64..7, 1..6)),
            held in proptest::collection::vec(proptest::option::of(0u64..12), 7),
        ) {
            let mut configs = vec![first];
            configs.extend(second);
            let durable = |n: NodeId| held[n as usize].map(|i| id(2, 1, i));
            let mark = quorum_durable(&configs, durable);
            for index in 0..13u64 {
                let quorum = configs.iter().all(|c| {
                    let holding = c.iter().filter(|&&n| held[n as usize].is_some_and(|i| i >= index));
                    holding.count() > c.len() / 2
                });
                proptest::prop_assert_eq!(quorum, mark.is_some_and(|m| m.index >= index));
            }
            // It is one of the entries a node holds, never made up.
            if let Some(m) = mark {
                proptest::prop_assert!(held.contains(&Some(m.index)));
            }
        }
    }

    #[test]
    fn a_leader_counts_its_followers_acknowledgements_of_its_own_leadership_only() {
        let d = Durability::new(Some(id(1, 1, 3)));
        d.set_me(1);
        d.membership(1, vec![voters(&[1, 2, 3])]);
        let view = d.view();
        let own = d.own_view();
        // Not leading: the committable mark is the own one.
        assert_eq!(view.current().last, Some(id(1, 1, 3)));
        let lead = leader_vote(2, 1);
        d.vote_saved(&lead);
        // Leading, nothing acknowledged: the own copy alone is no quorum.
        assert_eq!(view.current().last, None);
        d.synced(id(2, 1, 5), d.generation());
        view.acknowledged(2, &lead, id(2, 1, 4));
        assert_eq!(view.current().last, Some(id(2, 1, 4)));
        // An answer to an older leadership, or to a vote not yet committed, counts for nothing.
        view.acknowledged(3, &leader_vote(1, 1), id(2, 1, 9));
        view.acknowledged(3, &Vote::new(2, 1), id(2, 1, 9));
        assert_eq!(view.current().last, Some(id(2, 1, 4)));
        assert!(!d.followers_hold(1), "one follower of three is no quorum");
        // Both followers past the leader's own sync: committable beyond it.
        view.acknowledged(3, &lead, id(2, 1, 9));
        view.acknowledged(2, &lead, id(2, 1, 8));
        assert_eq!(view.current().last, Some(id(2, 1, 8)));
        assert!(d.followers_hold(8) && !d.followers_hold(9));
        assert_eq!(
            own.current().last,
            Some(id(2, 1, 5)),
            "the own mark is the own sync's"
        );
        // An older answer arriving late does not take an acknowledgement back.
        view.acknowledged(2, &lead, id(2, 1, 6));
        assert_eq!(view.current().last, Some(id(2, 1, 8)));
        // A voter added: the mark does not fall within the leadership.
        d.membership(10, vec![voters(&[1, 2, 3, 4, 5])]);
        assert_eq!(view.current().last, Some(id(2, 1, 8)));
        assert!(
            !d.followers_hold(6),
            "two followers of five hold nothing alone"
        );
        view.acknowledged(4, &lead, id(2, 1, 12));
        view.acknowledged(5, &lead, id(2, 1, 11));
        // Held by 4 (12), 5 (11) and 3 (9): three of five.
        assert_eq!(view.current().last, Some(id(2, 1, 9)));
        // Another leader: back to the own mark, the acknowledgements forgotten.
        d.vote_saved(&leader_vote(3, 2));
        assert_eq!(view.current().last, Some(id(2, 1, 5)));
        d.vote_saved(&leader_vote(4, 1));
        assert_eq!(view.current().last, None);
        assert!(!d.followers_hold(1));
    }

    #[test]
    fn a_joint_membership_needs_a_majority_of_both_voter_sets() {
        let d = Durability::new(None);
        d.set_me(1);
        let lead = leader_vote(2, 1);
        d.vote_saved(&lead);
        d.membership(4, vec![voters(&[1, 2, 3]), voters(&[1, 4, 5])]);
        let view = d.view();
        view.acknowledged(2, &lead, id(2, 1, 7));
        view.acknowledged(3, &lead, id(2, 1, 7));
        assert_eq!(view.current().last, None, "the second set holds nothing");
        view.acknowledged(4, &lead, id(2, 1, 6));
        assert_eq!(view.current().last, None);
        view.acknowledged(5, &lead, id(2, 1, 5));
        assert_eq!(view.current().last, Some(id(2, 1, 5)));
        assert!(d.followers_hold(5));
        // A cut removes the membership entries it reaches: the last one before it is in
        // effect. (Only a follower's log is cut; the acknowledgements go with it.)
        d.membership(9, vec![voters(&[1])]);
        d.truncated(9, Some(id(2, 1, 8)));
        d.vote_saved(&leader_vote(3, 1));
        view.acknowledged(2, &leader_vote(3, 1), id(3, 1, 9));
        view.acknowledged(3, &leader_vote(3, 1), id(3, 1, 9));
        assert_eq!(
            view.current().last,
            None,
            "still the joint membership of entry 4"
        );
        // Without any membership known, only the own mark counts.
        let d = Durability::new(Some(id(1, 1, 2)));
        d.set_me(1);
        d.vote_saved(&leader_vote(2, 1));
        d.view().acknowledged(2, &leader_vote(2, 1), id(2, 1, 9));
        assert_eq!(d.view().current().last, Some(id(1, 1, 2)));
        assert!(!d.followers_hold(1));
    }

    #[test]
    fn a_single_voter_commits_on_its_own_sync() {
        let d = Durability::new(None);
        d.set_me(1);
        d.membership(0, vec![voters(&[1])]);
        d.vote_saved(&leader_vote(1, 1));
        assert_eq!(d.view().current().last, None);
        d.synced(id(1, 1, 3), d.generation());
        assert_eq!(d.view().current().last, Some(id(1, 1, 3)));
        assert!(
            !d.followers_hold(1),
            "no followers, so they never hold anything"
        );
    }

    #[tokio::test]
    async fn a_cut_lowers_the_mark_and_syncs_of_writes_before_it_no_longer_count() {
        let d = Durability::new(Some(id(1, 1, 5)));
        let mut view = d.view();
        let before_cut = d.generation();
        d.truncated(4, Some(id(1, 1, 3)));
        assert_eq!(view.current().last, Some(id(1, 1, 3)));
        // The sync thread reports writes of entries 4..=6 made before the cut: ignored.
        d.synced(id(1, 1, 6), before_cut);
        assert_eq!(view.current().last, Some(id(1, 1, 3)));
        d.synced(id(2, 2, 4), d.generation());
        view.wait_for(4).await.unwrap();
        // It never goes down otherwise.
        d.synced(id(2, 2, 2), d.generation());
        assert_eq!(view.current().last, Some(id(2, 2, 4)));
        // A failed sync wakes every waiter with an error, and is final.
        let waiter = {
            let mut v = d.view();
            tokio::spawn(async move { v.wait_for(9).await })
        };
        d.failed();
        assert!(waiter.await.unwrap().is_err());
        d.synced(id(2, 2, 9), d.generation());
        assert!(view.wait_for(9).await.is_err());
    }
}
