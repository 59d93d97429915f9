"""MLflow side of `memlm extrapolate`: one MLflow run per RUN_DIR, logged from the driver only.

Why the driver: Ray tasks writing to one SQLite store at once contend for its lock, and a first-time creation of
the store from two processes fails (docs/design.md §9). The experiment is created before any task starts; each run's
metrics, params and tags go in one log_batch (a SQLite write costs ~10-15 ms per call).

Each invocation makes new MLflow runs holding every result it knows (fresh or reused from disk), so the latest
extrapolation run of a model is always complete; an earlier, interrupted invocation's runs stay as FAILED/KILLED.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memlm.trainer.config.run_config import TrackingConfig
from memlm.trainer.tracking.client import open_client
from memlm.trainer.tracking.tracker import RunsView, ensure_experiment

from .errors import ClusterError
from .extrapolate_plan import RunSpec

METRIC_PPL = "extrapolate_ppl"
METRIC_NLL = "extrapolate_nll"
METRIC_MEM = "mem_len"
KIND = "extrapolation"


# The columns an extrapolation run fills (it has no training metrics) in the experiment's saved runs view.
EXTRAPOLATION_VIEW_COLUMNS = ("metrics.`extrapolate_ppl`", "metrics.`extrapolate_nll`", "metrics.`mem_len`",
                              "tags.`arch`", "tags.`run_dir`")


def open_experiment(experiment: str, uri: str | None) -> tuple[Any, str, str]:
    """(client, experiment id, resolved URI), creating the experiment now: before Ray and before any task."""
    cfg = TrackingConfig(experiment=experiment, uri=uri or "")
    resolved = cfg.resolved_uri()
    try:
        client = open_client(resolved)
        view = RunsView("memlm: extrapolation", EXTRAPOLATION_VIEW_COLUMNS)
        return client, ensure_experiment(cfg, client, view), resolved
    except Exception as exc:  # noqa: BLE001 - any store problem is the user's to fix: say which store
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ClusterError(f"cannot use the MLflow store {resolved} ({first}); "
                           "fix --uri / $MLFLOW_TRACKING_URI") from None


def log_run(client: Any, experiment_id: str, run: RunSpec, run_summary: dict, split: str, tgt_len: int,
            artifacts: list[Path]) -> str:
    """One MLflow run for `run`: metrics at step m, tags, the shared artifacts. Returns its run id.

    Status FAILED when some m is missing (a task failed), so the MLflow UI shows an incomplete curve as such.
    """
    from mlflow.entities import Metric, Param, RunTag

    tags = {"arch": run.arch, "run_dir": str(run.run_dir), "kind": KIND, "checkpoint": run.tag}
    train_id = linked_train_run(client, run.train_run_id)
    if train_id:
        tags["memlm.train_run_id"] = train_id
    params = {"split": split, "tgt_len": str(tgt_len), "checkpoint_step": str(run.step),
              "mults": ",".join(str(row["m"]) for row in run_summary["results"]) or "-"}
    created = client.create_run(experiment_id, run_name=run.name)
    run_id = created.info.run_id
    timestamp = created.info.start_time
    metrics = []
    for row in run_summary["results"]:
        for key, value in ((METRIC_PPL, row["ppl"]), (METRIC_NLL, row["nll"]), (METRIC_MEM, row["mem_len"])):
            metrics.append(Metric(key, float(value), timestamp, int(row["m"])))
    try:
        # Fewer than MLflow's 1000 metrics / 100 params+tags per batch for m up to 333; split beyond that.
        for i in range(0, max(len(metrics), 1), 900):
            client.log_batch(run_id, metrics=metrics[i:i + 900],
                             params=[Param(k, v) for k, v in params.items()] if i == 0 else [],
                             tags=[RunTag(k, v) for k, v in tags.items()] if i == 0 else [], synchronous=True)
        for path in artifacts:
            client.log_artifact(run_id, str(path))
    except BaseException:
        client.set_terminated(run_id, "KILLED" if _interrupted() else "FAILED")
        raise
    client.set_terminated(run_id, "FAILED" if run_summary["missing_m"] else "FINISHED")
    return run_id


def linked_train_run(client: Any, run_id: str) -> str:
    """run_id when it names a run in this store (the training run of the folder), else "": a run folder trained
    against another store would otherwise get a tag pointing nowhere."""
    if not run_id:
        return ""
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException:
        return ""
    return run_id


def _interrupted() -> bool:
    import sys

    return isinstance(sys.exc_info()[1], KeyboardInterrupt)
