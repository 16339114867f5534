#!/usr/bin/env bash
# Sets up everything distrib needs on a fresh machine. Safe to run again.
#   0. a project virtual environment, .venv (DISTRIB_VENV elsewhere), so that the machine's own Python and a
#      user's packages are never changed and pip never weighs packages the project does not use (PYTHON=... uses
#      that interpreter as it is, for callers that made their own environment); enter it with
#      `source .venv/bin/activate`,
#   1. torch==2.13.0 first (its CPU wheel lies on these machines; an unpinned torch
#      would pull a multi-GB CUDA build),
#   2. every test and development dependency at the version in requirements/test.lock (the versions
#      CI last passed with; `bash scripts/lock.sh` regenerates it), then the package itself, editable,
#      without resolving again (so nothing unpinned slips in),
#   3. Debian's dataset-fashion-mnist (only when root and apt-get exist; otherwise
#      `distrib train` explains how to get the data, and the tests do not need it),
#   4. Debian's Slurm 22.05 (slurm-wlm: munge, slurmctld, slurmd) and iproute2, which the
#      cluster tests run for real (tests/cluster/slurm_cluster.py starts a one-node cluster;
#      tests/cluster/netns.py makes hosts of network namespaces); they skip with a reason without,
#   5. Debian's chromium, in which tests/test_site_layout.py renders every page of the documentation site and
#      fails where a table or a line runs past its column (it skips with a reason without). 3-5 as root with
#      apt-get only; elsewhere a message says what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  VENV=${DISTRIB_VENV:-.venv}
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
fi

LOCK=requirements/test.lock
# pip's notes about this machine's empty local index folders are noise here
quiet_pip() { "$PY" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  # a fresh environment: pip compiles every module it installs on one core (32 of its 55 s here); compileall does
  # the same bytecode on every core afterwards (19 s on 2), once
  quiet_pip --no-compile -c "$LOCK" "torch==2.13.0"
  quiet_pip --no-compile -r "$LOCK"
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 \
    || true  # (a few packages ship files for other Pythons, which pip skips as well)
else
  quiet_pip -r "$LOCK"
fi
quiet_pip --no-deps -e .

DATA=/usr/share/datasets/fashion-mnist
if [ ! -f "$DATA/train-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || echo "setup: apt-get update failed; trying the install anyway" >&2
    apt-get install -y -qq dataset-fashion-mnist >/dev/null \
      || echo "setup: could not install dataset-fashion-mnist; distrib train will say how to get the data" >&2
  else
    echo "setup: not root (or no apt-get): install the Debian package dataset-fashion-mnist, or pass --data-dir to distrib train" >&2
  fi
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v ip >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -qq --no-install-recommends slurm-wlm munge iproute2 >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1; apt-get install -y -qq --no-install-recommends slurm-wlm munge iproute2 >/dev/null; }; } \
      || echo "setup: could not install slurm-wlm/munge/iproute2; the Slurm and multi-host tests will skip" >&2
  fi
fi

if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1; apt-get install -y -qq chromium >/dev/null; }; } \
      || echo "setup: could not install chromium; the site's layout check (tests/test_site_layout.py) will skip" >&2
  else
    echo "setup: not root (or no apt-get): install Debian's chromium to run the site's layout check (tests/test_site_layout.py)" >&2
  fi
fi
