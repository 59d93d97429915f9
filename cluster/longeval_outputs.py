"""`memlm longeval`'s outputs from its summary: summary.json, longeval.csv, accuracy.png, <run>/heatmap.png, the
console table, and one MLflow run per run folder. Baselines (chance and the heuristics of a reader that does not
learn, trainer/inference/longeval_baselines.py) sit beside every accuracy in each of them.

The summary (`summary(...)`) holds the source's settings, `lengths` (tokens) and `length_labels`, `baselines` (one
row per length: {"length", "length_label", name: accuracy, ...}: every run is scored on the same samples, so one row
serves them all) and per run its results (each with its own `baselines`, per depth window too).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from memlm.trainer.inference.longeval import depth_windows
from memlm.trainer.inference.longeval_baselines import DESCRIPTIONS
from memlm.trainer.tracking.plots import plot_accuracy_heatmap

from .extrapolate_mlflow import linked_train_run
from .longeval_plots import plot_accuracy

METRIC = "longeval_acc"
BASELINE_METRIC = "longeval_baseline_{}"
CSV_FIELDS = ("run", "arch", "step", "task", "split", "length", "length_label", "depth_min", "depth_max", "samples",
              "accuracy", "tgt_len", "mem_len", "run_dir")


def summary(settings: dict, lengths: list[int], labels: list[str], runs: list, results: dict,
            seconds: dict) -> dict:
    """runs: LongRun; results / seconds: {(run name, length): result / evaluation seconds}."""
    floor = []
    for n, label in zip(lengths, labels):
        found = next((results[(run.name, n)] for run in runs if (run.name, n) in results), None)
        if found is not None:
            floor.append({"length": n, "length_label": label, **found["baselines"]})
    return {**settings, "lengths": lengths, "length_labels": labels, "baselines": floor, "runs": {
        run.name: {"run_dir": str(run.run_dir), "arch": run.arch, "step": run.step, "tgt_len": run.tgt_len,
                   "missing": [n for n in lengths if (run.name, n) not in results],
                   "results": [{**results[(run.name, n)], "eval_seconds": seconds.get((run.name, n))}
                               for n in lengths if (run.name, n) in results]} for run in runs}}


def baseline_names(summary: dict) -> list[str]:
    return list(dict.fromkeys(k for row in summary["baselines"] for k in row if k not in ("length", "length_label")))


def write_outputs(out: Path, summary: dict) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / "summary.json", "csv": out / "longeval.csv", "plot": out / "accuracy.png"}
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    names = baseline_names(summary)
    label_of = dict(zip(summary["lengths"], summary["length_labels"]))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS + tuple(f"baseline_{b}" for b in names), lineterminator="\n")
    writer.writeheader()
    for name, run in summary["runs"].items():
        for result in run["results"]:
            for cell in result["by_depth"]:
                row = {k: v for k, v in cell.items() if k != "baselines"}
                row.update({f"baseline_{b}": cell["baselines"].get(b) for b in names})
                writer.writerow({"run": name, "arch": run["arch"], "step": run["step"], "task": summary["task"],
                                 "split": summary["split"], "length": result["length"],
                                 "length_label": label_of[result["length"]], **row, "tgt_len": result["tgt_len"],
                                 "mem_len": result["mem_len"], "run_dir": run["run_dir"]})
    paths["csv"].write_text(buf.getvalue())
    lines = {name: {r["length"]: r["accuracy"] for r in run["results"]} for name, run in summary["runs"].items()}
    floor = {b: {row["length"]: row[b] for row in summary["baselines"] if b in row} for b in names}
    babilong = summary["source"] == "babilong"
    plot_accuracy(lines, floor, summary["lengths"], summary["length_labels"], paths["plot"],
                  title=f"{title(summary)}: accuracy against length",
                  xlabel="BABILong length (k = 1,000 GPT-2 tokens)" if babilong else "sample length (tokens)")
    if babilong:
        return paths  # one window per length: the heatmap would be this plot again
    windows = depth_windows(summary["depths"])
    for name, run in summary["runs"].items():
        by_length = {r["length"]: r["by_depth"] for r in run["results"]}
        grid = [[by_length[n][i]["accuracy"] if n in by_length else None for n in summary["lengths"]]
                for i in range(len(windows))]
        paths[f"heatmap:{name}"] = plot_accuracy_heatmap(grid, summary["lengths"], windows, out / name / "heatmap.png",
                                                         title=f"{name} ({run['arch']}): {summary['task']}")
    return paths


def title(summary: dict) -> str:
    return f"BABILong {summary['task']}" if summary["source"] == "babilong" else summary["task"]


def table(summary: dict) -> str:
    lengths, labels = summary["lengths"], summary["length_labels"]
    rows = ["| run | " + " | ".join(labels) + " |", "|---|" + "---|" * len(lengths)]
    for name, run in summary["runs"].items():
        acc = {r["length"]: r["accuracy"] for r in run["results"]}
        rows.append(f"| {name} | " + " | ".join(f"{100 * acc[n]:.1f}%" if n in acc else "failed" for n in lengths)
                    + " |")
    by_length = {row["length"]: row for row in summary["baselines"]}
    for b in baseline_names(summary):
        cells = [f"{100 * by_length[n][b]:.1f}%" if b in by_length.get(n, {}) else "-" for n in lengths]
        rows.append(f"| baseline: {DESCRIPTIONS.get(b, b)} | " + " | ".join(cells) + " |")
    if summary["source"] == "babilong":
        head = (f"BABILong {summary['task']} accuracy by length (BABILong's labels and scoring; "
                f"{summary['babilong']}):")
    else:
        head = f"{summary['task']} answer accuracy by sample length (tokens), all depths:"
    return head + "\n" + "\n".join(rows) + "\nbaselines: readers that do not learn, on the same samples"


def log_run(client: Any, experiment_id: str, run, summary: dict, artifacts: list[Path]) -> None:
    """One MLflow run for one run folder: accuracy and every baseline at step = length, the files as artifacts."""
    from mlflow.entities import Metric, Param, RunTag

    body = summary["runs"][run.name]
    name = f"{run.name}-babilong-{summary['task']}" if summary["source"] == "babilong" else \
        f"{run.name}-{summary['task']}"
    created = client.create_run(experiment_id, run_name=name)
    run_id, ts = created.info.run_id, created.info.start_time
    metrics = [Metric(METRIC, float(r["accuracy"]), ts, int(r["length"])) for r in body["results"]]
    for r in body["results"]:
        if summary["source"] != "babilong":
            metrics += [Metric(f"{METRIC}_depth{i}", float(c["accuracy"]), ts, int(r["length"]))
                        for i, c in enumerate(r["by_depth"])]
        metrics += [Metric(BASELINE_METRIC.format(b), float(v), ts, int(r["length"]))
                    for b, v in r["baselines"].items()]
    tags = {"arch": run.arch, "run_dir": str(run.run_dir), "kind": "longeval"}
    if linked_train_run(client, run.train_run_id):
        tags["memlm.train_run_id"] = run.train_run_id
    params = {k: str(summary[k]) for k in ("task", "source", "split", "seed", "samples_per_depth", "depths")}
    if summary["babilong"]:
        params["babilong"] = summary["babilong"]
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
