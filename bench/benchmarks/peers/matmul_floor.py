"""The hardware limit of one training step, measured: its matrix multiplications alone, replayed.

One training step is run under a dispatch mode that records every matrix multiplication torch executes (forward,
backward; the optimizer has none) with its operands' shapes, strides and dtypes, and nothing else. Replaying
those calls on random operands of the same layout, back to back, times the step as if every other operation
(softmax, masking, copies, layer norm, the optimizer, Python) were free, with the same BLAS kernels the model
uses. No implementation of the same computation in the same library can run faster than this; the gap between a
model's step and its floor is what an implementation controls. Models that compute more (a peer that projects
queries for memory rows it never uses) have a higher floor: the floor says how much work a model does, at what
speed this core does matrix multiplications.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


@dataclass(frozen=True)
class Operand:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def flops(op, operands: list[Operand]) -> int:
    """2 * multiply-adds of one call (the bias add of addmm/baddbmm is not counted, as FlopCounterMode does)."""
    if op in (aten.mm.default, aten.addmm.default):
        a, b = operands[-2:]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    a, b = operands[-2:]
    return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]


class RecordMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[object, list[Operand], dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS:
            operands = [Operand(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            scalars = {k: v for k, v in kwargs.items() if k in ("beta", "alpha")}
            self.calls.append((func, operands, scalars))
        return func(*args, **kwargs)


def materialise(op: Operand, gen: torch.Generator) -> torch.Tensor:
    """A random tensor with the operand's shape, strides and dtype (values ~N(0, 1): no denormals)."""
    size = sum((s - 1) * st for s, st in zip(op.shape, op.stride)) + 1 if all(op.shape) else 0
    base = torch.randn(size, generator=gen).to(op.dtype)
    return base.as_strided(op.shape, op.stride)


class MatmulFloor:
    """The recorded matmuls of one step of `runner`, ready to replay. `step` mimics Runner.step's signature so
    the floor can be timed in the same round-robin as the models."""

    def __init__(self, runner, batch, precision: str):
        recorder = RecordMatmuls()
        with recorder:
            runner.step(batch, precision)
        gen = torch.Generator().manual_seed(0)
        self.calls = [(op, [materialise(o, gen) for o in operands], scalars)
                      for op, operands, scalars in recorder.calls]
        self.n_calls = len(self.calls)
        self.flops = sum(flops(op, [Operand(tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors])
                         for op, tensors, _ in self.calls)

    def step(self, batch=None, precision: str = "") -> float:
        for op, tensors, scalars in self.calls:
            op(*tensors, **scalars)
        return float("nan")

    def time(self) -> float:
        t = time.perf_counter()
        self.step()
        return time.perf_counter() - t
