//! The auto-compaction driver: on the leader, asks [`AutoCompaction`] at its interval and
//! proposes the [`Command::Compact`] it answers (etcd's `--auto-compaction-mode`).
//!
//! # What it must not do
//! Decide: the policy is [`crate::domain::auto_compact`]. A follower does nothing, and a node
//! that becomes leader starts the policy afresh (its samples are its own).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::domain::auto_compact::{AutoCompaction, Retention};
use crate::domain::command::{Command, Response};
use crate::raft::consensus::Consensus;

/// Proposes compactions on the leader, as `retention` says.
pub struct AutoCompactor {
    pub retention: Retention,
    pub consensus: Consensus,
    pub clock: Arc<dyn Clock>,
}

impl AutoCompactor {
    pub async fn run(self, cancel: CancellationToken) {
        tracing::info!(retention = %self.retention, "auto-compaction on");
        let every = Duration::from_millis(self.retention.tick_ms());
        // The policy of the current term, if this node leads.
        let mut policy: Option<(u64, AutoCompaction)> = None;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let Some(term) = self.consensus.leader_term() else {
                policy = None;
                continue;
            };
            if policy.as_ref().is_none_or(|(t, _)| *t != term) {
                policy = Some((term, AutoCompaction::new(self.retention)));
            }
            let Some((_, auto)) = policy.as_mut() else {
                continue;
            };
            let (current, compacted) = self
                .consensus
                .view()
                .with_state(|kv| (kv.revision(), kv.compact_revision()));
            let Some(revision) = auto.tick(self.clock.mono().0, current, compacted) else {
                continue;
            };
            match self.consensus.submit(Command::Compact { revision }).await {
                Ok(Response::Compacted { .. }) => {
                    tracing::info!(%revision, "auto-compacted the history");
                }
                Ok(other) => tracing::debug!(?other, "auto-compaction not applied"),
                Err(e) => tracing::debug!(error = %e, "auto-compaction not proposed"),
            }
        }
    }
}
