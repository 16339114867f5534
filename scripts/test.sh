#!/usr/bin/env bash
# Set up, then run the whole test suite (bounded: every multi-process test has a timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q "$@"
