"""What `memlm longeval` will score, decided in the driver before Ray starts: the runs, and the source of samples
(memlm's generated task at lengths and depth windows, or BABILong's own files at their lengths).

Every user mistake (bad --lengths, a flag the source has no use for, a folder that is not a trained run, a BABILong
folder without the task) is one line here, not a Ray start followed by failing tasks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlm.data_pipeline import babilong
from memlm.data_pipeline.hf_tokenizer import KIND as HF_KIND
from memlm.data_pipeline.remote.location import path_or_url
from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.tasks import DEFAULTS as TASK_DEFAULTS
from memlm.data_pipeline.tasks import resolve_options
from memlm.trainer.checkpoint.run_loader import resolve_eval_config
from memlm.trainer.checkpoint.store import find_checkpoint, step_of

from .errors import ClusterError
from .extrapolate_plan import unique_names

LONGCTX_TASKS = ("qa1", "qa2", "qa3", "passkey")  # data_pipeline/longctx.py's
DEFAULTS = {"lengths": "512,1k,2k,4k", "depths": 5, "samples": 20, "seed": 0, "split": "test"}  # generated tasks
GENERATED_ONLY = ("depths", "seed", "split", "background", "lanes")  # flags BABILong's fixed samples have no use for


@dataclass(frozen=True)
class LongRun:
    run_dir: Path
    name: str
    arch: str
    step: int | None
    tgt_len: int
    train_run_id: str


@dataclass(frozen=True)
class Source:
    """The samples every run is scored on. Generated: `samples` per depth window (of `depths`) at each length in
    bytes. BABILong: the first `samples` records (every record when None) of each length's file, one window."""

    task: str
    lengths: tuple[int, ...]  # tokens: the x axis and MLflow's step (BABILong: its label's, k = 1000)
    labels: tuple[str, ...]  # the lengths as shown: "512", "1k" (BABILong: its folder names, "0k", "1M")
    samples: int | None
    depths: int = 1
    options: Any = None  # generated: the task's options (the background folder, ...)
    seed: int | None = None
    split: str = "babilong"
    babilong: str | None = None  # the BABILong folder, absolute

    def result_name(self, i: int) -> str:
        if self.babilong:
            return f"babilong-{self.task}-{self.labels[i]}.json"
        return f"{self.task}-{self.split}-len{self.lengths[i]}.json"

    def spec(self, i: int, lanes: int | None) -> dict:
        """What the Ray task evaluates (cluster/longeval_task.py)."""
        if self.babilong:
            return {"source": "babilong", "folder": self.babilong, "task": self.task, "length": self.labels[i],
                    "samples": self.samples}
        return {"source": "task", "task": self.task, "options": self.options, "length": self.lengths[i],
                "depths": self.depths, "samples": self.samples, "seed": self.seed, "split": self.split,
                "lanes": lanes}

    def settings(self) -> dict:
        """The summary's description of the source."""
        return {"task": self.task, "source": "babilong" if self.babilong else "task", "babilong": self.babilong,
                "split": self.split, "seed": self.seed, "samples_per_depth": self.samples, "depths": self.depths}

    def reusable(self, old: dict | None, step: int | None) -> bool:
        """Whether a result already in OUT is this source's at this checkpoint (and has the baselines)."""
        if not old or old.get("step") != step or "baselines" not in old:
            return False
        if self.babilong:
            return old.get("babilong") == self.babilong and old.get("limit", "unset") == self.samples
        return old.get("samples") == self.samples * self.depths and len(old.get("by_depth", [])) == self.depths \
            and all(old.get(k) == v for k, v in (("task", self.task), ("split", self.split), ("seed", self.seed)))


def parse_lengths(text: str) -> list[int]:
    """"512,1k,2k" -> [512, 1024, 2048] (k = 1024), sorted, each >= 64."""
    lengths = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            value = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise ClusterError(f"--lengths {text!r}: give sizes like 512,1k,2k,16k (k = 1024 tokens)") from None
        if value < 64:
            raise ClusterError(f"--lengths: every length must be >= 64 tokens, got {part}")
        lengths.append(value)
    return sorted(set(lengths))


def trained_manifest(run_dir: Path) -> dict:
    """The manifest of the data the run was trained on."""
    cfg = resolve_eval_config(run_dir, "test", None, None, None, None, None)
    return load_manifest(path_or_url(cfg.data.path))


def trained_corpus(run_dir: Path) -> dict:
    """The manifest's corpus entry of the data the run was trained on."""
    return trained_manifest(run_dir).get("corpus") or {}


def source_of(args: argparse.Namespace, first_run: Path) -> Source:
    """The source the flags name; the task defaults to the one the first run was trained on."""
    if args.babilong:
        return _babilong_source(args, first_run)
    for flag, default in DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    for flag in ("depths", "samples"):
        if getattr(args, flag) < 1:
            raise ClusterError(f"--{flag} must be >= 1, got {getattr(args, flag)}")

    if args.task is not None and args.task not in LONGCTX_TASKS:
        raise ClusterError(f"--task {args.task}: the generated tasks are {', '.join(LONGCTX_TASKS)}; BABILong's "
                           "qa1..qa20 are read from its files with --babilong DIR")
    manifest = trained_manifest(first_run)
    corpus = manifest.get("corpus") or {}
    # Data in a backbone's own tokens (its tokenizer.json): lengths count those tokens (trainer/inference/longeval.py)
    in_tokens = (manifest.get("tokenizer") or {}).get("kind") == HF_KIND
    trained = corpus.get("task") if corpus.get("kind") == "task" else None
    task = args.task or trained
    if task not in LONGCTX_TASKS:
        what = f"BABILong's {corpus.get('task')}" if corpus.get("kind") == "babilong" else \
            trained or "a text corpus"
        raise ClusterError(f"{first_run} was trained on {what}, not a generated long-context task; pass --task (one "
                           f"of {', '.join(LONGCTX_TASKS)}), or --babilong DIR to score BABILong's own files")
    options = {k: v for k, v in (corpus.get("options") or {}).items()
               if task == trained and k in TASK_DEFAULTS[task] and k not in ("length", "depth_min", "depth_max")}
    if args.background:
        options["background"] = args.background
    lengths = parse_lengths(args.lengths)
    resolve_options(task, {**options, "length": lengths[0]}, in_tokens=in_tokens)  # one line now, not a failed task
    return Source(task, tuple(lengths), tuple(size_label(n) for n in lengths), args.samples, args.depths, options,
                  args.seed, args.split)


def size_label(n: int) -> str:
    """512 -> "512", 1024 -> "1k", 1536 -> "1.5k" (k = 1024, as --lengths reads it)."""
    return f"{n / 1024:g}k" if n >= 1024 and n % 512 == 0 else str(n)


def _babilong_source(args: argparse.Namespace, first_run: Path) -> Source:
    given = [f"--{flag}" for flag in GENERATED_ONLY if getattr(args, flag) is not None]
    if given:
        raise ClusterError(f"--babilong scores BABILong's own samples: {', '.join(given)} appl"
                           f"{'ies' if len(given) == 1 else 'y'} to generated tasks only; drop "
                           f"{'it' if len(given) == 1 else 'them'}")
    if args.samples is not None and args.samples < 1:
        raise ClusterError(f"--samples must be >= 1, got {args.samples}")
    task = args.task
    if task is None:
        corpus = trained_corpus(first_run)
        task = corpus.get("task") if corpus.get("kind") in ("babilong", "task") else None
        if task not in babilong.TASKS:
            raise ClusterError(f"{first_run} was not trained on a BABILong task; pass --task (qa1..qa20)")
    babilong.check_task(task)
    folder = str(Path(args.babilong).resolve())
    if args.lengths is None:
        labels = babilong.lengths(folder, task)
        if not labels:
            babilong.files(folder, task, "0k")  # its one-line error says what the folder holds and what it needs
    else:
        labels = sorted({part.strip() for part in args.lengths.split(",") if part.strip()},
                        key=babilong.length_tokens)
    for label in labels:
        babilong.files(folder, task, label)  # every length there, before Ray starts
    return Source(task, tuple(babilong.length_tokens(label) for label in labels), tuple(labels), args.samples,
                  babilong=folder)


def check_runs(run_dirs: list[str]) -> list[LongRun]:
    folders = [Path(d).resolve() for d in run_dirs]
    if len(set(folders)) != len(folders):
        raise ClusterError("the same RUN_DIR is given twice; name each run once")
    runs = []
    for folder, name in zip(folders, unique_names(folders)):
        cfg = resolve_eval_config(folder, "test", None, None, None, None, None)
        _, tag = find_checkpoint(folder, None)
        id_file = folder / "mlflow_run_id"
        runs.append(LongRun(folder, name, cfg.model.arch, step_of(tag), cfg.model.tgt_len,
                            id_file.read_text().strip() if id_file.is_file() else ""))
    return runs
