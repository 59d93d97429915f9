"""Checkpoints that are complete or absent, and the checks that refuse a resume which would not continue the run.

Layout under RUN_DIR/checkpoints:
    global_step{N}/      DeepSpeed engine state (model, optimizer, lr scheduler) + rank{r}.pt + meta.json
    latest               the tag of the newest complete checkpoint (replaced atomically)
Writing: every rank saves into `.tmp-global_step{N}` (engine.save_checkpoint + its rank file); after a barrier
rank 0 renames the folder and replaces `latest` (temp file + os.replace), then prunes to train.keep_last. A
process killed anywhere before the rename leaves only a `.tmp-*` folder, which nothing reads and the next save
of that step removes; `latest` still names the previous checkpoint.
rank{r}.pt holds what lives outside the engine on that rank: recurrent memory, the stream cursor, RNG states.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from . import distributed

LATEST = "latest"
META = "meta.json"
TMP_PREFIX = ".tmp-"
# Test hook: "STEP:SECONDS" sleeps inside the aside-write of that step, so a test can SIGKILL mid-checkpoint.
SLEEP_HOOK = "MEMLM_TEST_SLEEP_IN_SAVE"


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run (world size, arch, tokenizer changed); the message says how."""


def tag_for(step: int) -> str:
    return f"global_step{step}"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Dropout masks on a GPU come from the CUDA generators: without them a resumed run drew other masks
        # from its first step (seen on an H100, bench/README.md's GPU section).
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine, ckpt_dir: Path, step: int, rank: int, rank_state: dict, meta: dict, keep_last: int) -> str:
    """Write checkpoint `step` aside, then publish it (see module docstring). Every rank calls this."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    if rank == 0:
        shutil.rmtree(ckpt_dir / tmp_tag, ignore_errors=True)  # a leftover of a killed run
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state={"step": step}, save_latest=False)
    torch.save(rank_state, ckpt_dir / tmp_tag / f"rank{rank}.pt")
    if rank == 0:
        (ckpt_dir / tmp_tag / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    _maybe_sleep(step)
    distributed.barrier()  # every rank's files are on disk before the checkpoint becomes visible
    if rank == 0:
        final = ckpt_dir / tag
        if final.exists():  # the same step saved again (e.g. the end of a resumed run that saved there)
            shutil.rmtree(final)
        os.replace(ckpt_dir / tmp_tag, final)
        _write_latest(ckpt_dir, tag)
        _prune(ckpt_dir, keep_last)
    distributed.barrier()
    return tag


def _maybe_sleep(step: int) -> None:
    hook = os.environ.get(SLEEP_HOOK)
    if hook:
        at, seconds = hook.split(":")
        if int(at) == step:
            time.sleep(float(seconds))


def _write_latest(ckpt_dir: Path, tag: str) -> None:
    tmp = ckpt_dir / f"{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(tag + "\n")
    os.replace(tmp, ckpt_dir / LATEST)


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    steps = sorted(int(p.name[len("global_step"):]) for p in ckpt_dir.glob("global_step*")
                   if p.name[len("global_step"):].isdigit())
    for old in steps[:-keep_last]:
        shutil.rmtree(ckpt_dir / tag_for(old), ignore_errors=True)


def latest_tag(ckpt_dir: Path) -> str | None:
    path = Path(ckpt_dir) / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    return tag if (Path(ckpt_dir) / tag / META).is_file() else None


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


def load_rank_state(ckpt_dir: Path, tag: str, rank: int) -> dict:
    # weights_only=False: the memory dataclasses and numpy RNG state are our own pickles, written by this code.
    return torch.load(Path(ckpt_dir) / tag / f"rank{rank}.pt", map_location="cpu", weights_only=False)
