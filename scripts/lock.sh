#!/usr/bin/env bash
# Regenerates requirements/test.lock: every package the README's test command installs, pinned to one
# version (the versions CI last passed with). Run it after changing a dependency in pyproject.toml, then run
# `bash scripts/test.sh` and commit the lock with the change.
#
#   bash scripts/lock.sh
#
# pip-compile (pip-tools) resolves pyproject.toml's `test` extra together with requirements/torch.in
# (torch==2.13.0) for this machine's Python, in a throwaway venv. pip resolves torch==2.13.0 to the CPU wheel
# that lies on these machines (2.13.0+cpu, found through pip's configured find-links), and the lock names that
# build exactly: what CI installs is what was tested.
# The package's own ranges (pyproject.toml) stay ranges: the lock is for the tests, not for users.
# `bash scripts/test_latest.sh` runs the suite against the newest releases instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
TOOL=$(mktemp -d)
trap 'rm -rf "$TOOL"' EXIT
"$PY" -m venv "$TOOL/venv"
"$TOOL/venv/bin/pip" install -q "pip-tools==7.6.2"
"$TOOL/venv/bin/pip-compile" --quiet --strip-extras --extra test --allow-unsafe --no-emit-index-url \
  --no-emit-find-links --no-emit-trusted-host --newline lf --output-file requirements/test.lock \
  pyproject.toml requirements/torch.in 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# the header names this script, not pip-compile's own command line (which names a temporary path)
sed -i -E 's|^#    pip-compile .*|#    bash scripts/lock.sh|' requirements/test.lock
echo "requirements/test.lock: $(grep -cE '^[A-Za-z0-9_.-]+==' requirements/test.lock) packages pinned"
