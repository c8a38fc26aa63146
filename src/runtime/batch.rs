//! Round batching: many concurrent callers share one expensive round (a quorum confirmation).
//!
//! # Invariant (what makes it safe for linearizable reads)
//! A caller is answered only by a round that *started after the caller arrived*. A round already
//! in flight when a caller arrives may have confirmed leadership before that caller's request
//! existed, so the caller waits for the next round. At most one round runs at a time; every
//! caller that arrived while round `n` ran is served by round `n + 1`, so under load the number
//! of rounds is bounded by the round trip time, not by the request rate.
//!
//! # What it must not do
//! Hold its lock across an await (the lock guards only the waiting list), or keep running when
//! nobody waits: the round loop ends as soon as a round finds no waiter.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// A boxed round: what one confirmation costs.
pub type RoundFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

type Round<T, E> = Arc<dyn Fn() -> RoundFuture<T, E> + Send + Sync>;

struct Waiting<T, E> {
    /// Whether a round loop is running.
    running: bool,
    /// Callers waiting for the next round to start.
    next: Vec<oneshot::Sender<Result<T, E>>>,
}

/// Shares rounds among concurrent callers. Cheap to clone.
pub struct RoundBatcher<T, E> {
    round: Round<T, E>,
    waiting: Arc<Mutex<Waiting<T, E>>>,
    /// What a caller gets if the round loop vanished (runtime shutdown) before answering it.
    on_abandoned: E,
}

impl<T, E: Clone> Clone for RoundBatcher<T, E> {
    fn clone(&self) -> Self {
        RoundBatcher {
            round: self.round.clone(),
            waiting: self.waiting.clone(),
            on_abandoned: self.on_abandoned.clone(),
        }
    }
}

impl<T, E> RoundBatcher<T, E>
where
    T: Clone + Send + 'static,
    E: Clone + Send + 'static,
{
    /// A batcher running `round` for its callers.
    pub fn new(
        round: impl Fn() -> RoundFuture<T, E> + Send + Sync + 'static,
        on_abandoned: E,
    ) -> Self {
        RoundBatcher {
            round: Arc::new(round),
            waiting: Arc::new(Mutex::new(Waiting {
                running: false,
                next: Vec::new(),
            })),
            on_abandoned,
        }
    }

    /// Join the next round that starts after this call and return its result.
    pub async fn confirm(&self) -> Result<T, E> {
        let (tx, rx) = oneshot::channel();
        let start_loop = {
            let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
            w.next.push(tx);
            !std::mem::replace(&mut w.running, true)
        };
        if start_loop {
            // The loop is its own task: it must outlive any one caller (a caller's HTTP request
            // may be dropped) because others wait on it.
            tokio::spawn(run_rounds(self.round.clone(), self.waiting.clone()));
        }
        rx.await.unwrap_or_else(|_| Err(self.on_abandoned.clone()))
    }
}

/// The most turns of the runtime [`while_ready_tasks_add`] waits.
const GATHER_TURNS: usize = 8;

/// Let the runtime run its ready tasks, turn after turn, while `added` (called after each
/// turn) says the turn added work and there is room for more; at most [`GATHER_TURNS`] turns.
///
/// Why: a task that gathers work for a shared round (a proposal batch, a leadership
/// confirmation) is woken by the first task that hands it work, and tokio runs a task woken
/// that way next (its LIFO slot), ahead of the other tasks made ready by the same read from
/// the network. Without this wait each of those pays a round of its own a moment later (on a
/// node with one async worker, proposal batches of one or two: docs/write-path.md,
/// thirty-third round). A yield puts the gatherer behind every ready task and a poll for I/O;
/// a turn that adds nothing ends the wait, and there is no timer, so a lone caller waits one
/// turn of an idle runtime.
pub async fn while_ready_tasks_add(mut added: impl FnMut() -> bool) {
    for _ in 0..GATHER_TURNS {
        tokio::task::yield_now().await;
        if !added() {
            break;
        }
    }
}

/// Callers already on their way join the round about to start. Safe: the round has not
/// started, so each caller that joins arrived before it.
async fn gather_callers<T, E>(waiting: &Mutex<Waiting<T, E>>) {
    let count = || waiting.lock().unwrap_or_else(|p| p.into_inner()).next.len();
    let mut seen = count();
    while_ready_tasks_add(|| {
        let now = count();
        let grew = now > seen;
        seen = now;
        grew
    })
    .await;
}

async fn run_rounds<T: Clone, E: Clone>(round: Round<T, E>, waiting: Arc<Mutex<Waiting<T, E>>>) {
    loop {
        gather_callers(&waiting).await;
        let callers = {
            let mut w = waiting.lock().unwrap_or_else(|p| p.into_inner());
            if w.next.is_empty() {
                w.running = false;
                return;
            }
            std::mem::take(&mut w.next)
        };
        let result = round().await;
        for caller in callers {
            let _ = caller.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn concurrent_callers_share_rounds_and_never_use_an_earlier_round() {
        let rounds = Arc::new(AtomicU64::new(0));
        let r = rounds.clone();
        let batcher: RoundBatcher<u64, ()> = RoundBatcher::new(
            move || {
                let r = r.clone();
                Box::pin(async move {
                    // The round's number is taken when it starts.
                    let n = r.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Ok(n)
                })
            },
            (),
        );
        let mut tasks = Vec::new();
        for _ in 0..200 {
            let b = batcher.clone();
            let rounds = rounds.clone();
            tasks.push(tokio::spawn(async move {
                let started_before_me = rounds.load(Ordering::SeqCst);
                let served_by = b.confirm().await.unwrap();
                // Served by a round that started after this caller arrived.
                assert!(served_by > started_before_me);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // 200 callers, far fewer rounds.
        assert!(rounds.load(Ordering::SeqCst) < 50);
        // The loop stops when idle and restarts on demand.
        assert_eq!(batcher.confirm().await, Ok(rounds.load(Ordering::SeqCst)));
    }

    /// On one thread, as a node with one async worker runs: callers woken together with the
    /// loop (by the same event) join the next round instead of waiting for one more.
    #[tokio::test(flavor = "current_thread")]
    async fn callers_made_ready_with_the_loop_share_its_next_round() {
        let rounds = Arc::new(AtomicU64::new(0));
        let permits = Arc::new(tokio::sync::Semaphore::new(0));
        let (r, p) = (rounds.clone(), permits.clone());
        let batcher: RoundBatcher<u64, ()> = RoundBatcher::new(
            move || {
                let (r, p) = (r.clone(), p.clone());
                Box::pin(async move {
                    let n = r.fetch_add(1, Ordering::SeqCst) + 1;
                    p.acquire().await.expect("open").forget();
                    Ok(n)
                })
            },
            (),
        );
        let settle = || async {
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
        };
        let mut tasks = Vec::new();
        let b = batcher.clone();
        tasks.push(tokio::spawn(async move { b.confirm().await }));
        settle().await;
        assert_eq!(rounds.load(Ordering::SeqCst), 1, "round 1 runs");
        // One caller arrives during round 1; nine more are woken with the loop.
        let b = batcher.clone();
        tasks.push(tokio::spawn(async move { b.confirm().await }));
        let go = Arc::new(tokio::sync::Notify::new());
        for _ in 0..9 {
            let (b, go) = (batcher.clone(), go.clone());
            tasks.push(tokio::spawn(async move {
                go.notified().await;
                b.confirm().await
            }));
        }
        settle().await;
        permits.add_permits(100);
        go.notify_waiters();
        for t in tasks {
            assert!(t.await.expect("task").is_ok());
        }
        assert_eq!(
            rounds.load(Ordering::SeqCst),
            2,
            "the ten later callers share round 2"
        );
    }
}
