#!/usr/bin/env bash
# Set up (scripts/setup.sh: the project's .venv), then, inside it, lint and check the format (ruff), check
# types (mypy; both configured in pyproject.toml), build the documentation site (scripts/docs.sh) and run the whole test suite with the doctests of src/distrib (bounded: every multi-process test
# has a timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/venv.sh  # the project's environment, which setup.sh made
ruff check .
ruff format --check .
# mypy and the documentation site (mkdocs.yml, warnings as errors) at once: each keeps one of the 2 cores busy
# (13 s and 17 s from a cold cache, 17 s together)
mypy_log=$(mktemp)
python3 -m mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
bash scripts/docs.sh
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
rm -f "$mypy_log"
[ "$mypy_status" -eq 0 ] || exit "$mypy_status"
# two test processes (pytest-xdist): most tests wait on processes they started, so two at a time use the 2 cores
# better than one; each test file stays on one process (tests/conftest.py's scheduler). DISTRIB_TEST_PROCESSES=0
# runs everything in this one process
exec python3 -m pytest -q -n "${DISTRIB_TEST_PROCESSES:-2}" "$@"
