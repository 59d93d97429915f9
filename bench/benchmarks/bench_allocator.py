"""What memlm's malloc settings (trainer/runtime/allocator.py) buy a CPU training step.

    .venv/bin/python bench/benchmarks/bench_allocator.py            # -> bench/results/allocator_cpu.json

The settings are per process and cannot be undone, so each measurement is a fresh process: one with glibc's
defaults (MEMLM_MALLOC=system), one with memlm's settings, alternated for --rounds rounds so that machine noise
hits both alike. Each process times forward + backward steps of Transformer-XL and LaMemo (bench_models.py's
step, the peer benchmark's small shape) in fp32 and bf16 autocast, one thread, and counts the page faults per
step (getrusage). Reported: per setting the median over rounds of each process's median step time, and the
paired ratio (median over rounds of system / tuned). Never part of the test suite; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from memlm.bench.common import RESULTS, load_average, paired_ratio, write_result
from memlm.bench.interrupt import stop_in_one_line

SETTINGS = ("system", "tuned")


def child(args) -> None:
    """One process: apply the setting, time every (arch, dtype), print one JSON line."""
    import torch

    from memlm.bench.benchmarks.bench_models import Runner
    from memlm.trainer.runtime.allocator import tune_allocator

    choice = tune_allocator()
    torch.set_num_threads(args.threads)
    rows = {}
    for arch in args.archs.split(","):
        runner = Runner(arch, args, "cpu")
        for dtype in args.dtypes.split(","):
            for _ in range(args.warmup):
                runner.step(dtype)
            times, faults = [], []
            for _ in range(args.steps):
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                runner.step(dtype)
                times.append(time.perf_counter() - t0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            rows[f"{arch}/{dtype}"] = {"median_step_s": statistics.median(times), "step_times_s": times,
                                       "page_faults_per_step": statistics.median(faults)}
        del runner
    print(json.dumps({"allocator": {"tuned": choice.tuned, "reason": choice.reason}, "rows": rows}))


def run_child(setting: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(MEMLM_MALLOC=setting, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--child", "--archs", args.archs, "--dtypes", args.dtypes,
           "--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--archs", default="txl,lamemo")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "allocator_cpu.json"))
    args = p.parse_args()
    # bench_models.Runner's shape: the peer benchmark's small shape
    args.n_layer, args.n_head, args.d_model, args.d_head, args.d_inner = 4, 4, 256, 64, 1024
    args.vocab, args.batch, args.tgt_len, args.mem_len, args.mem_tokens = 8000, 8, 128, 128, 10
    if args.child:
        child(args)
        return

    load_before = load_average()
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            runs[setting].append(run_child(setting, args))
            print(f"round {r + 1}/{args.rounds} {setting} done", file=sys.stderr, flush=True)
    load_after = load_average()

    tokens = args.batch * args.tgt_len
    table = {}
    for key in runs["system"][0]["rows"]:
        per = {s: [run["rows"][key]["median_step_s"] for run in runs[s]] for s in SETTINGS}
        faults = {s: statistics.median(run["rows"][key]["page_faults_per_step"] for run in runs[s]) for s in SETTINGS}
        table[key] = {
            **{f"{s}_step_s": statistics.median(per[s]) for s in SETTINGS},
            **{f"{s}_tokens_per_s": tokens / statistics.median(per[s]) for s in SETTINGS},
            **{f"{s}_page_faults_per_step": faults[s] for s in SETTINGS},
            "speedup_paired": paired_ratio(per["system"], per["tuned"]),
        }
    import torch

    from memlm.bench.benchmarks.bench_models import cpu_info

    result = {
        "benchmark": "allocator",
        "torch": torch.__version__,
        "cpu": cpu_info(),
        "config": {k: getattr(args, k) for k in ("archs", "dtypes", "threads", "rounds", "steps", "warmup", "n_layer",
                                                  "n_head", "d_model", "d_head", "d_inner", "vocab", "batch",
                                                  "tgt_len", "mem_len")},
        "allocator": {s: runs[s][0]["allocator"] for s in SETTINGS},
        "load_avg_before": load_before, "load_avg_after": load_after,
        "rows": table,
        "runs": runs,
    }
    out = write_result(args.out, result)
    print(f"{'arch/dtype':14} {'glibc default':>22} {'memlm settings':>22} {'speed-up':>9} {'faults/step':>16}")
    for key, row in table.items():
        print(f"{key:14} {row['system_step_s'] * 1e3:8.1f} ms {row['system_tokens_per_s']:7.0f} tok/s "
              f"{row['tuned_step_s'] * 1e3:8.1f} ms {row['tuned_tokens_per_s']:7.0f} tok/s "
              f"{row['speedup_paired']:8.3f}x "
              f"{row['system_page_faults_per_step']:7.0f} -> {row['tuned_page_faults_per_step']:.0f}")
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; wrote {out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
