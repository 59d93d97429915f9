"""What `memlm extrapolate` will do, decided before Ray starts: the multipliers, the runs, the (run, m) jobs.

Every user mistake (bad --mult, a folder that is not a trained run, a missing corpus) is found here, in the driver,
so it costs a one-line error and not a Ray start (5-13 s) followed by N failing tasks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.remote.location import path_or_url, redact
from memlm.data_pipeline.shards import load_manifest
from memlm.trainer.checkpoint.run_loader import resolve_eval_config
from memlm.trainer.checkpoint.store import find_checkpoint, step_of

from .errors import ClusterError

_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
MAX_MULT = 1000  # a typo guard ("1-1000000" would queue a million tasks), far beyond the paper's 10


def parse_mult(text: str) -> list[int]:
    """"1-10" -> 1..10, "1,2,4" -> [1, 2, 4], "3" -> [3]; items may mix ("1-3,8"). Sorted, without duplicates.

    Integers only: m names files and MLflow steps, and the paper's m is 1..10.
    """
    values: set[int] = set()
    for item in str(text).split(","):
        match = _ITEM.match(item)
        if not match:
            raise ClusterError(f"--mult {text!r}: {item.strip()!r} is not a multiplier; give a range like 1-10, a "
                               "list like 1,2,4 or one integer m >= 1")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if low < 1 or high < low or high > MAX_MULT:
            raise ClusterError(f"--mult {text!r}: {item.strip()!r} must be integers 1 <= A <= B <= {MAX_MULT}")
        values.update(range(low, high + 1))
    return sorted(values)


@dataclass(frozen=True)
class RunSpec:
    """One checked run folder."""

    run_dir: Path  # absolute: Ray workers may run in another working folder
    name: str  # unique among the runs of this invocation: output subfolder, MLflow run name, plot label
    arch: str
    tag: str  # checkpoint tag (global_stepN)
    step: int | None
    test_tokens: int  # the manifest's token count of the split: every evaluation must score exactly these
    train_run_id: str  # the training run's MLflow id from RUN_DIR/mlflow_run_id, "" when none


@dataclass(frozen=True)
class Job:
    """One (run, m) evaluation."""

    run: RunSpec
    m: int
    mem_len: int
    json_path: Path


def trained_tgt_len(run_dirs: list[str]) -> int:
    """The target length the runs were trained with: --tgt-len's default. Runs trained with different lengths
    have no common default (the plot and table are at one N): a ClusterError asks for --tgt-len."""
    lengths: dict[str, int] = {}
    for run_dir in run_dirs:
        cfg = resolve_eval_config(Path(run_dir), "test", None, None, None, None, None)  # names a missing folder
        lengths[run_dir] = cfg.model.tgt_len
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{d}: {n}" for d, n in lengths.items())
        raise ClusterError(f"the runs were trained with different target lengths ({listed}); pass --tgt-len N "
                           "to evaluate them all at one N")
    return next(iter(lengths.values()))


def check_runs(run_dirs: list[str], split: str, tgt_len: int, mults: list[int]) -> list[RunSpec]:
    """Every RUN_DIR resolved and validated at every m the way `memlm eval` would, or the first error."""
    if tgt_len < 1:
        raise ClusterError(f"--tgt-len must be >= 1, got {tgt_len}")
    folders = [Path(d).resolve() for d in run_dirs]
    if len(set(folders)) != len(folders):
        raise ClusterError("the same RUN_DIR is given twice; name each run once")
    names = unique_names(folders)
    specs = []
    for folder, name in zip(folders, names):
        # mem_len is checked at the largest m: the config validation is the same for every m, so one call
        # per run gives the message a user would see from `memlm eval RUN_DIR --mem-len M`.
        cfg = resolve_eval_config(folder, split, tgt_len, mults[-1] * tgt_len, None, None, None)
        _, tag = find_checkpoint(folder, None)
        manifest = load_manifest(path_or_url(cfg.data.path))
        splits = manifest.get("splits", {})
        if split not in splits:
            raise DataError(f"{redact(cfg.data.path)} (the data of {folder}) has no split {split!r} "
                            f"(it has: {', '.join(splits)})")
        id_file = folder / "mlflow_run_id"
        train_run_id = id_file.read_text().strip() if id_file.is_file() else ""
        specs.append(RunSpec(folder, name, cfg.model.arch, tag, step_of(tag), int(splits[split]["tokens"]),
                             train_run_id))
    return specs


def unique_names(folders: list[Path]) -> list[str]:
    """Each folder's name, or as many trailing path parts as make it unique (runs/a/txl, runs/b/txl -> a_txl, b_txl)."""
    for depth in range(1, max(len(f.parts) for f in folders) + 1):
        names = ["_".join(f.parts[-depth:]).lstrip("/_") or "root" for f in folders]
        if len(set(names)) == len(names):
            return names
    return [f"run{i}" for i in range(len(folders))]  # unreachable for distinct absolute paths


def result_path(out: Path, run: RunSpec, split: str, tgt_len: int, m: int) -> Path:
    """Split and N are in the name so runs of other settings into the same --out never overwrite or satisfy it."""
    return out / run.name / f"{split}-tgt{tgt_len}-m{m}.json"


def plan_jobs(runs: list[RunSpec], mults: list[int], tgt_len: int, split: str, out: Path
              ) -> tuple[list[Job], dict[tuple[str, int], dict[str, Any]]]:
    """(jobs to run, results already on disk keyed by (run name, m)).

    A result is reused only when it is the same evaluation of the same checkpoint (split, N, M, step, arch), so a
    rerun after a crash or a failed task does just what is missing, and a run trained further is evaluated again.
    Jobs come largest m first: those take longest, and starting them first shortens the parallel wall time.
    """
    jobs, done = [], {}
    for m in sorted(mults, reverse=True):
        for run in runs:
            path = result_path(out, run, split, tgt_len, m)
            old = read_result(path)
            expected = {"split": split, "tgt_len": tgt_len, "mem_len": m * tgt_len, "step": run.step, "arch": run.arch}
            if old is not None and all(old.get(k) == v for k, v in expected.items()):
                done[(run.name, m)] = old
            else:
                jobs.append(Job(run, m, m * tgt_len, path))
    return jobs, done


def read_result(path: Path) -> dict[str, Any] | None:
    """A previous result file, or None when absent or unreadable (a half-written file cannot exist: written aside)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
