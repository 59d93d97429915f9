"""Model FLOPs utilisation of a training step at the WikiText-103 base configuration (for a lent GPU).

    python bench/benchmarks/bench_mfu.py     # cuda, bf16, transformer/txl/lamemo/rmt -> bench/results/mfu_cuda.json
    python bench/benchmarks/bench_mfu.py --precision fp32 --out bench/results/mfu_cuda_fp32.json   # fp32 (tf32 matmuls)
    python bench/benchmarks/bench_mfu.py --archs txl --steps 10 --profile bench/results/profile_txl_bf16_cuda.txt
    python bench/benchmarks/bench_mfu.py --device cpu --n-layer 2 --lanes 2 --steps 3 --out /tmp/mfu.json  # CPU smoke

A step is what the trainer does per micro-batch, without DeepSpeed: forward of one [B, N] segment with the memory
carried from the previous one (bf16 autocast; LaMemo keeps S and alpha in fp32), mean NLL, backward, gradient
clipping, a fused AdamW step (on CUDA). MFU = tokens/s x training FLOPs per token / the device's peak dense bf16
rate, with training FLOPs = 3 x the analytic forward FLOPs of models/flops.py (backward = 2 x forward); fp32 runs
(tf32 matmuls) are also given against the dense tf32 peak. rmt runs with 10 memory tokens, no Transformer-XL cache
and bptt_depth 0 (one segment per step, like the others). Targets are
sampled from a Zipf distribution over the vocabulary, the same token-frequency law models/flops.py assumes for the
adaptive softmax's tail clusters, so measured work and counted FLOPs describe the same batches.
The trainer's own overhead on top of this loop is bench_trainer.py's figure (CPU); on CUDA, bench_gpu_trainer.py
measures the trainer itself (bench/README.md, GPU section).
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

from memlm.bench.common import RESULTS, write_result
from memlm.bench.interrupt import stop_in_one_line
from memlm.models import build_model
from memlm.models.config import ModelConfig
from memlm.models.flops import flops_per_token
from memlm.models.registry import arch_spec

# Dense tensor-core peaks (no sparsity), by device name, in FLOP/s: the vendors' datasheet figures (SXM parts;
# the H100 PCIe is listed first because its name also contains "H100").
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
PEAK_TF32 = {"H100 PCIe": 378e12, "H100": 494.7e12, "H200": 494.7e12, "A100": 156e12}
RMT_MEM_TOKENS = 10  # preset paper/wt103/rmt_bptt3_mem10

# The LaMemo paper's WikiText-103 base (App. C; preset paper/wt103/txl): 16 layers, 10 x 41, N = M = 150.
WT103_BASE = dict(n_layer=16, n_head=10, d_head=41, d_model=410, d_inner=2100, vocab_size=267735, tgt_len=150,
                  mem_len=150, cutoffs=[20000, 40000, 200000], div_val=1, tie_weight=True, dropout=0.1)


def peak_flops(device: str, table: dict | None = None) -> tuple[str, float | None]:
    if not device.startswith("cuda"):
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, next((peak for key, peak in (table or PEAK_BF16).items() if key in name), None)


def device_info(device: str) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30, cudnn=torch.backends.cudnn.version(),
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return info


class CompileCounts:
    """torch._dynamo's counters from now on: frames captured (each a graph; one more after warm-up is a recompile)
    and graph breaks."""

    def __init__(self):
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        self.counters = counters

    def read(self) -> dict:
        return {"graphs": int(self.counters["stats"]["unique_graphs"]),
                "breaks": int(sum(self.counters["graph_break"].values()))}


def zipf_tokens(vocab: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Token ids with P(rank r) proportional to 1/r, rank = id (word vocabularies are sorted by frequency)."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, int(torch.tensor(shape).prod()), replacement=True, generator=gen).view(shape)


def bench_arch(arch: str, args) -> dict:
    settings = {**WT103_BASE, "n_layer": args.n_layer, "tgt_len": args.tgt_len, "mem_len": args.mem_len}
    settings.update({k: getattr(args, k) for k in ("d_model", "n_head", "d_head", "d_inner") if getattr(args, k)})
    spec = arch_spec(arch)
    if spec.mem_len == "zero":  # no Transformer-XL cache (the baseline, ARMT)
        settings["mem_len"] = 0
    if spec.memory_tokens:  # RMT as preset paper/wt103/rmt_bptt3_mem10: memory tokens, no Transformer-XL cache
        settings.update(mem_len=0, **{spec.memory_tokens: RMT_MEM_TOKENS})
    cfg = ModelConfig(arch=arch, attention=args.attention, head_loss=args.head_loss, **settings).validate()
    torch.manual_seed(0)
    model = build_model(cfg).to(args.device).train()
    n_params = sum(p.numel() for p in model.parameters())
    forward = model
    if args.compile and args.compile_scope == "layer":
        model.compile_layers(dynamic=False)  # one layer's graph, reused by every layer
    elif args.compile:
        forward = torch.compile(model)
    fused = args.device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=2.5e-4, fused=fused)
    gen = torch.Generator().manual_seed(1)
    pool = [zipf_tokens(cfg.vocab_size, (args.lanes, cfg.tgt_len + 1), gen).to(args.device) for _ in range(4)]
    memory = model.init_memory(args.lanes, device=args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.precision]
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"

    def sync() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize()

    def step(i: int) -> float:
        nonlocal memory
        seq = pool[i % len(pool)]
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            out = forward(seq[:, :-1], memory, targets=seq[:, 1:])
            loss = out.nll.float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        opt.zero_grad(set_to_none=True)
        memory = out.memory.detached()
        sync()
        return time.perf_counter() - t0

    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    compiles = CompileCounts()
    t_warm = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    warmup_s = time.perf_counter() - t_warm
    after_warmup = compiles.read()
    times = [step(args.warmup + i) for i in range(args.steps)]
    timed = compiles.read()
    median = statistics.median(times)
    tokens_per_s = args.lanes * cfg.tgt_len / median
    fwd = flops_per_token(cfg, batch_size=args.lanes)["total"]
    achieved = tokens_per_s * 3 * fwd
    name, peak = peak_flops(args.device)
    row = {"arch": arch, "params": n_params, "compiled": bool(args.compile),
           "compile_scope": args.compile_scope if args.compile else None, "attention": args.attention,
           "head_loss": args.head_loss, "lanes": args.lanes, "step_s_median": median,
           # torch.compile's work: graphs captured during warm-up (the compile time is most of warmup_s), graph
           # breaks, and captures after warm-up (recompiles: a shape or guard that changed while timing; want 0).
           "graphs_at_warmup": after_warmup["graphs"], "graph_breaks": timed["breaks"],
           "recompiles_after_warmup": timed["graphs"] - after_warmup["graphs"],
           "step_s_min": min(times), "step_s": times, "warmup_s": warmup_s, "tokens_per_step": args.lanes * cfg.tgt_len,
           "tokens_per_s": tokens_per_s, "fwd_flops_per_token": fwd,
           "train_flops_per_step": 3 * fwd * args.lanes * cfg.tgt_len,
           "achieved_tflops": achieved / 1e12, "device": name, "peak_tflops": peak / 1e12 if peak else None,
           "mfu": achieved / peak if peak else None}
    if args.precision == "fp32":
        _, peak32 = peak_flops(args.device, PEAK_TF32)
        row.update(peak_tf32_tflops=peak32 / 1e12 if peak32 else None,
                   mfu_vs_tf32=achieved / peak32 if peak32 else None)
    if device_type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a (no peak for this device)"
    peak_mem = f", peak {row['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in row else ""
    print(f"{arch}: {median * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, {row['achieved_tflops']:.2f} TFLOP/s, "
          f"MFU {mfu}{peak_mem}; warm-up {warmup_s:.1f} s, graphs {row['graphs_at_warmup']}, breaks "
          f"{row['graph_breaks']}, recompiles {row['recompiles_after_warmup']}", flush=True)
    if args.profile and arch in args.profile_archs:
        row["profile"] = profile_steps(step, args, arch, median)
    model = forward = opt = memory = pool = None  # frees the GPU memory before the next arch (step() is done)
    if device_type == "cuda":
        torch.cuda.empty_cache()
    return row


MATMUL_KERNELS = ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "wgmma")


def profile_steps(step, args, arch: str, median: float) -> dict:
    """torch.profiler over args.profile_steps steps: a kernel table (by self device time) appended to args.profile,
    and the device time split into matmul kernels and the rest, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    n = args.profile_steps
    with profile(activities=activities) as prof:
        wall = sum(step(i) for i in range(n))
    events = prof.key_averages()
    sort_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = events.table(sort_by=sort_key, row_limit=30, max_name_column_width=90)
    summary = {"steps": n, "wall_ms_per_step": 1e3 * wall / n, "median_ms_per_step_unprofiled": 1e3 * median}
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        self_us = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))  # noqa: E731
        total = sum(self_us(e) for e in kernels)
        mm = sum(self_us(e) for e in kernels if any(k in e.key.lower() for k in MATMUL_KERNELS))
        top = sorted(kernels, key=self_us, reverse=True)[:10]
        summary.update(kernel_ms_per_step=total / 1e3 / n, matmul_kernel_ms_per_step=mm / 1e3 / n,
                       other_kernel_ms_per_step=(total - mm) / 1e3 / n,
                       kernel_launches_per_step=sum(e.count for e in kernels) / n,
                       gpu_busy_fraction=(total / 1e6) / wall if wall else None,
                       top10_kernels=[{"kernel": e.key[:160], "ms_per_step": self_us(e) / 1e3 / n,
                                       "calls_per_step": e.count / n}
                                      for e in top])
    with open(args.profile, "a") as f:
        f.write(f"# {arch}, {args.precision}, {args.device}, {n} profiled steps, lanes {args.lanes}, "
                f"N {args.tgt_len}, M {args.mem_len}, compiled {bool(args.compile)}\n")
        f.write(json.dumps(summary, indent=2) + "\n")
        f.write(table + "\n\n")
    print(f"{arch}: profile -> {args.profile}: " + ", ".join(
        f"{k} {v:.2f}" for k, v in summary.items() if isinstance(v, float)), flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--archs", nargs="+", default=["transformer", "txl", "lamemo", "rmt"])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--lanes", type=int, default=64, help="batch (the paper's 64 on one device)")
    parser.add_argument("--n-layer", type=int, default=16)
    for name in ("d-model", "n-head", "d-head", "d-inner"):
        parser.add_argument(f"--{name}", type=int, default=0, help="override the WikiText-103 base value (0: keep it)")
    parser.add_argument("--tgt-len", type=int, default=150)
    parser.add_argument("--mem-len", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (default: eager)")
    parser.add_argument("--compile-scope", choices=["model", "layer"], default="model",
                        help="with --compile: the whole forward, or one layer's work (Backbone.compile_layers)")
    parser.add_argument("--attention", choices=["auto", "eager", "flex"], default="auto",
                        help="model.attention (auto: FlexAttention on CUDA)")
    parser.add_argument("--head-loss", choices=["auto", "full", "chunked"], default="auto",
                        help="model.head_loss (auto: chunked on CUDA)")
    parser.add_argument("--profile", default=None, metavar="TXT", help="append a torch.profiler table per arch here")
    parser.add_argument("--profile-archs", nargs="+", default=["txl"], help="archs to profile (with --profile)")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="default bench/results/mfu_<device>.json")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.profile:
        Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
        Path(args.profile).write_text("")
    rows = [bench_arch(arch, args) for arch in args.archs]
    config = {**WT103_BASE, **{k: v for k, v in vars(args).items() if v or k not in WT103_BASE}}
    out = write_result(args.out or RESULTS / f"mfu_{args.device.split(':')[0]}.json",
                       {"benchmark": "mfu", "torch": torch.__version__, "device": device_info(args.device),
                        "precision": args.precision, "target_mfu_h100": 0.40, "config": config, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
