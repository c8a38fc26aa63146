//! `leasecore bench apply`: the state machine's apply, in this process, without a cluster.
//!
//! Every node applies every write, so what apply costs per put is paid three times per put in
//! a three-node cluster, on the same cores as the front end and the Raft core. A cluster's
//! figures move with the host by tens of percent from one run to the next; this one runs the
//! apply alone, on one thread, with nothing else in the process, so that it can be counted
//! in instructions, which repeat exactly for the same binary and input:
//! `valgrind --tool=callgrind --toggle-collect='*apply_now*' leasecore bench apply --keys
//! 100000 -c 24 --value-size 256` counts the apply alone (about 9,500 instructions per put
//! on 2026-11-30: the state's map a third, the key index a fifth, the event record's sled
//! write and the watch hub a tenth to a fifth each).
//!
//! The load is shaped as `bench --etcd put` makes it: every put creates a key
//! `bench/apply/<writer>/<n>` of one of `writers` writers in turn, with a value of
//! `value_size` bytes, applied in groups of `group` entries (what one commit hands to apply
//! under load), through the same `StateMachine` (sled tree, key index, event records) and
//! watch hub a node runs.
//!
//! # What it must not do
//! Touch anything but its own temporary directory, which it removes at the end.

use std::sync::Arc;
use std::time::Instant;

use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, EntryPayload, LogId};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::client::ClientError;
use crate::domain::command::Command;
use crate::domain::history::HistoryLimits;
use crate::domain::types::Revision;
use crate::raft::Entry;
use crate::raft::state_machine::StateMachine;
use crate::runtime::watch::WatchHub;

/// What `bench apply` measured.
#[derive(Debug, Serialize)]
pub struct ApplyReport {
    pub puts: usize,
    pub group: usize,
    pub writers: usize,
    pub value_size: usize,
    pub seconds: f64,
    /// Wall time per put on the applying thread, in microseconds.
    pub us_per_put: f64,
    pub revision: u64,
}

/// Apply `puts` puts of new keys in groups of `group` entries; see the module's comment.
/// (A failure to set up or apply is reported as `Usage`: there is no cluster to blame.)
pub async fn apply(
    puts: usize,
    group: usize,
    writers: usize,
    value_size: usize,
) -> Result<ApplyReport, ClientError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| ClientError::Usage(format!("{what}: {e}"));
    let dir = std::env::temp_dir().join(format!("leasecore-bench-apply-{}", std::process::id()));
    // A directory left by an earlier run of the same pid would hold its state: start empty.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| fail("temporary directory", &e))?;
    let removed = RemoveOnDrop(dir.clone());
    let db = crate::storage::open_db(&dir, 256 << 20).map_err(|e| fail("sled", &e))?;
    let hub = Arc::new(WatchHub::new(
        HistoryLimits::default(),
        Revision(0),
        CancellationToken::new(),
    ));
    let (mut sm, _view) = StateMachine::open(&db, &dir, hub).map_err(|e| fail("state", &e))?;
    let (group, writers) = (group.max(1), writers.max(1));
    let value = "v".repeat(value_size);
    let mut written = vec![0u64; writers];
    let mut index = 0u64;
    let mut done = 0usize;
    let started = Instant::now();
    while done < puts {
        let n = group.min(puts - done);
        let entries: Vec<Entry> = (0..n)
            .map(|i| {
                let w = (done + i) % writers;
                written[w] += 1;
                index += 1;
                let cmd = Command::Put {
                    key: format!("bench/apply/{w:04}/{:08}", written[w]),
                    value: value.clone(),
                    lease: None,
                    prev_revision: None,
                };
                Entry {
                    log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
                    payload: EntryPayload::Normal(cmd.into()),
                }
            })
            .collect();
        sm.apply(entries).await.map_err(|e| fail("apply", &e))?;
        done += n;
    }
    let seconds = started.elapsed().as_secs_f64();
    drop((sm, db));
    drop(removed);
    Ok(ApplyReport {
        puts,
        group,
        writers,
        value_size,
        seconds,
        us_per_put: seconds * 1e6 / puts.max(1) as f64,
        revision: index,
    })
}

/// The run's directory, removed however the run ends.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
