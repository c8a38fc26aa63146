//! How far this node's Raft log is durable, and the leader's early acknowledgement of its own
//! appends.
//!
//! openraft 0.9's core awaits the flush of every append before it does anything else. On the
//! leader that put its own fdatasync and the followers' one after the other, and held the core
//! (no replication sent, no acknowledgement handled) for the leader's. So the leader
//! acknowledges its own appends to its core at once and syncs them meanwhile, on the sync
//! thread; what depends on the commit cannot become visible before its own copy is durable:
//! - the state machine applies an entry only once the log is durable up to it
//!   ([`DurableView::wait_for`]): clients are answered, reads served and watches woken only from
//!   applied state;
//! - the commit index the leader sends to followers is cut to its durable entry
//!   ([`DurableView::cap_commit`], in `raft::network`), so no follower applies it before;
//! - only normal entries that this node wrote as the leader of its current vote are acknowledged
//!   early ([`may_acknowledge_early`]): blank and membership entries wait for their sync, since
//!   openraft moves a membership change on when its entry commits, not when it applies;
//! - an append or snapshot from another leader is answered only once what it matched is
//!   durable here ([`append_answer_waits_for`], in `http::peer`): openraft answers at once for
//!   entries the log already holds, an ex-leader's own were acknowledged before their sync, and
//!   the leader holds this node to the match it answers (its reversion guard).
//!
//! An entry therefore becomes visible only once a majority holds it durably: the followers that
//! acknowledged it (a follower always syncs before it acknowledges) and the leader. A leader
//! that crashes first may lose it, as it may lose any write it never answered.
//!
//! # Invariants
//! - The durable mark only rises, except when the log is cut ([`Durability::truncated`]):
//!   then it falls to the last entry kept, and syncs of writes made before the cut no longer
//!   raise it (a generation, changed under the same lock, tells them apart).
//! - A failed sync is final: the mark never rises again and every waiter gets an error (after
//!   a failed fdatasync the kernel may have dropped the data while reporting later syncs fine).
//!
//! # What it must not do
//! Decide what is committed: openraft does. This only holds back what openraft's commit would
//! expose before the leader's own copy is on disk.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use openraft::{EntryPayload, Vote};
use tokio::sync::watch;

use super::{Entry, LogId, NodeId};

/// The last entry known to be on disk, and whether a sync ever failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DurableMark {
    pub last: Option<LogId>,
    pub failed: bool,
}

/// The writer's side: the sync thread and the log store move the mark.
#[derive(Clone)]
pub struct Durability {
    tx: Arc<watch::Sender<DurableMark>>,
    generation: Arc<AtomicU64>,
    capped: Arc<AtomicBool>,
}

impl Durability {
    /// Everything up to `last` is on disk (a log just opened and synced).
    pub fn new(last: Option<LogId>) -> Durability {
        let (tx, _) = watch::channel(DurableMark {
            last,
            failed: false,
        });
        Durability {
            tx: Arc::new(tx),
            generation: Arc::new(AtomicU64::new(0)),
            capped: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A reader's view.
    pub fn view(&self) -> DurableView {
        DurableView {
            rx: self.tx.subscribe(),
            capped: self.capped.clone(),
        }
    }

    /// The generation a write made now belongs to.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Writes of `generation` up to `last` are on disk.
    pub fn synced(&self, last: LogId, generation: u64) {
        self.tx.send_if_modified(|mark| {
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
        self.tx.send_modify(|mark| mark.failed = true);
    }

    /// Entries from `from` on were removed; `kept` is the last one left (if any).
    pub fn truncated(&self, from: u64, kept: Option<LogId>) {
        self.tx.send_modify(|mark| {
            self.generation.fetch_add(1, Ordering::AcqRel);
            if mark.last.is_some_and(|m| m.index >= from) {
                mark.last = kept;
            }
        });
    }
}

/// A reader's side: the state machine and the peer network.
#[derive(Clone)]
pub struct DurableView {
    rx: watch::Receiver<DurableMark>,
    /// Set when a commit told to followers was cut: once the mark rises, tell them again
    /// ([`DurableView::recommit_when_durable`]) rather than at the next heartbeat.
    capped: Arc<AtomicBool>,
}

/// Why an append's answer was withheld ([`append_answer_waits_for`]).
#[derive(Debug, thiserror::Error)]
pub enum AnswerNotDurable {
    #[error(
        "this node's raft log is not yet durable up to the entries the append matched (still not after {ms} ms)"
    )]
    Timeout { ms: u64 },
    #[error("a sync of this node's raft log failed; it answers no append")]
    SyncFailed,
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

    /// Wait until the log is durable up to `index`.
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

    /// The commit to tell followers: `commit`, cut to the durable entry.
    pub fn cap_commit(&self, commit: Option<LogId>) -> Option<LogId> {
        if cap_commit(commit, self.current()) == commit {
            return commit;
        }
        // Flag first, then read the mark again: a rise between the first read and the flag
        // would wake `recommit_when_durable` before the flag was up, and followers would wait
        // for the next heartbeat. A rise after this read finds the flag up. (At worst the flag
        // outlives its cut and one heartbeat goes out early.)
        self.capped.store(true, Ordering::SeqCst);
        cap_commit(commit, self.current())
    }

    /// Each time the mark rises after a commit was cut, call `tell` (the leader's heartbeat,
    /// which carries the commit): followers learn it within a sync, not a heartbeat interval
    /// later. Ends when the writer side is gone.
    pub async fn recommit_when_durable<F, Fut>(mut self, mut tell: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        while self.rx.changed().await.is_ok() {
            if self.capped.swap(false, Ordering::SeqCst) {
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

/// How far this node's log must be durable before it answers an append that succeeded up to
/// `answered` (the last entry the append carried, or its `prev_log_id` if it carried none):
/// `None` if it may answer now.
///
/// openraft answers an append whose entries the log already holds at once, synced or not, and
/// the leader records the answer as this node's match. A follower's own appends are synced
/// before openraft answers, so that only matters for entries this node wrote as a leader and
/// acknowledged early, sent back by its successor before its sync thread made them durable.
/// No commit rests on such an answer (openraft commits only an entry of the leader's own term,
/// which this node syncs as a follower, with everything written before it), but the match
/// does: it is what the leader's reversion guard (`raft::network::reversion`) holds this node
/// to, and after a crash that took those entries the node would be reported as having lost
/// acknowledged data, and replaced. Entries at or below `covered` (the last one in a snapshot,
/// or purged after one) are durable in the snapshot, not in the log the mark follows.
pub fn append_answer_waits_for(
    answered: Option<LogId>,
    covered: Option<u64>,
    durable: DurableMark,
) -> Option<u64> {
    let up_to = answered?.index;
    if covered.is_some_and(|c| c >= up_to) {
        return None;
    }
    match durable.last {
        Some(d) if !durable.failed && d.index >= up_to => None,
        _ => Some(up_to),
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

    /// A mark durable up to `last`, no sync failed.
    fn durable(last: Option<LogId>) -> DurableMark {
        DurableMark {
            last,
            failed: false,
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

    #[test]
    fn an_append_is_answered_only_once_what_it_matched_is_durable_here() {
        // A follower's own appends are synced before openraft answers: nothing to wait for.
        let at12 = Some(id(3, 1, 12));
        assert_eq!(append_answer_waits_for(at12, None, durable(at12)), None);
        assert_eq!(
            append_answer_waits_for(Some(id(3, 1, 9)), Some(4), durable(at12)),
            None
        );
        // An ex-leader holds entries 11..=12 written as leader, synced only up to 10: the new
        // leader's append (or heartbeat) that matches them waits for the sync thread.
        let at10 = durable(Some(id(3, 1, 10)));
        assert_eq!(append_answer_waits_for(at12, None, at10), Some(12));
        assert_eq!(append_answer_waits_for(at12, Some(10), at10), Some(12));
        assert_eq!(append_answer_waits_for(at12, None, durable(None)), Some(12));
        // Covered by a snapshot (installed, or the log purged after one): durable there.
        assert_eq!(append_answer_waits_for(at12, Some(12), durable(None)), None);
        assert_eq!(append_answer_waits_for(at12, Some(40), at10), None);
        // An empty log and an append matching nothing: nothing to wait for.
        assert_eq!(append_answer_waits_for(None, None, durable(None)), None);
        // After a failed sync nothing is durable any more: the wait ends in an error.
        let failed = DurableMark {
            last: at12,
            failed: true,
        };
        assert_eq!(append_answer_waits_for(at12, None, failed), Some(12));
        assert_eq!(append_answer_waits_for(at12, Some(12), failed), None);
    }

    #[tokio::test]
    async fn a_commit_cut_to_the_mark_is_told_again_once_the_mark_rises() {
        let d = Durability::new(Some(id(1, 1, 5)));
        let view = d.view();
        let (told_tx, mut told) = tokio::sync::mpsc::unbounded_channel();
        let recommit = tokio::spawn(view.clone().recommit_when_durable(move || {
            let told_tx = told_tx.clone();
            async move {
                let _ = told_tx.send(());
            }
        }));
        // Not cut: nothing to tell again.
        assert_eq!(view.cap_commit(Some(id(1, 1, 4))), Some(id(1, 1, 4)));
        d.synced(id(1, 1, 6), d.generation());
        // Cut to the mark, then the mark rises: told once.
        assert_eq!(view.cap_commit(Some(id(1, 1, 9))), Some(id(1, 1, 6)));
        d.synced(id(1, 1, 9), d.generation());
        tokio::time::timeout(std::time::Duration::from_secs(10), told.recv())
            .await
            .expect("told again within a sync")
            .unwrap();
        // Told once: the earlier rise, to 6, had no cut to tell.
        assert!(told.try_recv().is_err());
        drop(d);
        recommit.await.unwrap();
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
