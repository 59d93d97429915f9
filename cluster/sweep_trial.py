"""One sweep trial: the same `trainer.loop.train.run` as `memlm train`, in a Tune trial process or, with
`resources.workers > 1`, on that many Ray Train workers (one DeepSpeed rank each).

Why resume=True always: Tune restarts a failed trial by calling this function again (FailureConfig), and the
trial's own run folder SWEEP_DIR/trials/<trial id> holds its DeepSpeed checkpoints, so the retry continues from
the last one instead of step 0. We never hand checkpoints to Tune: the run folder is the state (on a cluster of
several nodes, SWEEP_DIR must be on storage every node sees, as Tune's storage_path must be).

Why not ray.train.report: inside a Tune function trial it fails the trial (docs/design.md §9), and with several Train
workers it is a barrier every rank must reach the same number of times, while the trainer reports on rank 0
only. Rank 0 therefore sends its rows through a Ray queue to the trial process, which calls ray.tune.report.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

from memlm.trainer.config.run_config import config_from_dict
from memlm.trainer.runtime import faults
from memlm.trainer.runtime.process import prepare_process
from memlm.trainer.tracking.client import open_client

from .ray_runtime import placement, single_process_env
from .sweep_config import plain_values

TRIALS_DIR = "trials"
NODES_FILE = "nodes.jsonl"  # in a trial's run folder: one line per attempt, the Ray node it ran on


class TuneReporter:
    """The trainer's reporter: keeps the latest value of every metric and reports to Tune whenever a row
    carries the sweep metric (validation rows for valid_*, every logged row for loss), so each result the
    scheduler and searcher see has the metric, the step (ASHA's time) and the last training loss too.

    Rows of the last step (`last_step`, the run's train.steps) are held back until `final()`, called after the
    trainer returned: a scheduler may stop a trial on any result (ASHA does at max_t), and a stop at the last
    step's validation would come before the trainer saved its final checkpoint and ended its MLflow run."""

    def __init__(self, metric: str, report: Callable[[dict], None], last_step: int | None = None):
        self.metric, self.report, self.last_step = metric, report, last_step
        self.latest: dict[str, Any] = {}
        self.reported_step = -1

    def __call__(self, row: dict) -> None:
        self.latest.update(row)
        if self.metric in row and (self.last_step is None or row.get("step", 0) < self.last_step):
            self._send()

    def final(self, recorded: dict | None = None) -> None:
        """After training: one last result if training went on past the last report (the trial's final row).

        recorded: what the run folder holds (run_folder_result), for a run that had nothing left to train (a
        restored sweep restarts a trial that finished just before the interrupt): Tune then gets the trial's own
        final result, not the one it saved mid-run."""
        if self.metric not in self.latest and recorded and self.metric in recorded:
            self.latest = {**recorded, **self.latest}  # rows trained here keep their (later) step
        if self.metric in self.latest and self.latest.get("step", -1) != self.reported_step:
            self._send()

    def _send(self) -> None:
        self.reported_step = self.latest.get("step", -1)
        self.report(dict(self.latest))


def trial_fn(config: dict, spec: dict) -> None:
    """The Tune function trainable. `config` holds the sampled values ({dotted key: value}); `spec` the sweep
    (sweep_dir, base_tree, fixed, metric, resources, parent run id, ...), the same for every trial."""
    from ray import tune

    ctx = tune.get_context()
    trial_id = ctx.get_trial_id()  # stable across retries and across a resumed sweep
    run_dir = Path(spec["sweep_dir"]) / TRIALS_DIR / trial_id

    values = {**spec["fixed"], **plain_values(config), "tracking.parent_run_id": spec["parent_run_id"]}
    arch = config_from_dict(spec["base_tree"], values).model.arch  # the arch may be searched
    values["tracking.run_name"] = trial_run_name(arch, spec["name"], trial_id)
    cfg = config_from_dict(spec["base_tree"], values)
    reporter = TuneReporter(spec["metric"], tune.report, last_step=cfg.train.steps)
    record_attempt(run_dir)
    if spec["workers"] > 1:
        _run_workers(spec, values, run_dir, trial_id, reporter)
    else:
        from memlm.trainer.loop.train import run  # here: a trial's process trains; the sweep's driver loads no torch

        single_process_env()  # one process: its own loopback port, never a driver's MASTER_PORT
        prepare_process(cpus=spec["resources"]["cpus"], who="trial")  # the CPUs Tune reserved for this trial
        run(cfg, run_dir, resume=True, reporter=_held(reporter))
    _tag_child_run(run_dir, values, spec, trial_id)
    reporter.final(run_folder_result(run_dir, spec["metric"]))  # last: the scheduler may end this process on it


def record_attempt(run_dir: Path) -> None:
    """Append where this attempt of the trial runs to RUN_DIR/nodes.jsonl: on a cluster, which node trained it
    (trials.csv's node column) and, after a retry, which node it left (a lost node's trials say so)."""
    import socket
    import time

    run_dir.mkdir(parents=True, exist_ok=True)
    row = {**placement(), "host": socket.gethostname(), "pid": os.getpid(), "time": round(time.time(), 3)}
    with (run_dir / NODES_FILE).open("a") as f:
        f.write(json.dumps(row) + "\n")


def trial_nodes(run_dir: Path) -> list[str]:
    """The node id of every attempt of a trial, oldest first (RUN_DIR/nodes.jsonl; [] for none recorded)."""
    path = run_dir / NODES_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line).get("node_id", "") for line in lines if line.strip()]


def _held(reporter: TuneReporter) -> Callable[[dict], None]:
    """The reporter, behind the tests' MEMLM_TEST_HOLD point "trial" (trainer/runtime/faults.py): a test holds
    a trial at a step after its first checkpoint, to lose the node under it. Unset, it is the reporter."""
    if not faults.holding("trial"):
        return reporter

    def report(row: dict) -> None:
        faults.at("trial", step=int(row.get("step", -1)))
        reporter(row)

    return report


def trial_run_name(arch: str, sweep_name: str, trial_id: str) -> str:
    """The MLflow run name of a trial: arch, sweep and the trial's number in it (Tune's id ends in it:
    "3f2a1_00003"), e.g. "lamemo-tiny-grid-00003"; short enough for the UI's runs table."""
    return f"{arch}-{sweep_name}-{trial_id.rsplit('_', 1)[-1]}"


def run_folder_result(run_dir: Path, metric: str) -> dict:
    """{"step", metric} as the trial's run folder records it: a valid_* metric from the newest validation JSON
    (eval/step{N}.json, N its step), any other from the last metrics.jsonl row; {} when there is none yet."""
    if metric.startswith("valid_"):
        evals = sorted(run_dir.glob("eval/step*.json"), key=lambda p: int(p.stem.removeprefix("step")))
        if not evals:
            return {}
        result = json.loads(evals[-1].read_text())
        key = metric.removeprefix("valid_")
        return {"step": int(evals[-1].stem.removeprefix("step")), metric: result.get(key)}
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    if not lines:
        return {}
    row = json.loads(lines[-1])
    return {"step": row.get("step"), metric: row.get(metric)}


def _tag_child_run(run_dir: Path, values: dict, spec: dict, trial_id: str) -> None:
    """Mark the trial's MLflow run (created by the trainer's Tracker) with the sweep and trial it belongs to."""
    id_file = run_dir / "mlflow_run_id"
    if not values.get("tracking.enabled", True) or not id_file.is_file():
        return
    try:
        client = open_client(values["tracking.uri"], create=False)
        run_id = id_file.read_text().strip()
        client.set_tag(run_id, "memlm.sweep", spec["name"])
        client.set_tag(run_id, "memlm.trial_id", trial_id)
    except Exception as exc:  # noqa: BLE001 - a tag must never fail a finished trial
        print(f"memlm sweep: warning: could not tag the MLflow run of trial {trial_id}: {exc}")


# -- several DeepSpeed ranks per trial through Ray Train -------------------------------------------------------


def _run_workers(spec: dict, values: dict, run_dir: Path, trial_id: str, reporter: TuneReporter) -> None:
    """A TorchTrainer whose workers each run trainer.loop.train.run: Ray Train sets RANK/WORLD_SIZE/LOCAL_RANK/
    MASTER_ADDR/MASTER_PORT and creates the torch process group (gloo on CPU, nccl on GPUs) before the loop
    starts; trainer.runtime.distributed.setup_env keeps those variables and deepspeed.init_distributed adopts the
    existing group. Tune's own retries are the only ones (Train's max_failures 0), so there is one retry count."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Empty, Queue

    res = spec["resources"]
    queue = Queue(actor_options={"num_cpus": 0})
    per_worker = {"CPU": res["cpus"], **({"GPU": res["gpus"]} if res["gpus"] else {})}
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"base_tree": spec["base_tree"], "values": values, "run_dir": str(run_dir), "queue": queue,
                           "cpus": res["cpus"]},
        scaling_config=ScalingConfig(num_workers=spec["workers"], use_gpu=res["gpus"] > 0,
                                     resources_per_worker=per_worker),
        run_config=RunConfig(name=f"{trial_id}", storage_path=str(Path(spec["sweep_dir"]) / "ray_train"),
                             failure_config=FailureConfig(max_failures=0)),
    )
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the trial's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name=f"train-{trial_id}", daemon=True)
    thread.start()
    # Forward rank 0's rows while the workers train, then whatever is still queued.
    while thread.is_alive() or not queue.empty():
        try:
            reporter(queue.get(timeout=0.5))
        except Empty:
            continue
    thread.join()
    if "error" in outcome:
        raise outcome["error"]


def _worker_loop(loop_config: dict) -> None:
    """Runs on every Ray Train worker: the ordinary training run at this worker's rank."""
    from memlm.trainer.loop.train import run  # here: a trial's process trains; the sweep's driver loads no torch

    prepare_process(cpus=loop_config["cpus"], who="trial worker")  # the CPUs Ray Train reserved for this rank
    queue = loop_config["queue"]
    cfg = config_from_dict(loop_config["base_tree"], loop_config["values"])
    # The trainer calls the reporter on rank 0 only; a put is a small actor call per logged row.
    run(cfg, Path(loop_config["run_dir"]), resume=True, reporter=queue.put)
