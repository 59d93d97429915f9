#!/usr/bin/env bash
# Creates ./.venv and installs memlm into it: torch==2.13.0 first (a local CPU wheel; an unpinned torch would
# pull a multi-GB CUDA build), then the package with its pinned dependencies. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${MEMLM_SKIP_INSTALL:-0}" = 1 ]; then
  exit 0  # an environment is already in .venv (tests/cli/test_readme.py runs the README against the one under test)
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,cluster,pretrained]"
# memlm, torchrun, deepspeed, mlflow and ray are in .venv/bin: the README's commands expect them on the PATH.
case ":${PATH}:" in
  *":$PWD/.venv/bin:"*) ;;
  *) echo "memlm is installed in $PWD/.venv; put it (and torchrun, deepspeed) on your PATH with: source .venv/bin/activate" >&2 ;;
esac
