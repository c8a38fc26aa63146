//! Compaction: snapshot and purge the Raft log, every `--snapshot-threshold` entries or when
//! its bytes pass a limit, never before the log is as large as the state (openraft's own
//! policy is off: this driver is the only one that asks for snapshots).
//!
//! openraft 0.9's `SnapshotPolicy` counts entries only, and after a snapshot it keeps up to
//! `max_in_snapshot_log_to_keep` entries of any size: 2,229 overwrites of one 1 MiB key grew a
//! node's log to gigabytes before the entry-count policy fired, and the compaction that
//! followed stalled the node for seconds. This driver looks at the stored log's bytes a few
//! times a second and asks openraft for a snapshot, then a purge, as
//! [`compaction_step`] decides, so the log (and each compaction) stays small.
//!
//! # What it must not do
//! Decide: [`compaction_step`] (pure) does. It never waits on openraft beyond a trigger call.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::resources::{CompactionPolicy, CompactionStep, LogStanding, compaction_step};
use crate::raft::Raft;
use crate::raft::state_machine::StateView;

/// How often the log's size is looked at.
pub const CHECK_EVERY: Duration = Duration::from_millis(200);

/// The byte-triggered compaction driver.
pub struct LogCompactor {
    pub raft: Raft,
    /// The stored log's bytes (kept by the log store).
    pub log_bytes: Arc<AtomicU64>,
    /// The applied state, whose size a snapshot must be worth.
    pub view: StateView,
    pub policy: CompactionPolicy,
}

impl LogCompactor {
    pub async fn run(self, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(CHECK_EVERY) => {}
            }
            // The metrics are copied out before anything else is read: while a borrow of
            // them lives, the Raft core cannot publish its own (a blocking lock on its task).
            let (applied, snapshot, purged) = {
                let m = self.raft.metrics();
                let m = m.borrow();
                (m.last_applied, m.snapshot, m.purged)
            };
            let index = |l: Option<crate::raft::LogId>| l.map_or(0, |l| l.index);
            let step = compaction_step(
                self.policy,
                LogStanding {
                    log_bytes: self.log_bytes.load(Ordering::Relaxed),
                    state_bytes: self.view.data_bytes(),
                    applied_index: index(applied),
                    snapshot_index: index(snapshot),
                    purged_index: index(purged),
                },
            );
            let trigger = self.raft.trigger();
            let result = match step {
                CompactionStep::Nothing => continue,
                CompactionStep::Snapshot => trigger.snapshot().await,
                CompactionStep::Purge(upto) => trigger.purge_log(upto).await,
            };
            if result.is_err() {
                // Raft has stopped (shutdown or a storage failure): nothing left to compact.
                return;
            }
        }
    }
}
