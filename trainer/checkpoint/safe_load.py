"""Reading checkpoint files without running code (see store.py's docstring, "Files that cannot run code").

Every file memlm writes holds tensors and plain values only, so it is read with `torch.load(weights_only=True)`.
DeepSpeed and zero_to_fp32 read their own files with a full unpickler, so `verify_folder` first loads every DeepSpeed
`*.pt` of a folder weights-only (memory-mapped), allowing only DeepSpeed's few plain record types.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .errors import UnsafeCheckpointError

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
