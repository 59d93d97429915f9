"""What every reproduction experiment shares: run `memlm` commands as subprocesses, a queue of them on the
machine's cores, the machine's description, and JSON results next to the other benchmarks.

Each training run and each evaluation is the real command a user types (`memlm train`, `memlm eval`,
`memlm extrapolate`, `memlm prepare`), started as its own process with one torch thread per job
(OMP_NUM_THREADS=1): on a 2-core machine two jobs run side by side without oversubscribing.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
FIGURES = RESULTS / "figures"  # plots the README and REPORT.md show (committed, unlike bench/results/*.png)
SHARED_DATA = ROOT.parent / "shared" / "data"
MEMLM = [sys.executable, "-m", "memlm"]


class ExperimentError(RuntimeError):
    """A command of the experiment failed; the message names it and where its log is."""


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    import torch

    from trainer.runtime import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M")}


def job_env(threads: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true", RAY_USAGE_STATS_ENABLED="0")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)  # each job is a plain single-process run, whatever launched this script
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def memlm(args: list[str], log: Path, threads: int = 1) -> float:
    """Run `memlm ARGS` with its output in LOG; returns wall seconds. Raises ExperimentError on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"$ memlm {' '.join(args)}\n")
        out.flush()
        code = subprocess.run(MEMLM + args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=job_env(threads)).returncode
    if code:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise ExperimentError(f"`memlm {args[0]}` failed with exit {code} (log: {log}): {tail[0]}")
    return time.perf_counter() - start


def run_queue(jobs: Iterable[Callable[[], dict]], workers: int) -> list[dict]:
    """Run the jobs `workers` at a time (threads that wait on subprocesses); results in submission order."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result() for f in futures]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    return path


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


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and half the range (with 2 seeds: the distance of each seed from the mean)."""
    return sum(values) / len(values), (max(values) - min(values)) / 2
