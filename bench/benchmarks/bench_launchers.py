"""The three launchers at the same tokens/s: plain `python -m memlm train`, `torchrun` and the `deepspeed` launcher.

    .venv/bin/python bench/benchmarks/bench_launchers.py                     # -> bench/results/launchers_cpu.json
    .venv/bin/python bench/benchmarks/bench_launchers.py --steps 10 --repeats 1 --out /tmp/l.json   # a quick look

Corpus and model are bench_trainer.py's (WikiText-2 with 8k BPE; 4 layers, d_model 256, 4 x 64 heads, d_inner
1024, N = M = 64, Transformer-XL, fp32, ZeRO-2), with the same global batch of 8 lanes everywhere: one plain
process with 8 lanes, or 2 ranks with 4 lanes each. No launcher gets OMP_NUM_THREADS from this script: each
process picks its threads itself (trainer/runtime/process.py: affinity cores / local ranks; torchrun sets
OMP_NUM_THREADS=1 on its own for several ranks, the deepspeed launcher sets nothing). One more row shows what the
deepspeed launcher's ranks did before that choice existed: every rank with one thread per core of the machine
(OMP_NUM_THREADS = the core count, torch's default), capped at a few steps because it collapses.
Runs alternate launcher by launcher, --repeats rounds; the figure per launcher is the median over its runs of the
median tokens/s of the metrics windows after warm-up. Never part of the test suite; nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlm.bench.benchmarks.bench_trainer import prepare_corpus, run_overrides
from memlm.bench.common import RESULTS, ROOT, child_env, load_average, write_result
from memlm.bench.interrupt import stop_in_one_line

DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def launch_command(launcher: str, port: int) -> list[str]:
    if launcher == "plain":
        return [sys.executable, "-m", "memlm"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "memlm"]
    return [str(DEEPSPEED), "--num_gpus", "2", "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port",
            str(port), "--module", "memlm"]


def one_run(args, data: Path, work: Path, launcher: str, collapse: bool = False) -> dict:
    from memlm.trainer.runtime.distributed import free_port

    ranks = 1 if launcher == "plain" else 2
    steps = args.collapse_steps if collapse else args.warmup + args.steps
    out = work / f"{launcher}{'-collapse' if collapse else ''}"
    extra = {"deepspeed.zero_stage": 2, "data.batch_size": args.batch // ranks, "train.log_every": 1}
    pairs = [f"{k}={v}" for k, v in run_overrides(args, data, "txl", steps, **extra).items()]
    config = work / "empty.yaml"
    config.write_text("{}\n")
    env = child_env(drop=("OMP_NUM_THREADS",), DEEPSPEED_TIMEOUT="2")  # every process picks its own threads
    if collapse:
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))  # torch's default: a thread per core, per rank
    hostfile = work / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = launch_command(launcher, free_port())
    if launcher == "deepspeed":
        cmd[1:1] = ["--hostfile", str(hostfile)]
    started = time.perf_counter()
    proc = subprocess.run([*cmd, "train", str(config), *pairs, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out)
    timed = rows[1:] if collapse else rows[args.warmup:]
    threads = sorted({line.split(" torch thread")[0].split()[-1] for line in (proc.stderr + proc.stdout).splitlines()
                      if " torch thread" in line and line.startswith("memlm")})
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed), "steps": steps,
            "threads_per_rank": threads, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="global lanes (split over the ranks)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--collapse-steps", type=int, default=4, help="steps of the old-default row (0: skip it)")
    parser.add_argument("--out", default=str(RESULTS / "launchers_cpu.json"))
    args = parser.parse_args()
    args.log_every = 1
    work = Path(tempfile.mkdtemp(prefix="bench_launchers-"))
    report = {"benchmark": "launchers", "nproc": os.cpu_count(), "affinity_cores": len(os.sched_getaffinity(0)),
              "cpu": platform.processor() or platform.machine(), "loadavg_before": load_average(),
              "config": {"model": "txl 4 x d256, 4 x 64 heads, d_inner 1024, N = M = 64, V 8192",
                         "global_lanes": args.batch, "zero_stage": 2, "steps": args.steps, "warmup": args.warmup,
                         "repeats": args.repeats, "corpus": "WikiText-2, spm-bpe 8k"}}
    try:
        data = prepare_corpus(work)
        runs: dict[str, list[dict]] = {name: [] for name in ("plain", "torchrun", "deepspeed")}
        for _ in range(args.repeats):
            for launcher in runs:
                runs[launcher].append(one_run(args, data, work, launcher))
                print(f"{launcher}: {runs[launcher][-1]['tokens_per_s']:.0f} tokens/s, threads per rank "
                      f"{runs[launcher][-1]['threads_per_rank']}", flush=True)
        report["launchers"] = {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs), "runs": rs}
                               for name, rs in runs.items()}
        plain = report["launchers"]["plain"]["tokens_per_s"]
        for name in runs:
            report["launchers"][name]["vs_plain"] = report["launchers"][name]["tokens_per_s"] / plain
        if args.collapse_steps:
            old = one_run(args, data, work, "deepspeed", collapse=True)
            old["vs_plain"] = old["tokens_per_s"] / plain
            report["deepspeed_before_thread_fit"] = old
            print(f"deepspeed, a thread per core per rank (the old default): {old['tokens_per_s']:.0f} tokens/s",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["loadavg_after"] = load_average()
    write_result(args.out, report)
    rows = report["launchers"]
    print("| launcher | tokens/s | vs plain |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tokens_per_s']:.0f} | {row['vs_plain']:.2f}x |")
    if "deepspeed_before_thread_fit" in report:
        old = report["deepspeed_before_thread_fit"]
        print(f"| deepspeed, old default threads | {old['tokens_per_s']:.0f} | {old['vs_plain']:.3f}x |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
