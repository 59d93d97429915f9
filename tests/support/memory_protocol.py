"""The memory protocol (models/README.md), as one check a registered arch's state must pass: what the trainer reads
and writes in it. tests/models/test_memory_protocol.py runs it over every registered arch, and
tests/models/test_new_arch_contract.py over an arch registered by a test."""

from __future__ import annotations

import dataclasses
import io

import torch

from memlm.models import build_model
from memlm.trainer.checkpoint.recurrent_state import plain_state, rebuild_state
from support.models import registry_config

B = 2  # lanes
PLAIN_VALUES = (int, float, bool, str, type(None))


def leaves(state, path: str = "memory"):
    """(path, value) of every tensor and plain value in a state, in field order."""
    if isinstance(state, torch.Tensor) or isinstance(state, PLAIN_VALUES):
        yield path, state
    elif isinstance(state, list):
        for i, item in enumerate(state):
            yield from leaves(item, f"{path}[{i}]")
    else:
        assert dataclasses.is_dataclass(state), f"{path} is a {type(state).__name__}: a state holds dataclasses, " \
                                                "lists, tensors and plain values (models/README.md)"
        for field in dataclasses.fields(state):
            yield from leaves(getattr(state, field.name), f"{path}.{field.name}")


def layout(state) -> list:
    """What a compiled forward guards on: each leaf's path, and its tensor's shape, dtype and device (its type
    otherwise)."""
    return [(path, tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else (path, type(v))
            for path, v in leaves(state)]


def check_memory_protocol(spec) -> None:
    """Assert that `spec`'s model keeps the memory protocol, on its registry tiny configuration."""
    cfg = registry_config(spec, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, cfg.vocab_size, (2, B, cfg.tgt_len), generator=gen).unbind(0)

    # The trainer's empty state: init_memory, copied by map_memory(torch.clone, ...) at clear()
    empty = model.init_memory(B)
    assert dataclasses.is_dataclass(empty) and hasattr(empty, "detached"), "init_memory returns a dataclass state"
    out = model(first, empty, targets=first)
    memory = out.memory
    assert type(memory) is type(empty)
    # Plain data with the lanes first (map_memory and the checkpoint walk it; a lane is row b of every tensor), and
    # one layout from segment to segment (a compiled forward would recompile on another)
    for path, value in leaves(memory):
        assert not isinstance(value, torch.Tensor) or (value.dim() >= 1 and value.shape[0] == B), \
            f"{path}: every tensor of a state has the lanes first"
    assert layout(memory) == layout(empty), "forward returns the state in init_memory's layout"
    key_valid = memory.key_valid  # what analyses mask the cached keys with
    assert key_valid.dtype == torch.bool and key_valid.dim() == 2 and key_valid.shape[0] == B

    # detached(): the same state, values unchanged, cut from the graph (what the trainer carries between steps)
    cut = memory.detached()
    assert type(cut) is type(memory) and layout(cut) == layout(memory)
    for (path, got), (_, want) in zip(leaves(cut), leaves(memory), strict=True):
        if isinstance(got, torch.Tensor):
            assert not got.requires_grad and torch.equal(got, want), path
        else:
            assert got == want, path

    # The window BPTT's part: an optional `cache`, stop-gradient, with detached() of its own, that each replayed
    # segment reads as the new segment read it; the rest of the state carries the gradient through the segments.
    if spec.recurrence == "memory_bptt":
        cache = getattr(memory, "cache", None)
        if cache is not None:
            assert hasattr(cache, "detached"), "a window-BPTT state's cache has detached()"
            assert not any(isinstance(v, torch.Tensor) and v.requires_grad for _, v in leaves(cache, "cache")), \
                "a window-BPTT state's cache is stop-gradient"
        carried = [p for p, v in leaves(memory) if isinstance(v, torch.Tensor) and v.requires_grad
                   and not p.startswith("memory.cache")]
        assert carried, "a memory_bptt state carries the gradient to the next segment"

    model.eval()
    with torch.no_grad():
        # init_memory is every lane at a document start: the trainer's clear() and a reset read alike
        fresh = model(second, model.init_memory(B), return_logits=True).logits
        reset = model(second, cut, reset=torch.ones(B, dtype=torch.bool), return_logits=True).logits
        torch.testing.assert_close(reset, fresh, rtol=0, atol=1e-6)
        # A checkpoint holds the state as plain data (torch.load(weights_only=True)) and rebuilds it on init_memory
        buffer = io.BytesIO()
        torch.save(plain_state(cut), buffer)
        buffer.seek(0)
        back = rebuild_state(model.init_memory(B), torch.load(buffer, weights_only=True), "cpu", "memory")
        assert layout(back) == layout(cut)
        want = model(second, cut, return_logits=True).logits
        torch.testing.assert_close(model(second, back, return_logits=True).logits, want, rtol=0, atol=0)
