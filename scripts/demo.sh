#!/usr/bin/env bash
# The README's main-job command: install into ./.venv, then run the demo (extra arguments go to `memlm demo`):
# prepare a real corpus (stdlib sources, or WikiText via $MEMLM_DEMO_WIKITEXT), train Transformer+RPE,
# Transformer-XL and LaMemo with DeepSpeed for the same --steps each (default 3000), evaluate on test, log to
# MLflow (sqlite:///mlflow.db in this folder) and print a comparison with the memory's effect.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/memlm demo "$@"
