#!/usr/bin/env bash
# The full fault suite (issue 10): every scenario with its full number of trials, real processes on
# loopback, each printing its figure. The README's test command runs a fast variant of each scenario. Also the
# long tables kept out of that suite: the whole checkpoint matrix across meshes (issue 29, 49 cells).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/venv.sh
exec python3 -m pytest -q -s -p no:cacheprovider tests/faults \
  tests/strategies/test_mesh_checkpoints.py -m "faults_full or not faults_full" "$@"
