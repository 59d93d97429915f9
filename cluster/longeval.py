"""`memlm longeval RUN_DIR [RUN_DIR ...] --lengths 512,1k,2k --depths 5`: accuracy on long-context tasks by sample
length and fact depth (BABILong-style QA, passkey: data_pipeline/longctx.py), or with `--babilong DIR --task qaN` on
BABILong's own files by their lengths, with BABILong's scoring (data_pipeline/babilong.py).

For every run folder and every length, one Ray task (cluster/longeval_task.py) scores the run's answers with the memory
carried over every segment (trainer/inference/longeval.py: `--samples` generated samples per depth window;
longeval_babilong.py: the file's records) and, on the same samples, the baselines of a reader that does not learn
(chance and cheap heuristics, longeval_baselines.py). Results go to OUT/<run>/<task>-<split>-len<L>.json (BABILong:
babilong-<task>-<L>.json) as they arrive, then to OUT/summary.json, OUT/longeval.csv, OUT/accuracy.png (accuracy
against length, one line per run, the baselines dashed), OUT/<run>/heatmap.png (length x depth; generated tasks) and
MLflow (one run per RUN_DIR: longeval_acc and longeval_baseline_<name> at step = length): cluster/longeval_outputs.py.
A rerun reuses every result of the same checkpoint and settings already in OUT.

The task and its options (the background folder) default to the ones the run was trained on (its data's
manifest); --task and --background choose others (cluster/longeval_plan.py). As `memlm extrapolate`
(cluster/extrapolate.py, whose Ray, retry and MLflow rules this follows): flags and runs are checked before Ray
starts; a failed task is reported by (run, length) and the rest is kept; the command then exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memlm.trainer.runtime import heartbeat

from .errors import ClusterError
from .extrapolate import RETRY_EXCEPTIONS
from .extrapolate_mlflow import open_experiment
from .longeval_outputs import log_run, summary, table, write_outputs
from .longeval_plan import Source, check_runs, parse_lengths, source_of
from .longeval_task import longeval_task
from .ray_flags import check_ray_flags
from .ray_runtime import error_reason, quiet_console_env, ray_session

DEFAULT_OUT = "longeval"


def main(args: argparse.Namespace) -> int:
    quiet_console_env()
    check_ray_flags(args)
    if args.babilong is None and args.lengths is not None:
        parse_lengths(args.lengths)  # a bad --lengths is refused before the runs are read
    runs = check_runs(args.run_dirs)
    source = source_of(args, runs[0].run_dir)
    out = Path(args.out or DEFAULT_OUT).resolve()
    jobs, results = [], {}
    for i in sorted(range(len(source.lengths)), key=lambda i: -source.lengths[i]):  # longest first: they take longest
        for run in runs:
            path = out / run.name / source.result_name(i)
            old = _read(path)
            if source.reusable(old, run.step):
                results[(run.name, source.lengths[i])] = old
            else:
                jobs.append((run, i, path))

    client, experiment_id, uri = open_experiment(args.experiment, args.uri)
    heartbeat.phase(None)  # its first line (memlm/start_watch.py)
    if source.babilong:
        what = (f"BABILong {source.task} from {source.babilong} ({source.samples or 'every'} record(s) per length, "
                "BABILong's scoring)")
    else:
        what = (f"{source.task} ({source.depths} depth windows x {source.samples} samples, {source.split} split)")
    print(f"longeval: {len(runs)} run(s) x {len(source.lengths)} length(s) on {what}: {len(jobs)} evaluation(s) to "
          "run", flush=True)
    seconds: dict[tuple[str, int], float] = {}
    failures: list[str] = []
    if jobs:
        fresh, seconds, failures = _run_on_ray(jobs, source, args)
        results.update(fresh)
    body = summary(source.settings(), list(source.lengths), list(source.labels), runs, results, seconds)
    paths = write_outputs(out, body)
    try:
        for run in runs:
            log_run(client, experiment_id, run, body, [paths["summary"], paths["csv"], paths["plot"],
                                                       *([paths[f"heatmap:{run.name}"]] if not source.babilong
                                                         else [])])
    except Exception as exc:  # noqa: BLE001 - the store went away: the results on disk still stand
        print(table(body))
        raise ClusterError(f"results are in {out}, but logging them to MLflow at {uri} failed ({error_reason(exc)}); "
                           "rerun the same command to log them (finished results are reused)") from None
    print(table(body))
    heatmaps = "" if source.babilong else ", <run>/heatmap.png"
    print(f"longeval: results in {out} (summary.json, longeval.csv, accuracy.png{heatmaps}); MLflow "
          f"experiment {args.experiment!r} at {uri}")
    for line in failures:
        print(f"memlm: error: long-context evaluation of {line}", file=sys.stderr)
    return 1 if failures else 0


def _run_on_ray(jobs, source: Source, args) -> tuple[dict, dict, list[str]]:
    import ray

    results, seconds, failures = {}, {}, []
    with ray_session(args.address, args.num_cpus):
        remote = ray.remote(longeval_task)
        opts = {"num_cpus": args.cpus_per_task, "num_gpus": args.gpus_per_task, "max_retries": args.max_retries,
                "retry_exceptions": RETRY_EXCEPTIONS}
        pending = {remote.options(**opts, name=f"longeval:{run.name}:{source.labels[i]}").remote(
            str(run.run_dir), source.spec(i, args.lanes), str(path), args.cpus_per_task): (run, i)
            for run, i, path in jobs}
        start = time.perf_counter()
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    run, i = pending.pop(ref)
                    length, label = source.lengths[i], source.labels[i]
                    try:
                        reply = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - reported per (run, length); the rest goes on
                        failures.append(f"{run.name} at length {label} failed (retries allowed: "
                                        f"{args.max_retries}): {error_reason(exc)}")
                        print(f"longeval: FAILED {failures[-1]}", file=sys.stderr, flush=True)
                        continue
                    results[(run.name, length)] = reply["result"]
                    seconds[(run.name, length)] = reply["seconds"]
                    print(f"[{len(results) + len(failures)}/{len(jobs)} {time.perf_counter() - start:6.1f} s] "
                          f"{run.name} length {label}: accuracy {reply['result']['accuracy']:.3f} "
                          f"in {reply['seconds']:.1f} s", flush=True)
        except BaseException:
            for ref in pending:  # Ctrl-C: leave nothing running on a cluster we do not own
                ray.cancel(ref, force=True)
            raise
    return results, seconds, failures


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
