"""`memlm sweep SWEEP.yaml [dotted.key=value ...] [--address ADDR] [--num-samples K] [--out DIR]`: Ray Tune over a
search space of run-config keys; each trial is an ordinary training run (cluster/sweep_trial.py).

Order of work, and why:
1. Read and check the sweep file and build every extreme trial config (cluster/sweep_config.py): a typo costs a
   second and one line, not a Ray start.
2. Pin what must not depend on a trial's working folder or node: the data path and the MLflow URI become
   absolute (Tune runs trials in other folders, on other nodes).
3. Create the MLflow experiment and the parent run in the driver, once (cluster/sweep_tracking.py).
4. Start or join Ray and run Tune: a fresh experiment under SWEEP_DIR/tune, or, when that folder already holds
   one, Tuner.restore: finished trials are kept, unfinished and errored ones continue from their own
   checkpoints. Trials never use ~/ray_results.
5. Table of trials (printed, SWEEP_DIR/trials.csv), the best trial (printed, SWEEP_DIR/best.json), both logged to
   the parent run, which then ends FINISHED (KILLED when interrupted, FAILED when no trial produced the metric).
"""

from __future__ import annotations

import argparse
import os
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from .errors import ClusterError
from .sweep_config import Sweep, load_sweep
from .sweep_trial import TRIALS_DIR, trial_fn
from .sweep_tracking import ParentRun, markdown_table, trials_csv

TUNE_DIR = "tune"  # Tune's experiment folder inside SWEEP_DIR
SIGNATURE_FILE = "sweep.json"
EXIT_INTERRUPTED = 130  # what a shell reports for Ctrl-C: rerun the command to resume
TRIAL_DRIVER_CPUS = 0.01  # a Tune trial that runs Ray Train workers (resources.workers > 1)
STOPPED = "STOPPED"  # our status for a trial the scheduler (ASHA) ended early


def main(args: argparse.Namespace) -> int:
    from .ray_runtime import quiet_console_env

    quiet_console_env()  # before anything imports ray
    sweep = load_sweep(args.sweep, args.overrides, args.num_samples)
    sweep_dir = Path(args.out or Path("sweeps") / sweep.name).resolve()
    experiment, uri = _pin_paths(sweep)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    resuming = _check_same_sweep(sweep, sweep_dir)
    if sweep.path != (sweep_dir / "sweep.yaml").resolve():  # kept beside the results, logged to the parent run
        shutil.copyfile(sweep.path, sweep_dir / "sweep.yaml")

    import mlflow  # noqa: F401 - imported first: it sets up its loggers, which route_library_loggers then adjusts

    from trainer.quiet import route_library_loggers

    route_library_loggers(sweep_dir)  # MLflow's database INFO lines to SWEEP_DIR/library.log, not the console
    parent = ParentRun(experiment, uri, sweep_dir)
    parent_id = parent.open(sweep.name, _parent_params(sweep))
    print(f"memlm sweep: {sweep.name}: {_describe_trials(sweep)} of {sweep.base_path.name} in {sweep_dir}", flush=True)
    print(f"memlm sweep: MLflow experiment '{experiment}', parent run {parent_id} ({uri})", flush=True)
    try:
        from .ray_runtime import ray_session

        with ray_session(address=args.address, num_cpus=args.num_cpus):
            trials = _run_tune(sweep, sweep_dir, parent_id, uri, resuming)
    except BaseException as exc:
        parent.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED", [], None, sweep.file.metric)
        raise
    return _report(sweep, sweep_dir, trials, parent)


def _pin_paths(sweep: Sweep) -> tuple[str, str]:
    """Absolute data path and MLflow URI for every trial; tracking on (the sweep's results are MLflow runs)."""
    from data_pipeline.shards import load_manifest
    from trainer.config import TrackingConfig

    cfg = sweep.trial_config({d.key: d.candidates()[0] for d in sweep.space})
    pinned: dict[str, Any] = {}
    if not cfg.data.path:
        load_manifest("")  # unset: one line naming data.path, not a failure in every trial
    pinned["data.path"] = str(Path(cfg.data.path).resolve())
    load_manifest(pinned["data.path"])  # a wrong data path fails here (one line), not in every trial
    experiment = sweep.file.experiment or cfg.tracking.experiment
    uri = TrackingConfig(uri=sweep.file.tracking_uri or cfg.tracking.uri).resolved_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):  # relative to this folder
        uri = f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    pinned.update({"tracking.enabled": True, "tracking.uri": uri, "tracking.experiment": experiment})
    searched = sorted(set(pinned) & {d.key for d in sweep.space})
    if searched:
        raise ClusterError(f"{sweep.path}: {', '.join(searched)} cannot be searched: the sweep sets it for every "
                           "trial (use data.path on the command line, experiment/tracking_uri in the sweep file)")
    sweep.fixed.update(pinned)
    return experiment, uri


def _check_same_sweep(sweep: Sweep, sweep_dir: Path) -> bool:
    """True when SWEEP_DIR holds a Tune experiment to resume; refuse one that was started from another sweep."""
    from ray import tune

    signature = sweep.signature()
    path = sweep_dir / SIGNATURE_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        if old != json.loads(json.dumps(signature)):
            changed = sorted(k for k in signature if old.get(k) != json.loads(json.dumps(signature[k])))
            raise ClusterError(f"{sweep_dir} holds a sweep with other settings ({', '.join(changed)} changed); "
                               "rerun with the original file and overrides to resume it, or pass another --out")
    path.write_text(json.dumps(signature, indent=2) + "\n")
    return tune.Tuner.can_restore(str(sweep_dir / TUNE_DIR))


def _parent_params(sweep: Sweep) -> dict[str, Any]:
    f = sweep.file
    params = {"sweep.name": sweep.name, "sweep.base": str(sweep.base_path), "sweep.num_samples": f.num_samples,
              "sweep.metric": f.metric, "sweep.mode": f.mode, "sweep.scheduler": f.scheduler.type,
              "sweep.max_failures": f.max_failures, "sweep.seed": f.seed,
              "sweep.resources": f"cpus={f.resources.cpus} gpus={f.resources.gpus} workers={f.resources.workers}"}
    params.update({f"space.{d.key}": d.describe() for d in sweep.space})
    params.update({f"fixed.{k}": v for k, v in sweep.fixed.items() if not k.startswith("tracking.")})
    return params


def _describe_trials(sweep: Sweep) -> str:
    grid = [len(d.values) for d in sweep.space if d.kind == "grid"]
    count = sweep.file.num_samples
    for n in grid:
        count *= n
    if grid:
        return f"{count} trials (grid {'x'.join(map(str, grid))} x {sweep.file.num_samples} sample(s))"
    return f"{count} trials"


# -- Tune ------------------------------------------------------------------------------------------------------


def _run_tune(sweep: Sweep, sweep_dir: Path, parent_id: str, uri: str, resuming: bool) -> list:
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from .sweep_progress import Progress

    f = sweep.file
    spec = {"sweep_dir": str(sweep_dir), "name": sweep.name, "base_tree": sweep.base_tree, "fixed": sweep.fixed,
            "metric": f.metric, "parent_run_id": parent_id, "workers": f.resources.workers,
            "resources": {"cpus": f.resources.cpus, "gpus": f.resources.gpus}}
    if f.resources.workers > 1:
        # The trial process only waits on its Ray Train run, whose workers ask for the CPUs/GPUs themselves; Tune
        # refuses an empty request, so the waiting process holds a token share of a CPU.
        resources = {"cpu": TRIAL_DRIVER_CPUS}
    else:
        resources = {"cpu": f.resources.cpus, "gpu": f.resources.gpus}
    trainable = tune.with_resources(tune.with_parameters(trial_fn, spec=spec), resources)
    path = sweep_dir / TUNE_DIR
    # Tune's newer output engine prints a boxed configuration table and a TensorBoard hint whatever `verbose`
    # says; the classic one honours verbose=0, and sweep_progress.Progress prints our one line per trial event.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if resuming:
        print(f"memlm sweep: resuming {path}: finished trials are kept, the others continue from their checkpoints",
              flush=True)
        tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=_param_space(sweep),
            tune_config=tune.TuneConfig(
                metric=f.metric, mode=f.mode, num_samples=f.num_samples, scheduler=_scheduler(sweep),
                search_alg=BasicVariantGenerator(random_state=f.seed, max_concurrent=f.max_concurrent),
                trial_dirname_creator=trial_dirname),
            run_config=tune.RunConfig(
                name=TUNE_DIR, storage_path=str(sweep_dir), verbose=0,
                callbacks=[Progress(f.metric, sweep.trial_config(
                    {d.key: d.candidates()[0] for d in sweep.space}).train.steps)],
                failure_config=tune.FailureConfig(max_failures=f.max_failures)),
        )
    tuner.fit()
    # The trials as saved on disk, not as fit() returns them: after Ctrl-C, Tune marks the stopped trials
    # TERMINATED in memory but saves them as PENDING/RUNNING, which is what a resumed sweep will see.
    return list(tune.ExperimentAnalysis(str(path)).trials)


def trial_dirname(trial) -> str:
    """Tune's folder of a trial: its id, matching SWEEP_DIR/trials/<id> (module level: Tune pickles it)."""
    return trial.trial_id


def _param_space(sweep: Sweep) -> dict:
    from ray import tune

    make = {"choice": tune.choice, "grid": tune.grid_search}
    space: dict[str, Any] = {}
    for d in sweep.space:
        if d.kind in make:
            space[d.key] = make[d.kind](d.values)
        else:
            space[d.key] = getattr(tune, d.kind)(*d.values)
    return space


def _scheduler(sweep: Sweep):
    s = sweep.file.scheduler
    if s.type == "none":
        return None
    from ray.tune.schedulers import ASHAScheduler

    steps = sweep.trial_config({d.key: d.candidates()[0] for d in sweep.space}).train.steps
    # time_attr "step": the trainer's own step survives a retry (Tune's training_iteration restarts at 1).
    return ASHAScheduler(time_attr="step", max_t=s.max_t or steps, grace_period=s.grace_period,
                         reduction_factor=s.reduction_factor)


# -- results ---------------------------------------------------------------------------------------------------


def best_row(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The trial row with the best finite `metric` (min or max), or None: a NaN or inf is never a best."""
    scored = [r for r in rows if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
    pick = min if mode == "min" else max
    return pick(scored, key=lambda r: r[metric]) if scored else None


def _report(sweep: Sweep, sweep_dir: Path, trials: list, parent: ParentRun) -> int:
    metric, keys = sweep.file.metric, [d.key for d in sweep.space]
    rows = [_trial_row(t, sweep_dir, metric, keys) for t in sorted(trials, key=lambda t: t.trial_id)]
    for row, trial in zip(rows, sorted(trials, key=lambda t: t.trial_id)):
        # Tune calls a trial the scheduler stopped TERMINATED, like a finished one; its step tells them apart.
        planned = sweep.trial_config(trial.config).train.steps
        if row["status"] == "TERMINATED" and isinstance(row["step"], int) and row["step"] < planned:
            row["status"] = STOPPED
    parent.settle_children(rows)
    columns = ["trial_id", "status", *keys, "step", metric, "failures", "mlflow_run_id", "run_dir"]
    (sweep_dir / "trials.csv").write_text(trials_csv(rows, columns))
    best = best_row(rows, metric, sweep.file.mode)
    unfinished = [r for r in rows if r["status"] not in ("TERMINATED", "ERROR", STOPPED)]
    errored = [r for r in rows if r["status"] == "ERROR"]
    print(markdown_table(rows, columns[:-2]), flush=True)
    if best is not None:
        best = {**best, "values": {k: best[k] for k in keys}}
        (sweep_dir / "best.json").write_text(json.dumps(best, indent=2, default=str) + "\n")
        values = " ".join(f"{k}={v}" for k, v in best["values"].items())
        print(f"best: trial {best['trial_id']} {metric}={best[metric]:.4g} at step {best['step']} ({values}); "
              f"run folder {best['run_dir']}", flush=True)
    artifacts = [sweep_dir / "sweep.yaml", sweep_dir / "trials.csv", sweep_dir / "best.json"]
    if unfinished:
        parent.finish("KILLED", artifacts, best, metric)
        print(f"memlm sweep: interrupted with {len(unfinished)} of {len(rows)} trials unfinished; rerun the same "
              "command to resume", flush=True)
        return EXIT_INTERRUPTED
    parent.finish("FINISHED" if best is not None else "FAILED", artifacts, best, metric)
    if errored:
        print(f"memlm sweep: {len(errored)} trial(s) failed after {sweep.file.max_failures} retries: "
              f"{', '.join(r['trial_id'] for r in errored)}", flush=True)
    if best is None:
        print(f"memlm sweep: no trial reported {metric}", file=sys.stderr, flush=True)
        return 1
    return 0


def _trial_row(trial, sweep_dir: Path, metric: str, keys: list[str]) -> dict:
    run_dir = sweep_dir / TRIALS_DIR / trial.trial_id
    # The trial's own run folder is the record; Tune's saved last_result can lag behind it (a trial resumed by a
    # restored sweep keeps the result it had at the interruption).
    last = run_folder_result(run_dir, metric) or trial.last_result or {}
    id_file = run_dir / "mlflow_run_id"
    row = {"trial_id": trial.trial_id, "status": trial.status, "step": last.get("step"),
           metric: last.get(metric), "failures": trial.run_metadata.num_failures,
           "mlflow_run_id": id_file.read_text().strip() if id_file.is_file() else "", "run_dir": str(run_dir)}
    row.update({k: trial.config.get(k) for k in keys})
    return row


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
