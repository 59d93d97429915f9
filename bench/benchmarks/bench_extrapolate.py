"""Memory extrapolation (`memlm extrapolate`, LaMemo Figure 5): Ray tasks against one process, and cost against M.

    .venv/bin/python bench/benchmarks/bench_extrapolate.py                       # -> bench/results/extrapolate_cpu.json
    bash scripts/offline.sh .venv/bin/python bench/benchmarks/bench_extrapolate.py --repeats 1 --arch txl

One small model (2 layers, d_model 128, 4 heads x 32, N = M = 64 while training, bytes vocabulary) is trained for a
few steps by the real trainer (`memlm train`, a subprocess) on the standard library's source files (test split
~12k byte tokens by default, --held-out-bytes), then its test split is evaluated with N = 64 and memory m x 64 for
m = 1..10 three ways:

- sequential: ten evaluate_run calls one after another in this process (torch threads 1, and 2 when nproc >= 2);
- Ray: the real command path (cluster.extrapolate.main, one task per m, each task 1 CPU / 1 torch thread) on a
  fresh local Ray started with num_cpus 1 and 2. Ray's start is timed apart from the command, since a cluster is
  usually already running; the command time includes worker start-up, the plot and the MLflow logging.

Each configuration is repeated --repeats times (default 2; median reported). The per-m times of the 1-thread
sequential runs give the cost against M: time(m=10) / time(m=1) next to the ratio of keys a current token attends
to ((M+N)/2N at m) and the analytic forward FLOPs ratio (models/flops.py), and least-squares fits t = a + b*M (and
+ c*M^2, to show how little curvature there is). Never part of the test suite; nothing here asserts a timing.

The machine is shared (other engineers run tests on the same 2 cores): the JSON records the load average before
and after every timed block, and the timings should be read with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memlm.bench.common import RESULTS, ROOT, child_env, load_average, write_result
from memlm.bench.interrupt import stop_in_one_line

MULTS = list(range(1, 11))
N = 64
MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "d_head": 32, "d_inner": 512, "tgt_len": N, "mem_len": N}


def prepare_run(root: Path, arch: str, held_out_bytes: int, steps: int) -> tuple[Path, int]:
    """A run folder trained by `memlm train` in a subprocess (this process stays free of a process group)."""
    from memlm.data_pipeline.prepare import prepare
    from memlm.demo import stdlib_corpus

    stdlib_corpus(root / "corpus", train_bytes=200_000, held_out_bytes=held_out_bytes)
    manifest = prepare("textdir", root / "corpus", root / "data", tokenizer="bytes", workers=1, progress=False)
    run = root / "runs" / arch
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"model.arch={arch}", f"data.path={root / 'data'}", f"train.steps={steps}", "train.save_every=0",
        "train.eval_every=0", "train.log_every=1000", "tracking.enabled=false", "data.batch_size=8"]
    subprocess.run([sys.executable, "-m", "memlm", "train", "tiny/txl", *overrides,
                    "--out", str(run)], cwd=ROOT, env=child_env(), check=True, capture_output=True, text=True)
    return run, manifest["splits"]["test"]["tokens"]


def sequential(run: Path, threads: int, tmp: Path) -> tuple[float, dict[int, float]]:
    """(total wall, {m: seconds}): ten evaluations, one process, one after another."""
    import torch

    from memlm.trainer.inference.evaluate import evaluate_run

    torch.set_num_threads(threads)
    per_m = {}
    start = time.perf_counter()
    for m in MULTS:
        t0 = time.perf_counter()
        evaluate_run(run, split="test", tgt_len=N, mem_len=m * N, json_path=tmp / f"seq-{m}.json")
        per_m[m] = time.perf_counter() - t0
    return time.perf_counter() - start, per_m


def on_ray(run: Path, num_cpus: int, out: Path, uri: str) -> tuple[float, float]:
    """(Ray start seconds, command seconds) of `memlm extrapolate RUN --mult 1-10` on a fresh local Ray."""
    import ray

    from memlm.cli import build_parser
    from memlm.cluster import extrapolate
    from memlm.cluster.ray_runtime import start

    t0 = time.perf_counter()
    start(num_cpus=num_cpus)
    ray_start = time.perf_counter() - t0
    args = build_parser().parse_args(["extrapolate", str(run), "--mult", "1-10", "--tgt-len", str(N), "--out",
                                      str(out), "--uri", uri, "--experiment", "bench", "--cpus-per-task", "1"])
    try:
        t0 = time.perf_counter()
        rc = extrapolate.main(args)
        command = time.perf_counter() - t0
    finally:
        ray.shutdown()
    if rc != 0:
        raise SystemExit(f"extrapolate failed with exit status {rc}")
    return ray_start, command


def linear_fits(xs: list[float], ys: list[float]) -> dict:
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    r2 = 1 - float(((y - pred) ** 2).sum()) / float(((y - y.mean()) ** 2).sum())
    c2, b2, a2 = np.polyfit(x, y, 2)
    xmax = float(x.max())
    return {"linear": {"intercept_s": float(a), "seconds_per_memory_token": float(b), "r2": r2},
            "quadratic": {"a": float(a2), "b": float(b2), "c": float(c2),
                          # share of the time at the largest M that the M^2 term explains (0 = linear)
                          "quadratic_share_at_max_M": float(c2 * xmax ** 2 / (a2 + b2 * xmax + c2 * xmax ** 2))}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="lamemo", choices=["txl", "lamemo"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--held-out-bytes", type=int, default=12_000, help="test split size (bytes = tokens)")
    p.add_argument("--steps", type=int, default=5, help="training steps (the weights only need to exist)")
    p.add_argument("--out", default=str(RESULTS / "extrapolate_cpu.json"))
    args = p.parse_args(argv)
    for key in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"):
        os.environ.setdefault(key, "true")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import torch

    from memlm.models.flops import flops_per_token
    from memlm.trainer.config.run_config import eval_model_config, load_config, override_config

    nproc = os.cpu_count() or 1
    cores = [1, 2] if nproc >= 2 else [1]
    with tempfile.TemporaryDirectory(prefix="bench_extrapolate_") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        run, test_tokens = prepare_run(tmp, args.arch, args.held_out_bytes, args.steps)
        print(f"trained {run} in {time.perf_counter() - t0:.1f} s; test split {test_tokens:,} tokens", flush=True)
        cfg = load_config(run / "config.yaml")
        lanes = cfg.data.eval_lanes

        seq = {c: [] for c in cores}
        per_m_runs: list[dict[int, float]] = []
        ray_runs = {c: [] for c in cores}
        loads = []
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        # Interleave the configurations within each repeat, so slow drifts of a shared machine hit all alike.
        for r in range(args.repeats):
            for c in cores:
                before = load_average()
                total, per_m = sequential(run, c, tmp)
                seq[c].append(total)
                if c == 1:
                    per_m_runs.append(per_m)
                loads.append({"what": f"sequential threads={c} repeat={r}", "before": before, "after": load_average()})
                print(f"repeat {r}: sequential, {c} thread(s): {total:.1f} s", flush=True)
            for c in cores:
                before = load_average()
                ray_start, command = on_ray(run, c, tmp / f"out-{c}-{r}", uri)
                ray_runs[c].append({"ray_start_s": ray_start, "command_s": command})
                loads.append({"what": f"ray num_cpus={c} repeat={r}", "before": before, "after": load_average()})
                print(f"repeat {r}: Ray num_cpus={c}: start {ray_start:.1f} s + command {command:.1f} s", flush=True)

    med_seq = {c: statistics.median(v) for c, v in seq.items()}
    med_cmd = {c: statistics.median(x["command_s"] for x in v) for c, v in ray_runs.items()}
    med_start = {c: statistics.median(x["ray_start_s"] for x in v) for c, v in ray_runs.items()}
    per_m = {m: statistics.median(run_[m] for run_ in per_m_runs) for m in MULTS}
    mem = [m * N for m in MULTS]
    flops = {}
    for m in MULTS:
        mcfg = eval_model_config(override_config(cfg, {"eval.tgt_len": N, "eval.mem_len": m * N, "eval.mem_mult": 0.0}))
        flops[m] = flops_per_token(mcfg, batch_size=lanes)["total"]
    keys_ratio = (MULTS[-1] * N + N) / (MULTS[0] * N + N)
    scaling = {}
    for c in cores:
        scaling[f"cores={c}"] = {
            "sequential_s": med_seq[c], "ray_command_s": med_cmd[c], "ray_start_s": med_start[c],
            "ray_command_plus_start_s": med_cmd[c] + med_start[c],
            "sequential_over_ray_command": med_seq[c] / med_cmd[c],
            "sequential_over_ray_with_start": med_seq[c] / (med_cmd[c] + med_start[c]),
        }
    if 2 in cores:
        scaling["ray_2_over_1_speedup"] = med_cmd[1] / med_cmd[2]
        scaling["sequential_1_thread_over_ray_2_cpus"] = med_seq[1] / med_cmd[2]
    result = {
        "benchmark": "memlm extrapolate m=1..10: local Ray tasks vs sequential evaluate_run; eval cost vs M",
        "machine": {"nproc": nproc, "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform(),
                    "note": "shared 2-core machine: other engineers' test suites ran at the same time; see loadavg"},
        "config": {"arch": args.arch, "model": MODEL, "tgt_len": N, "mults": MULTS, "eval_lanes": lanes,
                   "test_tokens": test_tokens, "train_steps": args.steps, "repeats": args.repeats,
                   "ray_task_cpus": 1, "ray_task_torch_threads": 1},
        "sequential_s": seq, "ray": ray_runs, "scaling_median": scaling,
        "cost_vs_M": {
            "per_m_seconds_sequential_1_thread_median": per_m,
            "time_ratio_m10_over_m1": per_m[MULTS[-1]] / per_m[MULTS[0]],
            "attended_keys_ratio_m10_over_m1": keys_ratio,
            "fwd_flops_per_token": flops,
            "fwd_flops_ratio_m10_over_m1": flops[MULTS[-1]] / flops[MULTS[0]],
            "fit_time_vs_M": linear_fits(mem, [per_m[m] for m in MULTS]),
        },
        "targets": {"ray_1_cpu_no_slower_than_sequential": "sequential_over_ray_command >= 1 at cores=1",
                    "faster_with_more_cores": "ray_2_over_1_speedup > 1",
                    "cost_at_most_linear_in_M": "time ratio <= keys ratio; linear fit r2 ~ 1, small quadratic share"},
        "loadavg": loads,
    }
    out = write_result(args.out, result)
    cost = result["cost_vs_M"]
    print(json.dumps({"scaling_median": scaling, "time_ratio_m10_over_m1": cost["time_ratio_m10_over_m1"],
                      "keys_ratio": keys_ratio, "flops_ratio": cost["fwd_flops_ratio_m10_over_m1"],
                      "fit": cost["fit_time_vs_M"]}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
