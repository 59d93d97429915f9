#!/usr/bin/env bash
# Creates ./.venv and installs memlm into it: torch==2.13.0 first (a local CPU wheel; an unpinned torch would
# pull a multi-GB CUDA build), then the package with its pinned dependencies. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,cluster]"
