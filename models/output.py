"""What every model's forward returns, and helpers for the recurrent state that travels between segments.

Shape letters (models/shapes.md): B lanes, N segment length, M memory length, R memory tokens, D model width,
V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor


@dataclass
class ModelOutput:
    nll: Tensor | None  # [B, N] per-token negative log-likelihood, 0 where target == -100; None without targets
    logits: Tensor | None  # [B, N, V] log-probabilities when asked for (their cross-entropy equals nll)
    memory: Any  # the state for the next segment (one of the *Memory dataclasses)
    aux_loss: Tensor | None = None  # RMT auxiliary memory loss (already weighted), else None


def cut(rows: Tensor) -> Tensor:
    """Rows kept as memory: cut from the autograd graph and copied into a tensor of their own. A slice would keep
    its whole source alive (the [B, M + N, D] layer input behind M cached rows; the [B, 2R + N, D] layer output
    behind RMT's R memory tokens): 2x to 15x the memory state's own bytes (bench/benchmarks/bench_memory.py)."""
    return rows.detach().clone(memory_format=torch.contiguous_format)


def map_memory(fn: Callable[[Tensor], Tensor], memory: Any) -> Any:
    """Apply fn to every tensor of a memory state (e.g. .to(device), .detach(), lane selection).

    Memory states are dataclasses whose fields are tensors, lists of tensors, ints or nested states.
    """
    if isinstance(memory, Tensor):
        return fn(memory)
    if isinstance(memory, list):
        return [map_memory(fn, m) for m in memory]
    if dataclasses.is_dataclass(memory):
        return dataclasses.replace(memory, **{f.name: map_memory(fn, getattr(memory, f.name))
                                              for f in dataclasses.fields(memory)})
    return memory
