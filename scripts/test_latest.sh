#!/usr/bin/env bash
# The test suite against the NEWEST release of every dependency, not the lock file: a break in a new
# release (cloudpickle 3.1.3 renaming pickled functions' files to <dynamic-code> was one) shows up here
# first, before the lock moves and CI meets it.
#
#   bash scripts/test_latest.sh [PYTEST ARGS...]
#
# It builds a fresh venv (no system site packages; $LATEST_VENV, default /tmp/distrib-latest), installs
# torch==2.13.0 (the CPU wheel on these machines: the newest torch is a multi-GB CUDA build; set
# LATEST_TORCH=newest to take it anyway; pip's configured cap on these machines stops it at 2.14.1, and
# PIP_CONFIG_FILE=/dev/null lifts the cap) and then this package with its test extra, unpinned and upgraded;
# prints which versions differ from requirements/test.lock; runs mypy and the suite. The README's test
# command (scripts/test.sh) stays on the lock.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${LATEST_VENV:-/tmp/distrib-latest}
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m venv --clear "$VENV"
pipq() { "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# --upgrade-strategy eager upgrades torch too (a dependency): hold it at 2.13.0 in that step as well
if [ "${LATEST_TORCH:-}" = newest ]; then TORCH=(torch); else TORCH=("torch==2.13.0"); fi
pipq --upgrade "${TORCH[@]}"
pipq --upgrade --upgrade-strategy eager -e ".[test]" "${TORCH[@]}"

echo "== versions that differ from requirements/test.lock"
"$VENV/bin/python" - <<'PY'
import re
from importlib.metadata import distributions
locked = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", open("requirements/test.lock").read(), re.M))
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
locked = {norm(k): v for k, v in locked.items()}
have = {norm(d.metadata["Name"]): d.version for d in distributions()}
rows = [(n, locked[n], have.get(n, "-")) for n in sorted(locked) if have.get(n, "-") != locked[n]]
rows += [(n, "-", v) for n, v in sorted(have.items()) if n not in locked and n not in ("pip", "distrib")]
for name, lock, now in rows:
    print(f"  {name:28} lock {lock:14} now {now}")
print(f"  ({len(rows)} differ)" if rows else "  (none: the lock is the newest of everything)")
PY

export PATH="$VENV/bin:$PATH"
python -m mypy
exec python -m pytest -q "$@"
