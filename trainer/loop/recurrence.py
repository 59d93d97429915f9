"""How a micro-batch walks the recurrence: which segments are forwarded, what the loss is, what carries over.

Shape legend: B lanes (data.batch_size), N segment length, k = model.bptt_depth.

Three schedules, one per kind of model state, each owning the per-rank state that a checkpoint saves
(`state_dict` / `load_state_dict`):

* `SegmentRecurrence` (transformer, txl, lamemo): one new segment per micro-batch; the memory is carried to the
  next micro-batch cut from the graph (Transformer-XL and LaMemo stop gradients at the cache anyway).
* `WindowBPTT` (rmt, `bptt_mode: window`, the RMT paper): one new segment per micro-batch, like every other arch.
  The lanes' last k segments (tokens, targets, reset flags and the Transformer-XL cache each one read when it was
  new) are replayed with the current weights, in the same graph, from the memory tokens before the oldest of them,
  so the new segment's loss backpropagates through exactly the last k memory transitions (fewer where a document
  start inside the window reset the memory, which cuts the path). k + 1 forwards per micro-batch, B x N new tokens.
  The loss is the new segment's; `bptt_replay_loss: true` also scores the replayed segments.
* `ChunkBPTT` (rmt, `bptt_mode: chunk`): k + 1 *new* segments per micro-batch in one graph, detached between
  micro-batches (truncated BPTT: the segments' losses reach 0, 1, ..., k earlier segments, mean k/2, and a step
  consumes (k + 1) x B x N tokens). Cheaper than the window; not what the paper trains.

The loss of a micro-batch is the summed NLL over the scored segments' non-ignored targets divided by their count,
plus RMT's auxiliary memory loss averaged over the scored segments (so its weight is aux_loss_weight whatever k
and the schedule). The figures reported back (nll, count, inputs) describe the *new* data only, so the logged
training loss and token counts mean the same thing in every schedule.

Window detail: after the step, the window slides by one segment; the memory before its new oldest segment is the
one this step's replay computed (current weights, cut from the graph). The cache a replayed segment reads is the
one the new segment before it left (the cache is stop-gradient, so nothing flows through it either way): what the
segment read when it was new under memlm's recipe; under `bptt_new_segment_cache: replayed` the new segment reads
the replay's recomputed cache instead, and the window still keeps the one from before, as the authors' loop does.

A skipped step (non-finite loss or gradient, trainer/loop/train.py) ends with `clear()`: every lane's memory emptied
and RMT's replay window dropped, so nothing computed by the forward that went wrong is carried or replayed, and no
lane can read across a document start that fell inside the skipped segments.

Saved state is tensors and plain values only (a checkpoint is read with torch.load(weights_only=True), so it
cannot run code): trainer/checkpoint/recurrent_state.py turns a memory dataclass (or a Segment) into a dict of its
fields, and `load_state_dict` rebuilds the objects on this run's own empty memory, which fixes their types; a saved
state whose fields do not match is refused naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from memlm.models import map_memory
from memlm.models.registry import arch_spec
from memlm.trainer.checkpoint.recurrent_state import RecurrenceStateError, plain_state, rebuild_state

from .batch_transfer import DeviceSegment, options_for, scored_targets, segment_to_device, tail_planner


@dataclass
class MicroBatch:
    loss: Tensor  # scalar in the graph: what engine.backward gets
    nll: Tensor  # summed NLL over the new segments' scored targets (detached; read it after the step, no sync)
    count: int  # those targets (counted on the host, before the copy to the device)
    inputs: int  # new input tokens (B x N per new segment)


@dataclass
class Segment:
    """One segment of every lane as it was read: what a replay needs to run it again."""

    tokens: Tensor  # [B, N]
    targets: Tensor  # [B, N], -100 = ignore
    reset: Tensor  # [B] bool: the lane started a new document here
    # the state's stop-gradient `cache` (RMT's Transformer-XL cache) the new segment before it left: what a replay
    # reads; None for a state without one (ARMT)
    cache: Any


def make_recurrence(model_cfg, memory, device) -> "SegmentRecurrence | ChunkBPTT | WindowBPTT":
    """The schedule for model_cfg, starting from `memory` (the model's init_memory)."""
    planner = tail_planner(model_cfg, device)
    if arch_spec(model_cfg.arch).recurrence == "segment":
        return SegmentRecurrence(memory, device, planner=planner)
    if model_cfg.bptt_mode == "chunk":
        return ChunkBPTT(memory, device, model_cfg.bptt_depth, planner=planner)
    return WindowBPTT(memory, device, model_cfg.bptt_depth, model_cfg.bptt_replay_loss,
                      start_memory=model_cfg.bptt_choice("bptt_start_memory"),
                      new_segment_cache=model_cfg.bptt_choice("bptt_new_segment_cache"),
                      replay_reduction=model_cfg.bptt_choice("bptt_replay_reduction"), planner=planner)


def _detached(memory: Any) -> Any:
    return memory.detached()


def _cache(memory: Any) -> Any:
    """The window BPTT's part of a state: its stop-gradient `cache` field, or None where it has none (models/README.md,
    the memory protocol)."""
    return getattr(memory, "cache", None)


def _with_cache(memory: Any, cache: Any) -> Any:
    """The state reading `cache` as its cache field (the state itself where it has none)."""
    return memory if cache is None else dataclasses.replace(memory, cache=cache)


def _nll_sum(out) -> Tensor:
    return out.nll.float().sum()  # stays on the device: the step reads its figures once (step_figures.py)


def _aux_mean(outs: list) -> Tensor | float:
    aux = [o.aux_loss for o in outs if o.aux_loss is not None]
    return torch.stack(aux).mean() if aux else 0.0


class _Recurrence:
    kind = ""

    def __init__(self, memory: Any, device, planner: Callable[[Tensor], Any] | None = None):
        self.memory, self.device = memory, device
        self.empty = memory  # the model's init_memory: what clear() goes back to
        self.copy = options_for(device)  # pinned and asynchronous to a GPU (batch_transfer.py)
        self.planner = planner  # the softmax head's tail plan of each new segment's targets (batch_transfer.py)

    def clear(self) -> None:
        """Every lane's memory emptied, as at a document start (after a skipped step, trainer/loop/train.py)."""
        self.memory = map_memory(torch.clone, self.empty)

    def _read(self, next_batch: Callable[[], Any]) -> DeviceSegment:
        """The next segment on the device, and its scored targets counted on the host (no device read)."""
        return segment_to_device(next_batch(), self.device, self.copy, self.planner)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "memory": plain_state(self.memory)}

    def load_state_dict(self, state: dict) -> None:
        self._check_kind(state)
        self.memory = rebuild_state(self.memory, state["memory"], self.device, "memory")

    def _check_kind(self, state: dict) -> None:
        saved = state.get("kind", SegmentRecurrence.kind if "memory" in state else None)
        if saved != self.kind:
            raise RecurrenceStateError(
                f"the checkpoint's recurrent state is {saved!r} but this run uses {self.kind!r}; set model.bptt_mode "
                "back to the checkpoint's, or start a new run folder")


class SegmentRecurrence(_Recurrence):
    """One new segment per micro-batch, memory carried across micro-batches cut from the graph."""

    kind = "segment"

    def step(self, forward: Callable, next_batch: Callable[[], Any]) -> MicroBatch:
        tokens, targets, reset, count, plan = self._read(next_batch)
        out = forward(tokens, self.memory, reset=reset, targets=targets, tail_plan=plan)
        nll = _nll_sum(out)
        self._next = out.memory
        loss = nll / max(count, 1) + _aux_mean([out])
        return MicroBatch(loss, nll.detach(), count, tokens.numel())

    def advance(self) -> None:
        """After the backward: carry the memory on, cut from this micro-batch's graph."""
        self.memory, self._next = _detached(self._next), None


class ChunkBPTT(_Recurrence):
    """k + 1 new segments per micro-batch in one graph (truncated BPTT), see the module docstring."""

    kind = "rmt-chunk"

    def __init__(self, memory: Any, device, depth: int, planner: Callable[[Tensor], Any] | None = None):
        super().__init__(memory, device, planner)
        self.depth = depth

    def step(self, forward: Callable, next_batch: Callable[[], Any]) -> MicroBatch:
        memory, outs, nll, count, inputs = self.memory, [], None, 0, 0
        for _ in range(self.depth + 1):
            tokens, targets, reset, seg_count, plan = self._read(next_batch)
            out = forward(tokens, memory, reset=reset, targets=targets, tail_plan=plan)
            seg_nll = _nll_sum(out)
            nll = seg_nll if nll is None else nll + seg_nll
            count, inputs = count + seg_count, inputs + tokens.numel()
            outs.append(out)
            memory = out.memory
        self._next = memory
        loss = nll / max(count, 1) + _aux_mean(outs)
        return MicroBatch(loss, nll.detach(), count, inputs)

    def advance(self) -> None:
        self.memory, self._next = _detached(self._next), None


class WindowBPTT(_Recurrence):
    """The RMT paper's BPTT: replay the last k segments before each new one, see the module docstring.

    State: `memory` holds the memory tokens before the oldest window segment, as the previous step's replay wrote
    them (its `cache` field is the cache after the newest segment, which the next new segment reads); `window` the
    up to k segments to replay, oldest first; `stored` (start_memory "stored" only) the memory each window segment
    would have read when it was new, i.e. what the new segment before it wrote, and `written` what the last new
    segment wrote. `scored` holds each window segment's scored-target count, on the host (a replayed segment's loss
    divides by it without reading the device); it is not saved: a resume counts it again from the saved targets.

    Where the RMT authors' loop chooses otherwise (models/config.py BPTT_CHOICES, model.bptt_recipe): start_memory
    "stored" starts the replay from the oldest segment's stored memory instead of the replayed one;
    new_segment_cache "replayed" gives the new segment the cache the replay just recomputed instead of the stored
    one (the window keeps the stored one for its replays); replay_reduction "segment_sum" sums the scored
    segments' mean NLLs instead of one mean over their tokens. memory_init_grad is the model's (models/rmt.py)."""

    kind = "rmt-window"

    def __init__(self, memory: Any, device, depth: int, replay_loss: bool = False, start_memory: str = "replayed",
                 new_segment_cache: str = "stored", replay_reduction: str = "token_mean",
                 planner: Callable[[Tensor], Any] | None = None):
        super().__init__(memory, device, planner)
        self.depth, self.replay_loss = depth, replay_loss
        self.start_memory, self.new_segment_cache, self.replay_reduction = (start_memory, new_segment_cache,
                                                                          replay_reduction)
        self.window: list[Segment] = []
        self.scored: list[int] = []  # per window segment, on the host
        self.stored: list[Any] = []
        self.written = memory

    def step(self, forward: Callable, next_batch: Callable[[], Any]) -> MicroBatch:
        tokens, targets, reset, new_count, plan = self._read(next_batch)
        start = self.stored[0] if self.start_memory == "stored" and self.window else self.memory
        memory = start  # cut from every earlier graph (advance() and clear() store it detached)
        scored, after_replay, parts = [], [], []  # parts: (summed NLL, targets) per scored segment
        for seg, seg_count in zip(self.window, self.scored, strict=True):
            out = forward(seg.tokens, _with_cache(memory, seg.cache), reset=seg.reset,
                          targets=seg.targets if self.replay_loss else None)
            if self.replay_loss:
                parts.append((_nll_sum(out), seg_count))
                scored.append(out)
            memory = out.memory
            after_replay.append(memory)
        cache = _cache(memory) if self.new_segment_cache == "replayed" and self.window else _cache(self.memory)
        # the new segment's plan; a replayed segment's loss (bptt_replay_loss) finds its tail rows on the device
        out = forward(tokens, _with_cache(memory, cache), reset=reset, targets=targets, tail_plan=plan)
        new_nll = _nll_sum(out)
        parts.append((new_nll, new_count))
        scored.append(out)
        # The window keeps the cache from before the replay, whichever one the new segment read: the authors'
        # prev_mems entry is the previous new segment's output, and their replays read it.
        self._next = (Segment(tokens, targets, reset, _cache(self.memory)), new_count, out.memory,
                      after_replay[0] if after_replay else out.memory)
        if self.replay_reduction == "segment_sum":
            nll_term = sum(seg_nll / max(seg_count, 1) for seg_nll, seg_count in parts)
        else:
            nll_term = sum(seg_nll for seg_nll, _ in parts) / max(sum(c for _, c in parts), 1)
        loss = nll_term + _aux_mean(scored)
        return MicroBatch(loss, new_nll.detach(), new_count, tokens.numel())

    def advance(self) -> None:
        """Slide the window by the segment just read, keeping at most k segments."""
        segment, count, newest, after_oldest = self._next
        self._next = None
        self.window.append(segment)
        self.scored.append(count)
        if self.start_memory == "stored":
            self.stored.append(_detached(self.written))  # what this segment read "when new": the last one's output
        self.written = newest
        start = self.memory
        if len(self.window) > self.depth:
            self.window.pop(0)
            self.scored.pop(0)
            if self.stored:
                self.stored.pop(0)
            start = after_oldest
        cache = _cache(newest)
        self.memory = _with_cache(_detached(start), None if cache is None else _detached(cache))

    def clear(self) -> None:
        """Memory emptied and nothing left to replay: the next segment's loss reaches no earlier segment."""
        super().clear()
        self.window, self.scored, self.stored, self.written = [], [], [], self.memory

    def state_dict(self) -> dict:
        state = {"kind": self.kind, "memory": plain_state(self.memory), "window": plain_state(self.window)}
        if self.start_memory == "stored":
            state.update(stored=plain_state(self.stored), written=plain_state(_detached(self.written)))
        return state

    def load_state_dict(self, state: dict) -> None:
        self._check_kind(state)
        empty = torch.empty(0)
        segment = Segment(tokens=empty, targets=empty, reset=empty, cache=_cache(self.memory))
        template = self.memory
        self.memory = rebuild_state(template, state["memory"], self.device, "memory")
        self.window = rebuild_state([segment], state["window"], self.device, "window")
        if segment.cache is None:  # a checkpoint of older memlm kept ARMT's empty cache in every window segment
            self.window = [dataclasses.replace(seg, cache=None) for seg in self.window]
        # Counted from the saved targets, host tensors (checkpoints load to the CPU), not from the device copies.
        self.scored = [scored_targets(saved["targets"]) for saved in state["window"]]
        if len(self.window) > self.depth:
            raise RecurrenceStateError(
                f"the checkpoint replays {len(self.window)} segments but model.bptt_depth is {self.depth}; set "
                "model.bptt_depth back to the checkpoint's, or start a new run folder")
        if self.start_memory == "stored":
            if "stored" not in state:
                raise RecurrenceStateError(
                    "the checkpoint was written with model.bptt_start_memory=replayed (it holds no stored "
                    "memories); resume with that setting (or the bptt_recipe that gave it), or start a new run folder")
            self.stored = rebuild_state([template], state["stored"], self.device, "stored")
            self.written = rebuild_state(template, state["written"], self.device, "written")
        else:
            self.written = self.memory
