"""Refuse, in one line and before the engine is built, a resume whose model no longer fits its checkpoint.

DeepSpeed finds a changed shape only inside load_checkpoint, as a 50-line `[rank0]:` traceback of
load_state_dict's size mismatches (issue 32). The checkpoint's parameter shapes are in DeepSpeed's model states
file: `param_shapes` (ZeRO 1-3, the full shapes of the partitioned parameters) or the module state dict itself
(ZeRO-0). This model's come from building it on the meta device (no memory, a fraction of a second even for the
papers' models). The line names the first parameter that differs, in the model's own order, and the model keys
that changed when the checkpoint's config is known. The recurrent memory saved in rank0.pt is compared the same
way (a changed model.mem_len keeps every weight's shape, but not the memory's: a traceback at the first step).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from memlm.models import build_model

from .errors import ResumeError
from .safe_load import deepspeed_safe_types, safe_load
from .store import upgrade


def checkpoint_shapes(folder: Path) -> tuple[dict[str, tuple[int, ...]], bool]:
    """(name -> shape, whether these are parameters only) of a DeepSpeed checkpoint folder; ({}, True) when it
    holds no model states file. Read memory-mapped: no tensor data is loaded."""
    files = sorted(Path(folder).glob("mp_rank_*_model_states.pt"))
    if not files:
        return {}, True
    state = safe_load(files[0], allow=deepspeed_safe_types(), mmap=True)
    if state.get("param_shapes"):
        shapes = {}
        for group in state["param_shapes"]:
            shapes.update({name: tuple(shape) for name, shape in group.items()})
        for name, shape in (state.get("frozen_param_shapes") or {}).items():
            shapes[name] = tuple(shape)
        return shapes, True
    module = state.get("module") or {}
    return {name.removeprefix("module."): tuple(t.shape) for name, t in module.items()}, False


def meta_model(model_cfg):
    """The model of `model_cfg` built on the meta device: shapes without memory or time."""
    with torch.device("meta"):
        return build_model(model_cfg)


def model_shapes(model, params_only: bool) -> dict[str, tuple[int, ...]]:
    """The model's parameter (or state dict) shapes."""
    if params_only:
        return {name: tuple(p.shape) for name, p in model.named_parameters()}
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def first_misfit(saved: dict[str, tuple[int, ...]], own: dict[str, tuple[int, ...]]) -> str | None:
    """The first difference between the checkpoint's shapes and this model's, in words; None when they fit."""
    for name, shape in own.items():
        if name not in saved:
            return f"parameter {name} {_shape(shape)} is not in the checkpoint"
        if saved[name] != shape:
            return f"parameter {name} is {_shape(saved[name])} in the checkpoint, {_shape(shape)} now"
    for name, shape in saved.items():
        if name not in own:
            return f"the checkpoint's parameter {name} {_shape(shape)} is not in this model"
    return None


def memory_misfit(template: Any, saved: Any, where: str) -> str | None:
    """The first tensor of a saved recurrent state (plain dicts, lists, tensors) whose shape differs from this run's
    fresh state `template` (dataclasses, lists, tensors); what else differs the recurrence refuses by itself."""
    if dataclasses.is_dataclass(template) and isinstance(saved, dict):
        fields = (f.name for f in dataclasses.fields(template))
        found = (memory_misfit(getattr(template, n), saved[n], f"{where}.{n}") for n in fields if n in saved)
        return next((m for m in found if m), None)
    if isinstance(template, (list, tuple)) and isinstance(saved, list):
        found = (memory_misfit(t, s, f"{where}[{i}]") for i, (t, s) in enumerate(zip(template, saved)))
        return next((m for m in found if m), None)
    if hasattr(template, "shape") and hasattr(saved, "shape") and tuple(template.shape) != tuple(saved.shape):
        was, now = _shape(tuple(saved.shape)), _shape(tuple(template.shape))
        return f"the recurrent {where} is {was} in the checkpoint, {now} now"
    return None


def saved_memory(folder: Path) -> Any:
    """Rank 0's recurrent memory as checkpoint FOLDER saved it (plain state), or None."""
    path = Path(folder) / "rank0.pt"
    if not path.is_file():
        return None
    return (upgrade(safe_load(path), path).get("recurrence") or {}).get("memory")


def check_model_fits(model_cfg, batch_size: int, folder: Path, changed: dict[str, tuple] | None = None) -> None:
    """ResumeError naming the first misfit when the model of `model_cfg` (batch_size lanes) cannot continue
    checkpoint FOLDER: a parameter's shape, else the recurrent memory's (model.mem_len, compressed_len, ... are
    configuration for the weights, but the saved memory has their sizes).
    changed: the keys whose values differ from the checkpoint's config ({key: (was, now)}), if known."""
    saved, params_only = checkpoint_shapes(folder)
    if not saved:
        return
    model = meta_model(model_cfg)
    misfit = first_misfit(saved, model_shapes(model, params_only))
    if misfit is None:
        memory = saved_memory(folder)
        if memory is not None:
            import torch

            misfit = memory_misfit(model.init_memory(batch_size, device=torch.device("meta")), memory, "memory")
    if misfit is None:
        return
    keys = ", ".join(f"{key} was {was!r}, now {now!r}" for key, (was, now) in (changed or {}).items())
    because = f" ({keys})" if keys else ""
    raise ResumeError(f"cannot resume from {folder}: the model's shape changed{because}: {misfit}; set it back, or "
                      "start a new run folder")


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
