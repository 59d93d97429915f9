"""A micro-batch's segment from the host onto the training device, without making the host wait for the device.

A copy from ordinary (pageable) host memory to a CUDA device is synchronous: torch stages it and waits on the
stream, so every kernel queued before it must finish first, and the GPU then idles while the host launches the
next ones. Three such copies at the start of every micro-batch drained the GPU three times. From page-locked
(pinned) memory the copy is a DMA queued on the stream behind the work already there, and `non_blocking=True`
lets the host go on at once. The pinned block is torch's (CachingHostAllocator): it records the copy's stream
use and hands the block out again only after the copy has run, so dropping the pinned tensor here is safe.

What the host needs to know about the segment (how many targets are scored: the loss divides by it) is counted
from the host's copy before the transfer, with numpy, which refuses a device tensor: never a device read.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch import Tensor

from memlm.data_pipeline.lanes import IGNORE
from memlm.models.head_plan import TailPlan, tail_plan


class CopyOptions(NamedTuple):
    pin: bool  # copy into page-locked host memory first
    non_blocking: bool  # queue the transfer and return


def copy_options(device_type: str, cuda_available: bool) -> CopyOptions:
    """How to move host tensors to a device of `device_type`: pinned and asynchronous to a CUDA device (pinning
    needs CUDA: torch.cuda.is_available()); a plain copy elsewhere (to the CPU `.to` is no copy at all)."""
    to_gpu = device_type == "cuda" and cuda_available
    return CopyOptions(pin=to_gpu, non_blocking=to_gpu)


def options_for(device) -> CopyOptions:
    return copy_options(torch.device(device).type, torch.cuda.is_available())


def to_device(tensor: Tensor, device, options: CopyOptions) -> Tensor:
    if options.pin:
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=options.non_blocking)


def scored_targets(targets: Tensor) -> int:
    """The targets the loss scores (not IGNORE), counted on the host: `targets` must be a host tensor."""
    return int(np.count_nonzero(targets.numpy() != IGNORE))


class DeviceSegment(NamedTuple):
    tokens: Tensor  # [B, N] on the device
    targets: Tensor  # [B, N] on the device, IGNORE = not scored
    reset: Tensor  # [B] bool on the device
    scored: int  # targets != IGNORE, counted on the host
    tail_plan: TailPlan | None = None  # the adaptive softmax's tail rows of these targets, planned on the host


def segment_to_device(batch: Any, device, options: CopyOptions,
                      planner: Callable[[Tensor], TailPlan] | None = None) -> DeviceSegment:
    """A batch (tokens, targets, reset on the host: a LaneStream Batch) on `device`, with its scored-target count
    and, given a planner (`tail_planner`), the tail plan of its targets, made from the host copy and sent along."""
    plan = None
    if planner is not None:
        plan = planner(batch.targets)
        plan = (plan.pin_memory() if options.pin else plan).to(device, non_blocking=options.non_blocking)
    return DeviceSegment(to_device(batch.tokens, device, options), to_device(batch.targets, device, options),
                         to_device(batch.reset, device, options), scored_targets(batch.targets), plan)


def tail_planner(model_cfg, device) -> Callable[[Tensor], TailPlan] | None:
    """How to plan the tail rows of a batch's targets for this model on `device`: only the chunked softmax head
    reads a plan (model.head_loss chunked, or auto on CUDA), and only when it has tail clusters. Without one the
    head finds the rows on the device, at a host sync per tail cluster (models/head_plan.py)."""
    on_cuda = torch.device(device).type == "cuda"
    chunked = model_cfg.head_loss == "chunked" or (model_cfg.head_loss == "auto" and on_cuda)
    if not chunked or not model_cfg.cutoffs:
        return None
    cutoffs, vocab_size = list(model_cfg.cutoffs), model_cfg.vocab_size
    return lambda targets: tail_plan(targets, cutoffs, vocab_size)
