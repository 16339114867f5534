#!/usr/bin/env bash
# Set up, then check types (mypy, configured in pyproject.toml) and run the whole test suite with the
# doctests of src/distrib (bounded: every multi-process test has a timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m mypy
exec python3 -m pytest -q "$@"
