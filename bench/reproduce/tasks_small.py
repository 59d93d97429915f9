"""Copy and reverse (RMT Figure 4): per-token answer accuracy as a sample spans 1, 2, 4 and 6 segments, for the
no-memory Transformer+RPE, Transformer-XL (M = N) and RMT.

    .venv/bin/python bench/reproduce/tasks_small.py                   # -> bench/results/reproduce_tasks_cpu.json
    .venv/bin/python bench/reproduce/tasks_small.py --profile smoke   # CI: 2 and 4 segments, 3 steps

The segment length stays N = 8 (configs/reproduce/copy_reverse.yaml), so every run reads the same tokens per step; the
number of segments a sample spans comes from the task length L: a copy sample is `L symbols > the L symbols
twice` plus its boundary token (3L + 2 tokens), a reverse sample `L symbols > reversed` (2L + 2). Each data set is
`memlm prepare --corpus task`, each run `memlm train` then `memlm eval --split test`, whose JSON carries
`accuracy`: the fraction of answer tokens (the only scored ones) that are the model's most likely byte.

What the architectures can reach: the no-memory model sees one segment; Transformer-XL with M = N over 2 layers
sees 3N = 24 tokens back; RMT's 8 memory tokens carry what it writes from segment to segment, trained by window
BPTT over the whole sample (bptt_depth = segments - 1), as the paper trains these tasks.

A finished run is kept: re-running the command continues an interrupted experiment (Ctrl-C or SIGTERM stops it and
every command it started, in one line).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from functools import partial
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, load_average, write_json, write_result
from memlm.bench.reproduce.children import CHILDREN
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

PRESET = ROOT / "configs" / "reproduce" / "copy_reverse.yaml"
N = 8
ARCHS = {"transformer": ("Transformer+RPE", ["model.arch=transformer", "model.mem_len=0"]),
         "txl": ("Transformer-XL (M = N)", ["model.arch=txl"]),
         "rmt": ("RMT (8 memory tokens)", ["model.arch=rmt", "model.mem_len=0", "model.num_mem_tokens=8"]),
         # The same RMT, each segment count starting from the weights trained at the previous one (2 -> 4 -> 6),
         # as the RMT authors' later work trains: `memlm train --resume --reshard` loads the weights only.
         "rmt_cur": ("RMT, curriculum over segments", ["model.arch=rmt", "model.mem_len=0",
                                                       "model.num_mem_tokens=8"])}
CURRICULUM_FROM = 2  # the curriculum starts from the plain RMT run at this segment count
PROFILES = {
    "cpu": {"segments": [1, 2, 4, 6], "steps": 2000, "docs": "10000,200,500", "overrides": []},
    "smoke": {"segments": [2, 4], "steps": 3, "docs": "64,16,16",
              "overrides": ["model.d_model=32", "model.n_head=2", "model.d_inner=64", "train.warmup_steps=1",
                            "train.log_every=1", "data.batch_size=4", "data.eval_batch_size=4"]},
}


def sample_tokens(task: str, length: int) -> int:
    """Tokens of one sample: prompt, '>', answer and the boundary token."""
    return length + 1 + (2 * length if task == "copy" else length) + 1


def task_length(task: str, segments: int) -> int:
    """The largest L whose samples fit in `segments` segments of N tokens."""
    per_symbol = 3 if task == "copy" else 2
    return max(1, (segments * N - 2) // per_symbol)


def prepare(task: str, length: int, work: Path, docs: str) -> Path:
    data = work / "data" / f"{task}-L{length}"
    if not (data / "manifest.json").is_file():
        memlm(["prepare", "--corpus", "task", "--task", task, "--task-length", str(length), "--task-docs", docs,
               "--out", str(data), "--seed", "0", "--overwrite", "--workers", "1"], work / "logs" / "prepare.log",
              name=data.name)
    return data


def one_run(task: str, segments: int, arch: str, *, profile: str, work: Path, uri: str,
            init_from: Path | None = None) -> dict:
    """Train and evaluate one (task, segments, arch); init_from: a run folder whose final weights start this one."""
    spec = PROFILES[profile]
    length = task_length(task, segments)
    spans = math.ceil(sample_tokens(task, length) / N)
    name = f"{task}-S{segments}-{arch}"
    run_dir, log = work / "runs" / name, work / "logs" / f"{name}.log"
    row_path = run_dir / "reproduce_row.json"
    if row_path.is_file():
        RUNS.skip(name)
        return read_json(row_path)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    data = prepare(task, length, work, spec["docs"])
    label, keys = ARCHS[arch]
    extra = [f"model.bptt_depth={max(0, spans - 1)}"] if arch == "rmt" else []
    if arch == "rmt" and spans == 1:
        extra = ["model.bptt_depth=0"]
    overrides = spec["overrides"] + keys + extra + [
        f"train.steps={spec['steps']}", f"data.path={data}", f"tracking.uri={uri}",
        f"tracking.experiment=memlm-reproduce-tasks-{profile}", f"tracking.run_name={name}"]
    RUNS.start(name, f"L {length}, {spans} segments: train {spec['steps']:,} steps"
               + (f" from {init_from.name}'s weights" if init_from else "") + ", then eval test")
    start = time.perf_counter()
    resume = []
    if init_from is not None:  # weights only: the optimizer, schedule and data position start over
        # Under its own tag, so this run's final checkpoint (the same step number) never meets it.
        source = init_from / "checkpoints"
        shutil.copytree(source / (source / "latest").read_text().strip(), run_dir / "checkpoints" / "init")
        (run_dir / "checkpoints" / "latest").write_text("init")
        resume = ["--resume", "--reshard"]
    memlm(["train", str(PRESET), *overrides, "--out", str(run_dir), *resume], log, name=name, run_dir=run_dir,
          steps=spec["steps"])
    train_s = time.perf_counter() - start
    path = run_dir / "eval" / "test.json"
    memlm(["eval", str(run_dir), "--split", "test", "--json", str(path)], log, name=name)
    result = read_json(path)
    if "accuracy" not in result or not math.isfinite(result["nll"]):
        raise ExperimentError(f"{name}: the test evaluation gave no accuracy or a non-finite NLL ({path})")
    row = {"task": task, "segments": segments, "init_from": shown(init_from) if init_from else None,
           "segments_spanned": spans, "task_length": length,
           "sample_tokens": sample_tokens(task, length), "arch": arch, "label": label,
           "accuracy": result["accuracy"], "answer_nll": result["nll"], "scored_tokens": result["tokens"],
           "documents": result["documents"], "steps": spec["steps"], "train_seconds": round(train_s, 1),
           "run_dir": shown(run_dir), "load_after": load_average()}
    write_json(row_path, row)
    RUNS.finish(name, f"accuracy {row['accuracy']:.3f}, answer nll {row['answer_nll']:.3f}, {train_s / 60:.1f} min, "
                f"load {load_average()[0]}")
    return row


def curriculum(task: str, *, profile: str, work: Path, uri: str, plain_queued: bool) -> dict:
    """RMT at each segment count above CURRICULUM_FROM, started from the previous count's weights.

    plain_queued: the plain RMT run at CURRICULUM_FROM is a job of the same queue (wait for it, never train it
    twice); otherwise this chain trains it first."""
    previous = work / "runs" / f"{task}-S{CURRICULUM_FROM}-rmt"
    if plain_queued:
        while not (previous / "reproduce_row.json").is_file():
            CHILDREN.check()
            time.sleep(1)
    else:
        one_run(task, CURRICULUM_FROM, "rmt", profile=profile, work=work, uri=uri)
    row = {}
    for segments in [s for s in PROFILES[profile]["segments"] if s > CURRICULUM_FROM]:
        row = one_run(task, segments, "rmt_cur", profile=profile, work=work, uri=uri, init_from=previous)
        previous = work / "runs" / f"{task}-S{segments}-rmt_cur"
    return row


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for arch, (label, _) in ARCHS.items():
            mine = sorted((r for r in rows if r["task"] == task and r["arch"] == arch), key=lambda r: r["segments"])
            if mine:
                ax.plot([r["segments"] for r in mine], [r["accuracy"] for r in mine], marker="o", label=label)
        ax.set_title(f"{task}: answer accuracy (N = {N})")
        ax.set_xlabel("segments per sample")
        ax.set_ylabel("per-token answer accuracy")
        ax.set_ylim(0, 1.05)
        ax.set_xticks(sorted({r["segments"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--work", type=Path, help="data, runs and logs (default runs/reproduce/tasks-PROFILE)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default 2)")
    parser.add_argument("--tasks", default="copy,reverse")
    parser.add_argument("--archs", default=",".join(ARCHS), help="subset of: " + ", ".join(ARCHS))
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/reproduce_tasks_PROFILE.json)")
    add_stop_options(parser)
    args = parser.parse_args(argv)
    supervise(args)
    work = (args.work or ROOT / "runs" / "reproduce" / f"tasks-{args.profile}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    spec = PROFILES[args.profile]
    tasks, archs = args.tasks.split(","), args.archs.split(",")
    bad = [t for t in tasks if t not in ("copy", "reverse")] + [a for a in archs if a not in ARCHS]
    if bad:
        parser.error(f"unknown task or arch: {', '.join(bad)}")
    jobs = [partial(one_run, task, s, arch, profile=args.profile, work=work, uri=uri)
            for s in spec["segments"] for task in tasks for arch in archs if arch != "rmt_cur"]
    chain = [s for s in spec["segments"] if s > CURRICULUM_FROM] + ([] if "rmt" in archs else [CURRICULUM_FROM])
    RUNS.plan(len(jobs) + (len(tasks) * len(chain) if "rmt_cur" in archs else 0))
    if "rmt_cur" in archs:  # one chain per task, after the plain runs it starts from
        jobs += [partial(curriculum, task, profile=args.profile, work=work, uri=uri, plain_queued="rmt" in archs)
                 for task in tasks]
    started, load_start = time.time(), load_average()
    try:
        for task in tasks:  # data first, one at a time (the jobs below only read it)
            for s in spec["segments"]:
                prepare(task, task_length(task, s), work, spec["docs"])
        run_queue(jobs, args.jobs)
    except ExperimentError as err:
        print(f"tasks_small: error: {err}", file=sys.stderr)
        return 1
    rows = sorted((read_json(p) for p in (work / "runs").glob("*/reproduce_row.json")),
                  key=lambda r: (r["task"], r["segments"], list(ARCHS).index(r["arch"])))
    results, figures = (work, work) if args.profile == "smoke" else (RESULTS, FIGURES)
    figure = plot(rows, figures / f"reproduce_tasks_{args.profile}.png")
    out = args.out or results / f"reproduce_tasks_{args.profile}.json"
    write_result(out, {"experiment": "tasks_small", "profile": args.profile, "machine": machine(),
                     "command": f"python bench/reproduce/tasks_small.py --profile {args.profile}",
                     "preset": shown(PRESET), "steps": spec["steps"], "segment_len": N, "jobs": args.jobs,
                     "wall_minutes": round((time.time() - started) / 60, 1), "load_start": load_start,
                     "load_end": load_average(), "figure": shown(figure), "runs": rows})
    print("| task | segments | L | " + " | ".join(label for label, _ in ARCHS.values()) + " |")
    print("|---|---|---|" + "---|" * len(ARCHS))
    for task in tasks:
        for s in spec["segments"]:
            cells = [next((f"{r['accuracy']:.3f}" for r in rows if (r["task"], r["segments"], r["arch"]) ==
                          (task, s, a)), "-") for a in ARCHS]
            print(f"| {task} | {s} | {task_length(task, s)} | " + " | ".join(cells) + " |")
    print(f"wrote {out} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(run_experiment(main))
