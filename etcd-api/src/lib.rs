//! etcd v3's gRPC API, generated from etcd's own `.proto` files (see `proto/README.md`):
//! the messages (with serde in the gRPC-JSON gateway's encoding), a server trait per service,
//! and a client per service.
//!
//! Nothing here decides anything: the server adapter (`leasecore::etcd`) implements the
//! traits, and `leasecore bench --etcd` drives both leasecore and etcd with the clients.
//! The module layout follows the protos' packages, as etcd's own Go packages do.
#![allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]

/// The encoded `FileDescriptorSet` of every `.proto` file here: what a gRPC reflection
/// service answers with, so that tools like `grpcurl` can call the API without the files.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/etcd_descriptors.bin"));

/// `mvccpb`: keys, values and events.
pub mod mvccpb {
    tonic::include_proto!("mvccpb");
    include!(concat!(env!("OUT_DIR"), "/mvccpb.serde.rs"));
}

/// `authpb`: users, roles and permissions.
pub mod authpb {
    tonic::include_proto!("authpb");
    include!(concat!(env!("OUT_DIR"), "/authpb.serde.rs"));
}

/// `etcdserverpb`: the KV, Watch, Lease, Cluster, Maintenance and Auth services.
pub mod etcdserverpb {
    tonic::include_proto!("etcdserverpb");
    include!(concat!(env!("OUT_DIR"), "/etcdserverpb.serde.rs"));
}

/// `v3lockpb`: the Lock service.
pub mod v3lockpb {
    tonic::include_proto!("v3lockpb");
    include!(concat!(env!("OUT_DIR"), "/v3lockpb.serde.rs"));
}

/// `v3electionpb`: the Election service.
pub mod v3electionpb {
    tonic::include_proto!("v3electionpb");
    include!(concat!(env!("OUT_DIR"), "/v3electionpb.serde.rs"));
}
