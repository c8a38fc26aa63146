//! The clocks: defined in the client crate ([`leasecore_client::clock`]), the only place that
//! reads them, so that the server and its clients share one notion of time.

pub use leasecore_client::clock::*;
