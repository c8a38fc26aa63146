//! leasecore: a Consistent Core. A small Raft-replicated key-value store (openraft, with log and
//! state in sled) served over HTTP/JSON (axum), with leases, watches and Flease.
//!
//! # Architecture
//! ```text
//!   client ──► http/ ──► raft::consensus ──► openraft ──► raft/{log_store,state_machine} ──► sled
//!                │              │                                   │ apply
//!                └──────────────┴──────────► domain/ (pure) ◄───────┘
//! ```
//! - [`domain`] is pure and synchronous: every rule lives there, time is an argument.
//! - [`storage`] opens sled and names its trees; [`raft`] adapts openraft (log store, state
//!   machine, peer network, and the [`raft::consensus::Consensus`] handle).
//! - [`runtime`] holds the async drivers (round batching, the election watchdog).
//! - [`http`] maps requests to calls and errors to statuses in one place; [`wire`] holds the
//!   JSON documents shared with [`client`].
//! - [`node`] wires a node together and shuts it down in order; [`clock`] is the only place
//!   that reads clocks; [`metrics`] renders Prometheus text; [`bench`](mod@bench) is the load generator.
//!
//! # The dependency rule
//! `domain` imports nothing above it. Adapters translate and never decide.

pub mod bench;
/// The Rust client (the `leasecore-client` crate), re-exported for the CLI and the tests.
pub use leasecore_client as client;
/// Transport failures in words (from the client crate).
pub use leasecore_client::transport;
pub mod clock;
pub mod domain;
pub mod etcd;
pub mod http;
pub mod metrics;
pub mod node;
pub mod raft;
pub mod runtime;
pub mod storage;
pub mod tls;
pub mod version;
pub mod wire;
