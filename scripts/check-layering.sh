#!/usr/bin/env bash
# The pure core stays pure: src/domain names no I/O crate and reads no clock.
set -euo pipefail
cd "$(dirname "$0")/.."
bad=$(grep -rnE '\b(tokio|sled|axum|reqwest|openraft|tracing_subscriber|hyper)::|Instant::now|SystemTime::now|thread_rng|rand::rng' src/domain || true)
if [ -n "$bad" ]; then
  echo "src/domain must stay pure (no I/O crates, no clock or RNG reads):" >&2
  echo "$bad" >&2
  exit 1
fi
echo "layering: src/domain is pure"
