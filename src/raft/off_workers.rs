//! Long synchronous work, and waits for a lock that long work holds, kept off the async
//! workers.
//!
//! A node runs everything that keeps it in its cluster (the Raft core, the peer streams, the
//! heartbeats and their answers) on a few tokio worker threads: two on a two-core machine. An
//! apply that changes a great many keys at once (a prefix delete of 190,000 keys takes seconds)
//! holds the state's lock throughout; a request that reads the state meanwhile blocked its
//! worker on that lock, and with one worker applying and the other blocked, nothing ran Raft:
//! followers stopped answering heartbeats and the leader stepped down. Here a thread that must
//! wait or work for long first hands its worker's queue to another thread
//! (`tokio::task::block_in_place`), so the runtime keeps all its workers.
//!
//! # Invariants
//! - Only a reader that finds the lock taken while a long hold is under way ([`long_hold`])
//!   hands its worker over; any other read costs what a read of the lock costs, and waits on
//!   its worker for the microseconds the lock's ordinary holders keep it, looking again every
//!   [`LOOK_AGAIN`] whether a long hold has begun meanwhile (a reader woken by one holder's
//!   release may find the next, long, holder already in).
//! - Outside a multi-threaded runtime (a current-thread runtime in tests, a plain thread, the
//!   blocking pool) the work simply runs where it is: those have no other tasks to hand over
//!   or may not hand them over.
//!
//! # Doubtful
//! Readers that hand over each take a thread of tokio's blocking pool while they wait (512 at
//! most; beyond that a hand-over waits for a thread, and its worker with it).
//!
//! # What it must not do
//! Decide anything, or change what the guarded state holds: it only chooses the thread that
//! waits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio::runtime::{Handle, RuntimeFlavor};

/// How long a wait on a worker lasts before it looks again whether a long hold began: a
/// reader that started waiting behind an ordinary holder moves off its worker within this of
/// a long hold's start.
const LOOK_AGAIN: Duration = Duration::from_micros(200);

/// Long holds under way in this process (several nodes share one in tests: a reader of one
/// then hands over needlessly, which costs a thread switch and nothing else).
static LONG_HOLDS: AtomicUsize = AtomicUsize::new(0);

/// A long hold under way while this lives: readers that find a lock taken meanwhile wait off
/// the async workers.
#[must_use = "the hold ends when this is dropped"]
pub struct LongHold(());

/// Announce a long hold (take it before the lock, drop it after the lock's guard).
pub fn long_hold() -> LongHold {
    LONG_HOLDS.fetch_add(1, Ordering::SeqCst);
    LongHold(())
}

impl Drop for LongHold {
    fn drop(&mut self) {
        LONG_HOLDS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Run `f`, which may take long, without holding up the other tasks of this worker.
pub fn run<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Whether a wait for a taken lock may be long.
fn long_wait() -> bool {
    LONG_HOLDS.load(Ordering::SeqCst) > 0
}

/// A read guard of `lock`; while a long hold may be what holds it, waiting off the async
/// workers.
pub fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    acquire(|| lock.try_read(), |d| lock.try_read_for(d), || lock.read())
}

/// A write guard of `lock`; while a long hold may be what holds it, waiting off the async
/// workers.
pub fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    acquire(
        || lock.try_write(),
        |d| lock.try_write_for(d),
        || lock.write(),
    )
}

/// Take a guard at once if free; else wait on this worker, [`LOOK_AGAIN`] at a time, until
/// it is taken or a long hold may be what keeps it, and then wait off the workers.
fn acquire<G>(
    now: impl FnOnce() -> Option<G>,
    within: impl Fn(Duration) -> Option<G>,
    wait: impl FnOnce() -> G,
) -> G {
    if let Some(guard) = now() {
        return guard;
    }
    loop {
        if long_wait() {
            return run(wait);
        }
        if let Some(guard) = within(LOOK_AGAIN) {
            return guard;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::Duration;

    /// On a runtime of two workers, `holder` takes the lock and keeps it (the long apply)
    /// while `waiter` waits for it: whether a third task ran meanwhile.
    async fn third_task_runs(holder_hands_over: bool, waiter_hands_over: bool) -> bool {
        let lock = Arc::new(RwLock::new(0u64));
        let (held_tx, held_rx) = tokio::sync::oneshot::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let holder = {
            let lock = lock.clone();
            tokio::spawn(async move {
                let _long = long_hold();
                let hold = move || {
                    let mut guard = lock.write();
                    held_tx.send(()).unwrap();
                    release_rx.recv_timeout(Duration::from_secs(30)).unwrap();
                    *guard += 1;
                };
                if holder_hands_over { run(hold) } else { hold() }
            })
        };
        held_rx.await.unwrap();
        let waiter = {
            let lock = lock.clone();
            tokio::spawn(async move {
                if waiter_hands_over {
                    *read(&lock)
                } else {
                    *lock.read()
                }
            })
        };
        // Waited for on this (the test's own, not a worker) thread: with both workers stuck,
        // no timer of the runtime would fire.
        let (ran_tx, ran_rx) = mpsc::channel();
        let other = tokio::spawn(async move { ran_tx.send(()).unwrap() });
        let ran = ran_rx.recv_timeout(Duration::from_secs(5)).is_ok();
        release_tx.send(()).unwrap();
        holder.await.unwrap();
        other.await.unwrap();
        assert_eq!(
            waiter.await.unwrap(),
            1,
            "the waiter saw the holder's change"
        );
        ran
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_waiting_for_a_long_holder_leaves_its_worker_to_other_tasks() {
        assert!(third_task_runs(false, true).await);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_holder_leaves_its_worker_to_other_tasks() {
        assert!(third_task_runs(true, false).await);
    }

    /// The finding in miniature: without either hand-over, the two workers are stuck.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_hand_over_nothing_else_runs() {
        assert!(!third_task_runs(false, false).await);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn on_a_current_thread_runtime_the_work_runs_in_place() {
        let lock = RwLock::new(3);
        assert_eq!(*read(&lock), 3);
        assert_eq!(run(|| 4), 4);
        *write(&lock) = 5;
        assert_eq!(*read(&lock), 5);
    }

    #[test]
    fn outside_any_runtime_the_work_runs_in_place() {
        let lock = RwLock::new(1);
        assert_eq!(run(|| *read(&lock) + 1), 2);
    }
}
