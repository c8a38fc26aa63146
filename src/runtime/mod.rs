//! Thin async drivers around the pure cores.
//!
//! Each driver moves data between the world (tokio timers, Raft, HTTP) and a `domain` core, and
//! decides nothing itself. Every long-running driver is an `async fn run(self, cancel)` spawned
//! on the node's task tracker, so shutdown can stop and await it.
//!
//! # Layout
//! - [`batch`]: [`batch::RoundBatcher`], which lets many concurrent callers share one quorum
//!   round (linearizable reads now, lease refreshes later).
//! - [`election`]: the election watchdog against openraft 0.9's election stall.

pub mod batch;
pub mod election;
