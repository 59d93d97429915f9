"""The figures one training step adds up over ranks, in the step's one all-reduce (and its one host read)."""

from __future__ import annotations

from typing import NamedTuple


class StepFigures(NamedTuple):
    """Sums over ranks. A flag field counts the ranks that raised it."""

    nll: float  # summed NLL of the new targets
    targets: float  # scored targets
    inputs: float  # input tokens read
    bad_loss: float  # ranks whose loss was not finite
    bad_grad: float  # ranks whose gradient norm was not finite (checked by memlm at ZeRO-0 only)
    stop: float  # ranks asked to stop by SIGTERM

    @classmethod
    def summed(cls, nll, targets: int, inputs: int, bad_loss, bad_grad, stop: bool, world_size: int) -> "StepFigures":
        """One float64 tensor of every rank's figures, all-reduced when there are several ranks, read once."""
        import torch
        import torch.distributed as dist

        device = nll.device
        as_tensor = lambda value: torch.as_tensor(float(value), dtype=torch.float64, device=device)  # noqa: E731
        summed = torch.stack([nll.double(), as_tensor(targets), as_tensor(inputs), bad_loss.double(),
                              bad_grad.double(), as_tensor(stop)])
        if world_size > 1:
            dist.all_reduce(summed)
        return cls(*summed.tolist())

    @property
    def skip(self) -> bool:
        """Some rank saw a non-finite loss or gradient norm: every rank skips the update."""
        return self.bad_loss > 0 or self.bad_grad > 0
