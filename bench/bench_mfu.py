"""Model FLOPs utilisation of a training step at the WikiText-103 base configuration (for a lent GPU).

    python bench/bench_mfu.py                                   # cuda, bf16, transformer/txl/lamemo -> results/mfu_cuda.json
    python bench/bench_mfu.py --device cpu --n-layer 2 --lanes 2 --steps 3 --out /tmp/mfu.json   # smoke run on CPU

A step is what the trainer does per micro-batch, without DeepSpeed: forward of one [B, N] segment with the memory
carried from the previous one (bf16 autocast; LaMemo keeps S and alpha in fp32), mean NLL, backward, gradient
clipping, a fused AdamW step (on CUDA). MFU = tokens/s x training FLOPs per token / the device's peak dense bf16
rate, with training FLOPs = 3 x the analytic forward FLOPs of models/flops.py (backward = 2 x forward). Targets are
sampled from a Zipf distribution over the vocabulary, the same token-frequency law models/flops.py assumes for the
adaptive softmax's tail clusters, so measured work and counted FLOPs describe the same batches.
The trainer's own overhead on top of this loop is bench_trainer.py's figure; trainer MFU ~= this / (1 + overhead).
Needs only torch and this repository (the GPU machines have no registry access). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import build_model, map_memory  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.flops import flops_per_token  # noqa: E402

# Dense bf16 tensor-core peak (no sparsity), by device name, in FLOP/s: the vendors' datasheet figures.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}

# The LaMemo paper's WikiText-103 base (App. C; configs/wt103_base_txl.yaml): 16 layers, 10 x 41, N = M = 150.
WT103_BASE = dict(n_layer=16, n_head=10, d_head=41, d_model=410, d_inner=2100, vocab_size=267735, tgt_len=150,
                  mem_len=150, cutoffs=[20000, 40000, 200000], div_val=1, tie_weight=True, dropout=0.1)


def peak_flops(device: str) -> tuple[str, float | None]:
    if not device.startswith("cuda"):
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def zipf_tokens(vocab: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Token ids with P(rank r) proportional to 1/r, rank = id (word vocabularies are sorted by frequency)."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, int(torch.tensor(shape).prod()), replacement=True, generator=gen).view(shape)


def bench_arch(arch: str, args) -> dict:
    settings = {**WT103_BASE, "n_layer": args.n_layer, "tgt_len": args.tgt_len, "mem_len": args.mem_len}
    if arch == "transformer":
        settings["mem_len"] = 0
    cfg = ModelConfig(arch=arch, **settings).validate()
    torch.manual_seed(0)
    model = build_model(cfg).to(args.device).train()
    fused = args.device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=2.5e-4, fused=fused)
    gen = torch.Generator().manual_seed(1)
    pool = [zipf_tokens(cfg.vocab_size, (args.lanes, cfg.tgt_len + 1), gen).to(args.device) for _ in range(4)]
    memory = model.init_memory(args.lanes, device=args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.precision]
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"

    def step(i: int) -> float:
        nonlocal memory
        seq = pool[i % len(pool)]
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            out = model(seq[:, :-1], memory, targets=seq[:, 1:])
            loss = out.nll.float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        opt.zero_grad(set_to_none=True)
        memory = map_memory(torch.Tensor.detach, out.memory)
        sync()
        return time.perf_counter() - t0

    def sync() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize()

    for i in range(args.warmup):
        step(i)
    times = [step(args.warmup + i) for i in range(args.steps)]
    median = statistics.median(times)
    tokens_per_s = args.lanes * cfg.tgt_len / median
    fwd = flops_per_token(cfg, batch_size=args.lanes)["total"]
    achieved = tokens_per_s * 3 * fwd
    name, peak = peak_flops(args.device)
    row = {"arch": arch, "params": sum(p.numel() for p in model.parameters()), "step_s_median": median,
           "step_s_min": min(times), "tokens_per_s": tokens_per_s, "fwd_flops_per_token": fwd,
           "achieved_tflops": achieved / 1e12, "device": name, "peak_tflops": peak / 1e12 if peak else None,
           "mfu": achieved / peak if peak else None}
    if device_type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a (no peak for this device)"
    print(f"{arch}: {median * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, {row['achieved_tflops']:.2f} TFLOP/s, "
          f"MFU {mfu}", flush=True)
    del model, opt, memory, pool
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--archs", nargs="+", default=["transformer", "txl", "lamemo"])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--lanes", type=int, default=64, help="batch (the paper's 64 on one device)")
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--tgt-len", type=int, default=150)
    parser.add_argument("--mem-len", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="default bench/results/mfu_<device>.json")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    rows = [bench_arch(arch, args) for arch in args.archs]
    out = Path(args.out or ROOT / "bench" / "results" / f"mfu_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "mfu", "torch": torch.__version__, "precision": args.precision,
                               "target_mfu_h100": 0.40, "config": {**WT103_BASE, **vars(args)}, "rows": rows},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
