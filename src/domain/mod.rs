//! The pure core of leasecore: every rule lives here.
//!
//! # The sans-I/O contract
//! - Nothing in `domain` does I/O, spawns, sleeps or reads a clock. It does not name tokio,
//!   sled, axum, reqwest or openraft. Inputs are method calls (any that depend on time take
//!   `now` as an argument); outputs are return values.
//! - Iteration that reaches an output is deterministic (`BTreeMap`/`BTreeSet`), so every replica
//!   applying the same log produces byte-identical state and the same events.
//! - Errors here are *deterministic* domain outcomes (a CAS mismatch, an unknown lease). They are
//!   values that travel back to the client; they never stop a node.
//!
//! # Layout
//! - [`types`]: newtypes shared by every layer (revisions, time).
//! - [`auth`]: users, roles, permissions, tokens (etcd-style RBAC).
//! - [`bootstrap`]: may a node with an empty data dir start (lost-data protection).
//! - [`command`]: the Raft log vocabulary: `Command` in, `Response` and `Event` out.
//! - [`limits`]: input validation shared by the HTTP edge and the CLI.
//! - [`history`]: `EventHistory`, the bounded recent changes that watches read.
//! - [`key_index`]: where every version of every key is kept (records or bases).
//! - [`kv`]: `KvState`, the replicated key-value state machine (keys and leases).
//! - [`lease`]: `LeaseTracker`, the leader-only lease deadlines.
//! - [`log_reversion`]: has a follower lost entries it acknowledged (came back empty)?
//! - [`lwlease`]: the Chockler–Malkhi light-weight lease over one read/write register.
//! - [`members`]: membership as leased keys (`members/{id}`): layout and record.
//! - [`peer_trust`]: which peer messages a node accepts (sender membership, consistent
//!   claims, no disruptive votes).
//! - [`prevote`]: whether a node grants a pre-vote, and whether a candidate won one.
//! - [`health`]: readiness, quorum loss, peer reachability, learner catch-up.
//! - [`resources`]: connection cap, storage quota, log compaction by bytes, peer addresses.
//! - [`tag_first`]: decoding the log's internally tagged enums without serde's buffering.
//! - [`value_bytes`]: the etcd API's byte values in the text store (NUL and base64).
//! - [`vote_release`]: when a node that joined with an empty data dir may vote again.

pub mod auth;
pub mod auto_compact;
pub mod bootstrap;
pub mod command;
pub mod flease;
pub mod health;
pub mod history;
pub mod history_fill;
pub mod key_bytes;
pub mod key_index;
pub mod kv;
pub mod lease;
pub mod limits;
pub mod log_reversion;
/// The Chockler–Malkhi light-weight lease (pure; in the client crate, whose register runner
/// drives it).
pub use leasecore_client::lwlease;
pub mod members;
pub mod mvcc;
pub mod peer_link;
pub mod peer_trust;
pub mod prevote;
pub mod range;
pub mod recipes;
pub mod resources;
pub mod tag_first;
pub mod txn;
pub mod types;
pub mod value_bytes;
pub mod vote_release;
pub mod watch_batch;
