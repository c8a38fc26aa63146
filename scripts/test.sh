#!/usr/bin/env bash
# The whole test suite: layering, formatting, lints, then every test (unit, property,
# storage conformance, OpenAPI contract, end-to-end clusters on loopback).
# This is the command README.md gives and .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust (https://rustup.rs) and run again" >&2
  exit 1
fi
# The etcd-client crate (tests/etcd_client.rs) compiles etcd's protos with protoc at build time:
# without it the lints and tests below cannot build, so install it now or say why not.
if ! command -v protoc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing protobuf-compiler (protoc)"; (apt-get update -qq && apt-get install -y -qq protobuf-compiler) >/dev/null
fi
if ! command -v protoc >/dev/null 2>&1 && [ -z "${PROTOC:-}" ]; then
  echo "protoc not found: the etcd-client crate used by tests/etcd_client.rs needs it to build" >&2
  echo "(apt-get install protobuf-compiler, or set PROTOC to its path)" >&2
  exit 1
fi

# The programs the tests drive (etcdctl, etcd, the Python clients, Chromium, strace...) are
# installed in the background while the code compiles; the tests wait for them below.
tools_log=$(mktemp)
trap 'rm -f "$tools_log"' EXIT
scripts/test-tools.sh >"$tools_log" 2>&1 &
tools_pid=$!

scripts/check-layering.sh

if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all -- --check
else
  echo "rustfmt not installed: skipping the format check"
fi
# The lints run inside the test build: clippy-driver wraps rustc for this workspace's crates,
# as `cargo clippy` does, so each crate is compiled once, with its lints, instead of once for
# clippy and again for the tests. `-D warnings` reaches the driver as `cargo clippy -- -D
# warnings` passes it (CLIPPY_ARGS, which the driver tracks), so it fails the build on any
# warning or lint of this workspace; dependencies keep their flags, and their builds are
# shared with plain `cargo build` and `cargo test`.
if clippy-driver --version >/dev/null 2>&1; then
  export RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS
  RUSTC_WORKSPACE_WRAPPER=$(command -v clippy-driver)
  CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
else
  echo "clippy not installed: building the tests without lints"
fi
cargo test --locked --workspace --all-targets --no-run

wait "$tools_pid" || true
cat "$tools_log"
# Where the suite could install them, the tests that drive etcdctl, etcd and the Python etcd
# clients fail rather than skip when one is missing.
# (etcd itself only where it is installed: Debian releases without etcd-server exist.)
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export LEASECORE_REQUIRE_ETCDCTL=1 LEASECORE_REQUIRE_PY_ETCD=1
  if command -v etcd >/dev/null 2>&1; then export LEASECORE_REQUIRE_ETCD=1; fi
fi

# Every test binary runs even after one fails, so that one failure does not hide the others.
# The integration tests are one binary (tests/integration.rs), so its test threads take the
# next test of any file, not only of the file in hand. Three threads on two cores: with two,
# the cores were idle a third of the time (tests waiting on processes, timers and disks); with
# three, that binary took 377 s instead of 489 s here, every test passing.
cargo test --locked --workspace --all-targets --no-fail-fast -- --test-threads 3

# The dashboard in a real browser (skips with a message where Chromium cannot be installed),
# on the binary the integration tests ran.
LEASECORE_BIN="${CARGO_TARGET_DIR:-target}/debug/leasecore" scripts/browser-test.sh
