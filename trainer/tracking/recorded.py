"""What a run folder records against what its MLflow run holds: the metrics (metrics.jsonl's rows, eval/*.json's
results, keyed as the trainer and `memlm eval` log them) and the artifacts, and sending the ones the run lacks.

The trainer sends the metrics of a gap with it once its store answers again (tracker.py); `memlm track RUN_DIR`
sends everything a run missed (catchup.py). Nothing is sent twice: each key's history on the server is read first.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Optional

from memlm.trainer.config.run_config import RunConfig

METRICS = "metrics.jsonl"
EVAL_DIR = "eval"
ROOT_ARTIFACTS = ("config.yaml", "ds_config.json")  # what the trainer logs at the top of the run's artifacts
VALIDATION_FILE = re.compile(r"step(\d+)\.json")  # the trainer's validation passes
EVALUATION_FILE = re.compile(r"(\w+)-step(\d+)-tgt(\d+)-mem(\d+)\.json")  # `memlm eval`'s default names
RESULT_KEYS = ("nll", "ppl", "bpc")

MAX_BATCH_METRICS = 1000  # MLflow's limit per log_batch


def recorded_metrics(run_dir: Path, config: RunConfig) -> dict[str, dict[int, float]]:
    """key -> step -> value, as the trainer and `memlm eval` log them, from what the run folder records."""
    found: dict[str, dict[int, float]] = {}

    def put(key: str, step: int, value: Any) -> None:
        try:
            found.setdefault(key, {})[int(step)] = float(value)
        except (TypeError, ValueError):  # None (a skipped step's loss) or a non-number: the trainer skips it too
            pass

    metrics = run_dir / METRICS
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    for line in lines:
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):  # a line cut by a kill mid-write: not a row of this run
            continue
        for key, value in row.items():
            if key != "step":
                put(key, step, value)  # a step written twice (a resume without rewind): the later row wins
    for path in sorted((run_dir / EVAL_DIR).glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if VALIDATION_FILE.fullmatch(path.name):
            prefix, step = "valid_", result.get("step")
        elif EVALUATION_FILE.fullmatch(path.name):
            trained = (result.get("tgt_len"), result.get("mem_len")) == (config.model.tgt_len, config.model.mem_len)
            suffix = "" if trained else f"_tgt{result.get('tgt_len')}_mem{result.get('mem_len')}"
            prefix, step = f"{result.get('split')}_", result.get("step")
        else:
            continue
        for key in RESULT_KEYS:
            if key in result and step is not None:
                put(f"{prefix}{key}{suffix if prefix != 'valid_' else ''}", step, result[key])
    return found


def send_missing_metrics(client: Any, run_id: str, run_dir: Path, config: RunConfig,
                         steps: Optional[tuple[int, int]] = None) -> tuple[int, int, int]:
    """Log the recorded metrics (those of steps first..last only, if given) that the run's history lacks.
    Returns (sent, already there, keys)."""
    from mlflow.entities import Metric  # mlflow on use: the trainer imports this module with tracking off too

    now = int(time.time() * 1000)
    missing, present = [], 0
    recorded = recorded_metrics(run_dir, config)
    for key, values in sorted(recorded.items()):
        if steps is not None:
            values = {s: v for s, v in values.items() if steps[0] <= s <= steps[1]}
        if not values:
            continue
        held = {m.step for m in client.get_metric_history(run_id, key)}
        for step in sorted(values):
            if step in held:
                present += 1
            else:
                missing.append(Metric(key, values[step], now, step))
    missing.sort(key=lambda m: m.step)  # in step order, as the trainer would have sent them
    for i in range(0, len(missing), MAX_BATCH_METRICS):
        client.log_batch(run_id, metrics=missing[i:i + MAX_BATCH_METRICS], synchronous=True)
    return len(missing), present, len(recorded)


def send_missing_artifacts(client: Any, run_id: str, run_dir: Path) -> int:
    """Log config.yaml, ds_config.json and eval/*.json where the run's artifacts lack them; returns how many."""
    wanted = [(run_dir / name, None) for name in ROOT_ARTIFACTS]
    wanted += [(path, EVAL_DIR) for path in sorted((run_dir / EVAL_DIR).glob("*.json"))]
    listed = {a.path for a in client.list_artifacts(run_id)}
    if EVAL_DIR in listed:
        listed |= {a.path for a in client.list_artifacts(run_id, EVAL_DIR)}
    sent = 0
    for path, folder in wanted:
        name = f"{folder}/{path.name}" if folder else path.name
        if path.is_file() and name not in listed:
            client.log_artifact(run_id, str(path), folder)
            sent += 1
    return sent
