//! leasecore: a Consistent Core. See README.md for the map.
pub mod clock;
pub mod domain;
pub mod raft;
pub mod storage;
pub mod runtime;
pub mod wire;
pub mod metrics;
pub mod http;
pub mod node;
pub mod client;
