"""`memlm demo`: the real pipeline, end to end, on a corpus that exists on any machine (DESIGN §6).

1. Corpus. `--wikitext PATH` (or $MEMLM_DEMO_WIKITEXT) prepares WikiText (word tokenizer) with `prepare`;
   otherwise the standard library's own `.py` files become a `textdir` corpus under OUT/corpus (one document per
   file, split deterministically by sorted name: every 10th file test, the next one valid, the rest train,
   a few MB in all) prepared with the bytes tokenizer (vocabulary 256) into OUT/data.
2. Training. A small no-memory Transformer+RPE baseline, Transformer-XL and LaMemo, each through the real trainer
   (`trainer.train.run`: a DeepSpeed engine, CPU accelerator when there is no GPU) into OUT/runs/ARCH, tracked in
   MLflow (experiment "memlm-demo"; default store: SQLite mlflow.db in the working folder). The step count comes
   from `--seconds` (training seconds per architecture) and a short timing of that model's own training step.
3. Evaluation of each run's final checkpoint on the test split (`evaluate_run`, per-document memory).
4. A comparison table: arch, parameters, steps, train loss, test NLL, bpc (bytes) or ppl (words), tokens/s.

Re-running with the same OUT replaces the corpus, data and run folders this demo wrote there.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sysconfig
import time
from pathlib import Path

DEMO_EXPERIMENT = "memlm-demo"
DEMO_ARCHS = ("transformer", "txl", "lamemo")
CORPUS_MARKER = "MEMLM_DEMO_CORPUS"  # a folder holding this file was written by the demo and may be replaced
TRAIN_BYTES = 3_000_000  # stdlib corpus caps (bytes of UTF-8 text per split)
HELD_OUT_BYTES = 48_000
HELD_OUT_MAX_FILE = 8_000  # held-out documents stay short so that evaluation (longest lane) is quick
MIN_STEPS, MAX_STEPS = 5, 100_000
STEP_OVERHEAD = 1.5  # headroom: trainer step (DeepSpeed, data stream, logging) vs the bare measured step
# Small models: 2 layers, d_model 128, 4 heads x 32, N = M = 64, 8 lanes.
MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "d_head": 32, "d_inner": 512, "tgt_len": 64, "mem_len": 64,
         "dropout": 0.0, "dropatt": 0.0}
ARCH_MODEL = {"transformer": {"mem_len": 0}, "txl": {}, "lamemo": {}}
BATCH = 8


# ---------------------------------------------------------------------------------------------------------------
# Corpus


def stdlib_corpus(root: Path, train_bytes: int | None = None, held_out_bytes: int | None = None) -> dict:
    """Write the stdlib's top-level .py files (UTF-8, > 2 kB) as ROOT/{train,valid,test}/NNNN_name.txt.

    Sorted by name; file i goes to test when i % 10 == 0, to valid when i % 10 == 1 (if at most 8 kB), else to train, until each
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
            from data_pipeline.format import DataError

            raise DataError(f"{folder} exists and was not written by `memlm demo`: choose another --out "
                            "or remove it yourself")
    folder.mkdir(parents=True)


def prepare_corpus(out: Path, wikitext: str | None) -> tuple[Path, dict, str]:
    """(DATA_DIR, manifest, description) for the demo's corpus."""
    from data_pipeline.prepare import prepare

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


def demo_config(arch: str, data: Path, vocab_size: int, steps: int):
    from .config import config_from_dict

    model = {"arch": arch, **MODEL, **ARCH_MODEL[arch], "vocab_size": vocab_size}
    if vocab_size > 20_000:  # word-level WikiText: an adaptive softmax keeps the CPU step affordable
        model.update(cutoffs=[2000, 10000], div_val=1)
    tree = {
        "model": model,
        "data": {"path": str(data), "batch_size": BATCH, "eval_batch_size": 2 * BATCH},
        "train": {"steps": steps, "lr": 1e-3, "warmup_steps": min(20, steps // 10), "schedule": "cosine",
                  "clip": 0.25, "save_every": 0, "keep_last": 1, "eval_every": steps, "eval_batches": 8,
                  "log_every": max(1, min(10, steps // 5))},
        "deepspeed": {"zero_stage": 0, "precision": "fp32"},
        "tracking": {"enabled": True, "experiment": DEMO_EXPERIMENT, "run_name": f"demo-{arch}"},
    }
    return config_from_dict(tree)


def measure_step_seconds(cfg, repeats: int = 5, warmup: int = 3) -> tuple[float, int]:
    """(seconds per training step, parameter count) of cfg.model with a plain Adam on random tokens.

    The DeepSpeed step on the CPU adds little on top of this; memory is carried as in training."""
    import torch

    from models import build_model, map_memory

    torch.manual_seed(0)
    model = build_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    b, n, v = cfg.data.batch_size, cfg.model.tgt_len, cfg.model.vocab_size
    memory = model.init_memory(b)
    times = []
    for i in range(warmup + repeats):
        tokens = torch.randint(0, v, (b, n))
        start = time.perf_counter()
        out = model(tokens, memory, targets=torch.randint(0, v, (b, n)))
        out.nll.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        memory = map_memory(lambda t: t.detach(), out.memory)
        if i >= warmup:  # the first steps pay one-off allocation and thread start-up costs
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], params


def _replace_run_folder(run_dir: Path) -> None:
    """A fresh run folder: an earlier demo run there (config.yaml / checkpoints) is removed first."""
    if not run_dir.exists():
        return
    if (run_dir / "config.yaml").is_file() or (run_dir / "checkpoints").is_dir() or not any(run_dir.iterdir()):
        shutil.rmtree(run_dir)
    else:
        from data_pipeline.format import DataError

        raise DataError(f"{run_dir} exists and is not a run folder: choose another --out or remove it yourself")


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# Main


def main(args) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")
    out = Path(getattr(args, "out", None) or "runs/demo")
    seconds = float(getattr(args, "seconds", 60.0))
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
    print(f"  training {', '.join(archs)} for about {seconds:g} s each (2 layers, d_model {MODEL['d_model']}, "
          f"N {MODEL['tgt_len']}, M {MODEL['mem_len']}, {BATCH} lanes)", flush=True)

    from .evaluate import evaluate_run
    from .train import run

    rows = []
    for arch in archs:
        probe = demo_config(arch, data, vocab, steps=1)
        step_s, params = measure_step_seconds(probe)
        steps = int(max(MIN_STEPS, min(MAX_STEPS, seconds / (STEP_OVERHEAD * max(step_s, 1e-6)))))
        cfg = demo_config(arch, data, vocab, steps)
        run_dir = out / "runs" / arch
        _replace_run_folder(run_dir)
        print(f"\n== {arch}: {params:,} parameters, {steps} steps (measured {step_s * 1000:.0f} ms/step)", flush=True)
        start = time.perf_counter()
        run(cfg, run_dir)
        train_s = time.perf_counter() - start
        metrics = read_metrics(run_dir)
        last = metrics[-1] if metrics else {}
        rates = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
        start = time.perf_counter()
        result = evaluate_run(run_dir, split="test")
        eval_s = time.perf_counter() - start
        _log_test_result(cfg, run_dir, result)
        rows.append({"arch": arch, "params": params, "steps": int(last.get("step", steps)),
                     "train_loss": float(last.get("loss", float("nan"))), "test_nll": float(result["nll"]),
                     "test_bpc": float(result.get("bpc", result["nll"] / math.log(2))),
                     "test_ppl": float(result.get("ppl", math.exp(min(result["nll"], 50.0)))),
                     "tokens_per_s": sum(rates) / len(rates) if rates else float("nan"),
                     "test_tokens": int(result["tokens"]), "train_s": train_s, "eval_s": eval_s,
                     "run_dir": str(run_dir)})
        print(f"   trained in {train_s:.1f} s, test evaluated in {eval_s:.1f} s "
              f"({int(result['tokens']):,} tokens)", flush=True)

    byte_level = tok["kind"] == "bytes"
    print()
    print(format_table(rows, byte_level))
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    uri = probe.tracking.resolved_uri()
    print(f"\nrun folders: {out / 'runs'}/ARCH (config, DeepSpeed JSON, metrics.jsonl, checkpoints, eval/); "
          f"table: {out / 'results.json'}")
    print(f"MLflow: experiment '{DEMO_EXPERIMENT}' in {uri}")
    if uri.startswith("sqlite:///"):
        store = _relative_sqlite(uri)
        flag = "" if store == "sqlite:///mlflow.db" else f" --uri {store}"  # the commands' own default
        print(f"  browse it: memlm ui{flag}   (http://127.0.0.1:5000)")
        print(f"  compare:   memlm compare --experiment {DEMO_EXPERIMENT}{flag}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


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


def _log_test_result(cfg, run_dir: Path, result: dict) -> None:
    """Add the test-split numbers to the run's MLflow run (reopened through its run-id file)."""
    try:
        from .tracking import Tracker
    except ImportError:
        return
    try:
        tracker = Tracker(cfg.tracking, run_dir, 0, cfg)
        tracker.log_metrics(int(result.get("step") or cfg.train.steps),
                            {f"test_{k}": float(result[k]) for k in ("nll", "ppl", "bpc") if k in result})
        tracker.finish("FINISHED")
    except Exception as exc:  # noqa: BLE001 - tracking must never cost the demo its table
        print(f"   (MLflow: could not log the test result: {type(exc).__name__}: {exc})")
