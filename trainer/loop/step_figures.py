"""The figures of one training step: summed over ranks in the step's one all-reduce, read on the host once.

On a GPU every read of a device value on the host waits for all the work queued before it, and the GPU idles
until the host has queued more. A step has one decision the host must take before the optimizer runs: skip the
update if any rank's loss or gradient norm is not finite (trainer/loop/nonfinite.py). That read is the step's one
host read, and everything else the step reports rides along in it. What the host already knows (the targets it
counted before copying the batch, the input tokens, a SIGTERM) goes onto the device as a fill, which queues a
kernel with the value as its argument: no copy, no wait (a tensor built from Python data would be a blocking
copy from pageable memory).
"""

from __future__ import annotations

import math
from typing import NamedTuple


class StepFigures(NamedTuple):
    """Sums over ranks, except grad_norm. A flag field counts the ranks that raised it."""

    nll: float  # summed NLL of the new targets
    targets: float  # scored targets
    inputs: float  # input tokens read
    bad_loss: float  # ranks whose loss was not finite
    bad_grad: float  # ranks whose gradient norm was not finite (checked by memlm at ZeRO-0 only)
    stop: float  # ranks asked to stop by SIGTERM
    grad_norm: float  # the global gradient norm memlm computed (ZeRO-0), this rank's; NaN where it computed none

    @classmethod
    def summed(cls, nll, targets: int, inputs: int, bad_loss, bad_grad, stop: bool, world_size: int,
               grad_norm=None) -> "StepFigures":
        """One float64 tensor of every rank's figures, all-reduced when there are several ranks, read once.

        nll, bad_loss, bad_grad and grad_norm are device scalars; targets, inputs and stop host values."""
        import torch
        import torch.distributed as dist

        fill = lambda value: nll.new_full((), float(value), dtype=torch.float64)  # noqa: E731
        summed = torch.stack([nll.double(), fill(targets), fill(inputs), bad_loss.double(), bad_grad.double(),
                              fill(stop)])
        if world_size > 1:
            dist.all_reduce(summed)
        # The ZeRO-0 norm is already global (the gradients are averaged over ranks before it): read, not summed.
        norm = grad_norm.double() if grad_norm is not None else fill(math.nan)
        return cls(*torch.cat([summed, norm.reshape(1)]).tolist())  # the step's one host read

    @property
    def skip(self) -> bool:
        """Some rank saw a non-finite loss or gradient norm: every rank skips the update."""
        return self.bad_loss > 0 or self.bad_grad > 0
