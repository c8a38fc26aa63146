//! Thin async drivers around the pure cores.
//!
//! Each driver moves data between the world (tokio timers, Raft, HTTP) and a `domain` core, and
//! decides nothing itself. Every long-running driver is an `async fn run(self, cancel)` spawned
//! on the node's task tracker, so shutdown can stop and await it.
//!
//! # Layout
//! - [`auth`]: password hashing (bounded), token issue and caller resolution.
//! - [`batch`]: [`batch::RoundBatcher`], which lets many concurrent callers share one quorum
//!   round (linearizable reads now, lease refreshes later).
//! - [`bootstrap`]: asks the peers whether a cluster runs (empty data dir at start).
//! - [`compaction`]: snapshot and purge the log by bytes (openraft counts only entries).
//! - [`election`]: the election watchdog against openraft 0.9's election stall.
//! - [`quorum`]: the quorum watchdog: a leader that lost its quorum steps down.
//! - [`lease`]: the lease tracker's shell: apply-path observer, refresh, the expiry driver.
//! - [`watch`]: the watch hub: event history fed by apply, wake-ups by key and prefix.
//! - [`flease`]: Flease rounds over the peer port, the local acceptor, membership re-arming.
//!
//! The lease shell talks to `raft::consensus::Consensus` directly rather than through a port:
//! every decision it sequences is made by the pure `domain::lease`, which is where its tests
//! are; the shell itself is exercised end to end.

pub mod auth;
pub mod auto_compact;
pub mod batch;
pub mod bootstrap;
pub mod compaction;
pub mod election;
pub mod flease;
pub mod history_fill;
pub mod lease;
pub mod quorum;
pub mod replace;
pub mod stall;
pub mod watch;
