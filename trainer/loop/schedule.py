"""Learning-rate schedule as a multiplier of train.lr: linear warmup from 0, then cosine / linear / constant
down to min_lr_ratio at train.steps. A client LambdaLR (not a DeepSpeed scheduler) so one function decides it
and the checkpoint carries it with the engine (DeepSpeed saves a client lr_scheduler's state_dict)."""

from __future__ import annotations

import math


def lr_factor(step: int, *, steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based: the step about to be taken)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps  # never exactly 0: step 0 already learns
    if schedule == "constant":
        return 1.0
    span = max(1, steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        decay = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def make_scheduler(optimizer, train_cfg):
    """A torch LambdaLR over `optimizer` following train_cfg (TrainConfig)."""
    from torch.optim.lr_scheduler import LambdaLR

    def factor(step: int) -> float:
        return lr_factor(step, steps=train_cfg.steps, warmup_steps=train_cfg.warmup_steps,
                         schedule=train_cfg.schedule, min_lr_ratio=train_cfg.min_lr_ratio)

    return LambdaLR(optimizer, factor)


def rebase(scheduler, train_cfg) -> tuple[float, float]:
    """After a resume with a changed config: the restored optimizer and scheduler follow train_cfg from the step the
    scheduler has reached. DeepSpeed's load restores the saved peak rate (base_lrs), each group's current rate and
    its weight_decay / eps, so the new values would otherwise apply to nothing; the schedule's shape (warmup,
    schedule, steps, min_lr_ratio) is this run's LambdaLR function already. Returns the rate before and after."""
    groups = scheduler.optimizer.param_groups
    before = float(groups[0]["lr"])
    reached = scheduler.last_epoch  # optimizer steps the schedule has taken (a skipped step takes none)
    scheduler.base_lrs = [train_cfg.lr for _ in groups]
    for group, factor in zip(groups, scheduler.lr_lambdas):
        group["initial_lr"] = train_cfg.lr
        group["lr"] = train_cfg.lr * factor(reached)  # as LambdaLR.get_lr computes it
        group["weight_decay"] = train_cfg.weight_decay
        group["eps"] = train_cfg.adam_eps
    scheduler._last_lr = [group["lr"] for group in groups]
    return before, float(groups[0]["lr"])
