"""A recurrent state as a checkpoint stores it: tensors and plain values only, so a rank file is read with
torch.load(weights_only=True) and cannot run code (docs/design.md §4).

`plain_state` turns a memory dataclass (or a replay window's Segment) into a dict of its fields; `rebuild_state`
rebuilds the objects on this run's own empty memory, which fixes their types, and refuses a saved state whose fields
do not match, naming the field. The training loop's schedules (trainer/loop/recurrence.py) save and resume with them;
convert.py rewrites older checkpoints' pickled states with `plain_state`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from memlm.errors import MemlmError


class RecurrenceStateError(MemlmError, ValueError):
    """A checkpoint's recurrent state that this run's schedule cannot continue; the message says how (the command
    line prints it as one line, as every MemlmError)."""


def plain_state(state: Any) -> Any:
    """A memory state (dataclasses, lists, tensors, ints) as dicts, lists, CPU tensors and plain values."""
    if isinstance(state, Tensor):
        return state.detach().cpu()
    if isinstance(state, (list, tuple)):
        return [plain_state(s) for s in state]
    if dataclasses.is_dataclass(state):
        return {f.name: plain_state(getattr(state, f.name)) for f in dataclasses.fields(state)}
    return state


def rebuild_state(template: Any, saved: Any, device, where: str) -> Any:
    """plain_state's inverse: `saved` rebuilt into `template`'s types (a fresh state of this run) on `device`.
    A state's `retired_fields` (fields older memlm saved in it, models/README.md's memory protocol) are dropped."""
    if dataclasses.is_dataclass(template):
        names = {f.name for f in dataclasses.fields(template)}
        retired = set(getattr(template, "retired_fields", ()))
        if not isinstance(saved, dict) or not names <= set(saved) <= names | retired:
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise RecurrenceStateError(f"the checkpoint's {where} has fields {got}, this run's has {sorted(names)}; "
                                       "resume with the model settings of the checkpoint, or start a new run folder")
        return dataclasses.replace(template, **{n: rebuild_state(getattr(template, n), saved[n], device, f"{where}.{n}")
                                                for n in names})
    if isinstance(template, list):
        if not isinstance(saved, list):
            raise RecurrenceStateError(f"the checkpoint's {where} is {type(saved).__name__}, expected a list")
        # Lists hold one kind of element (per-layer tensors, window segments): the first one types them all.
        element = template[0] if template else None
        return [rebuild_state(element, s, device, f"{where}[{i}]") for i, s in enumerate(saved)]
    if isinstance(template, Tensor) or isinstance(saved, Tensor):
        if not isinstance(saved, Tensor):
            raise RecurrenceStateError(f"the checkpoint's {where} is {type(saved).__name__}, expected a tensor")
        # in the run's own dtype: a checkpoint's state kept in another (a bf16 run's first segments wrote fp32
        # before the memory took the compute dtype) would change dtype at the next segment
        return saved.to(device, template.dtype) if isinstance(template, Tensor) and saved.is_floating_point() \
            else saved.to(device)
    return saved
