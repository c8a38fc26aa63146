//! Generates etcd v3's messages, server traits and clients from the `.proto` files in
//! `proto/`. `protox` parses them in Rust, so building needs no `protoc` on the machine.
//! `pbjson-build` adds serde implementations in proto3's JSON mapping with the proto field
//! names, which is what etcd's gRPC-JSON gateway speaks.

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
    let bytes = prost::Message::encode_to_vec(&descriptors);
    // The encoded descriptors are also what the server's reflection service answers with.
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    std::fs::write(format!("{out}/etcd_descriptors.bin"), &bytes)
        .expect("the descriptor set is written to OUT_DIR");
    pbjson_build::Builder::new()
        .register_descriptors(&bytes)
        .expect("descriptors register")
        .preserve_proto_field_names()
        .ignore_unknown_fields()
        .build(&[
            ".mvccpb",
            ".authpb",
            ".etcdserverpb",
            ".v3lockpb",
            ".v3electionpb",
        ])
        .expect("JSON code generation from etcd's .proto files");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)
        .expect("code generation from etcd's .proto files");
}
