"""RMT Figure 4 in the paper's own setting: copy, reverse and associative retrieval split into 1 to 9 segments.

    .venv/bin/python bench/reproduce/rmt_tasks.py --profile cpu     # the part that fits an hour on 2 cores
    .venv/bin/python bench/reproduce/rmt_tasks.py --profile gpu     # every task and segment count (one GPU)
    .venv/bin/python bench/reproduce/rmt_tasks.py --profile smoke   # CI: seconds, proves the pipeline
    .venv/bin/python bench/reproduce/rmt_tasks.py --profile small   # the earlier small setting (tasks_small.py)

The setting (RMT paper, section 4.1, Figure 4, appendix A.1, and the authors' run_copy.sh / run_reverse.sh /
run_retrieval.sh / train_synthetic.py). Each task is fixed: copy 24 symbols -> the 24 written twice (72
predictions), reverse 24 -> 24 (48), retrieval 4 key-value pairs and a key -> its value (10 predictions, "10/1").
Symbols come from 10 digits (chance: 0.1). A sample of S segments has segments of N = predictions / S, so
every segment count reads the same tokens per sample; the memory is N for both models: Transformer-XL's cache
(mem_len = N) and RMT's memory tokens (num_mem_tokens = N). Samples are cut as the authors' loader cuts them:
the first token is an input only (`memlm prepare --task-option predict_first=false`), so copy is 72 predictions,
not 73, and splits into exactly S segments. Models: configs/reproduce/rmt_tasks.yaml (copy, reverse) and
rmt_tasks_retrieval.yaml. Only the answer is scored, in training and in the test accuracy.

The four models, each trained for the same number of optimizer steps on the same samples (so the same tokens):
one step is one batch of 32 samples, as in the authors' loop, which sums the loss over all segments of a sample
before stepping:
    transformer  no memory (mem_len 0); grad_accum = S.
    txl          Transformer-XL, cache N (gradient stops at the cache, as in every Transformer-XL); grad_accum = S.
    rmt          RMT with N memory tokens and no gradient between segments (Figure 4's caption); grad_accum = S.
    rmt_bptt     RMT with BPTT through every segment of the sample (bptt_mode chunk, depth S - 1: the whole
                 sample in one graph, one mean over its answer tokens). This is what the authors' train_synthetic.py
                 does with mem_backprop_depth 0, the value of their Figure 4 runs: the memory tokens a segment
                 writes are not detached before the next one reads them. Figure 5 is BPTT's figure.

Accuracy is per answer character on the test split, teacher-forced (`memlm eval` reports `accuracy`: the fraction
of answer tokens that are the model's most likely byte). The authors' script scores copy and reverse with more
than one segment by greedy generation instead, which can only be lower or equal for a given model.

Budget: the authors trained 250,000-1,000,000 steps per run (their experiment_results/short_synthetic+MT.csv).
No profile here comes near that; each profile says its steps, and the results JSON records them.

A finished run is kept: re-running the command continues an interrupted experiment (Ctrl-C or SIGTERM stops it and
every command it started, in one line).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, load_average, write_json, write_result
from memlm.bench.reproduce.experiment import (
    FIGURES,
    ExperimentError,
    add_stop_options,
    machine,
    memlm,
    read_json,
    run_experiment,
    run_queue,
    save_figure,
    shown,
    supervise,
)
from memlm.bench.reproduce.progress import RUNS
from memlm.bench.reproduce.rmt_tasks_authors import summary

PRESETS = ROOT / "configs" / "reproduce"
DIGITS = "0123456789"


@dataclass(frozen=True)
class Task:
    predictions: int  # per sample, the first token being an input only
    answer: int  # scored characters per sample
    segments: tuple[int, ...]  # the counts S for which N = predictions / S gives exactly S segments
    preset: str
    options: tuple[str, ...]  # `memlm prepare --task-option`s


TASKS = {
    "copy": Task(72, 48, (1, 2, 3, 4, 6, 8, 9), "rmt_tasks.yaml", (f"alphabet={DIGITS}", "predict_first=false")),
    "reverse": Task(48, 24, (1, 2, 3, 4, 6, 8), "rmt_tasks.yaml", (f"alphabet={DIGITS}", "predict_first=false")),
    "retrieval": Task(10, 1, (1, 2, 3, 4, 5), "rmt_tasks_retrieval.yaml", ("query=", "predict_first=false")),
}
LENGTH = {"copy": 24, "reverse": 24, "retrieval": 4}  # symbols; retrieval: key-value pairs
ARCHS = {"transformer": "Baseline (no memory)", "txl": "Transformer-XL (cache = N)",
         "rmt": "RMT (memory = N, no BPTT)", "rmt_bptt": "RMT + BPTT over the sample"}
PROFILES = {
    # Every task, every segment count the paper plots; steps sized for about 20 minutes of one H100 with 8 runs at a
    # time (an estimate until it has run there: the results JSON records the wall time).
    "gpu": {"tasks": ("copy", "reverse", "retrieval"), "segments": None, "steps": 4000, "docs": "100000,5000,10000",
            "jobs": 8, "overrides": []},
    # The largest part that fits an hour on this 2-core machine (about 0.45 s a step, 2 runs at a time): the
    # question Figure 4 answers at 4+ segments (copy in 6 segments of 12: Transformer-XL against RMT, with and
    # without BPTT) and the control that the budget learns the task where no memory is needed (1 segment).
    "cpu": {"tasks": ("copy",), "segments": None, "steps": 3000, "docs": "100000,1000,2000", "jobs": 2,
            "overrides": [], "cells": (("copy", 1, "transformer"), ("copy", 6, "txl"), ("copy", 6, "rmt"),
                                       ("copy", 6, "rmt_bptt"))},
    "smoke": {"tasks": ("copy", "retrieval"), "segments": (1, 3), "steps": 2, "docs": "64,8,16", "jobs": 2,
              "overrides": ["model.n_layer=1", "model.d_model=32", "model.d_head=8", "model.d_inner=32",
                            "data.batch_size=4", "data.eval_batch_size=8", "train.log_every=1"]},
}


def segment_len(task: str, segments: int) -> int:
    n = math.ceil(TASKS[task].predictions / segments)
    if math.ceil(TASKS[task].predictions / n) != segments:
        raise ExperimentError(f"{task}: {TASKS[task].predictions} predictions cannot be cut into {segments} segments "
                              f"of equal length (use one of {TASKS[task].segments})")
    return n


def arch_overrides(arch: str, segments: int, n: int) -> list[str]:
    if arch == "transformer":
        return ["model.arch=transformer", "model.mem_len=0", f"train.grad_accum={segments}"]
    if arch == "txl":
        return ["model.arch=txl", f"model.mem_len={n}", f"train.grad_accum={segments}"]
    rmt = ["model.arch=rmt", "model.mem_len=0", f"model.num_mem_tokens={n}"]
    if arch == "rmt":
        return rmt + ["model.bptt_depth=0", f"train.grad_accum={segments}"]
    return rmt + ["model.bptt_mode=chunk", f"model.bptt_depth={segments - 1}", "train.grad_accum=1"]


def prepare(task: str, work: Path, docs: str) -> Path:
    data = work / "data" / task
    if not (data / "manifest.json").is_file():
        options = [arg for opt in TASKS[task].options for arg in ("--task-option", opt)]
        memlm(["prepare", "--corpus", "task", "--task", task, "--task-length", str(LENGTH[task]), "--task-docs", docs,
               *options, "--out", str(data), "--seed", "0", "--overwrite", "--workers", "1"],
              work / "logs" / "prepare.log", name=data.name)
    return data


def one_run(task: str, segments: int, arch: str, *, profile: str, work: Path, uri: str) -> dict:
    spec = PROFILES[profile]
    n = segment_len(task, segments)
    name = f"{task}-S{segments}-{arch}"
    run_dir, log = work / "runs" / name, work / "logs" / f"{name}.log"
    row_path = run_dir / "reproduce_row.json"
    if row_path.is_file():
        RUNS.skip(name)
        return read_json(row_path)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    data = work / "data" / task
    overrides = spec["overrides"] + arch_overrides(arch, segments, n) + [
        f"model.tgt_len={n}", f"train.steps={spec['steps']}", f"data.path={data}", f"tracking.uri={uri}",
        f"tracking.experiment=memlm-reproduce-rmt-tasks-{profile}", f"tracking.run_name={name}"]
    RUNS.start(name, f"N {n}: train {spec['steps']:,} steps of 32 samples, then eval test")
    start = time.perf_counter()
    memlm(["train", str(PRESETS / TASKS[task].preset), *overrides, "--out", str(run_dir)], log, name=name,
          run_dir=run_dir, steps=spec["steps"])
    train_s = time.perf_counter() - start
    path = run_dir / "eval" / "test.json"
    memlm(["eval", str(run_dir), "--split", "test", "--json", str(path)], log, name=name)
    result = read_json(path)
    if "accuracy" not in result or not math.isfinite(result["nll"]):
        raise ExperimentError(f"{name}: the test evaluation gave no accuracy or a non-finite NLL ({path})")
    if result["tokens"] != result["documents"] * TASKS[task].answer:
        raise ExperimentError(f"{name}: scored {result['tokens']} tokens for {result['documents']} samples, not "
                              f"{TASKS[task].answer} each ({path})")
    row = {"task": task, "segments": segments, "segment_len": n, "memory": n if arch != "transformer" else 0,
           "arch": arch, "label": ARCHS[arch], "accuracy": result["accuracy"], "answer_nll": result["nll"],
           "scored_tokens": result["tokens"], "documents": result["documents"], "steps": spec["steps"],
           "samples_seen": spec["steps"] * _batch(spec), "train_seconds": round(train_s, 1),
           "run_dir": shown(run_dir), "load_after": load_average()}
    write_json(row_path, row)
    RUNS.finish(name, f"accuracy {row['accuracy']:.3f}, answer nll {row['answer_nll']:.3f}, {train_s / 60:.1f} min, "
                f"load {load_average()[0]}")
    return row


def _batch(spec: dict) -> int:
    sizes = [o.split("=", 1)[1] for o in spec["overrides"] if o.startswith("data.batch_size=")]
    return int(sizes[-1]) if sizes else 32


def _authors_cell(task: str, segments: int, arch: str) -> str:
    """' (authors: median m, k of n near chance)' where the authors report the cell."""
    ref = summary(task, segments, arch)
    if ref is None:
        return ""
    return f" (authors: {ref['median']:.2f}, {ref['near_chance']}/{len(ref['runs'])} near chance)"


def plot(rows: list[dict], path: Path, profile: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for arch, label in ARCHS.items():
            mine = sorted((r for r in rows if r["task"] == task and r["arch"] == arch), key=lambda r: r["segments"])
            if mine:
                ax.plot([r["segments"] for r in mine], [r["accuracy"] for r in mine], marker="o", label=label)
        steps = sorted({r["steps"] for r in rows if r["task"] == task})
        ax.set_title(f"{task} ({TASKS[task].predictions} predictions), {'/'.join(map(str, steps))} steps")
        ax.set_xlabel("segments per sample (memory = segment length)")
        ax.set_ylabel("test per-character accuracy")
        ax.set_ylim(0, 1.05)
        ax.axhline(0.1, color="grey", lw=0.8, ls=":")  # chance: 10 symbols
        ax.set_xticks(sorted({r["segments"] for r in rows if r["task"] == task}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"RMT Figure 4 setting, profile {profile} (chance 0.1; the paper trains 250k-1M steps)", fontsize=9)
    return save_figure(fig, path)


def small(args) -> int:
    from memlm.bench.reproduce import tasks_small

    argv = ["--profile", "cpu", "--progress-every", str(args.progress_every), "--grace", str(args.grace)]
    for flag, value in (("--work", args.work), ("--jobs", args.jobs), ("--tasks", args.tasks), ("--out", args.out)):
        argv += [flag, str(value)] if value is not None else []
    if args.segments or args.archs != ",".join(ARCHS):
        raise SystemExit("rmt_tasks: error: --profile small takes no --segments or --archs (its models and segment "
                         "counts are tasks_small.py's)")
    return tasks_small.main(argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES) + ["small"], default="cpu")
    parser.add_argument("--work", type=Path, help="data, runs and logs (default runs/reproduce/rmt-tasks-PROFILE)")
    parser.add_argument("--jobs", type=int, help="runs at a time, one thread each (default: the profile's)")
    parser.add_argument("--tasks", help="subset of: " + ", ".join(TASKS) + " (default: the profile's)")
    parser.add_argument("--segments", help="comma-separated segment counts (default: the profile's)")
    parser.add_argument("--archs", default=",".join(ARCHS), help="subset of: " + ", ".join(ARCHS))
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/reproduce_rmt_tasks_PROFILE"
                                                 ".json)")
    add_stop_options(parser)
    args = parser.parse_args(argv)
    if args.profile == "small":  # the earlier setting (N = 8, the task grows with the segments): its own script
        return small(args)
    spec = PROFILES[args.profile]
    tasks = args.tasks.split(",") if args.tasks else list(spec["tasks"])
    archs = args.archs.split(",")
    bad = [t for t in tasks if t not in TASKS] + [a for a in archs if a not in ARCHS]
    if bad:
        parser.error(f"unknown task or arch: {', '.join(bad)}")
    wanted = [int(s) for s in args.segments.split(",")] if args.segments else spec["segments"]
    plan = [(task, s, arch) for task in tasks for s in (wanted or TASKS[task].segments)
            for arch in archs if not (arch == "rmt_bptt" and s == 1)]  # one segment: no transition to train
    if spec.get("cells") and not (args.tasks or args.segments or args.archs != ",".join(ARCHS)):
        plan = list(spec["cells"])  # the profile's chosen cells, unless the command picks its own
    try:
        for task, s, _ in plan:
            segment_len(task, s)
    except ExperimentError as err:
        parser.error(str(err))
    supervise(args)
    work = (args.work or ROOT / "runs" / "reproduce" / f"rmt-tasks-{args.profile}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    RUNS.plan(len(plan))
    started, load_start = time.time(), load_average()
    try:
        for task in tasks:  # data first, one task at a time (the runs only read it)
            prepare(task, work, spec["docs"])
        run_queue([partial(one_run, *job, profile=args.profile, work=work, uri=uri) for job in plan],
                  args.jobs or spec["jobs"])
    except ExperimentError as err:
        print(f"rmt_tasks: error: {err}", file=sys.stderr)
        return 1
    rows = sorted((read_json(p) for p in (work / "runs").glob("*/reproduce_row.json")),
                  key=lambda r: (list(TASKS).index(r["task"]), r["segments"], list(ARCHS).index(r["arch"])))
    results, figures = (work, work) if args.profile == "smoke" else (RESULTS, FIGURES)
    figure = plot(rows, figures / f"reproduce_rmt_tasks_{args.profile}.png", args.profile)
    out = args.out or results / f"reproduce_rmt_tasks_{args.profile}.json"
    write_result(out, {"experiment": "rmt_tasks", "profile": args.profile, "machine": machine(),
                       # this command; the rows are every finished run in the work folder, earlier commands' too
                       "command": " ".join(["python bench/reproduce/rmt_tasks.py", *(argv if argv is not None
                                                                                       else sys.argv[1:])]),
                       "presets": [shown(PRESETS / t.preset) for t in TASKS.values()], "steps": spec["steps"],
                       "docs": spec["docs"], "jobs": args.jobs or spec["jobs"],
                       "wall_minutes": round((time.time() - started) / 60, 1), "load_start": load_start,
                       "load_end": load_average(), "figure": shown(figure), "runs": rows,
                       "authors": [{"task": t, "segments": s, "arch": a, **summary(t, s, a)}
                                   for t, s, a in sorted({(r["task"], r["segments"], r["arch"]) for r in rows})
                                   if summary(t, s, a)]})
    print("Accuracy here, and in brackets the authors' runs: their median, and how many ended near chance (< 0.25)")
    print("| task | segments | N | " + " | ".join(ARCHS.values()) + " |")
    print("|---|---|---|" + "---|" * len(ARCHS))
    for task in tasks:
        for s in sorted({r["segments"] for r in rows if r["task"] == task}):
            cells = [next((f"{r['accuracy']:.3f}" for r in rows if (r["task"], r["segments"], r["arch"]) ==
                           (task, s, a)), "-") + _authors_cell(task, s, a) for a in ARCHS]
            print(f"| {task} | {s} | {segment_len(task, s)} | " + " | ".join(cells) + " |")
    print(f"wrote {out} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(run_experiment(main))
