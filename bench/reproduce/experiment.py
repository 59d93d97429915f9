"""What every reproduction experiment shares: run `memlm` commands as subprocesses, a queue of them on the
machine's cores, the machine's description, figures beside the results (paths, result JSON and the environment of
a command: bench/common.py, shared with the benchmarks).

Each training run and each evaluation is the real command a user types (`memlm train`, `memlm eval`,
`memlm extrapolate`, `memlm prepare`), started as its own process with one torch thread per job
(OMP_NUM_THREADS=1): on a 2-core machine two jobs run side by side without oversubscribing. Ctrl-C or SIGTERM
stops the script and every command it started (children.py) in one line; rerunning the same command resumes.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterable

from memlm.bench.common import RESULTS, ROOT, child_env
from memlm.bench.interrupt import Stopped, stop_in_one_line
from memlm.bench.reproduce.children import CHILDREN
from memlm.bench.reproduce.progress import RUNS, report_every

FIGURES = RESULTS / "figures"  # plots the README and REPORT.md show (committed, unlike bench/results/*.png)
MEMLM = [sys.executable, "-m", "memlm"]


class ExperimentError(RuntimeError):
    """A command of the experiment failed; the message names it and where its log is."""


def machine() -> dict:
    import torch

    from memlm.trainer.runtime.process import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M")}


def job_env(threads: int = 1) -> dict:
    """Each job is a plain single-process run (whatever launched this script) with THREADS torch threads."""
    return child_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                     MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true", RAY_USAGE_STATS_ENABLED="0")


def memlm(args: list[str], log: Path, threads: int = 1, *, name: str, run_dir: Path | None = None,
          steps: int | None = None) -> float:
    """Run `memlm ARGS` with its output in LOG; returns wall seconds. Raises ExperimentError on failure, Stopped
    when the script is stopping. NAME (the run), RUN_DIR and STEPS (a training's) are what the progress line shows."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    what = f"eval {args[args.index('--split') + 1]}" if args[0] == "eval" and "--split" in args else args[0]
    with open(log, "a") as out:
        out.write(f"$ memlm {' '.join(args)}\n")
        out.flush()
        code = CHILDREN.run(MEMLM + args, stdout=out, cwd=ROOT, env=job_env(threads), name=name, what=what,
                            run_dir=run_dir, steps=steps)
    if code:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise ExperimentError(f"`memlm {args[0]}` failed with exit {code} (log: {log}): {tail[0]}")
    return time.perf_counter() - start


def run_queue(jobs: Iterable[Callable[[], dict]], workers: int) -> list[dict]:
    """Run the jobs `workers` at a time (threads that wait on subprocesses); results in submission order."""
    pool = ThreadPoolExecutor(max_workers=workers)
    futures = [pool.submit(job) for job in jobs]
    try:
        wait(futures)  # the signal handler's Stopped lands here
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)  # no queued job starts; the running ones are being stopped
        raise
    pool.shutdown()
    return [f.result() for f in futures]


def add_stop_options(parser) -> None:
    parser.add_argument("--progress-every", type=float, default=60, metavar="SECONDS",
                        help="print the commands under way (step, ETA) every SECONDS (default 60; 0: never)")
    parser.add_argument("--grace", type=float, default=30, metavar="SECONDS",
                        help="on Ctrl-C or SIGTERM, how long the commands get to stop before they are killed "
                             "(default 30)")


def supervise(args) -> None:
    """Apply add_stop_options' choices: the grace period and the progress lines."""
    CHILDREN.grace = args.grace
    if args.progress_every > 0:
        report_every(args.progress_every)


def run_experiment(main: Callable[[], int], again: str = "rerun the same command to resume: finished runs are "
                   "kept, interrupted ones start over") -> int:
    """main()'s status; on Ctrl-C or SIGTERM the children stop and one line says what stopped and what AGAIN does."""

    def wind_down(stop: Stopped) -> str:
        ended = [f"{name} ({doing}{', killed' if killed else ''})" for name, doing, killed in CHILDREN.stop()]
        parts = [f"ended {', '.join(ended)}"] if ended else []
        if RUNS.total:
            parts.append(f"{RUNS.finished} of {RUNS.total} runs finished")
        return ": " + "; ".join(parts + [again])

    return stop_in_one_line(main, on_signal=CHILDREN.forward, on_repeat=CHILDREN.kill_now, wind_down=wind_down)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def last_metrics(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (110 dpi) and close a matplotlib figure; returns its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def shown(path: Path) -> str:
    """PATH relative to the repository when it lies inside it (results JSON stays machine-independent)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and half the range (with 2 seeds: the distance of each seed from the mean)."""
    return sum(values) / len(values), (max(values) - min(values)) / 2
