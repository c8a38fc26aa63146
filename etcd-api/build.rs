//! Generates etcd v3's messages, server traits and clients from the `.proto` files in
//! `proto/`. `protox` parses them in Rust, so building needs no `protoc` on the machine.

fn main() {
    const PROTOS: [&str; 5] = [
        "proto/auth.proto",
        "proto/kv.proto",
        "proto/rpc.proto",
        "proto/v3election.proto",
        "proto/v3lock.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    let descriptors = protox::compile(PROTOS, ["proto"]).expect("etcd's .proto files parse");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)
        .expect("code generation from etcd's .proto files");
}
