"""`memlm track RUN_DIR`: log to a run's MLflow run whatever its run folder records and the run does not hold yet.

The run folder is the record (tracker.py): metrics.jsonl (one row per logged step), eval/step*.json (the training's
validation passes: valid_nll/ppl/bpc), eval/SPLIT-stepN-tgtT-memM.json (`memlm eval`: SPLIT_nll/ppl/bpc, with a
_tgtT_memM suffix when not evaluated at the trained lengths), config.yaml (the params), STATUS_FILE (how the run
ended). A run whose tracking server was away at its start, for a while, or at its end gets the rest here; a run
that never reached the server is created (its id then goes to mlflow_run_id, as the trainer would have done).

Nothing is sent twice: each metric key's history on the server is read, and only (key, step) pairs it lacks are
logged; artifacts already listed and params already set are skipped. Running it again, or after the trainer caught
up by itself, adds nothing. A store that cannot be reached is one line naming it (exit 2) and changes nothing.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memlm.trainer.config.run_config import RunConfig
from memlm.trainer.runtime import heartbeat

from .errors import TrackingError

METRICS = "metrics.jsonl"
EVAL_DIR = "eval"
ROOT_ARTIFACTS = ("config.yaml", "ds_config.json")  # what the trainer logs at the top of the run's artifacts
VALIDATION_FILE = re.compile(r"step(\d+)\.json")  # the trainer's validation passes
EVALUATION_FILE = re.compile(r"(\w+)-step(\d+)-tgt(\d+)-mem(\d+)\.json")  # `memlm eval`'s default names
RESULT_KEYS = ("nll", "ppl", "bpc")


@dataclass
class CatchUp:
    """What one `memlm track` did."""

    run_id: str
    uri: str
    created: bool = False
    metrics_sent: int = 0
    metrics_present: int = 0
    keys: int = 0
    artifacts_sent: int = 0
    status: Optional[str] = None  # set on the run now; None: left as it was

    def line(self, run_dir: Path) -> str:
        what = [f"{self.metrics_sent} metric values sent ({self.metrics_present} of {self.keys} keys' "
                f"{self.metrics_sent + self.metrics_present} were already there)",
                f"{self.artifacts_sent} artifact{'s' if self.artifacts_sent != 1 else ''}"]
        if self.status:
            what.append(f"status {self.status}")
        run = f"{'new ' if self.created else ''}MLflow run {self.run_id} at {self.uri}"
        return f"memlm track: {run_dir} -> {run}: " + ", ".join(what)


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
    from mlflow.entities import Metric

    from .tracker import MAX_BATCH_METRICS

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


def catch_up(run_dir: Path, uri: Optional[str] = None) -> CatchUp:
    """Everything RUN_DIR records that its MLflow run lacks, logged to it (see the module docstring)."""
    from memlm.trainer.config.run_config import load_config

    from .client import open_client, set_environment
    from .tracker import LOCK_FILE, RUN_ID_FILE, STATUS_FILE, URI_FILE, _redact, error_reason, open_run

    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise TrackingError(f"{config_path} is missing: {run_dir} is not a run folder written by `memlm train`")
    config = load_config(config_path)
    uri_file = run_dir / URI_FILE
    recorded_uri = uri_file.read_text().strip() if uri_file.is_file() else ""
    if not (uri or recorded_uri or config.tracking.enabled):
        raise TrackingError(f"{run_dir} was trained with tracking.enabled=false: pass --uri URI to log it somewhere")
    # A store that --uri or the run folder names may be created; one guessed from the working folder may not.
    create = bool(uri or recorded_uri)
    uri = uri or recorded_uri or config.tracking.resolved_uri()
    id_file = run_dir / RUN_ID_FILE
    with _folder_lock(run_dir / LOCK_FILE, run_dir):
        set_environment()
        client = open_client(uri, create=create)
        before = id_file.read_text().strip() if id_file.is_file() else ""
        try:
            client.search_experiments(max_results=1)  # reachable? before anything is written
        except Exception as exc:  # noqa: BLE001 - any failure here means nothing was sent
            raise TrackingError(f"cannot reach MLflow at {_redact(uri)} ({error_reason(exc)}): nothing was "
                                f"logged; run `memlm track {run_dir}` again once it is up") from None
        try:
            run_id = open_run(client, uri, config.tracking, run_dir, config, reopen=False)
            done = CatchUp(run_id, _redact(uri), created=run_id != before)
            done.metrics_sent, done.metrics_present, done.keys = send_missing_metrics(client, run_id, run_dir, config)
            done.artifacts_sent = send_missing_artifacts(client, run_id, run_dir)
            status_file = run_dir / STATUS_FILE
            status = status_file.read_text().strip() if status_file.is_file() else ""
            if status and client.get_run(run_id).info.status != status:
                client.set_terminated(run_id, status)
                done.status = status
        except Exception as exc:  # noqa: BLE001 - what went is on the server, and a rerun sends only the rest
            raise TrackingError(f"MLflow at {_redact(uri)} failed while catching up ({error_reason(exc)}): what "
                                f"was sent stays, run `memlm track {run_dir}` again to send the rest") from None
    return done


class _folder_lock:
    """LOCK_FILE, held without waiting: a Tracker holds it while its run trains, and sends what it missed itself."""

    def __init__(self, path: Path, run_dir: Path):
        self.path, self.run_dir = path, run_dir
        self.file: Any = None

    def __enter__(self) -> None:
        self.file = open(self.path, "a")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.close()
            raise TrackingError(f"{self.run_dir} is training now: its trainer logs what the server missed itself "
                                "once the server is back; run `memlm track` after the run ends") from None

    def __exit__(self, *exc: Any) -> None:
        self.file.close()


def main(args: argparse.Namespace) -> int:
    from memlm.trainer.runtime.quiet import prints_into_library_log, route_library_loggers

    from .client import set_environment

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise TrackingError(f"run folder {run_dir} does not exist")
    set_environment()
    import mlflow  # noqa: F401 - imported before its loggers are routed, and outside the stdout redirection below

    route_library_loggers(run_dir)  # a store's creation and migrations: into RUN_DIR/library.log, as in training
    with prints_into_library_log(run_dir):  # MLflow's "View run ... at: URL" when a run on a server ends
        done = catch_up(run_dir, args.uri)
    heartbeat.phase(None)
    print(done.line(run_dir))
    return 0
