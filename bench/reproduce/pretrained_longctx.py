"""Memory on a pretrained backbone, the whole flow measured (issue 37 item 7): a small GPT-2-shaped model trained on
WikiText-2 through memlm, saved as a Hugging Face folder, given RMT or ARMT memory and fine-tuned on passkey and
qa1 with the curriculum, beside the backbone alone, segment by segment and with its full context.

    .venv/bin/python bench/reproduce/pretrained_longctx.py                  # cpu, 30 minutes on 2 quiet cores
    .venv/bin/python bench/reproduce/pretrained_longctx.py --profile gpu    # one GPU, about 8 minutes (estimated)
    .venv/bin/python bench/reproduce/pretrained_longctx.py --profile smoke  # the pipeline only (tests), no longeval

Results: bench/results/reproduce_pretrained_longctx_PROFILE.json and its figures (smoke: in --work).

1. The backbone: `memlm train configs/reproduce/pretrained_backbone.yaml` (arch hf, a random GPT-2 of 2 layers and
   width 64 given inline, 1,024 positions) on WikiText-2 in bytes, segments of 1,024 bytes, then `memlm eval --split
   test` (its bits per byte) and `memlm export RUN --out WORK/backbone --hf-backbone`: a save_pretrained folder.
   Bytes, not a BPE: the long-context tasks are made in bytes, so the lengths, the segments (N = 128 bytes) and the
   samples are those of bench/reproduce/longctx.py's from-scratch models of the same widths, and the tables sit
   beside each other. (With a backbone whose folder has a tokenizer.json, `memlm curriculum` and `longeval` make the
   samples in its tokens instead: README, "Long-context accuracy".)
2. `memlm curriculum configs/reproduce/pretrained_longctx.yaml model.backbone=WORK/backbone` per (arch, task), the
   stages and stop rule of longctx.py's machinery (curriculum_run; passkey, qa1 with one distractor): hf_rmt and
   hf_armt (8 memory tokens, the backbone trained whole; --archs hf_rmt_frozen / hf_rmt_lora for the variants), and
   `hf`, the backbone alone reading every segment by itself.
3. The upper bound, `hf_full`: the backbone alone with the whole sample in one segment. Run with the curriculum, one
   stage at a time: stage S is `memlm curriculum ... model.tgt_len=S x 128 --segments 1` with the depth window of
   the memory stages' S-segment samples given (--task-option depth_min/depth_max), so its samples are theirs (the
   script checks the prepared options), from the previous stage's weights (train.init_from); at 1 segment it is
   the `hf` curriculum's own first stage (the same model on the same samples), whose weights the 2-segment stage
   starts from.
4. Every stage's model on its stage's test samples, bucketed by measured segments from fact to question, with the
   baselines (longctx_eval.py, as longctx.py scores); then `memlm longeval` on each arch's last model at every
   stage's length (fresh samples, the fact anywhere), the no-memory backbone beside it.

A finished step is not redone: rerunning continues. Ctrl-C stops everything in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, WIKITEXT2, load_average, write_result
from memlm.bench.reproduce import longctx
from memlm.bench.reproduce.experiment import (
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
from memlm.bench.reproduce.progress import RUNS
from memlm.bench.reproduce.wikitext2 import smoke_corpus

BACKBONE_PRESET = ROOT / "configs" / "reproduce" / "pretrained_backbone.yaml"
PRESET = ROOT / "configs" / "reproduce" / "pretrained_longctx.yaml"
EXPERIMENT = "memlm-reproduce-pretrained-longctx"
RMT = ["model.arch=hf_rmt", "model.num_mem_tokens=8"]
# arch -> its keys on top of the preset and the backbone folder. ARMT's W_v starts at zero as its authors start it
# on a pretrained backbone (assoc_value_init_std 0, the default): the wrapped model starts as the backbone.
ARCHS = {
    "hf_rmt": RMT,
    "hf_armt": ["model.arch=hf_armt", "model.num_mem_tokens=8", "model.assoc_dim=16"],
    "hf": ["model.arch=hf"],
    "hf_full": ["model.arch=hf"],  # one segment of S x N: full_context_run
    "hf_rmt_frozen": [*RMT, "model.backbone_train=frozen"],
    "hf_rmt_lora": [*RMT, "model.backbone_train=lora"],
}
LABELS = {"hf_rmt": "hf_rmt: RMT, 8 memory tokens", "hf_armt": "hf_armt: ARMT, 8 memory tokens",
          "hf": "hf: backbone alone, no memory", "hf_full": "hf: backbone alone, full context",
          "hf_rmt_frozen": "hf_rmt, backbone frozen", "hf_rmt_lora": "hf_rmt, LoRA rank 8"}
TASKS = longctx.TASKS
PROFILES = {
    # About 50 minutes on 2 quiet cores, every stage at its cap (estimated from timed steps, not yet run:
    # bench/README.md). The backbone: 1,500 steps of 4 x 1,024 bytes (6 M bytes, half an epoch of WikiText-2) with 2
    # threads, about 6 minutes. Then two curricula at a time, one thread each: stages of 1, 2, 4, 8 segments capped at
    # 2,500 / 750 / 500 / 250 steps (the from-scratch experiment's 5,000 / 1,500 / 1,000 / 500: a backbone that reads
    # text already may learn the one-segment task sooner, which ends the stage), no plateau before the cap at 1
    # segment, after 2 checks of 250 steps without a gain later; about 40 minutes for the 6 jobs.
    "cpu": {"pretrain": {"threads": 2, "overrides": []},
            "archs": "hf_rmt,hf_armt,hf,hf_full", "segments": "1,2,4,8", "steps": "2500,750,500,250",
            "min_steps": "2500,250,250,250", "check_every": 250, "check_samples": 100, "patience": 2,
            "docs": "4000,100,200", "overrides": [], "longeval": {"samples": 25}},
    # One H100, about 8 minutes (estimated, not yet run): a backbone of 4 layers and width 128 with 2,048 positions
    # pretrained for 3,000 steps of 16 x 2,048 bytes in bf16 (a launch-bound tiny model, ~25 ms a step: 75 s), then
    # every arch, the LoRA and frozen variants included, up to 16 segments, 32 lanes, 10 jobs at once (12 curricula:
    # hf_full runs in hf's job; one process and CPU thread each on the one GPU; caps of 2,000 + 750 x 2 + 500 x 4 +
    # 300 x 8 + 300 x 16 = 12,700 segment passes a curriculum at ~15 ms, about 5 minutes), then memlm longeval.
    "gpu": {"pretrain": {"threads": 4, "overrides": [
                "model.backbone_config.n_layer=4", "model.backbone_config.n_embd=128",
                "model.backbone_config.n_inner=512", "model.backbone_config.n_positions=2048", "model.tgt_len=2048",
                "data.batch_size=16", "train.steps=3000", "deepspeed.precision=bf16"]},
            "archs": ",".join(ARCHS), "segments": "1,2,4,8,16", "steps": "2000,750,500,300,300",
            "min_steps": "2000,250,250,150,150", "check_every": 50, "check_samples": 200, "patience": 3,
            "docs": "8000,200,400", "jobs": 10, "overrides": ["data.batch_size=32", "deepspeed.precision=bf16"],
            "longeval": {"samples": 50}},
    # Seconds of work in nine processes: every step of the flow but memlm longeval (its Ray start alone costs the
    # smoke's time; tests/cluster/test_longeval.py runs it), nothing tracked. The no-memory curriculum and hf_full
    # only: a memory arch's curriculum on a backbone is the same function with other keys, run by
    # tests/trainer/loop/test_backbone_tokens_tasks.py (hf_rmt), and every arch's keys are loaded by
    # tests/bench/test_pretrained_longctx_smoke.py.
    "smoke": {"pretrain": {"threads": 1, "overrides": ["train.steps=2", "train.warmup_steps=0", "data.batch_size=2",
                                                       "train.eval_every=0", "train.save_every=0",
                                                       "train.log_every=1", "tracking.enabled=false"]},
              "archs": "hf,hf_full", "segments": "1,2", "steps": "2", "min_steps": "0", "check_every": 2,
              "check_samples": 2, "patience": 3, "docs": "16,2,4",
              "overrides": ["data.batch_size=4", "train.warmup_steps=0", "train.log_every=1",
                            "tracking.enabled=false"], "longeval": None},
}


def pretrain(spec: dict, work: Path, uri: str, source: Path) -> dict:
    """The backbone: WikiText-2 in bytes, `memlm train`, its test bits per byte, the --hf-backbone export."""
    record = work / "eval" / "backbone.json"
    if record.is_file():
        RUNS.skip("backbone")
        return read_json(record)
    data, run, folder = work / "data" / "wikitext-2-bytes", work / "runs" / "backbone", work / "backbone"
    log = work / "logs" / "backbone.log"
    RUNS.start("backbone", f"memlm train {shown(BACKBONE_PRESET)} on WikiText-2 bytes, eval test, export "
                           "--hf-backbone")
    if not (data / "manifest.json").is_file():
        memlm(["prepare", "--corpus", "wikitext", "--input", str(source), "--out", str(data), "--tokenizer", "bytes",
               "--workers", "1", "--overwrite"], log, name="backbone")
    from memlm.trainer.config.run_config import load_config

    steps = load_config(BACKBONE_PRESET, spec["overrides"]).train.steps
    seconds = memlm(["train", str(BACKBONE_PRESET), f"data.path={data}", f"tracking.uri={uri}",
                     f"tracking.experiment={EXPERIMENT}", *spec["overrides"], "--out", str(run),
                     *(["--resume"] if (run / "checkpoints").is_dir() else [])],
                    log, spec["threads"], name="backbone", run_dir=run, steps=steps)
    test = work / "eval" / "backbone-test.json"
    memlm(["eval", str(run), "--split", "test", "--json", str(test)], log, spec["threads"], name="backbone")
    memlm(["export", str(run), "--out", str(folder), "--hf-backbone", "--overwrite"], log, name="backbone")
    evaluated = read_json(test)
    done = {"run": shown(run), "folder": shown(folder), "steps": steps, "train_seconds": round(seconds, 1),
            "test": {key: evaluated[key] for key in ("tokens", "nll", "bpc", "tgt_len", "step")}}
    record.write_text(json.dumps(done, indent=1) + "\n")
    RUNS.finish("backbone", f"trained in {seconds / 60:.1f} min; WikiText-2 test {evaluated['bpc']:.3f} bits per "
                            "byte")
    return done


def task_options(task: str, background: Path) -> dict:
    """The curriculum's --task-option pairs of TASKS[task] (and the background) as `memlm curriculum` reads them."""
    flags = TASKS[task]
    options = dict(flags[i + 1].split("=", 1) for i in range(0, len(flags), 2))
    return {**options, **({"background": str(background)} if task != "passkey" else {})}


def full_context_run(task: str, no_memory: dict, *, spec: dict, overrides: list[str], work: Path,
                     background: Path) -> dict:
    """The backbone alone with each stage's whole sample in one segment (module docstring, 3), after the `hf`
    curriculum NO_MEMORY, whose first stage is its own; scored as every curriculum is."""
    from memlm.trainer.loop.curriculum import parse_docs, parse_segments, per_stage
    from memlm.trainer.loop.curriculum_samples import stage_options

    name = f"hf_full-{task}"
    out, log, result = work / "runs" / name, work / "logs" / f"{name}.log", work / "eval" / f"{name}.json"
    if result.is_file():
        RUNS.skip(name)
        return {"arch": "hf_full", "task": task, "skipped": True, **longctx.with_records(read_json(result), out)}
    segments = parse_segments(spec["segments"])
    caps, firsts = (per_stage(flag, spec[key], len(segments)) for flag, key in (("--steps", "steps"),
                                                                                ("--min-steps", "min_steps")))
    hf = read_json(work / "runs" / f"hf-{task}" / "curriculum.json")
    N = hf["tgt_len"]
    if segments[0] != 1 or hf["segments"] != segments:
        raise ExperimentError(f"hf_full starts from the hf curriculum's one-segment stage: give --segments 1,... "
                              f"(the hf curriculum of {task} ran {hf['segments']})")
    RUNS.start(name, f"one segment of S x {N} bytes for S in {spec['segments']}, each from the previous stage")
    records, seconds = [{**hf["stages"][0], "stage": 0}], 0.0
    for k, S in list(enumerate(segments))[1:]:
        options = stage_options(task, {**task_options(task, background), "docs": parse_docs(spec["docs"]),
                                       "seed": 0}, S, N)
        stage = out / f"{S}seg"
        window = ["--task-option", f"depth_min={options['depth_min']!r}", "--task-option",
                  f"depth_max={options['depth_max']!r}"]
        seconds += memlm(["curriculum", str(PRESET), *overrides, f"model.tgt_len={S * N}",
                          f"train.init_from={records[-1]['run_dir']}", "--task", task, *TASKS[task], *window,
                          *longctx.curriculum_flags(spec, task, background, segments="1", steps=str(caps[k]),
                                                    min_steps=str(firsts[k])), "--out", str(stage)], log, name=name)
        made = read_json(stage / "data" / f"{task}-1seg" / "manifest.json")["corpus"]["options"]
        if made != json.loads(json.dumps(options)):
            raise ExperimentError(f"{stage}: its samples were made with other options than the {S}-segment stages' "
                                  f"({sorted(k for k in options if made.get(k) != options[k])})")
        records.append({**read_json(stage / "curriculum.json")["stages"][0], "stage": k, "segments": S})
    (out / "curriculum.json").write_text(json.dumps({"task": task, "tgt_len": N, "segments": segments,
                                                     "full_context": True, "stages": records}, indent=1) + "\n")
    return longctx.evaluate_curriculum("hf_full", task, out, log, result, seconds, name)


def arch_job(arch: str, task: str, archs: list[str], *, spec: dict, work: Path, backbone: Path, uri: str,
             background: Path) -> list[dict]:
    """One queue job: the (arch, task) curriculum; `hf`'s job goes on with hf_full, which starts from its first
    stage."""
    common = [*spec["overrides"], f"model.backbone={backbone}", "model.backbone_config={}", f"tracking.uri={uri}",
              f"tracking.experiment={EXPERIMENT}"]
    done = [longctx.curriculum_run(arch, task, spec=spec, preset=PRESET, overrides=common + ARCHS[arch], work=work,
                                   background=background)]
    if arch == "hf" and "hf_full" in archs:
        done.append(full_context_run(task, done[0], spec=spec, overrides=common + ARCHS["hf_full"], work=work,
                                     background=background))
    return done


def last_stage(work: Path, arch: str, task: str) -> Path:
    return Path(read_json(work / "runs" / f"{arch}-{task}" / "curriculum.json")["stages"][-1]["run_dir"])


def run_longeval(task: str, archs: list[str], *, spec: dict, work: Path, uri: str) -> dict:
    """`memlm longeval` of each arch's last model at every stage's length; {arch: {length: accuracy}} and the
    baselines by length."""
    runs = [last_stage(work, arch, task) for arch in archs]
    segments = [int(s) for s in spec["segments"].split(",")]
    N = read_json(work / "runs" / f"{archs[0]}-{task}" / "curriculum.json")["tgt_len"]
    out = work / "longeval" / task
    RUNS.start(f"longeval-{task}", f"memlm longeval of {len(runs)} runs at {len(segments)} lengths")
    seconds = memlm(["longeval", *map(str, runs), "--lengths", ",".join(str(S * N) for S in segments), "--depths",
                     "1", "--samples", str(spec["longeval"]["samples"]), "--out", str(out), "--uri", uri,
                     "--experiment", EXPERIMENT, "--num-cpus", "2"], work / "logs" / f"longeval-{task}.log",
                    name=f"longeval-{task}")
    summary = read_json(out / "summary.json")
    by_dir = {Path(run["run_dir"]).resolve(): run for run in summary["runs"].values()}
    accuracy = {arch: {str(r["length"]): r["accuracy"] for r in by_dir[path.resolve()]["results"]}
                for arch, path in zip(archs, runs)}
    RUNS.finish(f"longeval-{task}", f"in {seconds:.0f} s")
    return {"lengths": summary["lengths"], "samples": spec["longeval"]["samples"], "accuracy": accuracy,
            "baselines": summary["baselines"]}


def longeval_table(task: str, evaluated: dict) -> list[str]:
    lengths = [str(n) for n in evaluated["lengths"]]
    lines = [f"{task}: memlm longeval, each arch's last model on {evaluated['samples']} fresh samples a length (bytes; "
             "the fact anywhere in the background)", "", "| model | " + " | ".join(lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for arch, row in evaluated["accuracy"].items():
        lines.append(f"| {LABELS[arch]} | " + " | ".join(f"{100 * row[n]:.0f}" for n in lengths) + " |")
    chance = [row.get("chance") for row in evaluated["baselines"]]
    if all(c is not None for c in chance):
        lines.append("| *chance* | " + " | ".join(f"*{100 * c:.{3 if c < 0.01 else 0}f}*" for c in chance) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--work", type=Path, help="runs, data and logs (default runs/reproduce/pretrained-longctx-"
                                                  "PROFILE)")
    parser.add_argument("--jobs", type=int, help="curricula at a time, one thread each (default 2; gpu 10)")
    parser.add_argument("--archs", help="comma-separated subset of: " + ", ".join(ARCHS) + " (default: the profile's)")
    parser.add_argument("--tasks", help="comma-separated subset of: " + ", ".join(TASKS) + " (default: all)")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/reproduce_pretrained_longctx_"
                                                 "PROFILE.json)")
    parser.add_argument("--background", type=Path, default=WIKITEXT2,
                        help=f"WikiText-2 folder: the backbone's text and qa1's background (default {WIKITEXT2})")
    parser.add_argument("--no-longeval", action="store_true", help="skip the memlm longeval step")
    add_stop_options(parser)
    args = parser.parse_args(argv)
    supervise(args)
    spec = PROFILES[args.profile]
    archs = (args.archs or spec["archs"]).split(",")
    tasks = (args.tasks or ",".join(TASKS)).split(",")
    for given, known, flag in ((archs, ARCHS, "--archs"), (tasks, TASKS, "--tasks")):
        if set(given) - set(known):
            parser.error(f"{flag}: unknown {', '.join(sorted(set(given) - set(known)))}; valid: {', '.join(known)}")
    if "hf_full" in archs and "hf" not in archs:
        parser.error("--archs: hf_full starts from hf's one-segment stage; give hf too")
    if not (args.background / "wiki.train.tokens").is_file():
        parser.error(f"--background {args.background}: no wiki.train.tokens there; give the WikiText-2 folder")
    work = (args.work or ROOT / "runs" / "reproduce" / f"pretrained-longctx-{args.profile}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    started, load_start = time.time(), load_average()
    try:
        source = smoke_corpus(work / "wikitext-2-lines") if args.profile == "smoke" else args.background
        RUNS.plan(1 + len(tasks) * len(archs) + (0 if args.no_longeval or not spec["longeval"] else len(tasks)))
        backbone = pretrain(spec["pretrain"], work, uri, source)
        jobs = [lambda a=a, t=t: arch_job(a, t, archs, spec=spec, work=work, backbone=work / "backbone", uri=uri,
                                          background=args.background)
                for t in tasks for a in archs if a != "hf_full"]
        done = [run for runs in run_queue(jobs, args.jobs or spec.get("jobs", 2)) for run in runs]
        evaluated = {} if args.no_longeval or not spec["longeval"] else {
            task: run_longeval(task, archs, spec=spec, work=work, uri=uri) for task in tasks}
    except ExperimentError as err:
        print(f"pretrained_longctx: error: {err}", file=sys.stderr)
        return 1
    results = {task: sorted((r for r in done if r["task"] == task), key=lambda r: archs.index(r["arch"]))
               for task in tasks}
    results_dir, figures = (work, work) if args.profile == "smoke" else (RESULTS, FIGURES)
    out = args.out or results_dir / f"reproduce_pretrained_longctx_{args.profile}.json"
    shown_figures = {}
    for task, runs in results.items():
        path = longctx.plot(task, runs, figures / f"{out.stem}_{task}.png", LABELS)
        shown_figures[path.stem] = shown(path)
    timing = {"machine": machine(), "command": " ".join(["python bench/reproduce/pretrained_longctx.py",
                                                         *(sys.argv[1:] if argv is None else argv)]),
              "wall_minutes": round((time.time() - started) / 60, 1), "load_start": load_start,
              "load_end": load_average()}
    for r in done:
        r.pop("skipped", None)
    write_result(out, {"experiment": "pretrained_longctx", "version": 1, "profile": args.profile, **timing,
                       "presets": {"backbone": shown(BACKBONE_PRESET), "curriculum": shown(PRESET)}, "spec": spec,
                       "tasks": {t: TASKS[t] for t in tasks}, "archs": {a: ARCHS[a] for a in archs},
                       "labels": {a: LABELS[a] for a in archs}, "backbone": backbone, "figures": shown_figures,
                       "train_seconds": {f"{r['arch']}-{r['task']}": r.get("train_seconds") for r in done},
                       "results": results, "longeval": evaluated})
    test = backbone["test"]
    print(f"backbone: {backbone['steps']:,} steps on WikiText-2 bytes, test {test['bpc']:.3f} bits per byte "
          f"(segments of {test['tgt_len']})\n")
    sys.stdout.write(longctx.markdown(results, LABELS))
    for task, table in evaluated.items():
        print("\n".join(longeval_table(task, table)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_experiment(main))
