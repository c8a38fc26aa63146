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
# curl is used by scripts/cluster.sh and the smoke checks; install it where it is missing.
if ! command -v curl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing curl"; (apt-get update -qq && apt-get install -y -qq curl) >/dev/null
fi
# openssl makes the throw-away certificates of the TLS tests (scripts/certs.sh).
if ! command -v openssl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing openssl"; (apt-get update -qq && apt-get install -y -qq openssl) >/dev/null
fi

# strace holds a follower's syncs back in tests/fault.rs (a slow disk); that test skips without it.
if ! command -v strace >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing strace"; (apt-get update -qq && apt-get install -y -qq strace) >/dev/null
fi

# etcdctl 3.4 (Debian's etcd-client) drives the etcd v3 API tests (tests/etcd_api.rs); with the
# variable set they fail rather than skip when it is missing.
if ! command -v etcdctl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing etcd-client (etcdctl)"; (apt-get update -qq && apt-get install -y -qq etcd-client) >/dev/null
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export LEASECORE_REQUIRE_ETCDCTL=1
fi
# A real etcd 3.4 (Debian's etcd-server) is the source that tests/etcd_migrate.rs mirrors into
# leasecore with `etcdctl make-mirror`; with the variable set it fails rather than skips.
if ! command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing etcd-server (etcd)"; (apt-get update -qq && apt-get install -y -qq etcd-server) >/dev/null
fi
if command -v etcd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export LEASECORE_REQUIRE_ETCD=1
fi
# python-etcd3 (gRPC) and etcd3gw (the JSON gateway) drive the etcd v3 API from Python
# (tests/etcd_python.rs); with the variable set those tests fail rather than skip when the
# packages are missing. Debian's own python3 is externally managed (PEP 668): there pip needs
# --break-system-packages, which only adds two client libraries to a test machine.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
    echo "installing python3-pip"; (apt-get update -qq && apt-get install -y -qq python3 python3-pip) >/dev/null
  fi
  # (python-etcd3's generated modules load with protobuf 4 and later only in its pure-Python
  # implementation; the test sets the same variable.)
  if ! PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python python3 -c 'import etcd3, etcd3gw' >/dev/null 2>&1; then
    echo "installing the Python etcd clients (pip: etcd3, etcd3gw)"
    pkgs=(etcd3==0.12.0 etcd3gw==2.7.0)
    pip_flags=(-q --disable-pip-version-check --root-user-action=ignore)
    python3 -m pip install "${pip_flags[@]}" "${pkgs[@]}" 2>/dev/null \
      || python3 -m pip install "${pip_flags[@]}" --break-system-packages "${pkgs[@]}" \
      || echo "pip could not install ${pkgs[*]}: tests/etcd_python.rs will fail" >&2
  fi
  export LEASECORE_REQUIRE_PY_ETCD=1
fi
# The etcd-client crate (tests/etcd_client.rs) compiles etcd's protos with protoc at build time:
# without it the lints and tests below cannot build, so say why now rather than skip.
if ! command -v protoc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing protobuf-compiler (protoc)"; (apt-get update -qq && apt-get install -y -qq protobuf-compiler) >/dev/null
fi
if ! command -v protoc >/dev/null 2>&1 && [ -z "${PROTOC:-}" ]; then
  echo "protoc not found: the etcd-client crate used by tests/etcd_client.rs needs it to build" >&2
  echo "(apt-get install protobuf-compiler, or set PROTOC to its path)" >&2
  exit 1
fi

scripts/check-layering.sh

if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all -- --check
else
  echo "rustfmt not installed: skipping the format check"
fi
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --locked --workspace --all-targets -- -D warnings
else
  echo "clippy not installed: skipping lints"
fi

# Every test binary runs even after one fails, so that one failure does not hide the others.
# The integration tests are one binary (tests/integration.rs), so their two test threads
# take the next test of any file, not only of the file in hand.
cargo test --locked --workspace --all-targets --no-fail-fast

# The dashboard in a real browser (skips with a message where Chromium cannot be installed).
scripts/browser-test.sh
