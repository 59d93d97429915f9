"""Checkpoints that are complete or absent, and the checks that refuse a resume which would not continue the run.

Layout under RUN_DIR/checkpoints:
    global_step{N}/      DeepSpeed engine state (model, optimizer, lr scheduler) + rank{r}.pt + meta.json
    latest               the tag of the newest complete checkpoint (replaced atomically)
Writing: every rank saves into `.tmp-global_step{N}` (engine.save_checkpoint + its rank file); after a barrier
rank 0 renames the folder and replaces `latest` (temp file + os.replace), then prunes to train.keep_last. A
process killed anywhere before the rename leaves only a `.tmp-*` folder, which nothing reads and the next save
removes; `latest` still names the previous checkpoint.
rank{r}.pt holds what lives outside the engine on that rank, each piece saved by the object that owns it
(`state_dict` / `load_state_dict`): the trainer's counters (step, tokens, skipped steps), the recurrent memory
(and RMT's replay window), the stream cursor, the RNG states; plus the format version (`upgrade` reads older ones).

Files that cannot run code: every file memlm writes holds tensors and plain values only and is read weights-only;
DeepSpeed's own files are verified the same way before DeepSpeed unpickles them (safe_load.py). rank files written
before that (pickled memory dataclasses and numpy arrays) are refused with the command that converts them once if
you trust them (convert.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import torch

from memlm.trainer.runtime import distributed, faults

from . import disk_full
from .errors import CheckpointWriteError, ResumeError
from .latest import CHECKPOINTS, LATEST, META, latest_tag, read_latest  # also read as store.* by the loop
from .safe_load import safe_load

# rank{r}.pt's format: 2 = {"format", and one entry per saved piece: "trainer", "recurrence", "stream", "rng"}.
FORMAT_VERSION = 2
FORMAT_KEY = "format"
TMP_PREFIX = ".tmp-"


def tag_for(step: int) -> str:
    return f"global_step{step}"


class Stateful(Protocol):
    """What a checkpoint saves and restores: each piece owns its state (tensors and plain values only)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def save(engine, ckpt_dir: Path, step: int, rank: int, pieces: Mapping[str, Stateful], meta: dict,
         keep_last: int) -> str:
    """Write checkpoint `step` aside, then publish it (see module docstring). Every rank calls this; `pieces` are
    this rank's state outside the engine, saved under their names in rank{r}.pt with the FORMAT_VERSION."""
    ckpt_dir = Path(ckpt_dir)
    rank_state = {FORMAT_KEY: FORMAT_VERSION, **{name: piece.state_dict() for name, piece in pieces.items()}}
    tag = tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    if rank == 0:
        for leftover in ckpt_dir.glob(TMP_PREFIX + "global_step*"):  # of a killed or failed save: never read
            shutil.rmtree(leftover, ignore_errors=True)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, save_latest=False)
        faults.at("engine-saved", step=step, rank=rank)
        faults.at("enospc", step=step, rank=rank)
        torch.save(rank_state, ckpt_dir / tmp_tag / f"rank{rank}.pt")
        if rank == 0:
            (ckpt_dir / tmp_tag / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    except (OSError, RuntimeError) as exc:  # a full disk, a quota, a vanished mount: the previous one stays usable
        # torch.save reports a full disk as a RuntimeError that never says so (disk_full.py): measured first,
        # before the space of the partial files is given back.
        full = disk_full.reason(exc, ckpt_dir)
        if not isinstance(exc, OSError) and full is None:
            raise
        if distributed.world_size() == 1:
            shutil.rmtree(ckpt_dir / tmp_tag, ignore_errors=True)  # give the space back
        # With several ranks the others may still be writing into the folder (removing it under them turned one
        # rank's full disk into another's "Parent directory does not exist"); the peer watch ends them, and rank 0
        # removes the leftover at the next save.
        previous = latest_tag(ckpt_dir)
        raise CheckpointWriteError(
            f"cannot write checkpoint {ckpt_dir / tag} ({full or exc.strerror or exc}); "
            + (f"the previous checkpoint {ckpt_dir / previous} is intact and `latest` names it: free space, then "
               "rerun with --resume" if previous else "no earlier checkpoint exists: free space and start again")
        ) from None
    faults.at("rank-saved", step=step, rank=rank)  # also where MEMLM_TEST_SLEEP_IN_SAVE sleeps
    distributed.barrier()  # every rank's files are on disk before the checkpoint becomes visible
    if rank == 0:
        final = ckpt_dir / tag
        if final.exists():  # the same step saved again (e.g. the end of a resumed run that saved there)
            shutil.rmtree(final)
        os.replace(ckpt_dir / tmp_tag, final)
        faults.at("renamed", step=step, rank=rank)
        _write_latest(ckpt_dir, tag)
        faults.at("latest", step=step, rank=rank)
        _prune(ckpt_dir, keep_last, step)
    distributed.barrier()
    return tag


def _write_latest(ckpt_dir: Path, tag: str) -> None:
    tmp = ckpt_dir / f"{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(tag + "\n")
    os.replace(tmp, ckpt_dir / LATEST)


def _prune(ckpt_dir: Path, keep_last: int, step: int) -> None:
    """Keep the newest keep_last checkpoints up to `step`, the one just written and named by `latest`. Later steps
    are left alone: they exist only where a resume went back to an earlier checkpoint (an edited `latest`), and
    counting them would delete the checkpoint `latest` names (it happened: "global_step4 is missing")."""
    steps = sorted(int(p.name[len("global_step"):]) for p in ckpt_dir.glob("global_step*")
                   if p.name[len("global_step"):].isdigit())
    older = [s for s in steps if s < step]
    for old in older[:max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(ckpt_dir / tag_for(old), ignore_errors=True)


def find_checkpoint(run_dir: Path, tag: str | None = None) -> tuple[Path, str]:
    """(RUN_DIR/checkpoints, tag) for reading a run's weights: `tag`, else the one `latest` names; a ResumeError
    when there is none or it is missing."""
    ckpt_dir = Path(run_dir) / CHECKPOINTS
    if tag is None:
        tag = read_latest(ckpt_dir)
        if tag is None:
            raise ResumeError(f"{run_dir} has no checkpoint ({ckpt_dir / LATEST} is missing): train it first or "
                              "name a run folder that saved one")
    if not tag or not (ckpt_dir / tag).is_dir():
        raise ResumeError(f"checkpoint {ckpt_dir / tag} is missing (the `latest` file points at it)")
    return ckpt_dir, tag


def step_of(tag: str) -> int | None:
    """global_step40 -> 40; None for a tag without a trailing number."""
    match = re.search(r"(\d+)$", tag)
    return int(match.group(1)) if match else None


def read_meta(ckpt_dir: Path, tag: str) -> dict:
    return json.loads((Path(ckpt_dir) / tag / META).read_text())


def check_compatible(saved: dict, current: dict, ckpt_path: Path) -> None:
    """Refuse a resume whose world size, arch or tokenizer differs from the checkpoint's, naming both values."""
    fixes = {
        "world_size": "launch with the same number of processes, or pass --reshard to load only the weights "
                      "(optimizer state and data position start over)",
        "arch": "set model.arch back, or start a new run folder",
        "tokenizer": "point data.path at data prepared with the checkpoint's tokenizer, or start a new run folder",
    }
    for key, fix in fixes.items():
        if saved.get(key) != current.get(key):
            raise ResumeError(f"cannot resume from {ckpt_path}: {key} was {_show(saved.get(key))}, now "
                              f"{_show(current.get(key))}; {fix}")


def _show(value) -> str:
    if isinstance(value, dict):  # a tokenizer identity: the fields a person recognises
        return f"{value.get('kind')} (vocab {value.get('vocab_size')}, sha256 {str(value.get('sha256'))[:12]})"
    return repr(value)


def restore_rank(ckpt_dir: Path, tag: str, rank: int, pieces: Mapping[str, Stateful]) -> None:
    """Load this rank's file of checkpoint `tag` (weights-only) into `pieces`, each by its name; an older format is
    read through `upgrade`. A piece's own ValueError (a state it cannot continue) becomes a ResumeError."""
    path = Path(ckpt_dir) / tag / f"rank{rank}.pt"
    state = upgrade(safe_load(path), path)
    missing = [name for name in pieces if name not in state]
    if missing:
        raise ResumeError(f"cannot resume from {path}: it holds no {', '.join(missing)} state; resume from another "
                          "checkpoint (edit `latest`) or start a new run folder")
    for name, piece in pieces.items():
        try:
            piece.load_state_dict(state[name])
        except ValueError as exc:
            raise ResumeError(f"cannot resume from {Path(ckpt_dir) / tag}: {exc}") from None


def upgrade(state: dict, path: Path) -> dict:
    """A rank file's contents in the current format. Format 1 (no version key, before the pieces saved
    themselves) kept the trainer's counters at the top level, and before that the memory outside the recurrence."""
    version = state.get(FORMAT_KEY, 1)
    if version > FORMAT_VERSION:
        raise ResumeError(f"{path} was written by a newer memlm (checkpoint format {version}, this one reads up to "
                          f"{FORMAT_VERSION}): upgrade memlm to resume it")
    if version == 1:
        state = {FORMAT_KEY: FORMAT_VERSION,
                 "trainer": {"step": state["step"], "tokens": state["tokens"],
                             "skipped_steps": state.get("skipped_steps", 0)},  # written after a good step only
                 "recurrence": state.get("recurrence") or {"memory": state["memory"]},
                 "stream": state["stream"], "rng": state["rng"]}
    return state
