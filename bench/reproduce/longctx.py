"""What memory does on long-context tasks: exact-match accuracy of every memory design and the no-memory baseline on
passkey and BABILong-style qa1, by segments between the fact and the question, beside what readers that do not
learn score on the same samples.

    .venv/bin/python bench/reproduce/longctx.py                   # cpu -> bench/results/reproduce_longctx_cpu.json
    .venv/bin/python bench/reproduce/longctx.py --profile gpu     # one GPU, about 8 minutes (not yet run)
    .venv/bin/python bench/reproduce/longctx.py --profile smoke   # seconds (CI): the pipeline, never the quality

Every (arch, task) is trained with `memlm curriculum` (configs/reproduce/longctx.yaml; the archs differ only in their
memory keys, ARCHS): stage 1 holds fact and question in one segment, where every model, the no-memory one included,
must learn the task; then 2, 4, 8 segments, the fact always in the first, each stage from the previous weights,
B whole samples per step, a constant rate after warmup, and each stage ending on its held-out answers (learned, a
plateau, or the cap: trainer/loop/curriculum_stop.py). Then bench/reproduce/longctx_eval.py scores each stage's
model on the stage's own test split (fresh samples), bucketing every sample by its measured distance, with chance and
the heuristics of trainer/inference/longeval_baselines.py on the same samples. BABILong-style: bAbI-like facts in
WikiText-2 background, sizes in bytes, a smaller world than bAbI's and far smaller models than the papers': the
numbers cannot be set beside published BABILong figures. A finished curriculum or evaluation is not redone:
rerunning continues.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, WIKITEXT2, load_average, write_result
from memlm.bench.reproduce.children import CHILDREN
from memlm.bench.reproduce.experiment import (
    FIGURES,
    ExperimentError,
    add_stop_options,
    job_env,
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

PRESET = ROOT / "configs" / "reproduce" / "longctx.yaml"
# arch -> its memory keys on top of the preset (N = M = 128: Transformer-XL and LaMemo cache one segment; RMT and
# ARMT 8 memory tokens; their BPTT is the curriculum's, through the whole sample).
ARCHS = {
    "transformer": ["model.arch=transformer", "model.mem_len=0"],
    "txl": ["model.arch=txl"],
    "lamemo": ["model.arch=lamemo"],
    "rmt": ["model.arch=rmt", "model.mem_len=0", "model.num_mem_tokens=8"],
    "armt": ["model.arch=armt", "model.mem_len=0", "model.num_mem_tokens=8", "model.assoc_dim=16",
             "model.assoc_value_init_std=0.02"],
    "compressive": ["model.arch=compressive", "model.compressed_len=128", "model.compression_rate=4"],
    "infinite_former": ["model.arch=infinite_former", "model.ltm_basis=64", "model.ltm_samples=128",
                        "model.ltm_sticky=true"],
}
LABELS = {"transformer": "no memory (Transformer+RPE)", "txl": "Transformer-XL (M = N)", "lamemo": "LaMemo (M = N)",
          "rmt": "RMT (8 memory tokens)", "armt": "ARMT (8 memory tokens)",
          "compressive": "Compressive (M = N, 128 compressed)", "infinite_former": "∞-former (M = N, 64 basis)"}
BASELINE_LABELS = {"chance": "chance", "last_mentioned": "last place mentioned", "most_frequent": "most frequent place",
                   "question_place_known": "question's place known"}
# task -> its curriculum options: qa1 with one distractor, so stage 1's segment of 128 bytes holds the whole story
# (the background folder, WikiText-2, is the script's --background)
TASKS = {"passkey": [], "qa1": ["--task-option", "facts=2"]}
PROFILES = {
    # About 1 1/2 hours on 2 quiet cores, two curricula at a time: d 64, 2 layers, N = 128 bytes, 8 lanes; stages of
    # 1, 2, 4 and 8 segments (128 to 1,024 bytes) capped at 5,000, 1,500, 1,000 and 500 steps (a step costs its
    # segments). Stage 0 never ends on a plateau: every model must learn it, and its jump comes late (the first
    # attempt's cap of 3,000 cut the no-memory model's passkey at 38%, rising from step 2,000). Later stages end on a
    # plateau after 2 checks of 250 steps without a gain; 100 held-out samples a check, 200 test samples a stage.
    "cpu": {"archs": "transformer,txl,lamemo,rmt,armt", "segments": "1,2,4,8", "steps": "5000,1500,1000,500",
            "min_steps": "5000,250,250,250", "check_every": 250, "check_samples": 100, "patience": 2,
            "docs": "4000,100,200", "overrides": []},
    # One H100, about 8 minutes (estimated, not yet run): every arch, up to 16 segments (2,048 bytes), d 128, 32
    # lanes; all 14 curricula at once, one process and CPU thread each (the machine has 16 cores) on the one GPU,
    # where a tiny model's step is launch-bound (~20 ms): caps of 3,000 + 1,000 x 2 + 750 x 4 + 500 x 8 + 500 x 16
    # micro-batches, 20,000 a curriculum, about 7 minutes, plus preparing 8,000 samples a stage.
    "gpu": {"archs": ",".join(ARCHS), "segments": "1,2,4,8,16", "steps": "3000,1000,750,500,500",
            "min_steps": "3000,250,250,250,250", "check_every": 250, "check_samples": 200, "patience": 2,
            "docs": "8000,200,400", "jobs": 14,
            "overrides": ["model.d_model=128", "model.d_head=32", "model.d_inner=512", "data.batch_size=32"]},
    # The memory-token archs given the room the cpu profile lacks at 4 and 8 segments (about 50 minutes on 2 quiet
    # cores, passkey): a gentler curriculum (3 and 6 segments between), 2,000 steps at 3 to 6 segments, no plateau
    # before step 1,000 of those stages.
    "cpu_long": {"archs": "rmt,armt", "tasks": "passkey", "segments": "1,2,3,4,6,8",
                 "steps": "5000,1500,2000,2000,2000,1000", "min_steps": "5000,250,1000,1000,1000,500",
                 "check_every": 250, "check_samples": 100, "patience": 3, "docs": "4000,100,200", "overrides": []},
    "smoke": {"archs": "transformer,armt", "segments": "1,2", "steps": "2", "min_steps": "0", "check_every": 2,
              "check_samples": 2, "patience": 3, "docs": "16,2,4",
              "overrides": ["data.batch_size=4", "train.warmup_steps=0", "train.log_every=1"]},
}


def one_run(arch: str, task: str, *, profile: str, work: Path, uri: str, background: Path) -> dict:
    """Train (arch, task) through the curriculum and score its stages; returns the evaluation."""
    spec = PROFILES[profile]
    return curriculum_run(arch, task, spec=spec, preset=PRESET, overrides=spec["overrides"] + ARCHS[arch] + [
        f"tracking.uri={uri}", "tracking.experiment=memlm-reproduce-longctx"], work=work, background=background)


def curriculum_run(arch: str, task: str, *, spec: dict, preset: Path, overrides: list[str], work: Path,
                   background: Path, name: str | None = None) -> dict:
    """`memlm curriculum PRESET OVERRIDES` on TASK with the profile SPEC's stages and stop rule into
    WORK/runs/NAME, then its evaluation (evaluate_curriculum); a finished one is read back (also the experiment of
    bench/reproduce/pretrained_longctx.py)."""
    name = name or f"{arch}-{task}"
    out, log, result = work / "runs" / name, work / "logs" / f"{name}.log", work / "eval" / f"{name}.json"
    if result.is_file():
        RUNS.skip(name)
        return {"arch": arch, "task": task, "skipped": True, **with_records(read_json(result), out)}
    RUNS.start(name, f"curriculum over {spec['segments']} segments, at most {spec['steps']} steps a stage, then "
                     "the test samples of every stage")
    seconds = memlm(["curriculum", str(preset), *overrides, "--task", task, *TASKS[task],
                     *curriculum_flags(spec, task, background), "--out", str(out)], log, name=name)
    return evaluate_curriculum(arch, task, out, log, result, seconds, name)


def curriculum_flags(spec: dict, task: str, background: Path, **stage: str) -> list[str]:
    """The curriculum's options of profile SPEC (STAGE replaces --segments, --steps or --min-steps)."""
    flags = {"segments": spec["segments"], "steps": spec["steps"], "min_steps": spec["min_steps"], **stage}
    return [*(["--background", str(background)] if task != "passkey" else []), "--segments", flags["segments"],
            "--steps", flags["steps"], "--check-every", str(spec["check_every"]), "--check-samples",
            str(spec["check_samples"]), "--patience", str(spec["patience"]), "--min-steps", flags["min_steps"],
            "--docs", spec["docs"]]


def evaluate_curriculum(arch: str, task: str, out: Path, log: Path, result: Path, seconds: float, name: str) -> dict:
    """Score the stages of curriculum folder OUT (longctx_eval.py, a child process) into RESULT; its row."""
    with open(log, "a") as handle:
        command = [sys.executable, str(Path(__file__).with_name("longctx_eval.py")), str(out), "--json", str(result)]
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        code = CHILDREN.run(command, stdout=handle, cwd=ROOT, env=job_env(1), name=name, what="eval")
    if code:
        raise ExperimentError(f"the evaluation of {out} failed with exit {code} (log: {log})")
    evaluated = read_json(result)
    evaluated["train_seconds"] = round(seconds, 1)
    result.write_text(json.dumps(evaluated, indent=1) + "\n")
    own = ", ".join(f"{row['segments']}: {100 * row['own']['accuracy']:.0f}%" for row in evaluated["stages"])
    RUNS.finish(name, f"trained in {seconds / 60:.1f} min (load {load_average()[0]}); accuracy by segments {own}")
    return {"arch": arch, "task": task, **with_records(evaluated, out)}


def with_records(evaluated: dict, out: Path) -> dict:
    """Two figures beside the evaluation, per stage. The held-out answer loss at the stage's last check
    (OUT/curriculum.json): where exact match is 0 it still says whether some of the answer came across (passkey:
    ln 10 = 2.30 nats a digit is none). For QA, the most a reader of where the question sits (the prompt's length)
    can score on the test samples: a model without memory reads that place in its last segment. The generator sizes
    every prompt for the longest answer, so this is the most frequent answer's share; samples of exactly S x N bytes,
    as before, gave the answer's length away there (52-53% on qa1)."""
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.curriculum_samples import read_split
    from memlm.trainer.loop.curriculum_stop import StopRule, stage_record

    records = {r["stage"]: r for r in read_json(out / "curriculum.json")["stages"]}
    for row in evaluated["stages"]:
        record = records[row["stage"]]
        row["held_out_answer_nll"] = record.get("answer_nll")
        # How the stage ended, from its checks under the rule as it stands (a plateau found at the last check,
        # the cap's, was recorded as one before the rule said that the cap ends such a stage).
        ended = stage_record(StopRule(**record["rule"]), Path(record["run_dir"]), row["stop_step"])
        row["stop"], row["stop_reason"] = ended["stop"], ended["reason"]
        if evaluated["task"] != "passkey":
            data = load_config(Path(record["run_dir"]) / "config.yaml").data.path
            row["baselines"]["question_place_known"] = question_place_known(read_split(data, "test"))
    return evaluated


def question_place_known(samples: list) -> float:
    """Accuracy of the best reader of the prompt's length alone, fit to these samples: for each prompt length, the
    answer most often found there (an upper bound for any rule that reads only where the question sits)."""
    answers_at: dict[int, Counter] = {}
    for tokens, answer_len in samples:
        prompt_length = len(tokens) - answer_len - 1  # the sample is prompt, SEP, answer
        answers_at.setdefault(prompt_length, Counter())[bytes(tokens[-answer_len:].astype("uint8"))] += 1
    return sum(max(counts.values()) for counts in answers_at.values()) / len(samples)


def table(runs: list[dict], labels: dict[str, str], which: str = "own") -> list[str]:
    """Markdown: accuracy (%) by segments from fact to question, a row per arch, then the baselines."""
    segments = [row["segments"] for row in runs[0]["stages"]]
    lines = ["| " + ("model after the stage" if which == "own" else "the last stage's model") + " | "
             + " | ".join(f"{s} seg." for s in segments) + " |", "|---|" + "---|" * len(segments)]
    for run in runs:
        cells = [f"{100 * row[which]['accuracy']:.0f}" for row in run["stages"]]
        lines.append(f"| {labels[run['arch']]} | " + " | ".join(cells) + " |")
    baselines = runs[0]["stages"]
    for name, label in BASELINE_LABELS.items():
        if name in baselines[0]["baselines"]:
            value = [row["baselines"][name] for row in baselines]
            lines.append(f"| *{label}* | " + " | ".join(f"*{100 * v:.{3 if v < 0.01 else 0}f}*" for v in value) + " |")
    return lines


def stops(runs: list[dict], labels: dict[str, str]) -> list[str]:
    """Markdown: how each stage ended (learned / plateau / budget), at which step, and its held-out answer loss."""
    segments = [row["segments"] for row in runs[0]["stages"]]
    lines = ["| stage ended (step; held-out answer loss, nats a byte) | " + " | ".join(f"{s} seg." for s in segments)
             + " |", "|---|" + "---|" * len(segments)]
    for run in runs:
        cells = [f"{row['stop']} @ {row['stop_step']:,}"
                 + (f"; {row['held_out_answer_nll']:.2f}" if row.get("held_out_answer_nll") is not None else "")
                 for row in run["stages"]]
        lines.append(f"| {labels[run['arch']]} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict[str, list[dict]], labels: dict[str, str] = LABELS) -> str:
    """The tables of every task (bench/report.py renders REPORT.md's from the JSON with them)."""
    lines = []
    for task, runs in results.items():
        samples = runs[0]["stages"][0]["own"]["samples"]
        lines += [f"{task}: exact-match accuracy (%) by segments from fact to question, each stage's model on the "
                  f"stage's {samples} test samples (baselines in italics, on the same samples)", "",
                  *table(runs, labels), "", f"{task}: the last stage's model on the same samples", "",
                  *table(runs, labels, "final"), "", *stops(runs, labels), ""]
    return "\n".join(lines)


def plot(task: str, runs: list[dict], path: Path, labels: dict[str, str] = LABELS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    segments = [row["segments"] for row in runs[0]["stages"]]
    for run in runs:
        ax.plot(segments, [100 * row["own"]["accuracy"] for row in run["stages"]], marker="o",
                label=labels[run["arch"]])
    for (name, label), style in zip(BASELINE_LABELS.items(), (":", "--", "-.", (0, (1, 4)))):
        if name in runs[0]["stages"][0]["baselines"]:
            ax.plot(segments, [100 * row["baselines"][name] for row in runs[0]["stages"]], linestyle=style,
                    color="grey", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(segments, [str(s) for s in segments])
    ax.set_ylim(-3, 103)
    ax.set_xlabel("segments from fact to question (both counted)")
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title(f"{task}: each stage's model on its own test samples")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--work", type=Path, help="runs, data and logs (default runs/reproduce/longctx-PROFILE)")
    parser.add_argument("--jobs", type=int, help="curricula at a time, one thread each (default 2; gpu 14)")
    parser.add_argument("--archs", help="comma-separated subset of: " + ", ".join(ARCHS) + " (default: the profile's)")
    parser.add_argument("--tasks", help="comma-separated subset of: " + ", ".join(TASKS) + " (default: the profile's, "
                        "else all)")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/reproduce_longctx_PROFILE.json)")
    parser.add_argument("--background", type=Path, default=WIKITEXT2,
                        help=f"qa1's WikiText folder (default {WIKITEXT2})")
    add_stop_options(parser)
    args = parser.parse_args(argv)
    supervise(args)
    spec = PROFILES[args.profile]
    archs = (args.archs or spec["archs"]).split(",")
    tasks = (args.tasks or spec.get("tasks") or ",".join(TASKS)).split(",")
    for given, known, flag in ((archs, ARCHS, "--archs"), (tasks, TASKS, "--tasks")):
        if set(given) - set(known):
            parser.error(f"{flag}: unknown {', '.join(sorted(set(given) - set(known)))}; valid: {', '.join(known)}")
    work = (args.work or ROOT / "runs" / "reproduce" / f"longctx-{args.profile}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    started, load_start = time.time(), load_average()
    try:
        jobs = [lambda a=a, t=t: one_run(a, t, profile=args.profile, work=work, uri=uri, background=args.background)
                for t in tasks for a in archs]
        RUNS.plan(len(jobs))
        done = run_queue(jobs, args.jobs or spec.get("jobs", 2))
    except ExperimentError as err:
        print(f"longctx: error: {err}", file=sys.stderr)
        return 1
    results = {task: [r for r in done if r["task"] == task] for task in tasks}
    results_dir, figures = (work, work) if args.profile == "smoke" else (RESULTS, FIGURES)
    out = args.out or results_dir / f"reproduce_longctx_{args.profile}.json"
    shown_figures = {}
    for task, runs in results.items():
        path = plot(task, runs, figures / f"{out.stem}_{task}.png")
        shown_figures[path.stem] = shown(path)
    timing = {"machine": machine(), "command": " ".join(["python bench/reproduce/longctx.py",
                                                         *(sys.argv[1:] if argv is None else argv)]),
              "wall_minutes": round((time.time() - started) / 60, 1), "load_start": load_start,
              "load_end": load_average()}
    if all(r.get("skipped") for r in done) and out.is_file():
        # A rerun that trained and scored nothing (it only redrew the tables): the time and machine stay those of
        # the run that did.
        timing = {key: read_json(out).get(key, value) for key, value in timing.items()}
    for r in done:
        r.pop("skipped", None)
    write_result(out, {"experiment": "longctx", "version": 2, "profile": args.profile, **timing,
                       "preset": str(PRESET.relative_to(ROOT)), "spec": spec, "tasks": {t: TASKS[t] for t in tasks},
                       "archs": {a: ARCHS[a] for a in archs}, "labels": {a: LABELS[a] for a in archs},
                       "figures": shown_figures,
                       "train_seconds": {f"{r['arch']}-{r['task']}": r.get("train_seconds") for r in done},
                       "results": results})
    sys.stdout.write(markdown(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_experiment(main))
