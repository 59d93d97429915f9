"""Long-context accuracy: Transformer-XL, LaMemo, RMT and ARMT trained at short lengths on passkey and BABILong-style
QA1, tested up to 32x the longest trained length.

    .venv/bin/python bench/reproduce/longctx.py                   # cpu -> bench/results/reproduce_longctx_cpu.json
    .venv/bin/python bench/reproduce/longctx.py --profile gpu     # a GPU: wider model, longer curriculum
    .venv/bin/python bench/reproduce/longctx.py --profile smoke   # seconds (CI): the pipeline, never the quality

Every (arch, task) is trained with `memlm curriculum` (configs/reproduce/longctx.yaml; segments per sample grow
stage by stage, each stage from the previous one's weights, the BABILong / ARMT recipe), at equal steps and equal
tokens: the archs differ only in their memory keys (ARCHS). Then `memlm longeval` scores every final stage on
fresh test samples at lengths from the longest trained one up to 32x it, over depth windows (where in the
background the facts are), one Ray task per (run, length). BABILong-style: the QA background is WikiText-2 (bytes),
not PG-19. The JSON holds every run's accuracy by length and depth; the figures are the longeval heatmaps and an
accuracy-against-length plot per task. A finished stage or evaluation is not redone: rerunning continues.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: bench.*, memlm

from bench.common import RESULTS, ROOT, WIKITEXT2, load_average, write_result  # noqa: E402
from bench.reproduce.experiment import (  # noqa: E402
    FIGURES,
    ExperimentError,
    add_stop_options,
    machine,
    memlm,
    read_json,
    run_experiment,
    run_queue,
    shown,
    supervise,
)
from bench.reproduce.progress import RUNS  # noqa: E402

PRESET = ROOT / "configs" / "reproduce" / "longctx.yaml"
# arch -> its memory keys on top of the preset (equal size otherwise: RMT / ARMT memory tokens = 8)
ARCHS = {
    "txl": ["model.arch=txl"],
    "lamemo": ["model.arch=lamemo"],
    "rmt": ["model.arch=rmt", "model.mem_len=0", "model.num_mem_tokens=8", "model.bptt_depth=2"],
    "armt": ["model.arch=armt", "model.mem_len=0", "model.num_mem_tokens=8", "model.bptt_depth=2",
             "model.assoc_dim=16", "model.assoc_value_init_std=0.02"],
}
TASKS = ("passkey", "qa1")
PROFILES = {
    # About an hour on 2 cores: 3 stages of 3,000 steps (2, 4 and 8 segments of 64 bytes per sample: a passkey
    # sentence and its question need about 90), then lengths 512 (the longest trained) .. 16k bytes
    # (32x), 4 depth windows x 10 samples each.
    "cpu": {"segments": "2,4,8", "steps": 3000, "docs": "4000,50,50", "lengths": "512,1k,2k,4k,8k,16k",
            "depths": 4, "samples": 10, "overrides": []},
    "gpu": {"segments": "1,2,4,8,16", "steps": 5000, "docs": "20000,200,200", "lengths": "1k,2k,4k,8k,16k,32k",
            "depths": 5, "samples": 50, "overrides": [
                "model.n_layer=4", "model.d_model=128", "model.d_head=32", "model.d_inner=512", "model.tgt_len=64",
                "data.batch_size=32"]},
    "smoke": {"segments": "2,4", "steps": 2, "docs": "16,4,4", "lengths": "256,512", "depths": 2, "samples": 2,
              "overrides": ["train.warmup_steps=0", "train.log_every=1"]},
}


def one_run(arch: str, task: str, *, profile: str, work: Path, uri: str) -> dict:
    """Train (arch, task) through the curriculum; returns where its last stage is."""
    spec = PROFILES[profile]
    name = f"{arch}-{task}"
    out, log = work / "runs" / name, work / "logs" / f"{name}.log"
    last = out / f"stage{len(spec['segments'].split(',')) - 1}-{spec['segments'].split(',')[-1]}seg"
    if (last / "checkpoints" / "latest").is_file():
        RUNS.skip(name)
        return {"arch": arch, "task": task, "run_dir": last}
    RUNS.start(name, f"curriculum over {spec['segments']} segments, {spec['steps']:,} steps per stage")
    overrides = spec["overrides"] + ARCHS[arch] + [f"tracking.uri={uri}", "tracking.experiment=memlm-reproduce-longctx"]
    background = ["--background", str(WIKITEXT2)] if task.startswith("qa") else []
    seconds = memlm(["curriculum", str(PRESET), *overrides, "--task", task, *background, "--segments",
                     spec["segments"], "--steps", str(spec["steps"]), "--docs", spec["docs"], "--out", str(out)],
                    log, name=name)
    RUNS.finish(name, f"trained in {seconds / 60:.1f} min, load {load_average()[0]}")
    return {"arch": arch, "task": task, "run_dir": last, "train_seconds": round(seconds, 1)}


def evaluate(task: str, runs: list[dict], *, profile: str, work: Path, uri: str, cpus: int) -> dict:
    spec = PROFILES[profile]
    out = work / f"longeval-{task}"
    name = f"longeval-{task}"
    RUNS.start(name, f"{len(runs)} runs at lengths {spec['lengths']}")
    background = ["--background", str(WIKITEXT2)] if task.startswith("qa") else []
    memlm(["longeval", *[str(r["run_dir"]) for r in runs], "--task", task, *background, "--lengths",
           spec["lengths"], "--depths", str(spec["depths"]), "--samples", str(spec["samples"]), "--out", str(out),
           "--uri", uri, "--experiment", "memlm-reproduce-longctx-eval", "--num-cpus", str(cpus)],
          work / "logs" / f"{name}.log", threads=cpus, name=name)
    RUNS.finish(name, "evaluated")
    return read_json(out / "summary.json")


def markdown(results: dict[str, dict]) -> str:
    lines = []
    for task, summary in results.items():
        lengths = summary["lengths"]
        lines.append(f"{task}: answer accuracy (%) by sample length in tokens, all depths "
                     f"({summary['depths']} windows x {summary['samples_per_depth']} samples each)")
        lines.append("| arch | " + " | ".join(str(n) for n in lengths) + " |")
        lines.append("|---|" + "---|" * len(lengths))
        for run in summary["runs"].values():
            acc = {r["length"]: r["accuracy"] for r in run["results"]}
            lines.append(f"| {run['arch']} | " + " | ".join(f"{100 * acc[n]:.0f}" if n in acc else "-"
                                                          for n in lengths) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--work", type=Path, help="runs, data and logs (default runs/reproduce/longctx-PROFILE)")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at a time, one thread each (default 2)")
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated subset of: " + ", ".join(ARCHS))
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset of: " + ", ".join(TASKS))
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/reproduce_longctx_PROFILE.json)")
    add_stop_options(parser)
    args = parser.parse_args(argv)
    supervise(args)
    archs, tasks = args.archs.split(","), args.tasks.split(",")
    for given, known, flag in ((archs, ARCHS, "--archs"), (tasks, TASKS, "--tasks")):
        if set(given) - set(known):
            parser.error(f"{flag}: unknown {', '.join(sorted(set(given) - set(known)))}; valid: {', '.join(known)}")
    work = (args.work or ROOT / "runs" / "reproduce" / f"longctx-{args.profile}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    started, load_start = time.time(), load_average()
    try:
        jobs = [lambda a=a, t=t: one_run(a, t, profile=args.profile, work=work, uri=uri) for t in tasks for a in archs]
        RUNS.plan(len(jobs) + len(tasks))
        trained = run_queue(jobs, args.jobs)
        results = {task: evaluate(task, [r for r in trained if r["task"] == task], profile=args.profile, work=work,
                                  uri=uri, cpus=args.jobs) for task in tasks}
    except ExperimentError as err:
        print(f"longctx: error: {err}", file=sys.stderr)
        return 1
    results_dir, figures = (work, work) if args.profile == "smoke" else (RESULTS, FIGURES)
    out = args.out or results_dir / f"reproduce_longctx_{args.profile}.json"
    shown_figures = {}
    for task in tasks:  # longeval's plots, copied beside the other experiments' figures
        source = work / f"longeval-{task}"
        for path in [source / "accuracy.png", *sorted(source.glob("*/heatmap.png"))]:
            target = figures / f"{out.stem}_{task}_{path.parent.name if path.name == 'heatmap.png' else 'accuracy'}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
            shown_figures[target.stem] = shown(target)
    write_result(out, {"experiment": "longctx", "profile": args.profile, "machine": machine(),
                       "command": " ".join(["python bench/reproduce/longctx.py",
                                            *(sys.argv[1:] if argv is None else argv)]),
                       "preset": str(PRESET.relative_to(ROOT)), "spec": PROFILES[args.profile], "archs": ARCHS,
                       "wall_minutes": round((time.time() - started) / 60, 1), "load_start": load_start,
                       "load_end": load_average(), "figures": shown_figures,
                       "train_seconds": {f"{r['arch']}-{r['task']}": r.get("train_seconds") for r in trained},
                       "results": results})
    sys.stdout.write(markdown(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_experiment(main))
