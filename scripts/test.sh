#!/usr/bin/env bash
# The README's test command: install, lint, then run the whole suite offline (loopback only) on both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check --quiet .  # the linter's small rule set (pyproject.toml [tool.ruff]) before the tests
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true RAY_USAGE_STATS_ENABLED=0
# Three xdist workers on two cores: a fifth of a two-worker run's time the cores sat idle (tests waiting on
# subprocesses, servers, Ray and timers); MEMLM_TEST_WORKERS=N picks another count.
exec bash scripts/offline.sh .venv/bin/python -m pytest -n "${MEMLM_TEST_WORKERS:-3}" --dist loadgroup -q "$@"
