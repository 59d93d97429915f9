"""Skipping a step whose loss or gradient norm is not finite, through DeepSpeed's own overflow convention.

DeepSpeed already discards an update whose global gradient norm is inf/NaN in every optimizer that holds the
gradients itself (ZeRO 1-3, its bf16 optimizer): the optimizer sets `overflow`, clears its gradients and returns,
and the engine then leaves the learning-rate schedule where it was and counts `engine.skipped_steps`. A plain
torch optimizer (ZeRO-0 in fp32) has no such check, and no optimizer looks at the loss. `skipped_update` makes the
one engine.step() inside it take that same overflow path whatever the optimizer, so a step the trainer decided to
skip leaves weights, optimizer state and schedule exactly as they were, and DeepSpeed's counters stay coherent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_MISSING = object()


@contextlib.contextmanager
def skipped_update(optimizer) -> Iterator[None]:
    """Within: the optimizer's next step is an overflow (no update, gradients cleared by its own code path)."""
    saved: dict[str, object] = {}

    def patch(name: str, value) -> None:
        saved[name] = optimizer.__dict__.get(name, _MISSING)
        setattr(optimizer, name, value)

    if hasattr(optimizer, "_overflow_check_and_loss_scale_update"):  # ZeRO-3
        def forced_overflow(update_scale=True):
            optimizer.overflow = True
            return True if not update_scale else optimizer._loss_scale_update_and_overflow_cleanup()

        patch("_overflow_check_and_loss_scale_update", forced_overflow)
    elif hasattr(optimizer, "check_overflow") and hasattr(optimizer, "check_grad_overflow"):  # ZeRO 1-2
        patch("check_grad_overflow", True)
        patch("check_overflow", lambda *args, **kwargs: setattr(optimizer, "overflow", True))
    else:  # a torch optimizer (ZeRO-0) or DeepSpeed's bf16 optimizer: the engine zeroes the gradients after it
        patch("step", lambda *args, **kwargs: None)
        patch("overflow", True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(optimizer, name)
            else:
                setattr(optimizer, name, value)
