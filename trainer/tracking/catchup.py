"""`memlm track RUN_DIR`: log to a run's MLflow run whatever its run folder records and the run does not hold yet.

The run folder is the record (tracker.py): metrics.jsonl (one row per logged step), eval/step*.json (the training's
validation passes: valid_nll/ppl/bpc), eval/SPLIT-stepN-tgtT-memM.json (`memlm eval`: SPLIT_nll/ppl/bpc, with a
_tgtT_memM suffix when not evaluated at the trained lengths), config.yaml (the params), STATUS_FILE (how the run
ended). A run whose tracking server was away at its start, for a while, or at its end gets the rest here; a run
that never reached the server is created (its id then goes to mlflow_run_id, as the trainer would have done).
recorded.py reads the folder and sends what the run lacks; the trainer sends a gap's metrics with it too.

Nothing is sent twice: each metric key's history on the server is read, and only (key, step) pairs it lacks are
logged; artifacts already listed and params already set are skipped. Running it again, or after the trainer caught
up by itself, adds nothing. A store that cannot be reached is one line naming it (exit 2) and changes nothing.
"""

from __future__ import annotations

import argparse
import fcntl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memlm.trainer.config.run_config import load_config
from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.quiet import prints_into_library_log, route_library_loggers

from .client import open_client, set_environment
from .errors import TrackingError
from .recorded import send_missing_artifacts, send_missing_metrics
from .tracker import LOCK_FILE, RUN_ID_FILE, STATUS_FILE, URI_FILE, _redact, error_reason, open_run


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


def catch_up(run_dir: Path, uri: Optional[str] = None) -> CatchUp:
    """Everything RUN_DIR records that its MLflow run lacks, logged to it (see the module docstring)."""
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
