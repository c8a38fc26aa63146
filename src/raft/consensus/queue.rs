//! The proposal queue: group commit of client proposals into `Command::Batch` log entries, in
//! arrival order, with a bounded number of batches in flight.

use super::*;

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
            let mut bytes = first.0.approx_bytes();
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH_COMMANDS && bytes < MAX_BATCH_BYTES {
                match self.queue.try_recv() {
                    Ok(p) => {
                        bytes += p.0.approx_bytes();
                        batch.push(p);
                    }
                    Err(_) => break,
                }
            }
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
