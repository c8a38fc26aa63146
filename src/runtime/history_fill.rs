//! The history-fill driver: when this node's history starts above its compaction mark (it
//! installed a snapshot), it asks the other members how far back theirs reaches, fetches the
//! missing span page by page from the one reaching lowest, and hands each page to storage to
//! stage, then the whole to adopt (`domain::history_fill` decides, `raft::history_fill`
//! stores).
//!
//! # Invariants
//! - One fill at a time, one page in flight, every call with a deadline and every answer
//!   bounded ([`MAX_ANSWER_BYTES`]); the whole fill stays within the storage quota; a failed
//!   fill is retried with a growing pause (at most `MAX_PAUSE`), so a missing or hostile
//!   peer costs a request now and then, never a loop.
//! - Blocking storage work runs off the async workers.
//!
//! # What it must not do
//! Decide what to ask or accept (the plan does), or write to storage except through
//! [`FillStore`].

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::history_fill::{FillPlan, HistoryReach, MAX_ANSWER_BYTES, PageAnswer, PageAsk};
use crate::domain::types::Revision;
use crate::raft::NodeId;
use crate::raft::consensus::Consensus;
use crate::raft::history_fill::{FillError, FillStore};
use crate::raft::network::routes;

/// How often a node without a gap looks again (an install makes one).
const IDLE_PAUSE: Duration = Duration::from_secs(2);
/// The longest pause after failed fills.
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// A peer's answer to "how far back" or to a page.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Why one fill did not finish.
#[derive(Debug, thiserror::Error)]
enum Stop {
    #[error("stopping")]
    Cancelled,
    #[error("source {source_id}: {detail}")]
    Source { source_id: NodeId, detail: String },
    #[error(transparent)]
    Store(#[from] FillError),
    #[error("storage task failed: {0}")]
    Task(String),
    #[error(
        "the history to fill in (below revision {start}) passes this node's storage quota \
         ({budget} bytes): not filled until the next snapshot install"
    )]
    TooLarge { start: Revision, budget: u64 },
}

/// Fills this node's history from its peers.
pub struct HistoryFiller {
    pub consensus: Consensus,
    pub store: FillStore,
}

impl HistoryFiller {
    pub async fn run(self, cancel: CancellationToken) {
        let mut pause = IDLE_PAUSE;
        // The start of a history found too large to fill: not tried again until it changes.
        let mut given_up: Option<Revision> = None;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
            pause = match self.fill_once(&cancel, given_up).await {
                Ok(None) => IDLE_PAUSE,
                Ok(Some(floor)) => {
                    tracing::info!(%floor, "this node's history reaches back as its peers' does");
                    IDLE_PAUSE
                }
                Err(Stop::Cancelled) => return,
                Err(e @ Stop::TooLarge { start, .. }) => {
                    tracing::warn!(error = %e, "history fill given up");
                    given_up = Some(start);
                    IDLE_PAUSE
                }
                Err(Stop::Store(
                    FillError::NotNeeded | FillError::Superseded | FillError::Finished,
                )) => IDLE_PAUSE,
                Err(e) => {
                    tracing::warn!(error = %e, "history fill failed; trying again later");
                    (pause * 2).clamp(IDLE_PAUSE, MAX_PAUSE)
                }
            };
        }
    }

    /// One fill, if there is a gap (not one given up on) and a peer to fill it from: the new
    /// floor.
    async fn fill_once(
        &self,
        cancel: &CancellationToken,
        given_up: Option<Revision>,
    ) -> Result<Option<Revision>, Stop> {
        let store = self.store.clone();
        if blocking(move || store.resume()).await? {
            return Err(Stop::Store(FillError::Finished));
        }
        let local = self.store.local();
        if !local.has_gap() || given_up == Some(local.start) {
            return Ok(None);
        }
        let peers = self.peers();
        let mut reaches = Vec::new();
        for (id, addr) in &peers {
            let asked = self.call::<_, HistoryReach>(addr, routes::HISTORY_REACH, &());
            let answer = tokio::select! {
                _ = cancel.cancelled() => return Err(Stop::Cancelled),
                answer = asked => answer,
            };
            match answer {
                Ok(reach) => reaches.push((*id, reach)),
                Err(e) => tracing::debug!(peer = id, error = %e, "history reach unknown"),
            }
        }
        let Some(mut plan) = FillPlan::choose(local, &reaches) else {
            return Ok(None);
        };
        let source_id = plan.source;
        let source = |detail: String| Stop::Source { source_id, detail };
        let addr = peers
            .iter()
            .find(|(id, _)| *id == source_id)
            .map(|(_, a)| a.clone())
            .ok_or_else(|| source("not a member any more".into()))?;
        tracing::info!(
            source = source_id,
            floor = %plan.floor,
            start = %plan.start,
            "filling in the history an installed snapshot cut off"
        );
        let store = self.store.clone();
        let epoch = blocking(move || store.begin()).await?;
        // The whole fill stays within the storage quota: a source cannot fill the disk.
        let budget = self.consensus.quota().max_bytes;
        let mut staged = 0u64;
        while let Some(ask) = plan.ask() {
            // Shutdown does not wait for a page in flight.
            let asked = self.call::<_, PageAnswer>(&addr, routes::HISTORY_PAGE, &ask);
            let answer = tokio::select! {
                _ = cancel.cancelled() => return Err(Stop::Cancelled),
                answer = asked => answer.map_err(source)?,
            };
            let store = self.store.clone();
            match (ask, answer) {
                (PageAsk::Keys { .. }, PageAnswer::Keys(page)) => {
                    let keys = plan.on_keys(page).map_err(|e| source(e.to_string()))?;
                    staged += keys
                        .iter()
                        .map(|(k, v)| (k.len() + v.value.len()) as u64)
                        .sum::<u64>();
                    blocking(move || store.stage_keys(epoch, &keys)).await?;
                }
                (PageAsk::Events { .. }, PageAnswer::Events(page)) => {
                    let events = plan.on_events(page).map_err(|e| source(e.to_string()))?;
                    // Each event is stored twice: as a version and in its event record.
                    staged += 2 * events
                        .iter()
                        .map(|e| (e.key.len() + e.value.as_ref().map_or(0, String::len)) as u64)
                        .sum::<u64>();
                    blocking(move || store.stage_events(epoch, &events)).await?;
                }
                _ => return Err(source("answered another question".into())),
            }
            if staged > budget {
                return Err(Stop::TooLarge {
                    start: plan.start,
                    budget,
                });
            }
        }
        let (store, floor, start) = (self.store.clone(), plan.floor, plan.start);
        blocking(move || store.adopt(epoch, floor, start)).await?;
        Ok(Some(floor))
    }

    /// The other members and their addresses.
    fn peers(&self) -> Vec<(NodeId, String)> {
        let me = self.consensus.id();
        let metrics = self.consensus.raft().metrics();
        let m = metrics.borrow();
        m.membership_config
            .membership()
            .nodes()
            .filter(|(id, _)| **id != me)
            .map(|(id, node)| (*id, node.addr.clone()))
            .collect()
    }

    async fn call<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &Req,
    ) -> Result<Resp, String> {
        self.consensus
            .peers()
            .post_json_within(addr, path, body, CALL_TIMEOUT, MAX_ANSWER_BYTES)
            .await
            .map_err(|e| e.to_string())
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FillError> + Send + 'static,
) -> Result<T, Stop> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Stop::Task(e.to_string()))?
        .map_err(Stop::Store)
}
