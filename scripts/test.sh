#!/usr/bin/env bash
# The README's test command: install, lint, then run the whole suite offline (loopback only) on both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check --quiet .  # the linter's small rule set (pyproject.toml [tool.ruff]) before the tests
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true RAY_USAGE_STATS_ENABLED=0
exec bash scripts/offline.sh .venv/bin/python -m pytest -n 2 --dist loadgroup -q "$@"
