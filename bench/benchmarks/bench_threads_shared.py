"""Threads on a shared machine: tokens/s with the cores to itself against one busy single-threaded process beside it.

    .venv/bin/python bench/benchmarks/bench_threads_shared.py                  # -> bench/results/threads_shared.json
    .venv/bin/python bench/benchmarks/bench_threads_shared.py --repeats 1 --secs 2 --out /tmp/t.json   # a quick look

Workloads, each in a fresh process (OpenMP reads its settings once, when torch loads), through memlm's public
functions after `prepare_process` (the thread choice every memlm command makes, printed as `memlm bench: ...`):
  eval   the README's `memlm eval runs/lamemo --split test --mem-mult 4`: tiny LaMemo (2 x d32) on word-level
         WikiText-2 (V 33,278), N = 8, M = 32, trainer.inference.evaluate over the test split's first batches;
  train  bench_trainer's bare training step (Transformer-XL 4 x d256, N = M = 64, B 8, V 8192 BPE): forward with
         carried memory, backward, clip, Adam.
Settings:
  old    what memlm did before: one thread per core it owns, fixed (the worker never calls refit_threads);
  new    what memlm does now: the same choice, following the load (trainer.runtime.process.refit_threads once per
         iteration, as the trainer does per step: before each training step, between evaluate() calls of
         --eval-batches batches, and per batch inside evaluate() where it calls it itself);
  one    OMP_NUM_THREADS=1 (the workaround users found).
  For exploring, the old count with OpenMP's waiting changed before torch loads: `passive`
  (OMP_WAIT_POLICY=PASSIVE) and `spin=N` (GOMP_SPINCOUNT=N; libgomp's default is 300,000, ~10 ms here).
Sharing: `idle` (nothing started beside it; the machine may still be busy with other users: see
`others_before`), `pinned` (a `while True: pass` process pinned to the last core of this process's affinity mask),
`unpinned` (the same busy loop, placed by the kernel).

Runs are interleaved: every repetition runs every (sharing, setting) pair, in an order rotated per repetition.
Each run warms up, then times whole iterations for --secs of wall time (at least one). Before each run the cores'
use by other processes is measured for a second (/proc/stat, as refit_threads does: `others_before`, in cores;
the 1-minute load average too); --quiet-wait S waits up to S seconds for others_before < 0.15 before an idle run,
so that an "idle" baseline on a shared machine is idle. Reported per workload, sharing and setting: the median
tokens/s over repetitions with each run's figure, thread lines, timed iterations per thread count and load; slowdown =
median idle tokens/s / median
shared tokens/s of the same setting; paired = the median over repetitions of tokens/s against the old setting's
run of the same repetition and sharing (runs minutes apart on a shared machine differ more than that).
Never part of the test suite.
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

from memlm.bench.benchmarks.bench_trainer import BareLoop, collect_batches, prepare_corpus
from memlm.bench.common import RESULTS, ROOT, WIKITEXT2, child_env, load_average, write_result
from memlm.bench.interrupt import stop_in_one_line

# Left out of every worker's environment (besides a launcher's): the thread and waiting choices are the settings'.
DROPPED_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "LOCAL_SIZE")
BUSY_LOOP = "while True: pass"
QUIET = 0.15  # cores busy with other work below which the machine counts as idle


# ---------------------------------------------------------------------------------------------------------------
# The worker: one workload in this process, one JSON line on stdout


def eval_workload(data: Path, batches: int):
    """One call: trainer.inference.evaluate over the first batches of the test split, as `memlm eval --mem-mult 4`
    runs."""
    from memlm.models import build_model
    from memlm.trainer.config.run_config import eval_model_config, load_config
    from memlm.trainer.inference.evaluate import evaluate

    cfg = load_config("tiny/lamemo",
                      [f"data.path={data}", "model.vocab_size=33278", "eval.mem_mult=4"])
    mcfg = eval_model_config(cfg)
    model = build_model(mcfg)

    def step() -> int:
        result = evaluate(model, data, "test", lanes=cfg.data.eval_lanes, seg_len=mcfg.tgt_len,
                          max_batches=batches)
        return result["tokens"]
    return step


def train_workload(data: Path, _batches: int):
    """One call: one bare training step of bench_trainer's model (its BareLoop)."""
    shape = argparse.Namespace(batch=8, log_every=1)
    loop = BareLoop(shape, data, "txl", collect_batches(shape, data, 8))

    def step() -> int:
        loop.step()
        return shape.batch * 64
    return step


WORKLOADS = {"eval": (eval_workload, "wt2-word"), "train": (train_workload, "wt2-bpe8k")}


def worker(args) -> None:
    from memlm.trainer.runtime.process import prepare_process, refit_threads

    choice = prepare_process(who="bench")
    make, corpus = WORKLOADS[args.worker]
    work = make(Path(args.data) / corpus, args.eval_batches)

    import torch

    used: dict[int, int] = {}  # timed iterations per thread count

    def step() -> int:
        if not args.old:
            refit_threads()
        threads = torch.get_num_threads()
        used[threads] = used.get(threads, 0) + 1
        return work()
    for _ in range(args.warmup):
        step()
    used.clear()
    tokens, started = 0, time.perf_counter()
    while True:
        tokens += step()
        elapsed = time.perf_counter() - started
        if elapsed >= args.secs:
            break
    print(json.dumps({"tokens_per_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
                      "threads_chosen": choice.threads, "iterations_by_threads": used}), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The driver


def prepare_data(folder: Path) -> Path:
    from memlm.data_pipeline.prepare import prepare

    if not (WIKITEXT2 / "wiki.test.tokens").is_file():
        sys.exit(f"bench_threads_shared: WikiText-2 not found at {WIKITEXT2}")
    if not (folder / "wt2-word" / "manifest.json").is_file():
        prepare("wikitext", WIKITEXT2, folder / "wt2-word", tokenizer="word", workers=1, progress=False)
    if not (folder / "wt2-bpe8k" / "manifest.json").is_file():
        prepare_corpus(folder)
    return folder


def setting_env(setting: str) -> tuple[dict, list[str]]:
    """The worker's environment and extra flags for one setting (the user's thread variables removed first)."""
    env = child_env(drop=DROPPED_VARS)
    if setting == "one":
        env["OMP_NUM_THREADS"] = "1"
    elif setting == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif setting.startswith("spin="):
        env["GOMP_SPINCOUNT"] = setting.split("=", 1)[1]
    elif setting not in ("old", "new"):
        sys.exit(f"bench_threads_shared: unknown setting {setting!r} (old, new, one, passive, spin=N)")
    return env, ([] if setting == "new" else ["--old"])


def others_busy(seconds: float = 1.0) -> float:
    """Cores this process's cores spent on other processes over `seconds` (this process sleeps meanwhile)."""
    from memlm.trainer.runtime.process import busy_seconds

    cores = frozenset(os.sched_getaffinity(0))
    before = busy_seconds(cores)
    time.sleep(seconds)
    return (busy_seconds(cores) - before) / seconds


def wait_for_quiet(limit: float) -> float:
    """others_busy() once it is below QUIET, or the last figure after `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        others = others_busy()
        if others < QUIET or time.monotonic() >= deadline:
            return others


def start_busy(sharing: str) -> subprocess.Popen | None:
    if sharing == "idle":
        return None
    core = sorted(os.sched_getaffinity(0))[-1]
    pin = (lambda: os.sched_setaffinity(0, {core})) if sharing == "pinned" else None
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=pin)
    time.sleep(0.5)  # running, and seen by the load average's sampling
    return busy


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()


def one_run(args, workload: str, sharing: str, setting: str) -> dict:
    env, flags = setting_env(setting)
    cmd = [sys.executable, __file__, "--worker", workload, "--data", str(args.data), "--secs", str(args.secs),
           "--warmup", str(args.warmup), *flags]
    load = load_average()[0]
    others = wait_for_quiet(args.quiet_wait if sharing == "idle" else 0.0)
    busy = start_busy(sharing)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"tokens_per_s": None, "timed_out": True, "load1_before": load, "others_before": others}
    finally:
        stop(busy)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload}/{sharing}/{setting} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["thread_lines"] = [line for line in proc.stderr.splitlines() if line.startswith("memlm bench:")]
    result.update(load1_before=load, others_before=others)
    return result


def rotated(items: list, by: int) -> list:
    by %= len(items)
    return items[by:] + items[:by]


def summarize(runs: list[dict]) -> dict:
    table: dict = {}
    for run in runs:
        cell = table.setdefault(run["workload"], {}).setdefault(run["sharing"], {}).setdefault(
            run["setting"], {"tokens_per_s": [], "load1_before": [], "others_before": []})
        for key in ("tokens_per_s", "load1_before", "others_before"):
            cell[key].append(run[key])
    for by_sharing in table.values():
        for cells in by_sharing.values():
            for cell in cells.values():
                done = [v for v in cell["tokens_per_s"] if v is not None]
                cell["median_tokens_per_s"] = statistics.median(done) if done else None
                cell["median_load1"] = statistics.median(cell["load1_before"])
                cell["median_others_before"] = statistics.median(cell["others_before"])
        idle = by_sharing.get("idle", {})
        for sharing, cells in by_sharing.items():
            for setting, cell in cells.items():
                base = idle.get(setting, {}).get("median_tokens_per_s")
                if sharing != "idle" and base and cell["median_tokens_per_s"]:
                    cell["slowdown_vs_idle"] = base / cell["median_tokens_per_s"]
                old = cells.get("old", {}).get("tokens_per_s", [])
                pairs = [new / ref for new, ref in zip(cell["tokens_per_s"], old) if new and ref]
                if setting != "old" and pairs:
                    # Each repetition's runs sit side by side in time: the ratio least disturbed by other users.
                    cell["paired_speedup_over_old"] = statistics.median(pairs)
    return table


def print_table(table: dict) -> None:
    for workload, by_sharing in table.items():
        print(f"\n{workload}: median tokens/s; before the runs, the median cores busy with other work and load")
        for sharing, cells in by_sharing.items():
            parts = []
            for setting, cell in cells.items():
                slow = f" ({cell['slowdown_vs_idle']:.2f}x slower than idle)" if "slowdown_vs_idle" in cell else ""
                if "paired_speedup_over_old" in cell:
                    slow += f" [{cell['paired_speedup_over_old']:.2f}x old, paired]"
                tps = cell["median_tokens_per_s"]
                parts.append(f"{setting} {tps:,.0f}{slow}" if tps else f"{setting} timed out")
            load = statistics.median(c["median_load1"] for c in cells.values())
            others = statistics.median(c["median_others_before"] for c in cells.values())
            print(f"  {sharing:9s} others {others:.2f}, load {load:.1f}: " + ", ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--old", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help="prepared corpora (made here when missing; default: a temporary folder)")
    parser.add_argument("--workloads", default="eval,train")
    parser.add_argument("--settings", default="old,new,one")
    parser.add_argument("--sharing", default="idle,pinned,unpinned")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--secs", type=float, default=4.0, help="timed wall seconds per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--eval-batches", type=int, default=10, help="batches per evaluate() call")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="seconds an idle run may wait for the cores to be free of other work")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="a run still going after this is recorded as timed out")
    parser.add_argument("--out", default=str(RESULTS / "threads_shared.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    workloads, settings, sharings = (s.split(",") for s in (args.workloads, args.settings, args.sharing))
    with tempfile.TemporaryDirectory(prefix="memlm-bench-threads-") as tmp:
        args.data = prepare_data(Path(args.data or tmp))
        started, load_before, runs = time.time(), load_average(), []
        for rep in range(args.repeats):
            for workload in workloads:
                for sharing in rotated(sharings, rep):
                    for setting in rotated(settings, rep):
                        run = one_run(args, workload, sharing, setting)
                        run.update(workload=workload, sharing=sharing, setting=setting, repeat=rep)
                        runs.append(run)
                        tps = run["tokens_per_s"]
                        lines = " | ".join(run.get("thread_lines", []))
                        print(f"[{rep + 1}/{args.repeats}] {workload} {sharing} {setting}: "
                              f"{f'{tps:,.0f} tokens/s' if tps else 'timed out'} (others {run['others_before']:.2f}, "
                              f"load {run['load1_before']:.2f}) {lines}", flush=True)
    table = summarize(runs)
    print_table(table)
    result = {
        "benchmark": "threads_shared", "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "affinity_cores": len(os.sched_getaffinity(0)), "secs": args.secs, "warmup": args.warmup,
        "eval_batches": args.eval_batches, "quiet_wait": args.quiet_wait,
        "repeats": args.repeats, "loadavg_before": load_before, "loadavg_after": load_average(),
        "wall_s": time.time() - started, "summary": table, "runs": runs,
    }
    write_result(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    sys.exit(stop_in_one_line(main))  # Ctrl-C or SIGTERM: one line, exit 130 or 143
