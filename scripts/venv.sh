# Sourced by the scripts that run the project after scripts/setup.sh: enter the project's environment (.venv, or
# DISTRIB_VENV), so that `python3`, `distrib` and the tools are the ones setup.sh installed there. With PYTHON set,
# setup.sh installed into that interpreter instead, and nothing changes here.
if [ -z "${PYTHON:-}" ]; then
  VENV=$(cd "${DISTRIB_VENV:-.venv}" && pwd)
  export VIRTUAL_ENV=$VENV PATH="$VENV/bin:$PATH"
fi
