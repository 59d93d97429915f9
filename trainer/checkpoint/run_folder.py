"""A run folder holds one run: the rules `memlm train` applies to RUN_DIR before it trains into it.

What a run is made of: `metrics.jsonl`, `checkpoints/global_step*`, `eval/step*.json` and `mlflow_run_id` (the
MLflow run every later `train --resume` and `eval` log to). Training a second time into such a folder from step 0
appended the same steps to metrics.jsonl twice, logged both trainings to one MLflow run and left the first run's
evaluations behind, so:

- a fresh `train` into a folder that already holds a run is refused, naming the choices (`--resume` continues it,
  another `--out` starts a new one, `--overwrite` deletes it first, as Hugging Face's `overwrite_output_dir`);
- `--resume` rewinds what the folder says to the checkpoint it continues from: metrics rows and evaluations of
  later steps (written after that checkpoint by the run that was interrupted) are dropped, since the resumed run
  writes them again; `--reshard` starts the step count over, so the old rows are kept aside instead.

`claim` runs on every rank before the process group exists; only rank 0 changes files, and it first takes the
folder's run lock (run_lock.py), held until the run ends: a second `train` into the folder meanwhile is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from . import run_lock
from .run_files import RUN_ID_FILE
from .run_lock import LOCK_FILE
from .store import ResumeError

METRICS = "metrics.jsonl"
EVAL_DIR = "eval"
CHECKPOINTS = "checkpoints"


class RunFolderError(ResumeError):
    """A run folder that this command must not train into as asked; the message names the choices."""


def existing_run(run_dir: Path) -> str | None:
    """A short description of the run RUN_DIR already holds ("checkpoints up to step 20, 2 metrics rows, MLflow
    run 1a2b3c4d"), or None when it holds none (absent, empty, or only set-up files of a start that failed)."""
    run_dir = Path(run_dir)
    parts = []
    steps = checkpoint_steps(run_dir / CHECKPOINTS)
    if steps:
        parts.append(f"checkpoints up to step {max(steps)}")
    metrics = run_dir / METRICS
    if metrics.is_file():
        rows = sum(1 for line in metrics.read_text().splitlines() if line.strip())
        parts.append(f"{rows} metrics row{'s' if rows != 1 else ''}")
    id_file = run_dir / RUN_ID_FILE
    if id_file.is_file():
        parts.append(f"MLflow run {id_file.read_text().strip()[:8]}")
    return ", ".join(parts) or None


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    found = (re.fullmatch(r"global_step(\d+)", p.name) for p in Path(ckpt_dir).glob("global_step*"))
    return sorted(int(m.group(1)) for m in found if m)


def claim(run_dir: Path, resume: bool, overwrite: bool, rank: int) -> None:
    """Refuse (RunFolderError) or prepare RUN_DIR for this training, by the rules in the module docstring."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunFolderError("--resume continues the run in the folder and --overwrite deletes it: pass one of them")
    if rank == 0:  # before looking: two starts at once must not both find the folder free
        run_lock.acquire(run_dir)
    held = existing_run(run_dir)
    if held is None or resume:
        return
    if not overwrite:
        run_lock.release(run_dir)
        raise RunFolderError(f"{run_dir} already holds a run ({held}): pass --resume to continue it, or --out "
                             "NEW_DIR to start a new run (--overwrite deletes this one first)")
    if rank == 0:
        # Moved aside first (each entry atomically), then deleted: another rank writing its set-up log meanwhile
        # lands in one folder or the other, never in a half-deleted one. The run lock stays: it is held now, by
        # this run (run_lock.py), and a lock file must never be replaced under its holder.
        aside = run_dir.with_name(f".{run_dir.name}.overwritten-{os.getpid()}")
        aside.mkdir()
        for entry in run_dir.iterdir():
            if entry.name != LOCK_FILE:
                os.rename(entry, aside / entry.name)
        shutil.rmtree(aside, ignore_errors=True)


def rewind(run_dir: Path, step: int, reshard: bool = False) -> None:
    """Make RUN_DIR describe the run as of checkpoint `step`, which a resume continues from (rank 0 only)."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS
    if reshard:
        if metrics.is_file():  # a new step count: the old rows would collide with the new ones
            os.replace(metrics, _free_name(run_dir, "metrics.before-reshard", ".jsonl"))
        return
    if metrics.is_file():
        kept = [line for line in metrics.read_text().splitlines(keepends=True)
                if line.strip() and _row_step(line) <= step]
        tmp = metrics.with_name(f"{METRICS}.tmp-{os.getpid()}")
        tmp.write_text("".join(kept))
        os.replace(tmp, metrics)
    for path in (run_dir / EVAL_DIR).glob("step*.json"):
        found = re.fullmatch(r"step(\d+)\.json", path.name)
        if found and int(found.group(1)) > step:
            path.unlink()


def _row_step(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):  # a line cut by a kill mid-write: not a row of this run
        return float("inf")


def _free_name(folder: Path, stem: str, suffix: str) -> Path:
    path, n = folder / f"{stem}{suffix}", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}{suffix}"
    return path
