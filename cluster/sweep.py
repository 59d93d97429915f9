"""`memlm sweep SWEEP.yaml [dotted.key=value ...] [--address ADDR] [--num-samples K] [--out DIR]`: Ray Tune over a
search space of run-config keys; each trial is an ordinary training run (cluster/sweep_trial.py).

Order of work, and why:
1. Read and check the sweep file and build every extreme trial config (cluster/sweep_config.py), and check that a
   trial fits the local Ray it would start (its CPUs and GPUs are known beforehand): a typo or a GPU trial on a
   CPU machine costs a second and one line, not a Ray start and a sweep that waits forever.
2. Pin what must not depend on a trial's working folder or node: the data path and the MLflow URI become
   absolute (Tune runs trials in other folders, on other nodes).
3. Start or join Ray (with --address: check the trials fit the cluster, now that its resources are known), then
   create the MLflow experiment (sweep-NAME unless named) and the parent run in the driver, once
   (cluster/sweep_tracking.py), before any trial.
4. Run Tune: a fresh experiment under SWEEP_DIR/tune, or, when that folder already holds one, Tuner.restore:
   finished trials are kept, unfinished and errored ones continue from their own checkpoints. Trials never use
   ~/ray_results. Tune's own lines about an interruption go to SWEEP_DIR/library.log (memlm prints its own).
5. Table of trials (printed, SWEEP_DIR/trials.csv) with each trial's status, step and metric from its own run
   folder, the best finished trial (printed, SWEEP_DIR/best.json), both logged to the parent run, which then ends
   FINISHED (KILLED when interrupted, FAILED when no trial produced the metric). On a cluster trials.csv also
   names the node each trial last ran on (RUN_DIR/nodes.jsonl keeps every attempt's), and the summary names the
   nodes lost during the sweep and every retried trial: a lost node's finished trials are kept, its running ones
   continue elsewhere from their checkpoints (max_failures), and the exit status is 0 when every trial finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from memlm.data_pipeline.remote.location import is_remote
from memlm.data_pipeline.shards import load_manifest
from memlm.trainer.config import presets
from memlm.trainer.config.run_config import TrackingConfig
from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.quiet import LIBRARY_LOGGERS, route_library_loggers

from .errors import ClusterError
from .ray_flags import check_ray_flags
from .ray_runtime import (
    amount,
    connected_resources,
    dead_nodes,
    local_resources,
    lost_since,
    missing,
    quiet_console_env,
    ray_session,
    short_node,
)
from .sweep_config import Sweep, load_sweep
from .sweep_tracking import ParentRun, markdown_table, trials_csv
from .sweep_trial import TRIALS_DIR, run_folder_result, trial_fn, trial_nodes

TUNE_DIR = "tune"  # Tune's experiment folder inside SWEEP_DIR
SIGNATURE_FILE = "sweep.json"
EXIT_INTERRUPTED = 130  # what a shell reports for Ctrl-C: rerun the command to resume
TRIAL_DRIVER_CPUS = 0.01  # a Tune trial that runs Ray Train workers (resources.workers > 1)
STOPPED = "STOPPED"  # our status for a trial the scheduler (ASHA) ended early
INTERRUPTED = "INTERRUPTED"  # our status for a trial under way when the sweep was interrupted
ENDED = ("TERMINATED", STOPPED)  # trials that may be the best


def main(args: argparse.Namespace) -> int:
    quiet_console_env()  # before anything imports ray
    sweep = load_sweep(args.sweep, args.overrides, args.num_samples)
    check_ray_flags(args)
    if not args.address:  # what the local Ray will have is known before it starts
        _refuse_unless_trials_fit(sweep, local_resources(args.num_cpus), "the local Ray would have", args)
    sweep_dir = Path(args.out or Path("sweeps") / sweep.name).resolve()
    experiment, uri = _pin_paths(sweep)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    resuming = _check_same_sweep(sweep, sweep_dir)
    if sweep.path != (sweep_dir / "sweep.yaml").resolve():  # kept beside the results, logged to the parent run
        shutil.copyfile(sweep.path, sweep_dir / "sweep.yaml")

    import mlflow  # noqa: F401 - imported first: it sets up its loggers, which route_library_loggers then adjusts

    _route_library_logs(sweep_dir)
    base = presets.name_of(sweep.base_path)
    heartbeat.phase(None)  # its first line (memlm/start_watch.py)
    print(f"memlm sweep: {sweep.name}: {_describe_trials(sweep)} of {base} in {sweep_dir}", flush=True)
    parent: ParentRun | None = None
    try:
        with ray_session(address=args.address, num_cpus=args.num_cpus):
            if args.address:  # a cluster's resources are known once connected; Tune has not started yet
                _refuse_unless_trials_fit(sweep, connected_resources(), f"the Ray cluster at {args.address} has",
                                          args)
            parent = ParentRun(experiment, uri, sweep_dir)
            parent_id = parent.open(sweep.name, _parent_params(sweep))
            print(f"memlm sweep: MLflow experiment '{experiment}', parent run {parent_id} ({uri})", flush=True)
            dead_before = dead_nodes()  # a cluster remembers nodes that died before this sweep
            trials = _run_tune(sweep, sweep_dir, parent_id, uri, resuming)
            lost = lost_since(dead_before)
    except BaseException as exc:
        if parent is not None and parent.run_id:
            parent.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED", [], None, sweep.file.metric)
        raise
    return _report(sweep, sweep_dir, trials, parent, lost)


def trial_request(sweep: Sweep) -> dict[str, float]:
    """What one trial holds while it runs: its process, or with workers > 1 its Train workers and the waiting
    trial process (Tune starts a trial only when all of it fits at once)."""
    r = sweep.file.resources
    if r.workers > 1:
        return {"CPU": r.workers * r.cpus + TRIAL_DRIVER_CPUS, "GPU": r.workers * r.gpus}
    return {"CPU": r.cpus, "GPU": r.gpus}


def _refuse_unless_trials_fit(sweep: Sweep, available: dict[str, float], where: str,
                              args: argparse.Namespace) -> None:
    """Ray queues a request no node can fulfil forever (Tune repeats "No available node types can fulfill
    resource request"): refuse such a sweep in one line instead, with the fix."""
    asked = trial_request(sweep)
    short = missing(asked, available)
    if not short:
        return
    r = sweep.file.resources
    fixes = []  # one per missing resource: all of them are needed
    if "GPU" in short:
        fixes.append("resources.gpus=0 (train on CPUs)" if not available["GPU"] else
                     f"resources.gpus={available['GPU'] / r.workers:g}")
    if "CPU" in short:
        fits = max(available["CPU"] - (TRIAL_DRIVER_CPUS if r.workers > 1 else 0), 0) / r.workers
        fix = f"resources.cpus={math.floor(fits * 100) / 100:g}" if fits >= 0.01 else "fewer resources.workers"
        if not args.address:
            fix += f" (or --num-cpus {math.ceil(asked['CPU'])}: Ray then shares the cores)"
        fixes.append(fix)
    workers = f" x {r.workers} workers" if r.workers > 1 else ""
    raise ClusterError(f"{sweep.path.name}: each trial asks for {amount(asked, nonzero=True)} "
                       f"(resources: cpus {r.cpus:g}, gpus {r.gpus:g}{workers}) but {where} {amount(available)}, "
                       "so no trial could ever start; "
                       f"add {' and '.join(fixes)} to the command line")


# Tune's loggers whose console lines memlm says in its own words (sweep_progress.Progress, _report): the Ctrl-C
# notice with its "Tuner.restore(...)" hint and "Trials did not complete" (memlm: "rerun the same command to
# resume", "N trial(s) failed"), and the FileNotFoundError warning for every trial that never ran when the trials
# are read back (the table shows them as PENDING).
TUNE_LOGGERS = ("ray.tune.tune", "ray.tune.analysis.experiment_analysis")


def _route_library_logs(sweep_dir: Path) -> None:
    """MLflow's database INFO lines and the Tune lines above into SWEEP_DIR/library.log; the Tune loggers stop
    passing records on to Ray's console handler."""
    import logging

    for name in TUNE_LOGGERS:  # a previous sweep of this process (tests) wrote to its own folder
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            logger.removeHandler(handler)
        logger.propagate = False
    route_library_loggers(sweep_dir, names=LIBRARY_LOGGERS + TUNE_LOGGERS)


def _pin_paths(sweep: Sweep) -> tuple[str, str]:
    """Absolute data path and MLflow URI for every trial; tracking on (the sweep's results are MLflow runs)."""
    cfg = sweep.trial_config({d.key: d.candidates()[0] for d in sweep.space})
    pinned: dict[str, Any] = {}
    if not cfg.data.path:
        load_manifest("")  # unset: one line naming data.path, not a failure in every trial
    # A local folder made absolute (trials run in their own folders); a URL is the same from anywhere
    pinned["data.path"] = cfg.data.path if is_remote(cfg.data.path) else str(Path(cfg.data.path).resolve())
    load_manifest(pinned["data.path"])  # a wrong data path fails here (one line), not in every trial
    # A sweep's runs in an experiment of their own (trials beside training runs made both hard to read), unless
    # the sweep file or an override names one.
    experiment = sweep.file.experiment or sweep.fixed.get("tracking.experiment") or f"sweep-{sweep.name}"
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


def planned_trials(sweep: Sweep) -> int:
    """How many trials Tune makes: the whole grid once per sample."""
    return sweep.file.num_samples * math.prod(len(d.values) for d in sweep.space if d.kind == "grid")


def _describe_trials(sweep: Sweep) -> str:
    grid = [len(d.values) for d in sweep.space if d.kind == "grid"]
    count = planned_trials(sweep)
    if grid:
        return f"{count} trials (grid {'x'.join(map(str, grid))} x {sweep.file.num_samples} sample(s))"
    return f"{count} trials"


# -- Tune ------------------------------------------------------------------------------------------------------


def _run_tune(sweep: Sweep, sweep_dir: Path, parent_id: str, uri: str, resuming: bool) -> list:
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from .sweep_progress import Progress  # here: it imports ray.tune, which must come after quiet_console_env

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
    # A failed trial: Progress says so in one line with the error's reason, not Tune's traceback per attempt.
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
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
                callbacks=[Progress(f.metric, _planned_steps(sweep), scheduled=f.scheduler.type != "none")],
                failure_config=tune.FailureConfig(max_failures=f.max_failures)),
        )
    tuner.fit()
    # The trials as saved on disk, not as fit() returns them: after Ctrl-C, Tune marks the stopped trials
    # TERMINATED in memory but saves them as PENDING/RUNNING, which is what a resumed sweep will see.
    return list(tune.ExperimentAnalysis(str(path)).trials)


def _planned_steps(sweep: Sweep, config: dict | None = None) -> int:
    """train.steps of a trial (of the first point of the space when no trial config is given)."""
    return sweep.trial_config(config or {d.key: d.candidates()[0] for d in sweep.space}).train.steps


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

    steps = _planned_steps(sweep)
    # time_attr "step": the trainer's own step survives a retry (Tune's training_iteration restarts at 1).
    return ASHAScheduler(time_attr="step", max_t=s.max_t or steps, grace_period=s.grace_period,
                         reduction_factor=s.reduction_factor)


# -- results ---------------------------------------------------------------------------------------------------


def best_row(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The trial row with the best finite `metric` (min or max), or None: a NaN or inf is never a best."""
    scored = [r for r in rows if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
    pick = min if mode == "min" else max
    return pick(scored, key=lambda r: r[metric]) if scored else None


def _report(sweep: Sweep, sweep_dir: Path, trials: list, parent: ParentRun, lost: dict[str, str]) -> int:
    metric, keys = sweep.file.metric, [d.key for d in sweep.space]
    rows = [_trial_row(t, sweep, sweep_dir) for t in sorted(trials, key=lambda t: t.trial_id)]
    parent.settle_children(rows)
    columns = ["trial_id", "status", *keys, "step", metric, "failures", "mlflow_run_id", "run_dir", "node"]
    (sweep_dir / "trials.csv").write_text(trials_csv(rows, columns))
    # Only a trial that ended (ran its steps, or was stopped by the scheduler) can be the best: an interrupted
    # one's metric is from the middle of its run.
    best = best_row([r for r in rows if r["status"] in ENDED], metric, sweep.file.mode)
    ended = sum(r["status"] in ENDED + ("ERROR",) for r in rows)
    unfinished = planned_trials(sweep) - ended  # Tune makes a grid's trials as it goes: some may not exist yet
    errored = [r for r in rows if r["status"] == "ERROR"]
    print(markdown_table(rows, columns[:-3]), flush=True)
    if best is not None:
        best = {**best, "values": {k: best[k] for k in keys}}
        (sweep_dir / "best.json").write_text(json.dumps(best, indent=2, default=str) + "\n")
        values = " ".join(f"{k}={v}" for k, v in best["values"].items())
        print(f"best: trial {best['trial_id']} {metric}={best[metric]:.4g} at step {best['step']} ({values}); "
              f"run folder {best['run_dir']}", flush=True)
    for line in retry_lines(rows, lost):
        print(f"memlm sweep: {line}", flush=True)
    artifacts = [sweep_dir / "sweep.yaml", sweep_dir / "trials.csv", sweep_dir / "best.json"]
    if unfinished > 0:
        parent.finish("KILLED", artifacts, best, metric)
        print(f"memlm sweep: interrupted with {unfinished} of {planned_trials(sweep)} trials unfinished; rerun the "
              "same command to resume", flush=True)
        return EXIT_INTERRUPTED
    parent.finish("FINISHED" if best is not None else "FAILED", artifacts, best, metric)
    if errored:
        print(f"memlm sweep: {len(errored)} trial(s) failed after {sweep.file.max_failures} retries: "
              f"{', '.join(r['trial_id'] for r in errored)}", flush=True)
    if best is None:
        print(f"memlm sweep: no trial reported {metric}", file=sys.stderr, flush=True)
        return 1
    return 0


def retry_lines(rows: list[dict], lost: dict[str, str]) -> list[str]:
    """What the sweep's summary says about failures: the nodes lost while it ran, and every retried trial with
    where it ran (its run folder's nodes.jsonl) and how it ended."""
    lines = []
    if lost:
        names = ", ".join(f"{short_node(node)} ({addr})" for node, addr in sorted(lost.items()))
        on_lost = [r for r in rows if set(r["nodes"]) & set(lost)]
        kept = sum(r["nodes"][-1] in lost and r["status"] in ENDED for r in on_lost)
        moved = sum(r["nodes"][-1] not in lost for r in on_lost)
        lines.append(f"lost {len(lost)} node(s) during the sweep: {names}; {len(on_lost)} trial(s) had run there: "
                     f"{kept} finished there (kept), {moved} continued on other nodes from their last checkpoints")
    retried = [r for r in rows if r["failures"]]
    if retried:
        parts = []
        for r in retried:
            where = " -> ".join(short_node(n) + (" (lost)" if n in lost else "") for n in r["nodes"])
            parts.append(f"{r['trial_id']} {r['status']} after {r['failures']} failure(s)"
                         + (f", nodes {where}" if where else ""))
        lines.append(f"{len(retried)} trial(s) retried: {'; '.join(parts)}")
    return lines


def _trial_row(trial, sweep: Sweep, sweep_dir: Path) -> dict:
    """One trial as its own run folder records it: step and metric from the folder (Tune's saved last_result
    can lag behind it, or be missing for a trial that a restored sweep found already trained), status from Tune's
    state and the folder together (trial_status)."""
    metric = sweep.file.metric
    run_dir = sweep_dir / TRIALS_DIR / trial.trial_id
    last = run_folder_result(run_dir, metric) or trial.last_result or {}
    id_file = run_dir / "mlflow_run_id"
    row = {"trial_id": trial.trial_id, "step": last.get("step"), metric: last.get(metric),
           "failures": trial.run_metadata.num_failures,
           "mlflow_run_id": id_file.read_text().strip() if id_file.is_file() else "", "run_dir": str(run_dir)}
    row["nodes"] = trial_nodes(run_dir)
    row["node"] = row["nodes"][-1] if row["nodes"] else ""
    row["status"] = trial_status(trial.status, _last_logged_step(run_dir), _planned_steps(sweep, trial.config),
                                 sweep.file.scheduler.type != "none", run_dir)
    row.update({d.key: trial.config.get(d.key) for d in sweep.space})
    return row


def _last_logged_step(run_dir: Path) -> int | None:
    """The step of the run's last metrics row: the training always logs its last step (the metric may be older)."""
    rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    return json.loads(rows[-1]).get("step") if rows else None


def trial_status(tune_status: str, trained: int | None, planned: int, scheduled: bool, run_dir: Path) -> str:
    """What happened to a trial, in the table's words; `trained`: the last step it logged.

    TERMINATED: trained all its steps; STOPPED: ended early by the scheduler (Tune calls both TERMINATED);
    ERROR: failed after its retries; INTERRUPTED: under way when the sweep was stopped, a rerun continues it from
    its checkpoint; PENDING: nothing to continue from yet. Tune saves every trial that was running at Ctrl-C as
    PENDING, also one that had just trained its last step: its final checkpoint (written after the last row, so
    nothing is left to redo) tells them apart."""
    if tune_status == "TERMINATED":
        return STOPPED if scheduled and (trained or 0) < planned else "TERMINATED"
    if tune_status == "ERROR":
        return "ERROR"
    from memlm.trainer.checkpoint import store as checkpoint  # torch: the driver's only for an unfinished trial

    tag = checkpoint.latest_tag(run_dir / "checkpoints")
    if tag is None:
        return "PENDING"
    return "TERMINATED" if tag == checkpoint.tag_for(planned) else INTERRUPTED
