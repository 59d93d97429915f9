"""Generation speed: `trainer.inference.generate` (incremental cache inside a segment) against a naive loop that reruns
the
whole segment for every new token, per architecture, and Hugging Face TransfoXL's `generate` at the same shape.

    .venv/bin/python bench/benchmarks/bench_generate.py                 # -> bench/results/generate_cpu.json
    .venv/bin/python bench/benchmarks/bench_generate.py --tokens 64 --repeats 1 --no-hf

Shape: the demo's models (2 layers, d_model 128, 4 heads x 32, d_inner 512, N = M = 64, bytes vocabulary 256);
RMT with 4 memory tokens (no cache) and Transformer-XL + RMT (cache M = 64, 4 memory tokens). Weights are random:
speed does not depend on training. Each timed call feeds a 100-byte prompt (boundary + 99 bytes: one whole segment
through the model's forward, the rest incrementally) and samples --tokens tokens (top-p 0.9, seed 0), batch of one.
- memlm: `Generator.stream` (the API `memlm generate` uses, detokenization included);
- naive: the same sampling, but each token's log-probabilities come from the model's forward over the current
  segment (padded to N: LaMemo's look-ahead window depends on N) from the memory the segment started with; a full
  segment's forward gives the next memory, as in memlm. Both produce the same tokens (checked: `same_text`).
- HF TransfoXL (transformers 4.34.1 in the peer venv, ./.bench-venv, a subprocess): `generate` with
  do_sample, top_p 0.9, from a prompt of 100 random ids, same width/depth/heads/M; its memory slides by one token
  per step (HF keeps the last mem_len positions), so each token attends to M + 1 keys; ours to M + t (t <= N).
Archs are timed round-robin, --repeats times (default 5; medians, and the median of per-round naive/memlm
ratios), torch threads pinned (--threads, default 1), load average recorded before and after. Never part of the
test suite; nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from memlm.bench.common import RESULTS, ROOT, load_average, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line

MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "d_head": 32, "d_inner": 512, "tgt_len": 64, "vocab_size": 256,
         "dropout": 0.0, "dropatt": 0.0}
ARCHS = {
    "transformer": {"arch": "transformer", "mem_len": 0},
    "txl": {"arch": "txl", "mem_len": 64},
    "lamemo": {"arch": "lamemo", "mem_len": 64},
    "rmt": {"arch": "rmt", "mem_len": 0, "num_mem_tokens": 4},
    "txl_rmt": {"arch": "rmt", "mem_len": 64, "num_mem_tokens": 4},
}
PROMPT = "def generate(self, prompt, tokens):\n    # a prompt of one hundred bytes, more than a segment of 64\n  "
HF_VENV = ROOT / ".bench-venv" / "bin" / "python"


def naive_stream(model, tokenizer, prompt: str, tokens: int, top_p: float, seed: int) -> str:
    """Sampling with a full-segment recompute per token (the reference cost)."""
    import torch

    from memlm.trainer.inference.generate import Generator, TextStream, sample_next

    ids = Generator(model, tokenizer).encode_prompt(prompt)
    N = model.cfg.tgt_len
    memory, segment = model.init_memory(1), []
    generator = torch.Generator().manual_seed(seed)
    text, pieces = TextStream(tokenizer, ids), []

    def push(token: int):
        nonlocal memory, segment
        segment.append(token)
        padded = torch.tensor([segment + [0] * (N - len(segment))])
        out = model(padded, memory, return_logits=True)
        logp = out.logits[0, len(segment) - 1]
        if len(segment) == N:
            memory, segment = out.memory, []
        return logp

    with torch.no_grad():
        for token in ids:
            logp = push(token)
        for n in range(tokens):
            token = sample_next(logp, 1.0, 0, top_p, generator)
            pieces.append(text.push(token))
            if n + 1 < tokens:
                logp = push(token)
    return "".join(pieces) + text.flush()


HF_SCRIPT = r"""
import json, sys, time, warnings
import torch
torch.set_num_threads(int(sys.argv[1]))
tokens, repeats = int(sys.argv[2]), int(sys.argv[3])
from transformers import TransfoXLConfig, TransfoXLLMHeadModel
import transformers
warnings.simplefilter("ignore")
cfg = TransfoXLConfig(vocab_size=256, cutoffs=[], d_model=128, d_embed=128, n_head=4, d_head=32, d_inner=512,
                      n_layer=2, mem_len=64, tgt_len=64, div_val=1, untie_r=False, same_length=False, clamp_len=-1,
                      adaptive=True, dropout=0.0, dropatt=0.0, tie_word_embeddings=True, eos_token_id=None,
                      pad_token_id=0)
torch.manual_seed(0)
model = TransfoXLLMHeadModel(cfg).eval()
prompt = torch.randint(0, 256, (1, 100))
times = []
for _ in range(repeats + 1):
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_p=0.9,
                             top_k=0)
    times.append(time.perf_counter() - start)
assert out.shape[1] == 100 + tokens, out.shape
print(json.dumps({"seconds": times[1:], "library": f"transformers=={transformers.__version__}",
                  "torch": torch.__version__}))
"""


def bench_hf(tokens: int, repeats: int, threads: int) -> dict:
    if not HF_VENV.is_file():
        return {"skipped": f"{HF_VENV} is missing (bench/benchmarks/peers/requirements.txt)"}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": ""}
    proc = subprocess.run([str(HF_VENV), "-c", HF_SCRIPT, str(threads), str(tokens), str(repeats)],
                          capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        return {"failed": proc.stderr.strip().splitlines()[-1:] or ["?"]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    median = statistics.median(out["seconds"])
    return {**out, "median_s": median, "tokens_per_s": tokens / median,
            "note": "memory slides one token per step (HF mems): each token attends to M + 1 keys"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "generate_cpu.json"))
    args = parser.parse_args(argv)

    import torch

    from memlm.data_pipeline.tokenizers import ByteTokenizer
    from memlm.models import ModelConfig, build_model
    from memlm.trainer.inference.generate import Generator

    torch.set_num_threads(args.threads)
    tokenizer = ByteTokenizer()
    models = {}
    for name in args.archs.split(","):
        torch.manual_seed(0)
        models[name] = build_model(ModelConfig(**MODEL, **ARCHS[name])).eval()
    times = {name: {"memlm": [], "naive": []} for name in models}
    texts: dict[str, dict[str, str]] = {name: {} for name in models}
    settings = dict(tokens=args.tokens, top_p=0.9, seed=0)
    load_before = load_average()
    for repeat in range(args.repeats + 1):  # round 0 warms up
        for name, model in models.items():
            for method in ("memlm", "naive"):
                start = time.perf_counter()
                if method == "memlm":
                    text = Generator(model, tokenizer).generate(PROMPT, **settings)
                else:
                    text = naive_stream(model, tokenizer, PROMPT, args.tokens, 0.9, 0)
                elapsed = time.perf_counter() - start
                if repeat:
                    times[name][method].append(elapsed)
                texts[name][method] = text
    load_after = load_average()
    results = {}
    for name in models:
        row = {"config": ARCHS[name]}
        for method in ("memlm", "naive"):
            median = statistics.median(times[name][method])
            row[method] = {"seconds": times[name][method], "median_s": median, "tokens_per_s": args.tokens / median}
        row["speedup"] = row["naive"]["median_s"] / row["memlm"]["median_s"]
        # per-round ratio (memlm and naive timed back to back): the figure least disturbed by other processes
        row["speedup_paired"] = paired_ratio(times[name]["naive"], times[name]["memlm"])
        row["same_text"] = texts[name]["memlm"] == texts[name]["naive"]
        results[name] = row
    hf = None if args.no_hf else bench_hf(args.tokens, args.repeats, args.threads)
    report = {
        "benchmark": "generate", "tokens": args.tokens, "prompt_bytes": len(PROMPT.encode()), "repeats": args.repeats,
        "threads": args.threads, "model": MODEL, "results": results, "hf_transfoxl": hf,
        "load_before": load_before, "load_after": load_after, "torch": torch.__version__,
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "time_includes": "prompt feed (100 bytes) + sampling + detokenization",
    }
    out = write_result(args.out, report)
    print(f"{'arch':12s} {'memlm tok/s':>12s} {'naive tok/s':>12s} {'speedup':>8s} {'paired':>7s} same_text")
    for name, row in results.items():
        print(f"{name:12s} {row['memlm']['tokens_per_s']:12.1f} {row['naive']['tokens_per_s']:12.1f} "
              f"{row['speedup']:8.2f} {row['speedup_paired']:7.2f} {row['same_text']}")
    if hf and "tokens_per_s" in hf:
        print(f"{'hf-transfoxl':12s} {hf['tokens_per_s']:12.1f}")
    elif hf:
        print(f"hf-transfoxl: {hf}")
    print(f"load average before {load_before} after {load_after}; wrote {out}")
    return report


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
