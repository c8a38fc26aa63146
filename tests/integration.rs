//! Every integration test in one binary: each `tests/<name>.rs` is a module here.
//!
//! One binary instead of one per file: the suite compiled `tests/common` once per file and
//! linked fifty test binaries against the whole dependency tree, most of CI's build time on
//! two cores. Together they also share the test threads, so a file with one long test no
//! longer leaves the other thread idle. Run one file's tests with
//! `cargo test --test integration <name>::`.
//!
//! `tests/flease_memory.rs` stays a binary of its own: it installs a counting global
//! allocator, which would count every other test's allocations too.

mod common;
#[path = "support/auth.rs"]
mod support;

mod auth;
mod auth_watch;
mod backup;
mod bad_input;
mod bench_smoke;
mod cli_exit;
mod cli_surface;
mod cluster;
mod cluster_script;
mod config_file;
mod etcd_admin;
mod etcd_api;
mod etcd_authority;
mod etcd_binary_keys;
mod etcd_client;
mod etcd_gateway;
mod etcd_grpc_meta;
mod etcd_http;
mod etcd_migrate;
mod etcd_python;
mod fault;
mod flease;
mod flease_sim;
mod health;
mod heavy_apply;
mod history_fill;
mod history_reads;
mod history_v1;
mod hostile_input;
mod hostile_network;
mod leader_tail_loss;
mod lease_model;
mod leases;
mod linearizability;
mod locks;
mod logs;
mod lwlease_cli;
mod lwlease_sim;
mod members;
mod move_leader;
mod openapi;
mod peer_stream;
mod peer_trust;
mod prevote;
mod raft_storage;
mod readme;
mod replace;
mod resources;
mod tls;
mod watch;
mod watch_bytes;
mod watch_restart;
mod wiped_joiner;
mod wiped_node;
