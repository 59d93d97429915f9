"""The NLL of a linear layer's softmax at one index per row, without ever holding the [T, V] logits.

Shape legend: T rows (B x N positions), W input width, V outputs (the adaptive softmax's head: its shortlist plus
one logit per tail cluster, 20,003 at the WikiText-103 shape).

    nll[t] = logsumexp(x[t] @ weight.T + bias) - (x[t] @ weight[index[t]] + bias[index[t]])

The plain way (`F.log_softmax(F.linear(x, weight, bias).float())`, then a gather) writes fp32 [T, V] logits and
log-probabilities and keeps them for backward: 2 x 9,600 x 20,003 x 4 bytes = 1.5 GB per step at the base shape,
and several full passes over them. Here rows go through in chunks: forward keeps only each row's logsumexp, and
backward recomputes a chunk's logits to form its softmax gradient, (softmax - onehot(index)) x grad, in place.
The matmuls run in the inputs' dtype (bf16 under autocast); the softmax and logsumexp in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_ROWS = 4096  # x 20,003 fp32 logits = 328 MB at most alive at once at the WikiText-103 head


class ChunkedLinearNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, index: Tensor, chunk: int) -> Tensor:
        T = x.shape[0]
        lse = torch.empty(T, dtype=torch.float32, device=x.device)
        picked = torch.empty(T, dtype=torch.float32, device=x.device)
        for start in range(0, T, chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(x[rows], weight, bias).float()  # [chunk, V]
            lse[rows] = torch.logsumexp(logits, dim=-1)
            picked[rows] = logits.gather(1, index[rows, None]).squeeze(1)
        ctx.save_for_backward(x, weight, bias, index, lse)
        ctx.chunk = chunk
        return lse - picked

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, bias, index, lse = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        for start in range(0, x.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = F.linear(x[rows], weight, bias).float()
            # d nll / d logits = softmax - onehot(index), scaled by the incoming gradient of each row
            g = logits.sub_(lse[rows, None]).exp_()
            g.scatter_add_(1, index[rows, None], torch.full_like(lse[rows, None], -1.0))
            g.mul_(grad[rows, None].float())
            g_low = g.to(x.dtype)
            if grad_x is not None:
                grad_x[rows] = g_low @ weight
            grad_w.add_((g_low.t() @ x[rows]).float())  # summed over chunks in fp32
            grad_b.add_(g.sum(dim=0))
        return grad_x, grad_w.to(weight.dtype), grad_b.to(bias.dtype), None, None


def chunked_linear_nll(x: Tensor, weight: Tensor, bias: Tensor, index: Tensor, chunk: int | None = None) -> Tensor:
    """x [T, W], weight [V, W], bias [V], index [T] long in [0, V) -> nll [T] fp32 (see the module docstring)."""
    chunk = chunk or CHUNK_ROWS
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with torch.autocast(x.device.type, enabled=False):
        return ChunkedLinearNLL.apply(x.to(dtype), weight.to(dtype), bias.to(dtype), index, chunk)
