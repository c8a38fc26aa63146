//! gRPC server reflection (`grpc.reflection.v1` and the older `v1alpha` that many tools still
//! ask first) on the etcd port: the services and messages it serves, described from etcd's own
//! `.proto` files, so that `grpcurl` and similar tools can list and call them without copies of
//! the files. etcd itself does not serve reflection; kine does, and it costs nothing at rest.
//!
//! # What it must not do
//! Describe anything this port does not serve: the set is etcd's API and the health service.

use tonic::service::Routes;

/// `routes` with both reflection services added. The descriptor sets are compiled in, so a
/// failure here is a build defect: it is logged and the port serves on without reflection.
pub fn add_to(routes: Routes) -> Routes {
    let described = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(leasecore_etcd_api::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    match (described().build_v1(), described().build_v1alpha()) {
        (Ok(v1), Ok(v1alpha)) => routes.add_service(v1).add_service(v1alpha),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "gRPC reflection is not served: its descriptors do not build");
            routes
        }
    }
}
