"""WikiText-2 at word level: every architecture at one small config, equal steps and tokens, several seeds.

    .venv/bin/python bench/reproduce/wikitext2.py                   # profile cpu ->
    bench/results/reproduce_wt2_cpu.json
    .venv/bin/python bench/reproduce/wikitext2.py --profile gpu     # the WikiText-103 base shape (a GPU)
    .venv/bin/python bench/reproduce/wikitext2.py --profile smoke   # seconds: a few lines of WikiText-2, 3 steps

Data: ../shared/data/wikitext-2 prepared by `memlm prepare --corpus wikitext --tokenizer word` (the papers'
tokenization: the corpus's own words plus <eos>, vocabulary 33,278). Model: configs/reproduce/wikitext2.yaml for the
cpu profile (2 layers, d 128, 4 x 32 heads, d_inner 512, N = M = 64, 8 lanes, adaptive softmax 2k/10k, dropout
0.1, Adam 2e-3 cosine, 100 warmup steps); every variant changes only its architecture keys, so all of them read
the same batches for the same steps (equal tokens). Variants: Transformer+RPE (no memory), Transformer-XL, LaMemo,
LaMemo without look-ahead, LaMemo without interpolation, RMT (10 memory tokens, window BPTT over 2 segments, no
cache) and Transformer-XL + RMT (the same plus the M = 64 cache).

Each run is `memlm train` then `memlm eval --split valid/test` (whole splits, per-document memory) in its own
process with one thread, `--jobs` at a time; every run is logged to MLflow (experiment
memlm-reproduce-wt2-PROFILE), so `memlm compare --experiment memlm-reproduce-wt2-cpu` renders the same table.
A finished run (its eval JSONs exist) is not trained again: re-running the command continues an interrupted
reproduction (Ctrl-C or SIGTERM stops it and every command it started, in one line; a line says when each run
starts and finishes, and every --progress-every seconds where each training is, with its ETA). The JSON holds
every run and the table (mean and half-range over seeds); the figure shows test perplexity per variant with each
seed.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, WIKITEXT2, load_average, write_json, write_result
from memlm.bench.reproduce.experiment import (
    FIGURES,
    ExperimentError,
    add_stop_options,
    last_metrics,
    machine,
    mean_spread,
    memlm,
    read_json,
    run_experiment,
    run_queue,
    save_figure,
    shown,
    supervise,
)
from memlm.bench.reproduce.progress import RUNS

PRESET = ROOT / "configs" / "reproduce" / "wikitext2.yaml"
# name -> (label, overrides on top of the preset)
VARIANTS = {
    "transformer": ("Transformer+RPE", ["model.arch=transformer", "model.mem_len=0"]),
    "txl": ("Transformer-XL", ["model.arch=txl"]),
    "lamemo": ("LaMemo", ["model.arch=lamemo"]),
    "lamemo_no_lookahead": ("LaMemo w/o look-ahead", ["model.arch=lamemo", "model.lookahead=false"]),
    "lamemo_no_interp": ("LaMemo w/o interpolation", ["model.arch=lamemo", "model.interpolate=false"]),
    "rmt": ("RMT", ["model.arch=rmt", "model.mem_len=0"]),  # + the profile's "rmt" keys
    "txl_rmt": ("Transformer-XL + RMT", ["model.arch=rmt"]),
    "compressive": ("Compressive Transformer", ["model.arch=compressive"]),  # + the profile's "compressive" keys
    "infinite_former": ("∞-former", ["model.arch=infinite_former"]),  # + the profile's "infinite_former" keys
}
# The queue runs the papers' main comparison first (every seed), then the ablations and RMT.
QUEUE_ORDER = (("transformer", "txl", "lamemo", "compressive", "infinite_former"),
               ("lamemo_no_lookahead", "lamemo_no_interp", "rmt", "txl_rmt"))
PROFILES = {
    # 2,000 steps x 512 tokens = 1.02M tokens per run (about half an epoch); about 70 min for all 16 runs on 2 cores.
    # Each arch's own keys: RMT's memory tokens and BPTT; the Compressive Transformer's compressed memory as large as
    # the memory (LaMemo's Table 1: 150 and 150), at the largest rate up to Rae et al.'s 3 that divides N; the
    # ∞-former's basis as large as the memory too (Table 1: 150 and 150), with sticky memories.
    "cpu": {"steps": 2000, "seeds": [1, 2], "overrides": ["train.log_every=100"],
            "rmt": ["model.num_mem_tokens=10", "model.bptt_depth=2"],
            "compressive": ["model.compressed_len=64", "model.compression_rate=2"],
            "infinite_former": ["model.ltm_basis=64", "model.ltm_sticky=true"]},
    # Longer training for the comparison whose gap is small at 2,000 steps (Transformer-XL against LaMemo).
    "cpu_long": {"steps": 4000, "seeds": [1], "overrides": ["train.log_every=100"],
                 "rmt": ["model.num_mem_tokens=10", "model.bptt_depth=2"],
                 "compressive": ["model.compressed_len=64", "model.compression_rate=2"],
                 "infinite_former": ["model.ltm_basis=64", "model.ltm_sticky=true"]},
    # The WikiText-103 base shape (16 layers, d 410, 10 x 41 heads, N = M = 150) trained on WikiText-2.
    "gpu": {"steps": 8000, "seeds": [1, 2], "overrides": [
        "model.n_layer=16", "model.n_head=10", "model.d_head=41", "model.d_model=410", "model.d_inner=2100",
        "model.tgt_len=150", "model.mem_len=150", "data.batch_size=32", "train.lr=2.5e-4", "train.warmup_steps=0",
        "deepspeed.precision=bf16", "train.log_every=200"],
        "rmt": ["model.num_mem_tokens=10", "model.bptt_depth=2"],
        "compressive": ["model.compressed_len=150", "model.compression_rate=3"],
        "infinite_former": ["model.ltm_basis=150", "model.ltm_sticky=true"]},
    # CI: a few hundred lines of each split, a width-32 model, 3 steps; proves the pipeline, never the quality.
    "smoke": {"steps": 3, "seeds": [1], "overrides": [
        "model.n_layer=2", "model.n_head=2", "model.d_head=16", "model.d_model=32", "model.d_inner=64",
        "model.tgt_len=8", "model.mem_len=8", "model.cutoffs=[100,500]", "data.batch_size=2",
        "train.warmup_steps=1", "train.log_every=1"],
        "rmt": ["model.num_mem_tokens=2", "model.bptt_depth=1"],
        "compressive": ["model.compressed_len=4", "model.compression_rate=2"],
        "infinite_former": ["model.ltm_basis=4", "model.ltm_samples=8", "model.ltm_sticky=true"]},
}
SMOKE_LINES = 40  # lines of each WikiText-2 split in the smoke corpus (a document or two)


def smoke_corpus(out: Path) -> Path:
    """The first SMOKE_LINES lines of each split: a few documents, in the corpus's own format."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        lines = (WIKITEXT2 / f"wiki.{split}.tokens").read_text(encoding="utf-8").splitlines(True)
        (out / f"wiki.{split}.tokens").write_text("".join(lines[:SMOKE_LINES]), encoding="utf-8")
    return out


def prepare_data(work: Path, profile: str) -> Path:
    source = WIKITEXT2
    if not (source / "wiki.train.tokens").is_file():
        raise ExperimentError(f"WikiText-2 not found at {source}")
    if profile == "smoke":
        source = smoke_corpus(work / "wikitext-2-lines")
    data = work / "data"
    if not (data / "manifest.json").is_file():
        memlm(["prepare", "--corpus", "wikitext", "--input", str(source), "--out", str(data), "--tokenizer", "word",
               "--workers", "1", "--overwrite"], work / "logs" / "prepare.log", name="data")
    return data


def one_run(variant: str, seed: int, *, profile: str, data: Path, work: Path, uri: str, experiment: str) -> dict:
    """Train one (variant, seed) and evaluate it on valid and test; returns its row (cached once finished)."""
    name = f"{variant}-s{seed}"
    run_dir, log = work / "runs" / name, work / "logs" / f"{name}.log"
    row_path = run_dir / "reproduce_row.json"
    if row_path.is_file():
        RUNS.skip(name)
        return read_json(row_path)
    label, keys = VARIANTS[variant]
    spec = PROFILES[profile]
    trained = trained_steps(run_dir) == spec["steps"]
    if run_dir.exists() and not trained:  # an interrupted training: start it again (the simplest exact answer)
        shutil.rmtree(run_dir)
    vocab = read_json(data / "manifest.json")["tokenizer"]["vocab_size"]
    # The profile's shape first, then the variant's own keys (the no-memory baseline's mem_len=0 wins).
    arch = next(key.partition("=")[2] for key in keys if key.startswith("model.arch="))
    overrides = spec["overrides"] + keys + spec.get(arch, []) + [
        f"train.steps={spec['steps']}", f"train.seed={seed}", f"data.path={data}", f"model.vocab_size={vocab}",
        f"tracking.uri={uri}", f"tracking.experiment={experiment}", f"tracking.run_name={name}"]
    load_before = load_average()
    # A training that finished while its evaluations did not (the experiment was stopped): evaluate it only.
    RUNS.start(name, ("trained earlier: " if trained else f"train {spec['steps']:,} steps, then ")
               + "eval valid and test")
    train_s = None if trained else memlm(["train", str(PRESET), *overrides, "--out", str(run_dir)], log, name=name,
                                         run_dir=run_dir, steps=spec["steps"])
    evals, eval_s = {}, {}
    for split in ("valid", "test"):
        path = run_dir / "eval" / f"{split}.json"
        eval_s[split] = memlm(["eval", str(run_dir), "--split", split, "--json", str(path)], log, name=name)
        evals[split] = read_json(path)
    row = summarize_run(variant, label, seed, run_dir, evals)
    row.update(train_seconds=None if train_s is None else round(train_s, 1),
               eval_seconds={k: round(v, 1) for k, v in eval_s.items()},
               load_before=load_before, load_after=load_average())
    write_json(row_path, row)
    RUNS.finish(name, f"test ppl {row['test_ppl']:.2f}, valid ppl {row['valid_ppl']:.2f}, {row['tokens_per_s']:.0f} "
                f"tokens/s, " + (f"{train_s / 60:.1f} min" if train_s else "evaluated only")
                + f", load {load_average()[0]}")
    return row


def trained_steps(run_dir: Path) -> int:
    """The step of RUN_DIR's latest checkpoint (0 without one): a run saves only at its end (save_every 0)."""
    latest = run_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return 0
    tag = latest.read_text().strip()
    return int(tag.removeprefix("global_step")) if tag.removeprefix("global_step").isdigit() else 0


def summarize_run(variant: str, label: str, seed: int, run_dir: Path, evals: dict) -> dict:
    from memlm.models.flops import flops_per_token, param_count
    from memlm.trainer.config.run_config import load_config

    cfg = load_config(run_dir / "config.yaml")
    rows = last_metrics(run_dir)
    tail = rows[-5:]
    for split, result in evals.items():
        if not math.isfinite(result["nll"]):
            raise ExperimentError(f"{run_dir}: {split} NLL is {result['nll']} (a diverged run is reported as such)")
    return {
        "variant": variant, "label": label, "seed": seed, "run_dir": shown(run_dir),
        "steps": rows[-1]["step"], "tokens_seen": rows[-1]["tokens"],
        "params": param_count(cfg.model), "flops_per_token": flops_per_token(cfg.model)["total"],
        "tokens_per_s": statistics.median([r["tokens_per_s"] for r in rows[1:]] or [rows[-1]["tokens_per_s"]]),
        "train_loss_last": sum(r["loss"] for r in tail) / len(tail),
        "valid_ppl": evals["valid"]["ppl"], "test_ppl": evals["test"]["ppl"],
        "valid_tokens": evals["valid"]["tokens"], "test_tokens": evals["test"]["tokens"],
    }


def table(rows: list[dict]) -> list[dict]:
    out = []
    for variant, (label, _) in VARIANTS.items():
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        test, test_spread = mean_spread([r["test_ppl"] for r in mine])
        valid, valid_spread = mean_spread([r["valid_ppl"] for r in mine])
        out.append({"variant": variant, "label": label, "seeds": [r["seed"] for r in mine],
                    "test_ppl": test, "test_ppl_spread": test_spread, "valid_ppl": valid,
                    "valid_ppl_spread": valid_spread, "test_ppl_per_seed": [r["test_ppl"] for r in mine],
                    "tokens_per_s": statistics.median([r["tokens_per_s"] for r in mine]), "params": mine[0]["params"],
                    "flops_per_token": mine[0]["flops_per_token"], "tokens_seen": mine[0]["tokens_seen"]})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| model | test ppl | valid ppl | seeds | params | GFLOPs/token | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['test_ppl']:.1f} ± {r['test_ppl_spread']:.1f} | {r['valid_ppl']:.1f} ± "
                     f"{r['valid_ppl_spread']:.1f} | {len(r['seeds'])} | {r['params']:,} | "
                     f"{r['flops_per_token'] / 1e9:.4f} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r["label"] for r in rows]
    ax.bar(range(len(rows)), [r["test_ppl"] for r in rows], color="#9ecae1", label="mean over seeds")
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["test_ppl_per_seed"]), r["test_ppl_per_seed"], color="#08519c", zorder=3, s=14,
                   label="one seed" if i == 0 else None)
    low = min(min(r["test_ppl_per_seed"]) for r in rows)
    ax.set_ylim(low * 0.9, max(max(r["test_ppl_per_seed"]) for r in rows) * 1.03)
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right")
    ax.set_ylabel("test perplexity (lower is better)")
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--work", type=Path, help="runs, data and logs (default runs/reproduce/wt2-PROFILE)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (default 2)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--seeds", help="comma-separated seeds (default: the profile's)")
    parser.add_argument("--uri", help="MLflow tracking URI (default sqlite:///WORK/mlflow.db)")
    parser.add_argument("--out", type=Path, help="results JSON (default bench/results/reproduce_wt2_PROFILE.json)")
    add_stop_options(parser)
    args = parser.parse_args(argv)
    supervise(args)
    work = (args.work or ROOT / "runs" / "reproduce" / f"wt2-{args.profile}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    uri = args.uri or f"sqlite:///{work / 'mlflow.db'}"
    experiment = f"memlm-reproduce-wt2-{args.profile}"
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else PROFILES[args.profile]["seeds"]
    try:
        data = prepare_data(work, args.profile)
        jobs = [partial(one_run, v, s, profile=args.profile, data=data, work=work, uri=uri, experiment=experiment)
                for group in QUEUE_ORDER for s in seeds for v in group if v in variants]
        RUNS.plan(len(jobs))
        started, load_start = time.time(), load_average()
        run_queue(jobs, args.jobs)
    except ExperimentError as err:
        print(f"wikitext2: error: {err}", file=sys.stderr)
        return 1
    # Every finished run of this profile, including those of earlier invocations with other --variants/--seeds.
    rows = sorted((read_json(p) for p in (work / "runs").glob("*/reproduce_row.json")),
                  key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"]))
    summary = table(rows)
    # The smoke profile (CI) writes next to its runs, never over the committed results.
    results, figures = (work, work) if args.profile == "smoke" else (RESULTS, FIGURES)
    out = args.out or results / f"reproduce_wt2_{args.profile}.json"
    figure = plot(summary, figures / f"{out.stem}.png",  # named after the JSON: another --out, another figure
                  f"WikiText-2, {PROFILES[args.profile]['steps']:,} equal steps: test perplexity")
    write_result(out, {"experiment": "wikitext2", "profile": args.profile, "machine": machine(),
                     "command": " ".join(["python bench/reproduce/wikitext2.py",
                                          *(sys.argv[1:] if argv is None else argv)]),
                     "preset": str(PRESET.relative_to(ROOT)), "profile_overrides": PROFILES[args.profile]["overrides"],
                     "steps": PROFILES[args.profile]["steps"], "jobs": args.jobs, "mlflow_experiment": experiment,
                     "wall_minutes": round((time.time() - started) / 60, 1), "load_start": load_start,
                     "load_end": load_average(), "figure": shown(figure), "table": summary, "runs": rows})
    sys.stdout.write(markdown(summary))
    print(f"wrote {out} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(run_experiment(main))
