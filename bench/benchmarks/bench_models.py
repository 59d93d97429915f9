"""Forward + backward throughput of every architecture at one small fixed configuration.

    .venv/bin/python bench/benchmarks/bench_models.py             # CPU, fp32 and bf16 -> bench/results/models_cpu.json
    .venv/bin/python bench/benchmarks/bench_models.py --profile   # also torch.profiler tables for LaMemo and TXL
    .venv/bin/python bench/benchmarks/bench_models.py --device cuda --out bench/results/models_cuda.json

One step = forward of one segment [B, N] with the memory carried over from the previous step, mean NLL,
backward (gradients dropped, no optimizer). The architectures are timed round-robin (one step each per round),
so slow drifts of the machine hit all of them alike; the reported time is the median over the timed rounds
after warm-up (also the minimum, and for LaMemo / Transformer-XL the median of the per-round ratios, which is the
figure least disturbed by other processes on a shared machine). Achieved GFLOP/s uses the forward+backward FLOPs of one
step measured once with
torch.utils.flop_counter (matmuls only); the analytic forward FLOPs per token come from models/flops.py.
Never part of the test suite; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from memlm.bench.common import RESULTS, ROOT, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line
from memlm.models import ModelConfig, arch_spec, build_model
from memlm.models.flops import flops_per_token, param_count

ARCHS = ("transformer", "txl", "lamemo", "rmt")
TARGET_LAMEMO_TXL_RATIO = 1.25


def cpu_info() -> dict:
    """Model name and the bf16-relevant instruction sets, from /proc/cpuinfo where there is one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"name": platform.processor() or platform.machine()}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "name": fields.get("model name") or platform.processor() or platform.machine(),
        "bf16_isa": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
    }


def model_config(arch: str, args) -> ModelConfig:
    spec = arch_spec(arch)
    return ModelConfig(
        arch=arch, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, d_head=args.d_head,
        d_inner=args.d_inner, vocab_size=args.vocab, tgt_len=args.tgt_len,
        # The no-memory baseline has no cache; RMT runs on its memory tokens alone
        mem_len=0 if spec.mem_len == "zero" or spec.memory_tokens else args.mem_len, dropout=0.0,
        **({spec.memory_tokens: args.mem_tokens} if spec.memory_tokens else {}),
    ).validate()


def autocast(dtype: str, device: str):
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Runner:
    """One model, its carried memory and a fixed pool of random segments."""

    def __init__(self, arch: str, args, device: str):
        torch.manual_seed(0)
        self.cfg = model_config(arch, args)
        self.model = build_model(self.cfg).to(device).train()
        self.device = device
        gen = torch.Generator().manual_seed(1)
        shape = (args.batch, args.tgt_len + 1)
        self.pool = [torch.randint(0, args.vocab, shape, generator=gen).to(device) for _ in range(4)]
        self.memory = self.model.init_memory(args.batch, device=device)
        self.i = 0

    def step(self, dtype: str) -> None:
        seq = self.pool[self.i % len(self.pool)]
        self.i += 1
        with autocast(dtype, self.device):
            out = self.model(seq[:, :-1], self.memory, targets=seq[:, 1:])
            loss = out.nll.mean()
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
        loss.backward()
        self.memory = out.memory
        for p in self.model.parameters():
            p.grad = None

    def step_flops(self, dtype: str) -> int:
        with FlopCounterMode(display=False) as counter:
            self.step(dtype)
        return counter.get_total_flops()


def bench_dtype(runners: dict[str, Runner], dtype: str, args) -> dict:
    device = args.device
    for r in runners.values():
        for _ in range(args.warmup):
            r.step(dtype)
    times: dict[str, list[float]] = {a: [] for a in runners}
    for _ in range(args.steps):
        for arch, r in runners.items():
            sync(device)
            t0 = time.perf_counter()
            r.step(dtype)
            sync(device)
            times[arch].append(time.perf_counter() - t0)
    tokens = args.batch * args.tgt_len
    out = {}
    for arch, r in runners.items():
        med = statistics.median(times[arch])
        step_flops = r.step_flops(dtype)
        out[arch] = {
            "median_step_s": med,
            "min_step_s": min(times[arch]),
            "step_times_s": times[arch],
            "tokens_per_s": tokens / med,
            "fwd_bwd_flops_per_step_measured": step_flops,
            "achieved_gflops": step_flops / med / 1e9,
        }
    return out


def profile(runners: dict[str, Runner], dtype: str, args, out_dir: Path) -> dict[str, str]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    paths = {}
    for arch in ("lamemo", "txl"):
        if arch not in runners:
            continue
        r = runners[arch]
        for _ in range(2):
            r.step(dtype)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with torch_profile(activities=acts, record_shapes=True) as prof:
            for _ in range(3):
                r.step(dtype)
        sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        shapes = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=25)
        path = out_dir / f"profile_{arch}_{dtype}_{args.device}.txt"
        path.write_text(f"{arch} {dtype} 3 steps\n\n{table}\n\nby input shape\n\n{shapes}\n")
        paths[arch] = str(path.relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)
    return paths


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-head", type=int, default=64)
    p.add_argument("--d-inner", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tgt-len", type=int, default=64)
    p.add_argument("--mem-len", type=int, default=64)
    p.add_argument("--mem-tokens", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="torch.profiler tables for lamemo and txl")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/models_<device>.json)")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    archs = [a for a in args.archs.split(",") if a]
    dtypes = [d for d in args.dtypes.split(",") if d]
    out_path = Path(args.out) if args.out else RESULTS / f"models_{args.device}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)

    runners = {a: Runner(a, args, args.device) for a in archs}
    result = {
        "benchmark": "models forward+backward, one segment per step, memory carried",
        "torch": torch.__version__,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else cpu_info()["name"],
        "cpu": cpu_info(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "profile")},
        "models": {
            a: {
                "config": {k: getattr(r.cfg, k) for k in ("arch", "n_layer", "d_model", "n_head", "d_head", "d_inner",
                                                          "vocab_size", "tgt_len", "mem_len", "num_mem_tokens")},
                "params": param_count(r.cfg),
                "fwd_flops_per_token_analytic": flops_per_token(r.cfg, batch_size=args.batch)["total"],
                "fwd_flops_breakdown": flops_per_token(r.cfg, batch_size=args.batch),
            }
            for a, r in runners.items()
        },
        "results": {},
        "ratios": {},
        "targets": {"lamemo_over_txl_step_time": TARGET_LAMEMO_TXL_RATIO},
    }
    for dtype in dtypes:
        res = bench_dtype(runners, dtype, args)
        result["results"][dtype] = res
        line = "  ".join(f"{a} {res[a]['tokens_per_s']:8.0f} tok/s ({res[a]['achieved_gflops']:5.1f} GFLOP/s)"
                         for a in res)
        print(f"[{dtype}] {line}", flush=True)
        if "lamemo" in res and "txl" in res:
            ratio = res["lamemo"]["median_step_s"] / res["txl"]["median_step_s"]
            paired = paired_ratio(res["lamemo"]["step_times_s"], res["txl"]["step_times_s"])
            models = result["models"]
            flop_ratio = (models["lamemo"]["fwd_flops_per_token_analytic"]
                          / models["txl"]["fwd_flops_per_token_analytic"])
            result["ratios"][dtype] = {
                "lamemo_over_txl_step_time": ratio,
                "lamemo_over_txl_step_time_paired": paired,
                "lamemo_over_txl_step_time_min": res["lamemo"]["min_step_s"] / res["txl"]["min_step_s"],
                "lamemo_over_txl_fwd_flops": flop_ratio,
                "lamemo_over_txl_fwd_bwd_flops_measured": res["lamemo"]["fwd_bwd_flops_per_step_measured"]
                / res["txl"]["fwd_bwd_flops_per_step_measured"],
                "meets_target": ratio <= TARGET_LAMEMO_TXL_RATIO,
            }
            print(f"[{dtype}] LaMemo / Transformer-XL step time {ratio:.3f}x (paired {paired:.3f}x; "
                  f"FLOPs {flop_ratio:.3f}x; target <= "
                  f"{TARGET_LAMEMO_TXL_RATIO}x)", flush=True)
    if args.profile:
        result["profiles"] = {d: profile(runners, d, args, out_path.parent) for d in dtypes}
    write_result(out_path, result)
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
