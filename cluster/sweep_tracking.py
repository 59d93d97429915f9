"""The sweep's MLflow parent run: created once by the driver before any trial, reopened by a resumed sweep, and
given the outcome at the end (sweep file and trials table as artifacts, the best trial as tags and a metric).

The trials' own runs are made by the trainer's Tracker, nested under this one through tracking.parent_run_id
(tag mlflow.parentRunId). The driver creates the experiment first because several trials creating a fresh SQLite
store at the same moment fail (docs/design.md §9).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from memlm.trainer.config.run_config import TrackingConfig
from memlm.trainer.tracking.client import open_client
from memlm.trainer.tracking.tracker import ensure_experiment

PARENT_ID_FILE = "mlflow_parent_run_id"  # in SWEEP_DIR: a resumed sweep keeps its parent run


class ParentRun:
    def __init__(self, experiment: str, uri: str, sweep_dir: Path):
        self.uri = uri
        self.client = open_client(uri)
        self.experiment_id = ensure_experiment(TrackingConfig(experiment=experiment, uri=uri), self.client)
        self.id_file = sweep_dir / PARENT_ID_FILE
        self.run_id = ""
        self.sweep_name = ""
        self.resumed = False

    def open(self, name: str, params: dict[str, Any]) -> str:
        """Reuse the parent run recorded in SWEEP_DIR (set RUNNING again), else create it; returns its id."""
        from mlflow.exceptions import MlflowException

        self.sweep_name = name

        if self.id_file.is_file():
            run_id = self.id_file.read_text().strip()
            try:
                self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
                self.run_id, self.resumed = run_id, True
                return run_id
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                print(f"memlm sweep: parent run {run_id} is not in {self.uri}; starting a new one", flush=True)
        run = self.client.create_run(self.experiment_id, run_name=name,
                                     tags={"memlm.sweep": name, "memlm.kind": "sweep"})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100], synchronous=True)
        self.id_file.write_text(self.run_id + "\n")
        return self.run_id

    def settle_children(self, rows: list[dict]) -> None:
        """Give every trial's MLflow run the status of the trial: a trial ASHA stopped, or one under way when the
        sweep was interrupted, was ended from outside (its trainer never closed its run), so it becomes KILLED,
        with a `memlm.stopped_early` tag when ASHA stopped it (a resumed trial's trainer reopens its run); a
        finished trial's run is FINISHED. Failing calls warn: the sweep's own results stand."""
        for row in rows:
            run_id = row.get("mlflow_run_id")
            wanted = {"STOPPED": "KILLED", "INTERRUPTED": "KILLED", "TERMINATED": "FINISHED"}.get(row["status"])
            if not run_id or wanted is None:
                continue
            try:
                # Also set by the trial itself, but only once its training returned (a stopped trial never does).
                self.client.set_tag(run_id, "memlm.trial_id", row["trial_id"])
                if self.sweep_name:
                    self.client.set_tag(run_id, "memlm.sweep", self.sweep_name)
                if row["status"] == "STOPPED":
                    self.client.set_tag(run_id, "memlm.stopped_early", f"step {row['step']}")
                if self.client.get_run(run_id).info.status != wanted:
                    self.client.set_terminated(run_id, wanted)
            except Exception as exc:  # noqa: BLE001
                print(f"memlm sweep: warning: could not set the MLflow status of trial {row['trial_id']}: {exc}",
                      flush=True)

    def finish(self, status: str, artifacts: list[Path], best: dict | None, metric: str) -> None:
        """Artifacts, the best trial (tags: mutable, so a resumed sweep may update them), then end the run."""
        for path in artifacts:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        if best is not None:
            tags = {"best.trial_id": best["trial_id"], **{f"best.{k}": str(v) for k, v in best["values"].items()}}
            if best.get("mlflow_run_id"):
                tags["best.mlflow_run_id"] = best["mlflow_run_id"]
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value)
            self.client.log_metric(self.run_id, f"best_{metric}", float(best[metric]), step=int(best.get("step", 0)))
        self.client.set_terminated(self.run_id, status)


def trials_csv(rows: list[dict], columns: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return out.getvalue()


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
