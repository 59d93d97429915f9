#!/usr/bin/env bash
# The README's main-job command: install into ./.venv, then run the demo (extra arguments go to `memlm demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/memlm demo "$@"
