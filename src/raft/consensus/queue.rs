//! The proposal queue: group commit of client proposals into `Command::Batch` log entries, in
//! arrival order, with a bounded number of batches in flight.
//!
//! # Invariants
//! - Proposals are batched and submitted in the order they were queued.
//! - A batch holds at most [`MAX_BATCH_COMMANDS`] commands and about [`MAX_BATCH_BYTES`].
//! - A batch waits for nothing but the runtime's other ready work, a few turns of it at most
//!   ([`while_ready_tasks_add`]): no timer, so an idle node answers a lone proposal at once.

use super::*;
use crate::runtime::batch::while_ready_tasks_add;

/// Batches in flight at once: while they commit, new proposals gather into the next batch.
const BATCHES_IN_FLIGHT: usize = 4;
/// The most commands, and the most bytes (estimated), in one batch.
const MAX_BATCH_COMMANDS: usize = 1024;
const MAX_BATCH_BYTES: usize = 1 << 20;

/// Feeds proposals into openraft in order, many per log entry (group commit).
///
/// openraft 0.9 appends and flushes each submitted entry on its own before taking the next,
/// so one entry per command costs one fsync per command. This queue instead lets proposals
/// that arrive while up to `BATCHES_IN_FLIGHT` batches are committing gather into one
/// `Command::Batch`: one entry, one fsync, applied as consecutive commands. Order is kept:
/// batches are formed and submitted in arrival order.
pub struct ProposalQueue {
    pub(super) raft: Raft,
    pub(super) queue: mpsc::UnboundedReceiver<Proposal>,
}

impl ProposalQueue {
    /// Run until cancelled.
    pub async fn run(mut self, cancel: tokio_util::sync::CancellationToken) {
        let in_flight = Arc::new(tokio::sync::Semaphore::new(BATCHES_IN_FLIGHT));
        loop {
            let permit = tokio::select! {
                _ = cancel.cancelled() => return,
                p = in_flight.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => return,
                },
            };
            let first = tokio::select! {
                _ = cancel.cancelled() => return,
                next = self.queue.recv() => match next {
                    Some(p) => p,
                    None => return,
                },
            };
            let batch = gather(first, &mut self.queue).await;
            let (commands, replies): (Vec<Command>, Vec<_>) = batch.into_iter().unzip();
            let single = commands.len() == 1;
            let cmd = match single {
                true => commands.into_iter().next().expect("one command"),
                false => Command::Batch { commands },
            };
            match self.raft.client_write_ff(cmd.into()).await {
                Ok(applied) => {
                    tokio::spawn(async move {
                        let result = match applied.await {
                            Ok(Ok(written)) => Ok(written.data),
                            Ok(Err(e)) => Err(from_write_error(RaftError::APIError(e))),
                            // The core stopped (a shutdown) with the entry handed over: it may
                            // be in the log and replicated, and a later leader may commit it.
                            // `shutting_down` would promise nothing was done (clients resend).
                            Err(_) => Err(ConsensusError::OutcomeUnknown {
                                detail: "the node stopped with the write in flight".into(),
                            }),
                        };
                        distribute(result, single, replies);
                        drop(permit);
                    });
                }
                Err(_) => distribute(Err(ConsensusError::ShuttingDown), single, replies),
            }
        }
    }
}

/// The batch that starts with `first`: what is queued now, and what the runtime's other
/// ready tasks queue while it lets them run ([`while_ready_tasks_add`]: until a turn adds
/// nothing, the batch is full, or a few turns have passed). Letting the handlers made ready
/// by the same read from the network queue first made log entries about twice as large and
/// put 1.2-1.5x faster at 16 and 64 connections (docs/write-path.md, thirty-third round).
async fn gather(first: Proposal, queue: &mut mpsc::UnboundedReceiver<Proposal>) -> Vec<Proposal> {
    let mut gather = Gather::new(first);
    gather.drain(queue);
    if !gather.full() {
        while_ready_tasks_add(|| {
            let before = gather.batch.len();
            gather.drain(queue);
            gather.batch.len() > before && !gather.full()
        })
        .await;
    }
    gather.batch
}

/// A batch being gathered, within [`MAX_BATCH_COMMANDS`] and [`MAX_BATCH_BYTES`].
struct Gather {
    batch: Vec<Proposal>,
    bytes: usize,
}

impl Gather {
    fn new(first: Proposal) -> Self {
        Self {
            bytes: first.0.approx_bytes(),
            batch: vec![first],
        }
    }

    fn full(&self) -> bool {
        self.batch.len() >= MAX_BATCH_COMMANDS || self.bytes >= MAX_BATCH_BYTES
    }

    /// Take what is queued now, until the batch is full.
    fn drain(&mut self, queue: &mut mpsc::UnboundedReceiver<Proposal>) {
        while !self.full() {
            match queue.try_recv() {
                Ok(p) => {
                    self.bytes += p.0.approx_bytes();
                    self.batch.push(p);
                }
                Err(_) => break,
            }
        }
    }
}

/// Hand each proposer its own response.
fn distribute(
    result: Result<Response, ConsensusError>,
    single: bool,
    replies: Vec<oneshot::Sender<Result<Response, ConsensusError>>>,
) {
    match result {
        Ok(Response::Batch { responses }) if !single => {
            for (reply, r) in replies.into_iter().zip(responses) {
                let _ = reply.send(Ok(r));
            }
        }
        Ok(r) => {
            if let Some(reply) = replies.into_iter().next() {
                let _ = reply.send(Ok(r));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proposal(
        i: usize,
    ) -> (
        Proposal,
        oneshot::Receiver<Result<Response, ConsensusError>>,
    ) {
        let (tx, rx) = oneshot::channel();
        let cmd = Command::Put {
            key: format!("k{i:04}"),
            value: "v".into(),
            lease: None,
            prev_revision: None,
        };
        ((cmd, tx), rx)
    }

    fn keys(batch: &[Proposal]) -> Vec<String> {
        batch
            .iter()
            .map(|(c, _)| match c {
                Command::Put { key, .. } => key.clone(),
                other => panic!("not a put: {other:?}"),
            })
            .collect()
    }

    /// On one thread, as a node with one async worker runs: the handlers made ready together
    /// have not run yet when the first proposal wakes the queue, and still join its batch.
    #[tokio::test(flavor = "current_thread")]
    async fn proposals_of_tasks_ready_together_share_one_batch() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut answers = Vec::new();
        for i in 1..=10 {
            let (p, answer) = proposal(i);
            answers.push(answer);
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(p);
            });
        }
        let (first, _answer) = proposal(0);
        let batch = gather(first, &mut rx).await;
        let expected: Vec<String> = (0..=10).map(|i| format!("k{i:04}")).collect();
        assert_eq!(keys(&batch), expected, "one batch, in the order queued");
        drop(answers);
    }

    /// Tasks that queue proposals over several turns of the runtime (each waking the next)
    /// join the batch while each turn adds some, in order.
    #[tokio::test(flavor = "current_thread")]
    async fn a_batch_waits_while_each_turn_adds_proposals() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut answers = Vec::new();
        let mut chain = Vec::new();
        for i in 1..=3 {
            let (p, answer) = proposal(i);
            answers.push(answer);
            chain.push(p);
        }
        tokio::spawn(async move {
            for p in chain {
                let _ = tx.send(p);
                tokio::task::yield_now().await;
            }
            // The sender stays open: the batch must end because a turn added nothing.
            std::future::pending::<()>().await;
        });
        let (first, _answer) = proposal(0);
        let batch = gather(first, &mut rx).await;
        assert_eq!(keys(&batch), ["k0000", "k0001", "k0002", "k0003"]);
    }

    /// A lone proposal is not held: one turn that adds nothing ends its batch.
    #[tokio::test(flavor = "current_thread")]
    async fn a_lone_proposal_waits_one_turn() {
        let (_tx, mut rx) = mpsc::unbounded_channel::<Proposal>();
        let (first, _answer) = proposal(0);
        let batch = gather(first, &mut rx).await;
        assert_eq!(keys(&batch), ["k0000"]);
    }

    /// A full batch is closed at once; the rest stays queued, in order, for the next.
    #[tokio::test(flavor = "current_thread")]
    async fn a_full_batch_leaves_the_rest_queued_in_order() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut answers = Vec::new();
        for i in 1..MAX_BATCH_COMMANDS + 5 {
            let (p, answer) = proposal(i);
            answers.push(answer);
            tx.send(p).expect("queue open");
        }
        let (first, _answer) = proposal(0);
        let batch = gather(first, &mut rx).await;
        assert_eq!(batch.len(), MAX_BATCH_COMMANDS);
        let (next, _answer) = proposal(9999);
        let rest = gather(next, &mut rx).await;
        let rest_keys = keys(&rest);
        assert_eq!(rest_keys[0], "k9999");
        assert_eq!(rest_keys[1], format!("k{MAX_BATCH_COMMANDS:04}"));
        assert_eq!(rest.len(), 1 + 5);
    }
}
