#!/usr/bin/env bash
# The dashboard in a real browser (tests/browser/test_dashboard.py): starts a 3-node loopback
# cluster with the debug build, drives headless Chromium with Selenium, stops the cluster.
# Where Chromium, its driver or Selenium is missing it runs scripts/test-tools.sh (which
# installs what the suite drives, as root with apt-get and pip); if they are still missing it
# prints SKIP and exits 0. Screenshots go to target/screenshots/
# (LEASECORE_SCREENSHOTS=docs/screenshots to refresh the README's).
set -euo pipefail
cd "$(dirname "$0")/.."

have_browser() { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }
have_selenium() { python3 -c 'import selenium' >/dev/null 2>&1; }

if ! have_browser || ! have_selenium; then
  scripts/test-tools.sh
fi
if ! command -v python3 >/dev/null || ! have_browser || ! have_selenium; then
  echo "SKIP: the dashboard browser test needs python3, chromium, chromedriver and selenium"
  exit 0
fi

# scripts/test.sh passes the binary its test build made (the test profile's); a `cargo build`
# here would compile the crate again under the dev profile.
if [ -z "${LEASECORE_BIN:-}" ]; then cargo build --quiet; fi
# Selenium Manager must not go online (it fetches driver lists and sends statistics).
export SE_OFFLINE=true SE_AVOID_STATS=true
export LEASECORE_SCREENSHOTS=${LEASECORE_SCREENSHOTS:-$PWD/target/screenshots}
export LEASECORE_BIN=${LEASECORE_BIN:-${CARGO_TARGET_DIR:-target}/debug/leasecore}
export LEASECORE_CLUSTER_DIR=${LEASECORE_CLUSTER_DIR:-$(mktemp -d)/cluster}
export LEASECORE_BASE_PORT=${LEASECORE_BASE_PORT:-7401}
trap 'scripts/cluster.sh clean >/dev/null 2>&1 || true' EXIT
scripts/cluster.sh start 3 >/dev/null
LEASECORE_UI_URL="http://127.0.0.1:$LEASECORE_BASE_PORT" python3 tests/browser/test_dashboard.py
