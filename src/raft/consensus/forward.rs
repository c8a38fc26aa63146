//! Forwarded proposals, batched: a follower sends the proposals waiting to go to the leader in
//! one request (`/raft/propose_batch`) instead of one request each.
//!
//! Each forwarded write used to cost the leader a whole HTTP request of its own, about as much
//! as the write itself; under load a follower now sends a few requests carrying many
//! proposals, which the leader proposes together (and its proposal queue then commits as
//! one log entry).
//!
//! # Invariants
//! - Every proposal gets exactly the answer it would have had alone: its own response, or the
//!   batch's failure. A batch whose delivery is uncertain is never resent
//!   ([`Consensus::on_leader`] with `AtMostOnce`): each of its proposals answers
//!   `OutcomeUnknown`.
//! - A proposal the leader did not take (it stopped leading before proposing it) answers
//!   `NoLeader`: nothing was done.
//! - At most [`FORWARDS_IN_FLIGHT`] batches are in flight, each of at most
//!   [`MAX_FORWARD_COMMANDS`] proposals and about [`MAX_FORWARD_BYTES`]; the queue in front of
//!   them is bounded ([`FORWARD_QUEUE`]): a full queue makes proposers wait.
//! - A write the leader answered is in this node's applied state before its answer goes back
//!   (as etcd's are): the leader says how far it had applied when it answered
//!   ([`ForwardedAnswers`]), and this node waits, bounded by [`APPLY_WAIT`], until it has applied
//!   as far. Otherwise a read here (`consistency=local`, an etcd serializable range), or a
//!   decision this node takes from its state (an etcd auth check), could miss the caller's own
//!   acknowledged write. A wait that runs out still answers the leader's answer: the write is
//!   committed, only late here.
//! - A leader of an older build, which has no such route, gets the batch on its older route
//!   (no applied index: no wait), or, older still, the proposals one by one (its 404 means it
//!   did nothing).
//!
//! # What it must not do
//! Decide anything about a proposal: the leader does; this only carries them.

use super::*;

/// Batches in flight at once: while they are answered, new proposals gather into the next.
const FORWARDS_IN_FLIGHT: usize = 4;
/// The most proposals, and about the most bytes, in one batch (at least one proposal).
pub const MAX_FORWARD_COMMANDS: usize = 256;
const MAX_FORWARD_BYTES: usize = 1 << 20;
/// Proposals waiting for a batch before proposers wait.
const FORWARD_QUEUE: usize = 8192;
/// The longest a forwarded write's answer waits for this node to apply it. A follower that
/// lags further than this is sick (its disk, usually); its callers get their answers anyway.
pub const APPLY_WAIT: Duration = Duration::from_secs(2);

/// The leader's answers to a forwarded batch, and how far it had applied when it gave them
/// (at least as far as every write among them).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ForwardedAnswers {
    pub applied_index: u64,
    pub results: Vec<Result<Response, ConsensusError>>,
}

impl Consensus {
    /// Send `cmd` to the leader with the other proposals waiting to go there.
    pub(super) async fn forward(&self, cmd: Command) -> Result<Response, ConsensusError> {
        let queue = self.inner.forwards.get_or_init(|| {
            let (queue, waiting) = mpsc::channel(FORWARD_QUEUE);
            tokio::spawn(run_forwards(Arc::downgrade(&self.inner), waiting));
            queue
        });
        let (reply, answer) = oneshot::channel();
        queue
            .send((cmd, reply))
            .await
            .map_err(|_| ConsensusError::ShuttingDown)?;
        answer.await.map_err(|_| ConsensusError::ShuttingDown)?
    }

    /// Propose each of `cmds` on this node only (the target of forwarded batches): `NotLeader`
    /// for the whole batch if this node is not the leader, also once a leadership transfer it
    /// waited for has made another node the leader (the forwarding node then sends the batch
    /// there, rather than answering each write "no leader").
    pub async fn propose_batch_here(
        &self,
        cmds: Vec<Command>,
    ) -> Result<Vec<Result<Response, ConsensusError>>, ConsensusError> {
        if self.transferring() {
            super::transfer::until_settled(&mut self.inner.intake.subscribe()).await;
        }
        if !self.is_leader() {
            return Err(ConsensusError::NotLeader);
        }
        let proposed = cmds.into_iter().map(|cmd| self.propose_here(cmd));
        Ok(futures::future::join_all(proposed).await)
    }

    /// [`propose_batch_here`](Self::propose_batch_here) for a forwarding node: with the
    /// applied index it must reach before it answers (read after the answers, so at least
    /// every answered write's: a write's answer is given once it is applied).
    pub async fn propose_batch_for_peer(
        &self,
        cmds: Vec<Command>,
    ) -> Result<ForwardedAnswers, ConsensusError> {
        let results = self.propose_batch_here(cmds).await?;
        Ok(ForwardedAnswers {
            applied_index: self.inner.view.applied().log_index,
            results,
        })
    }

    /// One batch to the leader, and each proposal's answer, once this node applied as far as
    /// the leader had when it answered (see the module docs).
    async fn forward_batch(&self, cmds: Vec<Command>) -> Vec<Result<Response, ConsensusError>> {
        let n = cmds.len();
        let sent = self.on_leader(
            routes::PROPOSE_BATCH_APPLIED,
            &cmds,
            Delivery::AtMostOnce,
            || self.propose_batch_for_peer(cmds.clone()),
        );
        match self.within_request_deadline(sent).await {
            Ok(answers) if answers.results.len() == n => {
                if answers.results.iter().any(Result::is_ok)
                    && !self
                        .inner
                        .view
                        .wait_applied(answers.applied_index, APPLY_WAIT)
                        .await
                {
                    tracing::warn!(
                        index = answers.applied_index,
                        applied = self.inner.view.applied().log_index,
                        "answering forwarded writes this node has not applied yet: it lags the \
                         leader by more than {APPLY_WAIT:?}"
                    );
                }
                answers.results.into_iter().map(taken).collect()
            }
            Ok(answers) => cut_short(answers.results.len(), n),
            // A leader of an older build: nothing was done.
            Err(ConsensusError::Unsupported { .. }) => self.forward_batch_unmarked(cmds).await,
            Err(e) => vec![Err(no_leader_for_clients(e)); n],
        }
    }

    /// One batch to a leader of an older build, on its batch route (its answers say nothing of
    /// how far it applied), or older still, one request each.
    async fn forward_batch_unmarked(
        &self,
        cmds: Vec<Command>,
    ) -> Vec<Result<Response, ConsensusError>> {
        let n = cmds.len();
        let sent = self.on_leader(routes::PROPOSE_BATCH, &cmds, Delivery::AtMostOnce, || {
            self.propose_batch_here(cmds.clone())
        });
        match self.within_request_deadline(sent).await {
            Ok(results) if results.len() == n => results.into_iter().map(taken).collect(),
            Ok(results) => cut_short(results.len(), n),
            Err(ConsensusError::Unsupported { .. }) => {
                // An older leader: nothing was done; one request each, as it knows.
                let single = cmds.into_iter().map(|cmd| async move {
                    let here = || self.propose_here(cmd.clone());
                    self.on_leader(routes::PROPOSE, &cmd, Delivery::AtMostOnce, here)
                        .await
                });
                futures::future::join_all(single).await
            }
            Err(e) => vec![Err(no_leader_for_clients(e)); n],
        }
    }
}

impl Consensus {
    /// `sent`'s answer, or `Timeout` once the request deadline passed.
    async fn within_request_deadline<T>(
        &self,
        sent: impl Future<Output = Result<T, ConsensusError>>,
    ) -> Result<T, ConsensusError> {
        let t = self.inner.timeouts.request;
        match tokio::time::timeout(t, sent).await {
            Ok(answer) => answer,
            Err(_) => Err(ConsensusError::Timeout {
                ms: t.as_millis() as u64,
            }),
        }
    }
}

/// A leader's answer to `sent` proposals that holds only `answered` answers: which of them
/// it did is unknown.
fn cut_short(answered: usize, sent: usize) -> Vec<Result<Response, ConsensusError>> {
    let e = ConsensusError::OutcomeUnknown {
        detail: format!("the leader answered {answered} of {sent} proposals"),
    };
    vec![Err(e); sent]
}

/// A proposal the leader did not take was not done: to the client, there is no leader.
fn taken(result: Result<Response, ConsensusError>) -> Result<Response, ConsensusError> {
    result.map_err(no_leader_for_clients)
}

/// Gather waiting proposals into batches and send them, until the handle is gone.
async fn run_forwards(inner: std::sync::Weak<Inner>, mut waiting: mpsc::Receiver<Proposal>) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(FORWARDS_IN_FLIGHT));
    loop {
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = waiting.recv().await else {
            return;
        };
        let mut bytes = first.0.approx_bytes();
        let mut batch = vec![first];
        while batch.len() < MAX_FORWARD_COMMANDS && bytes < MAX_FORWARD_BYTES {
            match waiting.try_recv() {
                Ok(p) => {
                    bytes += p.0.approx_bytes();
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            let consensus = Consensus { inner };
            let (cmds, replies): (Vec<Command>, Vec<_>) = batch.into_iter().unzip();
            let results = consensus.forward_batch(cmds).await;
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result);
            }
            drop(permit);
        });
    }
}
