//! The JSON documents of the client API: defined in the client crate
//! ([`leasecore_client::api`]), shared by the HTTP server and every client.

pub use leasecore_client::api::*;
