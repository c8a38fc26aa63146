#!/usr/bin/env bash
# Installs the programs the test suite drives but does not build: curl and openssl (the
# cluster script, the TLS tests' certificates), strace (tests/fault.rs's slow disk), etcdctl
# and etcd 3.4 (Debian's etcd-client and etcd-server: the etcd API tests and the mirror from a
# real etcd), the Python etcd clients (python-etcd3 over gRPC, etcd3gw over the JSON gateway),
# and Chromium with its driver and Selenium (the dashboard's browser test).
#
# scripts/test.sh runs this in the background while it compiles, so that downloading and
# unpacking do not add to the suite's time; scripts/browser-test.sh, run alone, calls it for
# Chromium. It installs only what is missing, with one `apt-get update`, and only as root
# where apt-get exists; anywhere else it says what is missing and exits 0: each test then
# skips, or fails where the suite requires the tool.
set -uo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

missing=()
have curl || missing+=(curl)
have openssl || missing+=(openssl)
have strace || missing+=(strace)
have etcdctl || missing+=(etcd-client)
have etcd || missing+=(etcd-server)
if ! have python3 || ! python3 -m pip --version >/dev/null 2>&1; then missing+=(python3 python3-pip); fi
have chromium || missing+=(chromium)
have chromedriver || missing+=(chromium-driver)

can_apt=false
if have apt-get && [ "$(id -u)" = 0 ]; then can_apt=true; fi

if [ ${#missing[@]} -gt 0 ]; then
  if $can_apt; then
    echo "installing (apt-get): ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # One install for all; if it fails (one package missing from the mirror fails them all),
    # each package on its own, so that one failure costs only its own tests.
    if ! { apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
      for p in "${missing[@]}"; do
        apt-get install -y -qq "$p" >/dev/null || echo "apt-get could not install $p"
      done
    fi
  else
    echo "missing, and not installable here (needs root and apt-get): ${missing[*]}"
  fi
fi

# python-etcd3's generated modules load with protobuf 4 and later only in its pure-Python
# implementation; tests/etcd_python.rs sets the same variable.
pip_missing=()
if have python3; then
  PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python python3 -c 'import etcd3, etcd3gw' >/dev/null 2>&1 \
    || pip_missing+=(etcd3==0.12.0 etcd3gw==2.7.0)
  python3 -c 'import selenium' >/dev/null 2>&1 || pip_missing+=(selenium)
fi
if [ ${#pip_missing[@]} -gt 0 ] && python3 -m pip --version >/dev/null 2>&1; then
  echo "installing (pip): ${pip_missing[*]}"
  # Debian's own python3 is externally managed (PEP 668): there pip needs
  # --break-system-packages, which only adds client libraries to a test machine.
  pip_flags=(-q --disable-pip-version-check --root-user-action=ignore)
  python3 -m pip install "${pip_flags[@]}" "${pip_missing[@]}" >/dev/null 2>&1 \
    || python3 -m pip install "${pip_flags[@]}" --break-system-packages "${pip_missing[@]}" >/dev/null 2>&1 \
    || echo "pip could not install ${pip_missing[*]}"
fi
exit 0
