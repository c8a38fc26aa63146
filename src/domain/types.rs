//! Newtypes shared by every layer, defined in the client crate (they are also the API's):
//! see [`leasecore_client::types`].

pub use leasecore_client::types::*;
