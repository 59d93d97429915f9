"""`memlm demo`: the real pipeline, end to end, on a corpus that exists on any machine (docs/design.md §6).

1. Corpus. `--wikitext PATH` (or $MEMLM_DEMO_WIKITEXT) prepares WikiText (word tokenizer) with `prepare`;
   otherwise the standard library's own `.py` files become a `textdir` corpus under OUT/corpus (one document per
   file, split deterministically by sorted name: every 10th file test, the next one valid, the rest train,
   a few MB in all) prepared with the bytes tokenizer (vocabulary 256) into OUT/data.
2. Training. A small no-memory Transformer+RPE baseline, Transformer-XL and LaMemo, each by the real command
   (`memlm train OUT/configs/ARCH.yaml`: a DeepSpeed engine, CPU accelerator when there is no GPU) into
   OUT/runs/ARCH, all at once (one process each, the cores shared out between them), tracked in MLflow
   (experiment "memlm-demo", runs named demo-ARCH-CORPUS-TOKENIZER-ID with one ID per demo; default store: SQLite
   mlflow.db in the working folder; MLflow's start-up lines go to OUT/library.log). Every architecture trains
   for the same `--steps` on the same batches: the papers compare at equal steps and equal tokens, never equal
   wall time (a faster model would otherwise get more data).
3. Evaluation of each run's final checkpoint on the test split (`evaluate_run`, per-document memory).
4. A comparison table: arch, parameters, steps, train loss (mean of the last tenth of the steps), test NLL, bpc
   (bytes) or ppl (words), tokens/s (median over the logged windows, as `memlm compare` reports it), and each
   memory model's test NLL against the no-memory baseline.

The default step count and learning rate were chosen by measuring the three archs' test NLL at 300, 800 and 3,000
steps with learning rates 1e-3 and 2e-3 (the README's demo section shows the 3,000-step result): with them memory
pays off on the stdlib corpus (at a few hundred steps the baseline is still ahead: a model must first learn to use
its memory) and the demo stays near ten minutes on 2 cores.

Re-running with the same OUT replaces the corpus, data and run folders this demo wrote there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from memlm.invocation import activation_hint, memlm_command
from memlm.models.config import ConfigError
from memlm.models.flops import param_count
from memlm.models.registry import arch_spec  # torch-free
from memlm.trainer.config.run_config import config_from_dict
from memlm.trainer.runtime import heartbeat
from memlm.trainer.runtime.process import choose_threads
from memlm.trainer.runtime.quiet import route_library_loggers
from memlm.trainer.tracking.tracker import ensure_experiment, runs_link

DEMO_EXPERIMENT = "memlm-demo"
DEMO_ARCHS = ("transformer", "txl", "lamemo")
CORPUS_MARKER = "MEMLM_DEMO_CORPUS"  # a folder holding this file was written by the demo and may be replaced
TRAIN_BYTES = 3_000_000  # stdlib corpus caps (bytes of UTF-8 text per split)
HELD_OUT_BYTES = 48_000
HELD_OUT_MAX_FILE = 8_000  # held-out documents stay short so that evaluation (longest lane) is quick
DEMO_STEPS = 3000  # equal for every architecture; see the module docstring
DEMO_LR = 1e-3
NLL_TIE = 0.005  # nats/token: closer than this to the baseline reads "about the same"
# Small models: 2 layers, d_model 128, 4 heads x 32, N = M = 64, 8 lanes.
MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "d_head": 32, "d_inner": 512, "tgt_len": 64, "mem_len": 64,
         "dropout": 0.0, "dropatt": 0.0}
BATCH = 8


# ---------------------------------------------------------------------------------------------------------------
# Corpus


def stdlib_corpus(root: Path, train_bytes: int | None = None, held_out_bytes: int | None = None) -> dict:
    """Write the stdlib's top-level .py files (UTF-8, > 2 kB) as ROOT/{train,valid,test}/NNNN_name.txt.

    Sorted by name; file i goes to test when i % 10 == 0, to valid when i % 10 == 1 (if at most 8 kB), else to train,
    until each
    split holds its cap. Returns {split: (files, bytes)}."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file() and p.stat().st_size > 2000)
    _replace_own_folder(root)
    train_bytes = TRAIN_BYTES if train_bytes is None else train_bytes
    held_out_bytes = HELD_OUT_BYTES if held_out_bytes is None else held_out_bytes
    caps = {"train": train_bytes, "valid": held_out_bytes, "test": held_out_bytes}
    sizes = {split: [0, 0] for split in caps}
    for split in caps:
        (root / split).mkdir(parents=True)
    for i, path in enumerate(files):
        split = "test" if i % 10 == 0 else "valid" if i % 10 == 1 else "train"
        if sizes[split][1] >= caps[split]:
            continue
        if split != "train" and path.stat().st_size > HELD_OUT_MAX_FILE:
            split = "train"
            if sizes[split][1] >= caps[split]:
                continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        (root / split / f"{i:04d}_{path.stem}.txt").write_text(text, encoding="utf-8")
        sizes[split][0] += 1
        sizes[split][1] += len(text.encode("utf-8"))
        if all(s[1] >= caps[k] for k, s in sizes.items()):
            break
    (root / CORPUS_MARKER).write_text("written by `memlm demo`; safe to delete\n")
    return {split: tuple(v) for split, v in sizes.items()}


def _replace_own_folder(folder: Path) -> None:
    """Delete FOLDER if the demo wrote it (marker file); refuse to touch any other non-empty folder."""
    if folder.exists():
        if (folder / CORPUS_MARKER).is_file() or (folder.is_dir() and not any(folder.iterdir())):
            shutil.rmtree(folder)
        else:
            from memlm.data_pipeline.format import DataError  # keeps --help numpy-free

            raise DataError(f"{folder} exists and was not written by `memlm demo`: choose another --out "
                            "or remove it yourself")
    folder.mkdir(parents=True)


def prepare_corpus(out: Path, wikitext: str | None) -> tuple[Path, dict, str]:
    """(DATA_DIR, manifest, description) for the demo's corpus."""
    from memlm.data_pipeline.prepare import prepare  # keeps --help numpy-free (memlm/cli.py imports this module)

    data = out / "data"
    if wikitext:
        manifest = prepare("wikitext", wikitext, data, tokenizer="word", overwrite=True, progress=False)
        desc = f"WikiText from {wikitext} (word tokenizer)"
    else:
        sizes = stdlib_corpus(out / "corpus")
        manifest = prepare("textdir", out / "corpus", data, tokenizer="bytes", overwrite=True, progress=False)
        desc = "Python standard library sources (bytes; one document per file: " + ", ".join(
            f"{split} {n} files / {b / 1e6:.2f} MB" for split, (n, b) in sizes.items()) + ")"
    return data, manifest, desc


# ---------------------------------------------------------------------------------------------------------------
# Training


def demo_tree(arch: str, data: Path, vocab_size: int, steps: int, lr: float = DEMO_LR, run_name: str = "") -> dict:
    """The run configuration of one architecture, as the nested mapping a YAML preset holds."""
    model = {"arch": arch, **MODEL, "vocab_size": vocab_size}
    if arch_spec(arch).mem_len == "zero":  # an arch without the Transformer-XL cache (the no-memory baseline)
        model["mem_len"] = 0
    if vocab_size > 20_000:  # word-level WikiText: an adaptive softmax keeps the CPU step affordable
        model.update(cutoffs=[2000, 10000], div_val=1)
    return {
        "model": model,
        "data": {"path": str(Path(data).resolve()), "batch_size": BATCH, "eval_batch_size": 2 * BATCH},
        "train": {"steps": steps, "lr": lr, "warmup_steps": min(100, steps // 10), "schedule": "cosine",
                  "clip": 0.25, "save_every": 0, "keep_last": 1, "eval_every": 0,
                  "log_every": max(1, min(50, steps // 20))},
        "deepspeed": {"zero_stage": 0, "precision": "fp32"},
        "tracking": {"enabled": True, "experiment": DEMO_EXPERIMENT, "run_name": run_name or f"demo-{arch}"},
    }


def run_names(archs: tuple[str, ...], corpus: str, tokenizer: str) -> dict[str, str]:
    """MLflow run names of one demo: arch, corpus and tokenizer (a byte-level ppl of 5 and a word-level one of 1,000
    sit in the same experiment), and a short id shared by this demo's runs and no other demo's."""
    import uuid

    demo_id = uuid.uuid4().hex[:6]
    return {arch: f"demo-{arch}-{corpus}-{tokenizer}-{demo_id}" for arch in archs}


def demo_config(arch: str, data: Path, vocab_size: int, steps: int, lr: float = DEMO_LR):
    return config_from_dict(demo_tree(arch, data, vocab_size, steps, lr))


def _replace_run_folder(run_dir: Path) -> None:
    """A fresh run folder: an earlier demo run there (config.yaml / checkpoints) is removed first."""
    if not run_dir.exists():
        return
    if (run_dir / "config.yaml").is_file() or (run_dir / "checkpoints").is_dir() or not any(run_dir.iterdir()):
        shutil.rmtree(run_dir)
    else:
        from memlm.data_pipeline.format import DataError  # keeps --help numpy-free

        raise DataError(f"{run_dir} exists and is not a run folder: choose another --out or remove it yourself")


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return rows


class DemoError(RuntimeError):
    """A training process of the demo failed; the message names it and its log."""


def threads_per_run(n_runs: int) -> int:
    """Torch threads for each of n_runs concurrent training processes: this process's cores shared out."""
    return max(1, choose_threads().threads // n_runs)


def train_all(out: Path, trees: dict[str, dict], report_every: float = 30.0) -> dict[str, float]:
    """Train every architecture at once, one `memlm train` process each; returns {arch: wall seconds}.

    Each process's console output goes to OUT/logs/ARCH.log; this one prints a progress line every report_every
    seconds from the runs' metrics.jsonl."""
    import yaml

    threads = threads_per_run(len(trees))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each run is a plain single-process run
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    procs, logs, started, finished = {}, {}, {}, {}
    for arch, tree in trees.items():
        config = out / "configs" / f"{arch}.yaml"
        config.write_text(yaml.safe_dump(tree, sort_keys=False))
        run_dir = out / "runs" / arch
        _replace_run_folder(run_dir)
        logs[arch] = open(out / "logs" / f"{arch}.log", "w")
        started[arch] = time.perf_counter()
        procs[arch] = subprocess.Popen([sys.executable, "-m", "memlm", "train", str(config), "--out", str(run_dir)],
                                       stdout=logs[arch], stderr=subprocess.STDOUT, env=env)
    steps = {arch: tree["train"]["steps"] for arch, tree in trees.items()}
    print(f"  {len(procs)} training processes, {threads} torch thread(s) each; logs in {out / 'logs'}", flush=True)
    t0, last_report = time.perf_counter(), time.perf_counter()
    try:
        while len(finished) < len(procs):
            time.sleep(0.5)
            for arch, proc in procs.items():
                if arch not in finished and proc.poll() is not None:
                    finished[arch] = time.perf_counter() - started[arch]
                    logs[arch].close()
                    if proc.returncode:
                        log = out / "logs" / f"{arch}.log"
                        raise DemoError(f"training {arch} failed (exit {proc.returncode}): {_last_line(log)}; "
                                        f"log: {log}")
            if time.perf_counter() - last_report >= report_every and len(finished) < len(procs):
                last_report = time.perf_counter()
                print("  " + _progress_line(out, steps, time.perf_counter() - t0), flush=True)
    finally:
        for arch, proc in procs.items():
            if proc.poll() is None:  # an error or Ctrl-C here: no orphaned trainers left running
                proc.kill()
                proc.wait()
            logs[arch].close()
    return finished


def _progress_line(out: Path, steps: dict[str, int], elapsed: float) -> str:
    parts, fractions = [], []
    for arch, total in steps.items():
        rows = read_metrics(out / "runs" / arch)
        done = rows[-1]["step"] if rows else 0
        fractions.append(done / total)
        loss = f" loss {rows[-1]['loss']:.3f}" if rows else ""
        parts.append(f"{arch} {done}/{total}{loss}")
    slowest = min(fractions)
    eta = f", about {elapsed * (1 - slowest) / slowest / 60:.1f} min left" if slowest > 0.02 else ""
    return f"[{elapsed / 60:4.1f} min] " + " | ".join(parts) + eta


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


# ---------------------------------------------------------------------------------------------------------------
# Main


def main(args) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    out = Path(getattr(args, "out", None) or "runs/demo")
    steps = int(getattr(args, "steps", None) or DEMO_STEPS)
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    lr = float(getattr(args, "lr", None) or DEMO_LR)
    wikitext = getattr(args, "wikitext", None) or os.environ.get("MEMLM_DEMO_WIKITEXT") or None
    archs = tuple(getattr(args, "archs", None) or DEMO_ARCHS)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    data, manifest, desc = prepare_corpus(out, wikitext)
    tok = manifest["tokenizer"]
    vocab = int(tok["vocab_size"])
    split_tokens = {s: e["tokens"] for s, e in manifest["splits"].items()}
    print(f"memlm demo: corpus {desc}")
    print(f"  prepared into {data}: tokenizer {tok['kind']} (vocab {vocab}); tokens " +
          ", ".join(f"{s} {n:,}" for s, n in split_tokens.items()) + f" ({time.perf_counter() - t0:.1f} s)")
    tokens = steps * BATCH * MODEL["tgt_len"]
    print(f"  training {', '.join(archs)} at equal steps and tokens: {steps:,} steps x {BATCH} lanes x "
          f"{MODEL['tgt_len']} positions = {tokens:,} token positions each, the padding of documents' last segments "
          f"included (2 layers, d_model {MODEL['d_model']}, "
          f"N {MODEL['tgt_len']}, M {MODEL['mem_len']}, lr {lr:g})", flush=True)
    heartbeat.phase(None)  # the demo's own lines from here (memlm/start_watch.py)

    from memlm.trainer.inference.evaluate import evaluate_run  # keeps --help torch-free

    names = run_names(archs, "wikitext" if wikitext else "stdlib", tok["kind"])
    trees = {arch: demo_tree(arch, data, vocab, steps, lr, names[arch]) for arch in archs}
    import mlflow  # noqa: F401 - it sets its loggers up at import; they are routed below

    route_library_loggers(out)  # "Creating initial MLflow database tables" and the like: OUT/library.log
    experiment_id = ensure_experiment(demo_config(archs[0], data, vocab, steps, lr).tracking)  # before the runs
    try:
        train_seconds = train_all(out, trees)
    except DemoError as err:
        print(f"memlm: error: {err}", file=sys.stderr)
        return 1
    rows = []
    for arch in archs:
        run_dir = out / "runs" / arch
        cfg = demo_config(arch, data, vocab, steps, lr)
        metrics = read_metrics(run_dir)
        start = time.perf_counter()
        result = evaluate_run(run_dir, split="test")  # also logs test_nll/ppl/bpc to the run's MLflow run
        eval_s = time.perf_counter() - start
        rows.append({"arch": arch, "params": param_count(cfg.model), "steps": int(metrics[-1]["step"]),
                     "tokens": int(metrics[-1]["tokens"]), "train_loss": tail_mean_loss(metrics, steps),
                     "test_nll": float(result["nll"]), "test_bpc": float(result["bpc"]),
                     "test_ppl": float(result["ppl"]), "tokens_per_s": median_rate(metrics),
                     "test_tokens": int(result["tokens"]), "train_s": train_seconds[arch], "eval_s": eval_s,
                     "run_dir": str(run_dir)})
        print(f"  {arch}: trained in {train_seconds[arch] / 60:.1f} min, test evaluated in {eval_s:.1f} s "
              f"({int(result['tokens']):,} tokens)", flush=True)

    byte_level = tok["kind"] == "bytes"
    print()
    print(equal_tokens_line(steps, tokens, rows))
    print(format_table(rows, byte_level))
    print()
    print(memory_effect(rows, steps))
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    uri = demo_config(archs[0], data, vocab, steps, lr).tracking.resolved_uri()
    print(f"\nrun folders: {out / 'runs'}/ARCH (config, DeepSpeed JSON, metrics.jsonl, checkpoints, eval/); "
          f"table: {out / 'results.json'}")
    print(f"MLflow: experiment '{DEMO_EXPERIMENT}' in {uri}; this demo's runs: {', '.join(names.values())}")
    if uri.startswith("sqlite:///"):
        store = _relative_sqlite(uri)
        flag = "" if store == "sqlite:///mlflow.db" else f" --uri {store}"  # the commands' own default
        command = memlm_command()
        view = runs_link("http://127.0.0.1:5000", experiment_id, saved_view=True)
        print(f"  browse it: {command} ui{flag}   (then {view})")
        print(f"  compare:   {command} compare --experiment {DEMO_EXPERIMENT}{flag}")
        if activation_hint():
            print(f"  {activation_hint()}")
    print(f"total {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def equal_tokens_line(steps: int, positions: int, rows: list[dict]) -> str:
    """The results table's heading: the tokens each arch trained on, exactly. A lane pads a document's last segment
    and the padding is not trained on, so a run of S steps trains on a few tokens fewer than S x lanes x N positions
    (issue 32: the demo announced 1,536,000 and trained 1,534,347)."""
    trained = sorted({int(row["tokens"]) for row in rows})
    if len(trained) != 1:  # never with the same data, lanes and steps; said rather than hidden
        return (f"Equal steps for every arch ({steps:,} steps); training tokens differ: "
                + ", ".join(f"{row['arch']} {int(row['tokens']):,}" for row in rows) + ":")
    padding = positions - trained[0]
    note = f"; the other {padding:,} of the {positions:,} positions were documents' end padding" if padding else ""
    return f"Equal steps and tokens for every arch ({steps:,} steps, {trained[0]:,} training tokens each{note}):"


def tail_mean_loss(metrics: list[dict], steps: int) -> float:
    """Mean logged training loss over the last tenth of the steps (one batch's loss is too noisy to compare)."""
    tail = [m["loss"] for m in metrics if m["step"] > steps - max(1, steps // 10)] or [metrics[-1]["loss"]]
    return sum(tail) / len(tail)


def median_rate(metrics: list[dict]) -> float:
    """Median tokens/s over the logged windows: the number `memlm compare` shows for the same run."""
    rates = sorted(m["tokens_per_s"] for m in metrics if "tokens_per_s" in m)
    if not rates:
        return float("nan")
    mid = len(rates) // 2
    return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2


def memory_effect(rows: list[dict], steps: int) -> str:
    """Each memory model's test NLL against the no-memory baseline's, at the same steps and tokens."""
    base = next((r for r in rows if not arch_spec(r["arch"]).has_memory), None)
    others = [r for r in rows if arch_spec(r["arch"]).has_memory]
    if base is None or not others:
        return "memory's effect: needs the no-memory 'transformer' run next to a memory model"
    lines = [f"memory's effect (test NLL against the no-memory {base['arch']}, same steps and tokens):"]
    for r in others:
        delta = r["test_nll"] - base["test_nll"]
        verdict = "about the same" if abs(delta) < NLL_TIE else "better" if delta < 0 else "not better"
        lines.append(f"  {r['arch']:10s} {delta:+.3f} nats/token ({100 * delta / base['test_nll']:+.1f}%)  {verdict}")
    if all(r["test_nll"] >= base["test_nll"] for r in others):
        lines.append(f"  At {steps:,} steps memory has not paid off yet: a model must first learn to use it "
                     f"(this demo's default, {DEMO_STEPS:,} steps, is where it shows).")
    return "\n".join(lines)


def format_table(rows: list[dict], byte_level: bool) -> str:
    metric = "test bpc" if byte_level else "test ppl"
    lines = [f"{'arch':12s} {'params':>10s} {'steps':>6s} {'train loss':>10s} {'test nll':>9s} {metric:>9s} "
             f"{'tokens/s':>9s}"]
    for r in rows:
        value = r["test_bpc"] if byte_level else r["test_ppl"]
        lines.append(f"{r['arch']:12s} {r['params']:10,d} {r['steps']:6d} {r['train_loss']:10.3f} "
                     f"{r['test_nll']:9.3f} {value:9.3f} {r['tokens_per_s']:9.0f}")
    return "\n".join(lines)


def _relative_sqlite(uri: str) -> str:
    path = Path(uri[len("sqlite:///"):])
    try:
        rel = path.relative_to(Path.cwd().resolve())
        return f"sqlite:///{rel}"
    except ValueError:
        return uri
