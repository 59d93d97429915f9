"""Lane-stream throughput: shards on disk -> ready [B, N] batches, in one process.

    .venv/bin/python bench/benchmarks/bench_stream.py                       # -> bench/results/stream_cpu.json
    .venv/bin/python bench/benchmarks/bench_stream.py --tokens 5e6 --repeats 3 --data DATA_DIR --split train

Writes a synthetic corpus (~20M tokens by default, document lengths log-normal around a WikiText-103 article,
vocabulary 32k so tokens are uint16 on disk, 2M-token shards) with data_pipeline.shards.write_split to a temporary
folder, then times fresh LaneStreams reading one epoch's worth of batches (B = 8, N = 512): train (document
lanes, shuffled), train continuous, and eval (which includes its pre-pass over the tar headers). A repeat starts
from a fresh stream, so shard hashing and tar parsing are inside the timing; the page cache is warm after the
first repeat. Also timed: read_shard alone (the tar reading every mode pays). With WikiText-2 present in
../shared/data and data_pipeline.prepare available, its prepared train split is timed too.

Tokens/s counts batch slots (B x N per batch), the same unit as bench_models.py's training tokens/s, which the
JSON compares against (the fastest model result in bench/results/models_cpu.json; target: >= 50x).
Never part of the test suite; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from memlm.bench.common import RESULTS, ROOT, WIKITEXT2, write_result
from memlm.bench.interrupt import stop_in_one_line
from memlm.data_pipeline.format import FORMAT_VERSION, MANIFEST
from memlm.data_pipeline.shards import read_shard, write_split
from memlm.data_pipeline.stream import LaneStream

TARGET_RATIO = 50.0
VOCAB = 32_000


def write_synthetic(root: Path, tokens: int, shard_tokens: int, seed: int = 0) -> dict:
    """A prepared DATA_DIR with one 'train' split of about `tokens` tokens; returns the manifest."""
    rng = np.random.default_rng(seed)

    def documents():
        total, index = 0, 0
        while total < tokens:
            length = int(np.clip(rng.lognormal(mean=7.9, sigma=0.8), 1, 60_000))  # median ~2.7k, mean ~3.7k
            total += length
            index += 1
            yield rng.integers(1, VOCAB, size=length, dtype=np.uint16), None, f"doc {index}"

    entry = write_split(root, "train", documents(), VOCAB, shard_tokens)
    (root / "tokenizer").mkdir(exist_ok=True)
    manifest = {"format": FORMAT_VERSION, "corpus": {"kind": "synthetic", "input": ""},
                "tokenizer": {"kind": "word", "vocab_size": VOCAB, "sha256": "0" * 64, "boundary_id": 0,
                              "path": "tokenizer"},
                "splits": {"train": entry}}
    (root / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2))
    return manifest


def time_stream(data_dir: Path, split: str, slots: int, lanes: int, seg_len: int, **kwargs) -> dict:
    """Seconds for a fresh stream to yield `slots` batch slots (one epoch's worth for train)."""
    start = time.perf_counter()
    stream = LaneStream(data_dir, split, lanes=lanes, seg_len=seg_len, **kwargs)
    batches, scored = 0, 0
    for batch in stream:
        batches += 1
        scored += int((batch.targets != -100).sum())
        if batches * lanes * seg_len >= slots:
            break
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "batches": batches, "slots": batches * lanes * seg_len, "scored": scored}


def time_read_shards(data_dir: Path, manifest: dict, split: str) -> dict:
    start = time.perf_counter()
    tokens = 0
    for shard in manifest["splits"][split]["shards"]:
        for doc in read_shard(data_dir / shard["path"], expected_sha256=shard["sha256"]):
            tokens += len(doc["tokens"])
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def summarise(runs: list[dict], count_key: str) -> dict:
    seconds = [r["seconds"] for r in runs]
    med = statistics.median(seconds)
    out = {"seconds": seconds, "median_s": med, "tokens_per_s": runs[0][count_key] / med}
    if "scored" in runs[0]:
        out.update(batches=runs[0]["batches"], slots=runs[0]["slots"], scored_tokens=runs[0]["scored"],
                   scored_tokens_per_s=runs[0]["scored"] / med)
    return out


def bench_dir(data_dir: Path, split: str, args) -> dict:
    manifest = json.loads((data_dir / MANIFEST).read_text())
    entry = manifest["splits"][split]
    slots = entry["tokens"]
    common = dict(lanes=args.lanes, seg_len=args.seg_len)
    modes = {"train": dict(mode="train", seed=1), "train_continuous": dict(mode="train", seed=1, continuous=True),
             "eval": dict(mode="eval")}
    result = {"split": split, "documents": entry["documents"], "tokens": entry["tokens"],
              "shards": len(entry["shards"]), "modes": {}}
    result["read_shard"] = summarise([time_read_shards(data_dir, manifest, split) for _ in range(args.repeats)],
                                     "tokens")
    for name, kwargs in modes.items():
        runs = [time_stream(data_dir, split, slots if name != "eval" else float("inf"), **common, **kwargs)
                for _ in range(args.repeats)]
        result["modes"][name] = summarise(runs, "slots")
        print(f"{data_dir.name}/{split} {name:17s} {result['modes'][name]['tokens_per_s'] / 1e6:6.1f} M slots/s  "
              f"({result['modes'][name]['scored_tokens_per_s'] / 1e6:5.1f} M scored tokens/s)", flush=True)
    print(f"{data_dir.name}/{split} read_shard alone  {result['read_shard']['tokens_per_s'] / 1e6:6.1f} M tokens/s")
    return result


def model_comparison(stream_tokens_per_s: float) -> dict | None:
    path = RESULTS / "models_cpu.json"
    if not path.is_file():
        return None
    models = json.loads(path.read_text())
    best_name, best = None, 0.0
    for dtype, archs in models.get("results", {}).items():
        for arch, res in archs.items():
            if res.get("tokens_per_s", 0.0) > best:
                best_name, best = f"{arch}/{dtype}", res["tokens_per_s"]
    if not best:
        return None
    return {"models_file": str(path.relative_to(ROOT)), "fastest_model": best_name, "model_tokens_per_s": best,
            "model_config": {k: models.get("config", {}).get(k) for k in ("batch", "tgt_len", "threads")},
            "stream_train_tokens_per_s": stream_tokens_per_s, "ratio": stream_tokens_per_s / best,
            "target_ratio": TARGET_RATIO, "met": stream_tokens_per_s / best >= TARGET_RATIO}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=float, default=20e6, help="synthetic corpus size")
    parser.add_argument("--shard-tokens", type=float, default=2e6)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--seg-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", type=Path, help="also time this prepared DATA_DIR")
    parser.add_argument("--split", default="train")
    parser.add_argument("--no-wikitext2", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "stream_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the stream does not use torch's threads; keep the comparison honest

    report = {"benchmark": "lane stream: shards -> ready batches, one process", "torch": torch.__version__,
              "python": platform.python_version(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
              "config": {"lanes": args.lanes, "seg_len": args.seg_len, "repeats": args.repeats,
                         "synthetic_tokens": int(args.tokens), "shard_tokens": int(args.shard_tokens)},
              "datasets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        synth = Path(tmp) / "synthetic"
        start = time.perf_counter()
        write_synthetic(synth, int(args.tokens), int(args.shard_tokens))
        report["config"]["write_s"] = time.perf_counter() - start
        report["datasets"]["synthetic"] = bench_dir(synth, "train", args)
        wt2 = WIKITEXT2
        if not args.no_wikitext2 and (wt2 / "wiki.train.tokens").is_file():
            try:
                from memlm.data_pipeline.prepare import prepare
            except ImportError:
                prepare = None
            if prepare is not None:
                prepare("wikitext", wt2, Path(tmp) / "wikitext-2", progress=False)
                report["datasets"]["wikitext-2"] = bench_dir(Path(tmp) / "wikitext-2", "train", args)
        if args.data:
            report["datasets"][str(args.data)] = bench_dir(args.data, args.split, args)

    train = report["datasets"]["synthetic"]["modes"]["train"]["tokens_per_s"]
    report["vs_models"] = model_comparison(train)
    if report["vs_models"]:
        v = report["vs_models"]
        print(f"stream train {train / 1e6:.1f} M tokens/s vs fastest model {v['fastest_model']} "
              f"{v['model_tokens_per_s']:.0f} tokens/s: {v['ratio']:.0f}x (target >= {TARGET_RATIO:.0f}x)")
    write_result(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
