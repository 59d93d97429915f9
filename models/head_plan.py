"""Which rows each tail cluster of the adaptive softmax scores: a row plan built where the targets still are on the
host.

Shape letters (models/shapes.md): B lanes, N segment length, T rows of a flattened batch (the B·N targets, in
order), T_i rows planned for tail cluster i.

The tails score only the rows whose target is in them. Finding those rows on the device (`nonzero`) is a host sync
per cluster, and gives each cluster a row count that changes every batch. The trainer holds every batch's targets
on the host before it copies them over, so it builds the plan there (`tail_plan`, no sync: host tensors) and sends
it along with the batch (`TailPlan.to(device, non_blocking=True)`).

Each cluster's rows are padded with -1 to a multiple of ROW_MULTIPLE, and to ROW_MULTIPLE at least: the head reads
a -1 row as row 0 and masks it out of the result and the gradients, exactly. The padding makes the row counts vary
in steps of 64 only, and never 0 or 1, the sizes torch.compile specialises on (a cluster with no row gets 64 rows of
padding). The plan's tensors are marked dynamic along their one dimension, so a compiled forward keeps one graph
for every batch instead of recompiling at each new padded count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

ROW_MULTIPLE = 64


@dataclass(frozen=True)
class TailPlan:
    bounds: tuple[tuple[int, int], ...]  # the tail clusters' [lo, hi) token ranges, in order
    rows: tuple[Tensor, ...]  # per tail cluster: int64 [T_i], rows of the flattened targets, -1 = padding
    static: bool = False  # padded to fixed capacities: lengths left static for torch.compile (CUDA graphs)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TailPlan:
        return self._with(r.to(device, non_blocking=non_blocking) for r in self.rows)

    def pin_memory(self) -> TailPlan:
        """Page-locked copies, for a `to(cuda, non_blocking=True)` that does not wait for the host."""
        return self._with(r.pin_memory() for r in self.rows)

    def _with(self, rows) -> TailPlan:
        return TailPlan(self.bounds, tuple(r if self.static else _dynamic(r) for r in rows), self.static)


def tail_bounds(cutoffs: Sequence[int], vocab_size: int) -> tuple[tuple[int, int], ...]:
    edges = list(cutoffs) + [vocab_size]
    return tuple(zip(edges[:-1], edges[1:]))


def tail_plan(targets: Tensor, cutoffs: Sequence[int], vocab_size: int, multiple: int = ROW_MULTIPLE,
              host: bool = True, capacity: Sequence[int] | None = None) -> TailPlan:
    """targets [B, N] (any shape; -100 = ignored, in no cluster) -> the rows of targets.reshape(-1) in each tail
    cluster [cutoffs[i], cutoffs[i + 1]) (the last up to vocab_size), ascending, padded with -1.

    host=True (the trainer's plan): targets must be a host tensor (read through numpy, no device op at all).
    host=False: targets on any device, at one host sync per cluster (`nonzero`) on a GPU: the head's fallback when
    it is given no plan.
    capacity: per tail cluster, the rows to pad to at least: a static plan, one shape for every batch that fits
    (CUDA graphs replay one shape); a batch over a cluster's capacity gets the next multiple instead, a new shape.
    Its lengths are then left static for torch.compile."""
    flat = targets.reshape(-1)
    plan = []
    for i, (lo, hi) in enumerate(tail_bounds(cutoffs, vocab_size)):
        inside = (flat >= lo) & (flat < hi)
        # host: through numpy, which refuses device tensors, so a plan meant to cost no sync never does one
        rows = torch.from_numpy(np.flatnonzero(inside.numpy())) if host else inside.nonzero().squeeze(1)
        size = max(multiple, -(-rows.numel() // multiple) * multiple, capacity[i] if capacity else 0)
        padded = torch.cat([rows, rows.new_full((size - rows.numel(),), -1)])
        plan.append(padded if capacity else _dynamic(padded))
    return TailPlan(tail_bounds(cutoffs, vocab_size), tuple(plan), static=bool(capacity))


def _dynamic(rows: Tensor) -> Tensor:
    """Tell torch.compile that this length changes from batch to batch (a no-op outside torch.compile)."""
    import torch._dynamo  # loaded on first use: a plain import of memlm.models does not pay for it

    torch._dynamo.maybe_mark_dynamic(rows, 0)
    return rows
