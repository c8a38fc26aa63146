"""What the Python client scripts (tests/support/py_etcd3.py, py_etcd3gw.py) share: their
checks, each printing `ok: ...` or `MISMATCH: ...` and remembering the mismatches in
FAILURES, which a script reports at its end (and exits 1 if any)."""

import sys
import traceback

FAILURES = []
DEADLINE_S = 10.0


def check(what, got, want):
    if got == want:
        print(f"ok: {what}")
    else:
        print(f"MISMATCH: {what}: got {got!r}, want {want!r}")
        FAILURES.append(what)


def truthy(what, cond, detail=""):
    if cond:
        print(f"ok: {what}")
    else:
        print(f"MISMATCH: {what} {detail}")
        FAILURES.append(what)


def section(name, fn, *args):
    print(f"== {name}")
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        print(f"MISMATCH: section {name} raised:")
        traceback.print_exc(file=sys.stdout)
        FAILURES.append(name)
