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
python3 -m mypy
bash scripts/docs.sh  # the documentation site (mkdocs.yml), warnings as errors
# two test processes (pytest-xdist): most tests wait on processes they started, so two at a time use the 2 cores
# better than one; each test file stays on one process (tests/conftest.py's scheduler). DISTRIB_TEST_PROCESSES=0
# runs everything in this one process
exec python3 -m pytest -q -n "${DISTRIB_TEST_PROCESSES:-2}" "$@"
