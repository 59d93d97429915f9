"""Checkpoints that are complete or absent, and the checks that refuse a resume which would not continue the run.

Layout under RUN_DIR/checkpoints:
    global_step{N}/      DeepSpeed engine state (model, optimizer, lr scheduler) + rank{r}.pt + meta.json
    latest               the tag of the newest complete checkpoint (replaced atomically)
Writing: every rank saves into `.tmp-global_step{N}` (engine.save_checkpoint + its rank file); after a barrier
rank 0 renames the folder and replaces `latest` (temp file + os.replace), then prunes to train.keep_last. A
process killed anywhere before the rename leaves only a `.tmp-*` folder, which nothing reads and the next save
of that step removes; `latest` still names the previous checkpoint.
rank{r}.pt holds what lives outside the engine on that rank: recurrent memory, the stream cursor, RNG states.

Files that cannot run code. Every file memlm writes holds tensors and plain values only (the recurrence and the
stream turn their state into those in their state_dict), so it is read with `torch.load(weights_only=True)`.
DeepSpeed reads its own files with a full unpickler (and so does zero_to_fp32), so before it touches a folder
`verify_folder` loads every `*.pt` there weights-only (memory-mapped: the tensors are not read), allowing only
DeepSpeed's few plain record types. A file that would import anything else is refused in one line naming the file
and the object, before any of its bytes are unpickled by a full unpickler: opening a run folder someone sent you
runs none of its code. rank files written before this format (pickled memory dataclasses and numpy arrays) are
refused the same way, with the command that converts them once if you trust them (trainer/checkpoint/convert.py).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memlm.trainer.runtime import distributed

LATEST = "latest"
META = "meta.json"
TMP_PREFIX = ".tmp-"
# Test hook: "STEP:SECONDS" sleeps inside the aside-write of that step, so a test can SIGKILL mid-checkpoint.
SLEEP_HOOK = "MEMLM_TEST_SLEEP_IN_SAVE"
# Test hook: "POINT:STEP[:RANK]" SIGKILLs this process when it reaches POINT at STEP (on RANK, default every rank),
# as a preemption would (tests/trainer/checkpoint/test_kill_matrix.py); POINT "enospc" instead fails that step's save as a full disk.
KILL_HOOK = "MEMLM_TEST_KILL"
# Test hook: the signal KILL_HOOK sends instead of SIGKILL ("TERM": a scheduler's preemption; "INT": Ctrl-C).
SIGNAL_HOOK = "MEMLM_TEST_SIGNAL"


def kill_point(point: str, step: int, rank: int) -> None:
    """Die here (SIGKILL: no cleanup, no flush) when KILL_HOOK names this point, step and rank; or receive the
    signal SIGNAL_HOOK names there, as if a scheduler or a terminal had sent it at that moment."""
    hook = os.environ.get(KILL_HOOK)
    if not hook:
        return
    name, at, *who = hook.split(":")
    if name == point and int(at) == step and (not who or int(who[0]) == rank):
        if point == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.kill(os.getpid(), getattr(signal, f"SIG{os.environ.get(SIGNAL_HOOK, 'KILL')}"))


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run (world size, arch, tokenizer changed); the message says how."""


class CheckpointWriteError(ResumeError):
    """A checkpoint that could not be written (a full disk); the previous one is intact and `latest` names it."""


class UnsafeCheckpointError(ResumeError):
    """A checkpoint file that a weights-only load refuses (it would import code) or cannot read; nothing ran."""


def tag_for(step: int) -> str:
    return f"global_step{step}"


def rng_state() -> dict:
    """Every generator a training step draws from, as tensors and plain values (weights-only loadable)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Dropout masks on a GPU come from the CUDA generators: without them a resumed run drew other masks
        # from its first step (seen on an H100, bench/README.md's GPU section).
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                             saved["cached_gaussian"]))
    else:  # numpy's own tuple (an in-memory state of an older caller)
        np.random.set_state(saved)
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
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
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state={"step": step}, save_latest=False)
        kill_point("engine-saved", step, rank)
        kill_point("enospc", step, rank)
        torch.save(rank_state, ckpt_dir / tmp_tag / f"rank{rank}.pt")
        if rank == 0:
            (ckpt_dir / tmp_tag / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    except OSError as exc:  # a full disk, a quota, a vanished mount: the previous checkpoint must stay usable
        shutil.rmtree(ckpt_dir / tmp_tag, ignore_errors=True)  # give the space back
        previous = latest_tag(ckpt_dir)
        raise CheckpointWriteError(
            f"cannot write checkpoint {ckpt_dir / tag} ({exc.strerror or exc}); "
            + (f"the previous checkpoint {ckpt_dir / previous} is intact and `latest` names it: free space, then "
               "rerun with --resume" if previous else "no earlier checkpoint exists: free space and start again")
        ) from None
    kill_point("rank-saved", step, rank)
    _maybe_sleep(step)
    distributed.barrier()  # every rank's files are on disk before the checkpoint becomes visible
    if rank == 0:
        final = ckpt_dir / tag
        if final.exists():  # the same step saved again (e.g. the end of a resumed run that saved there)
            shutil.rmtree(final)
        os.replace(ckpt_dir / tmp_tag, final)
        kill_point("renamed", step, rank)
        _write_latest(ckpt_dir, tag)
        kill_point("latest", step, rank)
        _prune(ckpt_dir, keep_last, step)
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


def _prune(ckpt_dir: Path, keep_last: int, step: int) -> None:
    """Keep the newest keep_last checkpoints up to `step`, the one just written and named by `latest`. Later steps
    are left alone: they exist only where a resume went back to an earlier checkpoint (an edited `latest`), and
    counting them would delete the checkpoint `latest` names (it happened: "global_step4 is missing")."""
    steps = sorted(int(p.name[len("global_step"):]) for p in ckpt_dir.glob("global_step*")
                   if p.name[len("global_step"):].isdigit())
    older = [s for s in steps if s < step]
    for old in older[:max(len(older) - (keep_last - 1), 0)]:
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
    return safe_load(Path(ckpt_dir) / tag / f"rank{rank}.pt")


# ---------------------------------------------------------------------------------------------------------------
# Weights-only reading (module docstring)

# Written by memlm before its rank files held only tensors and plain values: such a file is refused with the
# conversion command rather than as hostile.
_LEGACY_GLOBALS = re.compile(r"^(models\.[a-z_]+\.[A-Za-z]+Memory|trainer\.recurrence\.Segment|numpy\.dtype|"
                             r"numpy\.ndarray|numpy\.(_core|core)\.multiarray\._reconstruct)$")
CONVERT_HINT = "python -m memlm.trainer.checkpoint.convert"


def deepspeed_safe_types() -> list:
    """The plain record types DeepSpeed pickles into its own checkpoint files (an enum, the loss-scaler settings,
    a fragment address): data with no code of their own, so a weights-only load may build them."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_load(path: Path, allow: list | None = None, mmap: bool = False) -> Any:
    """torch.load(path, weights_only=True) (tensors, plain containers and `allow`'s types); an
    UnsafeCheckpointError naming the file, and what it would have imported, for anything else."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allow or [])):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UnsafeCheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; resume from "
                                    "another one (edit `latest`) or start a new run folder") from None
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... by case
        raise UnsafeCheckpointError(_refusal(path, exc)) from None


def _refusal(path: Path, exc: Exception) -> str:
    try:
        imported = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))  # reads opcodes, runs nothing
    except Exception:  # noqa: BLE001 - not a readable torch zip file at all
        imported = []
    if imported and all(_LEGACY_GLOBALS.match(name) for name in imported):
        return (f"{path} was written by an older memlm (it pickles {', '.join(imported)}), and checkpoints are now "
                f"read weights-only so that a file cannot run code; if you trust it, convert its run folder once with "
                f"`{CONVERT_HINT} RUN_DIR`, else start a new run folder")
    if imported or "Weights only load failed" in str(exc):
        what = ", ".join(imported) or _unsupported(exc)
        return (f"refusing to load {path}: unpickling it would import {what}, which can run code (memlm's and "
                "DeepSpeed's checkpoints hold only tensors and plain values); nothing in it was run. Do not use "
                "this file unless you know who wrote it and why")
    return (f"cannot read checkpoint file {path} ({type(exc).__name__}: {_first_line(exc)}): it is truncated or "
            "not a torch checkpoint; resume from another checkpoint (edit `latest`) or start a new run folder")


def _unsupported(exc: Exception) -> str:
    match = re.search(r"unsupported GLOBAL (\S+)", str(exc), re.IGNORECASE)
    return match.group(1) if match else "a Python object"


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0].split(". ")[0][:200] if lines else "no message"


def verify_folder(folder: Path) -> None:
    """Refuse (UnsafeCheckpointError) a checkpoint folder holding any DeepSpeed `*.pt` file that a weights-only load
    with DeepSpeed's record types rejects, before DeepSpeed or zero_to_fp32 reads it with a full unpickler."""
    allow = deepspeed_safe_types()
    for path in sorted(Path(folder).glob("*.pt")):
        if not re.fullmatch(r"rank\d+\.pt", path.name):  # memlm's own are only ever read weights-only
            safe_load(path, allow=allow, mmap=True)
