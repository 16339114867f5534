#!/usr/bin/env bash
# Set up, then run the main job: `distrib train` on the real Fashion-MNIST.
# Extra arguments go to `distrib train` (e.g. --epochs 3, --replicas 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/venv.sh  # the project's environment, which setup.sh made
exec distrib train "$@"
