"""The NLL of a linear layer's softmax at one index per row, in tiles: the [T, V] logits are never held whole.

Shape letters (models/shapes.md): T rows (of a flattened batch), D model width (the rows' width), V vocabulary (the
softmax's columns, K in the code), r rows per tile, k columns per tile.

    nll[t] = logsumexp(x[t] @ weight.T + bias) - (x[t] @ weight[index[t]] + bias[index[t]])

The plain way (`F.log_softmax(F.linear(x, weight, bias).float())`, then a gather) writes fp32 [T, V] logits and
log-probabilities and keeps them for backward: 2 x 9,600 x 20,003 x 4 bytes = 1.5 GB per step at the WikiText-103
head. Here the logits go through in tiles: forward keeps only each row's logsumexp (over column tiles: the
logsumexp of the tiles' logsumexps), and backward recomputes a tile's logits to form its softmax gradient,
(softmax - onehot(index)) x grad, in place.

Two tilings, by which side is large: the adaptive softmax's head (9,600 rows x 20,032 columns) goes by rows, in
chunks of CHUNK_ROWS; a tail cluster (hundreds to a few thousand rows x up to 160,000 columns) goes by columns, in
chunks of CHUNK_COLS, with all its rows in one tile, so a row count that changes every batch never becomes a Python loop
bound (under torch.compile that would be a guard, and a recompile whenever the count of tiles changes).

The matmuls run in x's dtype (bf16 under autocast); a weight or bias tile is cast to it as it is read, so an fp32
table is never copied whole. Softmax, logsumexp and the gradient sums are in fp32 (float64 when x is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_ROWS = 4096  # x 20,032 fp32 logits = 328 MB at most alive at once at the WikiText-103 head
# x ~1,200 planned rows of WikiText-103's largest tail cluster = 160 MB of fp32 logits, 5 tiles over its 160,000
# words: fewer tiles launch fewer kernels (the tails' eager time on an H200 is mostly launches at 8,192)
CHUNK_COLS = 32768

# Pieces of a gradient: (first output, past the last output, destination [stop - start, ...]). Outputs covered by
# no piece (the head's padding columns) are dropped.
Pieces = list[tuple[int, int, Tensor]]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 matmuls, float64 for float64 ones (the float64 tests compare at 1e-12)."""
    return torch.promote_types(dtype, torch.float32)


def spans(n: int, size: int | None) -> list[tuple[int, int | None]]:
    """[start, stop) tiles of n items; size None: one tile of all of them, whatever n is (stop None = the end).
    At least one tile, so that every output of a gradient is written even when there are no rows."""
    if size is None:
        return [(0, None)]
    return [(start, min(start + size, n)) for start in range(0, max(n, 1), size)]


def _tile_logits(x: Tensor, weight: Tensor, bias: Tensor, c0: int, c1: int | None) -> Tensor:
    """x [r, D], weight tile [k, D] (cast already) -> fp32 logits [r, k] of columns [c0, c1)."""
    return F.linear(x, weight, bias[c0:c1].to(x.dtype)).to(accumulation_dtype(x.dtype))


def _in_tile(index: Tensor, c0: int, k: int) -> tuple[Tensor, Tensor]:
    """Each row's target as a column of the tile [c0, c0 + k) (clamped into it) and whether it really is there."""
    local = index - c0
    return local.clamp(0, k - 1), (local >= 0) & (local < k)


def nll_forward(x: Tensor, weight: Tensor, bias: Tensor, index: Tensor, rows: int | None = None,
                cols: int | None = None) -> tuple[Tensor, Tensor]:
    """x [T, D], weight [V, D], bias [V], index [T] long in [0, V) -> (nll [T], lse [T]), both fp32 (float64 for
    float64 x). rows/cols: the tile size along each side, None for the whole side."""
    K = weight.shape[0]
    nlls, lses = [], []
    for r0, r1 in spans(x.shape[0], rows):
        xr, ir = x[r0:r1], index[r0:r1]
        parts, picked = [], 0
        for c0, c1 in spans(K, cols):
            logits = _tile_logits(xr, weight[c0:c1].to(x.dtype), bias, c0, c1)  # [r, k]
            parts.append(torch.logsumexp(logits, dim=-1))
            local, here = _in_tile(ir, c0, logits.shape[1])
            # the target's logit where it falls in this tile; 0 elsewhere (exactly one tile holds it)
            picked = picked + torch.where(here, logits.gather(1, local[:, None]).squeeze(1), 0.0)
        lse = parts[0] if len(parts) == 1 else torch.logsumexp(torch.stack(parts, dim=-1), dim=-1)
        lses.append(lse)
        nlls.append(lse - picked)
    if len(lses) == 1:
        return nlls[0], lses[0]
    return torch.cat(nlls), torch.cat(lses)


def write_pieces(pieces: Pieces, c0: int, tile: Tensor, first: bool) -> None:
    """Write the gradient of outputs [c0, c0 + len(tile)) into the pieces that hold them: copied by the first row
    tile, added by the others. tile [k, ...]."""
    c1 = c0 + tile.shape[0]
    for start, stop, dest in pieces:
        lo, hi = max(start, c0), min(stop, c1)
        if lo >= hi:
            continue
        part, view = tile[lo - c0 : hi - c0], dest[lo - start : hi - start]
        view.copy_(part) if first else view.add_(part)


def nll_backward(x: Tensor, weight: Tensor, bias: Tensor, index: Tensor, lse: Tensor, grad: Tensor,
                 weight_pieces: Pieces, bias_pieces: Pieces, rows: int | None = None,
                 cols: int | None = None) -> Tensor:
    """The gradients of sum(grad * nll_forward(...)[0]): returns d/dx [T, D] (fp32; float64 for float64 x) and
    writes d/dweight and d/dbias into their pieces (each covered output exactly once by the first row tile)."""
    K = weight.shape[0]
    grad_x = []
    for n, (r0, r1) in enumerate(spans(x.shape[0], rows)):
        xr, ir, lr, gr = x[r0:r1], index[r0:r1], lse[r0:r1], grad[r0:r1]
        gx = None
        for c0, c1 in spans(K, cols):
            w = weight[c0:c1].to(x.dtype)  # [k, D]
            logits = _tile_logits(xr, w, bias, c0, c1)
            # d nll / d logits = softmax - onehot(index), scaled by each row's incoming gradient
            g = logits.sub_(lr[:, None]).exp_()
            local, here = _in_tile(ir, c0, g.shape[1])
            g.scatter_add_(1, local[:, None], -here.to(g.dtype)[:, None])
            g.mul_(gr[:, None].to(g.dtype))
            g_low = g.to(x.dtype)
            part = (g_low @ w).to(g.dtype)
            gx = part if gx is None else gx.add_(part)  # fp32 sum over column tiles
            if weight_pieces:
                write_pieces(weight_pieces, c0, g_low.t() @ xr, first=n == 0)
            if bias_pieces:
                write_pieces(bias_pieces, c0, g.sum(dim=0), first=n == 0)
        grad_x.append(gx)
    return grad_x[0] if len(grad_x) == 1 else torch.cat(grad_x)
