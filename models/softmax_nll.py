"""The training NLL of one full softmax with its linear layer, the gradient's [T, V] part formed in the forward pass.

Shape letters (models/shapes.md): T rows (of a flattened batch), D model width (the rows' width), V vocabulary (the
softmax's columns), r rows per tile.

    nll[t] = -log_softmax(x[t] @ weight.T + bias)[target[t]]

Written out with torch (`F.linear`, `F.log_softmax`, `gather`), a step passes over [T, V] from memory about seven
times besides the matmuls: addmm's bias copy, log_softmax's read and write, and in backward gather's zero-filled
gradient, log_softmax's backward (two reads and a write) and the bias gradient's sum. At the peer benchmark's shape
(T 1,024, V 8,000, one CPU thread) that is ~37 ms of a ~550 ms step. Here addmm's [T, V] logits are turned, r rows
at a time while they are in the cache, into G = softmax - onehot(target) in the same buffer, and backward scales the
[T, D] products by the per-row upstream gradient g instead of the [T, V] matrix:

    d x = g * (G @ weight),   d weight = G.T @ (g * x),   d bias = G.T @ g

The NLL is bitwise log_softmax + gather's (each row goes through the same log_softmax kernel); the gradients are the
same sums in another order (g applied after the products instead of before). fp32 only (`fits`): the CPU's training
path (`model.head_loss` full, or auto off CUDA) for a softmax without tail clusters. The chunked path
(chunked_nll.py) recomputes the logits in backward instead of keeping them, which a GPU's memory needs and a CPU's
time does not want.
"""

from __future__ import annotations

import torch
from torch import Tensor

TILE_BYTES = 1 << 19  # rows per tile: as many as fit 512 KiB of fp32 logits (16 rows at V 8,000), at least one


class LinearSoftmaxNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, target: Tensor) -> Tensor:
        # x [T, D], weight [V, D], bias [V], all fp32; target [T] in [0, V).
        grad_t = torch.addmm(bias, x, weight.t())  # [T, V] logits, overwritten by G below
        T, V = grad_t.shape
        picked = torch.empty((T, 1), dtype=grad_t.dtype, device=grad_t.device)  # each row's target log-probability
        rows = max(1, TILE_BYTES // (4 * max(V, 1)))
        index = target[:, None]
        for r0 in range(0, T, rows):
            tile = grad_t[r0 : r0 + rows]
            logprobs = torch.log_softmax(tile, dim=-1)  # the tile is still in the cache
            torch.gather(logprobs, 1, index[r0 : r0 + rows], out=picked[r0 : r0 + rows])
            torch.exp(logprobs, out=tile)
        flat = torch.arange(T, device=target.device) * V + target
        grad_t.view(-1).index_add_(0, flat, grad_t.new_full((T,), -1.0))  # softmax - onehot(target)
        ctx.save_for_backward(x, weight, grad_t)
        return picked.squeeze(1).neg()

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, G = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = grad[:, None]  # [T, 1]
        gx = (G @ weight).mul_(g) if need_x else None
        gw = G.t() @ (x * g) if need_w else None
        gb = (G.t() @ g).squeeze(1) if need_b else None
        return gx, gw, gb, None


def fits(x: Tensor, weight: Tensor) -> bool:
    """Whether this path applies: on the CPU, fp32 tensors and matmuls (no autocast to another dtype), eager. Elsewhere
    the head keeps F.linear + log_softmax: bf16 rounding as the tests pin it, a graph torch.compile traces whole, and
    on a GPU a tile loop would be a few kernel launches per 16 rows."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not torch.compiler.is_compiling()
            and not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != torch.float32))


def linear_softmax_nll(x: Tensor, weight: Tensor, bias: Tensor, target: Tensor) -> Tensor:
    """-> nll [T] fp32: -log_softmax(F.linear(x, weight, bias))[t, target[t]] for fp32 x, weight and bias (`fits`);
    target [T] in [0, V) (ignored positions clamped by the caller, who zeroes their NLL and with it their
    gradient)."""
    return LinearSoftmaxNLL.apply(x, weight, bias, target)
