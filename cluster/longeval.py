"""`memlm longeval RUN_DIR [RUN_DIR ...] --lengths 512,1k,2k --depths 5`: accuracy on long-context tasks by sample
length and fact depth (BABILong-style QA, passkey: data_pipeline/longctx.py).

For every run folder and every length, one Ray task (cluster/longeval_task.py) generates `--samples` samples per
depth window and scores the run's answers with the memory carried over every segment
(trainer/inference/longeval.py). Results go to OUT/<run>/<task>-<split>-len<L>.json as they arrive, then to
OUT/summary.json, OUT/longeval.csv, OUT/accuracy.png (accuracy against length, one line per run),
OUT/<run>/heatmap.png (length x depth) and MLflow (one run per RUN_DIR: longeval_acc at step = length). A rerun
reuses every result of the same checkpoint and settings already in OUT.

The task and its options (the background folder) default to the ones the run was trained on (its data's
manifest); --task and --background choose others. As `memlm extrapolate` (cluster/extrapolate.py, whose Ray,
retry and MLflow rules this follows): flags and runs are checked before Ray starts; a failed task is reported by
(run, length) and the rest is kept; the command then exits 1.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlm.trainer.runtime import heartbeat

from .errors import ClusterError
from .extrapolate import RETRY_EXCEPTIONS
from .ray_runtime import error_reason

DEFAULT_OUT = "longeval"
LONGCTX_TASKS = ("qa1", "qa2", "qa3", "passkey")  # data_pipeline/longctx.py's
METRIC = "longeval_acc"


@dataclass(frozen=True)
class LongRun:
    run_dir: Path
    name: str
    arch: str
    step: int | None
    tgt_len: int
    train_run_id: str


def parse_lengths(text: str) -> list[int]:
    """"512,1k,2k" -> [512, 1024, 2048] (k = 1024), sorted, each >= 64."""
    lengths = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            value = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise ClusterError(f"--lengths {text!r}: give sizes like 512,1k,2k,16k (k = 1024 tokens)") from None
        if value < 64:
            raise ClusterError(f"--lengths: every length must be >= 64 tokens, got {part}")
        lengths.append(value)
    return sorted(set(lengths))


def task_of(runs: list[Path], task: str | None, background: str | None) -> tuple[str, dict]:
    """(task, its options) from the flags, else from the first run's data (the task it was trained on)."""
    from memlm.data_pipeline.shards import load_manifest
    from memlm.data_pipeline.tasks import DEFAULTS
    from memlm.trainer.inference.evaluate import resolve_eval_config

    cfg = resolve_eval_config(runs[0], "test", None, None, None, None, None)
    corpus = load_manifest(Path(cfg.data.path)).get("corpus") or {}
    trained = corpus.get("task") if corpus.get("kind") == "task" else None
    task = task or trained
    if task not in LONGCTX_TASKS:
        raise ClusterError(f"{runs[0]} was trained on {trained or 'a text corpus'}, not a long-context task; pass "
                           f"--task (one of {', '.join(LONGCTX_TASKS)})")
    options = {k: v for k, v in (corpus.get("options") or {}).items()
               if task == trained and k in DEFAULTS[task] and k not in ("length", "depth_min", "depth_max")}
    if background:
        options["background"] = background
    return task, options


def check_runs(run_dirs: list[str]) -> list[LongRun]:
    from memlm.trainer.checkpoint.store import find_checkpoint, step_of
    from memlm.trainer.inference.evaluate import resolve_eval_config

    from .extrapolate_plan import unique_names

    folders = [Path(d).resolve() for d in run_dirs]
    if len(set(folders)) != len(folders):
        raise ClusterError("the same RUN_DIR is given twice; name each run once")
    runs = []
    for folder, name in zip(folders, unique_names(folders)):
        cfg = resolve_eval_config(folder, "test", None, None, None, None, None)
        _, tag = find_checkpoint(folder, None)
        id_file = folder / "mlflow_run_id"
        runs.append(LongRun(folder, name, cfg.model.arch, step_of(tag), cfg.model.tgt_len,
                            id_file.read_text().strip() if id_file.is_file() else ""))
    return runs


def main(args: argparse.Namespace) -> int:
    from .ray_runtime import quiet_console_env

    quiet_console_env()
    for flag in ("depths", "samples"):
        if getattr(args, flag) < 1:
            raise ClusterError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.address and args.num_cpus is not None:
        raise ClusterError("--num-cpus sizes a local Ray; an existing cluster (--address) has its own CPUs: give one")
    lengths = parse_lengths(args.lengths)
    runs = check_runs(args.run_dirs)
    task, options = task_of([r.run_dir for r in runs], args.task, args.background)
    from memlm.data_pipeline.tasks import resolve_options

    resolve_options(task, {**options, "length": lengths[0]})  # a bad option is one line now, not a failed task
    out = Path(args.out or DEFAULT_OUT).resolve()
    settings = {"task": task, "split": args.split, "seed": args.seed, "samples_per_depth": args.samples,
                "depths": args.depths}
    jobs, results = [], {}
    for length in sorted(lengths, reverse=True):  # longest first: they take longest
        for run in runs:
            path = out / run.name / f"{task}-{args.split}-len{length}.json"
            old = _read(path)
            if old and old.get("step") == run.step and old.get("samples") == args.samples * args.depths and all(
                    old.get(k) == settings[k] for k in ("task", "split", "seed")) and \
                    len(old.get("by_depth", [])) == args.depths:
                results[(run.name, length)] = old
            else:
                jobs.append((run, length, path))

    from .extrapolate_mlflow import open_experiment

    client, experiment_id, uri = open_experiment(args.experiment, args.uri)
    heartbeat.phase(None)  # its first line (memlm/start_watch.py)
    print(f"longeval: {len(runs)} run(s) x {len(lengths)} length(s) on {task} ({args.depths} depth windows x "
          f"{args.samples} samples, {args.split} split): {len(jobs)} evaluation(s) to run", flush=True)
    seconds: dict[tuple[str, int], float] = {}
    failures: list[str] = []
    if jobs:
        fresh, seconds, failures = _run_on_ray(jobs, task, options, args)
        results.update(fresh)
    summary = {**settings, "lengths": lengths, "runs": {
        run.name: {"run_dir": str(run.run_dir), "arch": run.arch, "step": run.step, "tgt_len": run.tgt_len,
                   "missing": [n for n in lengths if (run.name, n) not in results],
                   "results": [{**results[(run.name, n)], "eval_seconds": seconds.get((run.name, n))}
                               for n in lengths if (run.name, n) in results]} for run in runs}}
    paths = write_outputs(out, summary)
    try:
        for run in runs:
            _log_run(client, experiment_id, run, summary, [paths["summary"], paths["csv"], paths["plot"],
                                                            paths[f"heatmap:{run.name}"]])
    except Exception as exc:  # noqa: BLE001 - the store went away: the results on disk still stand
        print(table(summary))
        raise ClusterError(f"results are in {out}, but logging them to MLflow at {uri} failed ({error_reason(exc)}); "
                           "rerun the same command to log them (finished results are reused)") from None
    print(table(summary))
    print(f"longeval: results in {out} (summary.json, longeval.csv, accuracy.png, <run>/heatmap.png); MLflow "
          f"experiment {args.experiment!r} at {uri}")
    for line in failures:
        print(f"memlm: error: long-context evaluation of {line}", file=sys.stderr)
    return 1 if failures else 0


def _run_on_ray(jobs, task: str, options: dict, args) -> tuple[dict, dict, list[str]]:
    import ray

    from .longeval_task import longeval_task
    from .ray_runtime import ray_session

    results, seconds, failures = {}, {}, []
    with ray_session(args.address, args.num_cpus):
        remote = ray.remote(longeval_task)
        opts = {"num_cpus": args.cpus_per_task, "num_gpus": args.gpus_per_task, "max_retries": args.max_retries,
                "retry_exceptions": RETRY_EXCEPTIONS}
        pending = {remote.options(**opts, name=f"longeval:{run.name}:{length}").remote(
            str(run.run_dir), task, options, length, args.depths, args.samples, args.seed, args.split, args.lanes,
            str(path), args.cpus_per_task): (run, length) for run, length, path in jobs}
        start = time.perf_counter()
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    run, length = pending.pop(ref)
                    try:
                        reply = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - reported per (run, length); the rest goes on
                        failures.append(f"{run.name} at length {length} failed (retries allowed: "
                                        f"{args.max_retries}): {error_reason(exc)}")
                        print(f"longeval: FAILED {failures[-1]}", file=sys.stderr, flush=True)
                        continue
                    results[(run.name, length)] = reply["result"]
                    seconds[(run.name, length)] = reply["seconds"]
                    print(f"[{len(results) + len(failures)}/{len(jobs)} {time.perf_counter() - start:6.1f} s] "
                          f"{run.name} length {length}: accuracy {reply['result']['accuracy']:.3f} "
                          f"in {reply['seconds']:.1f} s", flush=True)
        except BaseException:
            for ref in pending:  # Ctrl-C: leave nothing running on a cluster we do not own
                ray.cancel(ref, force=True)
            raise
    return results, seconds, failures


CSV_FIELDS = ("run", "arch", "step", "task", "split", "length", "depth_min", "depth_max", "samples", "accuracy",
              "tgt_len", "mem_len", "run_dir")


def write_outputs(out: Path, summary: dict) -> dict[str, Path]:
    from memlm.trainer.inference.longeval import depth_windows
    from memlm.trainer.tracking.plots import plot_accuracy_against_length, plot_accuracy_heatmap

    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / "summary.json", "csv": out / "longeval.csv", "plot": out / "accuracy.png"}
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for name, run in summary["runs"].items():
        for result in run["results"]:
            for cell in result["by_depth"]:
                writer.writerow({"run": name, "arch": run["arch"], "step": run["step"], "task": summary["task"],
                                 "split": summary["split"], "length": result["length"], **cell,
                                 "tgt_len": result["tgt_len"], "mem_len": result["mem_len"], "run_dir": run["run_dir"]})
    paths["csv"].write_text(buf.getvalue())
    lines = {name: [(r["length"], r["accuracy"]) for r in run["results"]] for name, run in summary["runs"].items()}
    plot_accuracy_against_length(lines, paths["plot"], title=f"{summary['task']}: accuracy against length")
    windows = depth_windows(summary["depths"])
    for name, run in summary["runs"].items():
        by_length = {r["length"]: r["by_depth"] for r in run["results"]}
        grid = [[by_length[n][i]["accuracy"] if n in by_length else None for n in summary["lengths"]]
                for i in range(len(windows))]
        paths[f"heatmap:{name}"] = plot_accuracy_heatmap(grid, summary["lengths"], windows, out / name / "heatmap.png",
                                                         title=f"{name} ({run['arch']}): {summary['task']}")
    return paths


def table(summary: dict) -> str:
    lengths = summary["lengths"]
    head = "| run | " + " | ".join(str(n) for n in lengths) + " |"
    rows = [head, "|---|" + "---|" * len(lengths)]
    for name, run in summary["runs"].items():
        acc = {r["length"]: r["accuracy"] for r in run["results"]}
        rows.append(f"| {name} | " + " | ".join(f"{100 * acc[n]:.1f}%" if n in acc else "failed" for n in lengths)
                    + " |")
    return f"{summary['task']} answer accuracy by sample length (tokens), all depths:\n" + "\n".join(rows)


def _log_run(client: Any, experiment_id: str, run: LongRun, summary: dict, artifacts: list[Path]) -> None:
    from mlflow.entities import Metric, Param, RunTag

    from .extrapolate_mlflow import linked_train_run

    body = summary["runs"][run.name]
    created = client.create_run(experiment_id, run_name=f"{run.name}-{summary['task']}")
    run_id, ts = created.info.run_id, created.info.start_time
    metrics = [Metric(METRIC, float(r["accuracy"]), ts, int(r["length"])) for r in body["results"]]
    for r in body["results"]:
        metrics += [Metric(f"{METRIC}_depth{i}", float(c["accuracy"]), ts, int(r["length"]))
                    for i, c in enumerate(r["by_depth"])]
    tags = {"arch": run.arch, "run_dir": str(run.run_dir), "kind": "longeval"}
    if linked_train_run(client, run.train_run_id):
        tags["memlm.train_run_id"] = run.train_run_id
    params = {k: str(summary[k]) for k in ("task", "split", "seed", "samples_per_depth", "depths")}
    params.update(checkpoint_step=str(run.step), tgt_len=str(run.tgt_len))
    try:
        client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()],
                         tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        for path in artifacts:
            client.log_artifact(run_id, str(path))
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FAILED" if body["missing"] else "FINISHED")


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
