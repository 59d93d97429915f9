"""The adaptive softmax's training NLL as one autograd Function: the head and every tail cluster in tiles
(chunked_nll.py), each tail only on its planned rows (head_plan.py), and one gradient buffer per output table.

Shape letters (models/shapes.md): T rows of a flattened batch (B·N), D_0 head's input width, V_0 shortlist (S in the
code), Z clusters (the head and Z - 1 tails), V_h head's columns (V_0 + Z - 1 padded up to a multiple of
COL_MULTIPLE), V vocabulary, V_i vocabulary of tail cluster i, D_i input width of tail cluster i, T_i rows planned for
tail i (-1 = padding, read as row 0 and masked out).

    nll[t] = -log p_head(head column of target t)                 (its own column, or its cluster's)
             - log p_tail_i(target t | cluster i)                  (only for the T_i rows planned for tail i)

Why one Function: with one tied table (div_val 1) the head reads the table's first V_0 rows and tail i its rows
[lo, hi). As separate autograd nodes, each slice's backward zero-fills a whole [V, D_0] gradient and autograd adds
them up: several full-table writes per step (548 MB each at WikiText-103). Here backward allocates each table's
gradient once and every tile writes its own rows of it, once. The bias [V] is shared the same way; the tails'
gathered input rows add into the head's input gradient [T, D_0] instead of a zero-filled [T, D_0] each.

Why the head is padded: its width V_0 + Z - 1 (20,003 at WikiText-103) is not a multiple of 8, and cuBLAS then falls
back to an unaligned kernel 6.6x slower (0.956 ms vs 0.145 ms for a 4096 x 512 x 20,003 bf16 GEMM on an H100). The
padding columns have zero weights and bias -inf: exp(-inf) = 0 in the softmax, and their gradients, all zero, are
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import chunked_nll
from .chunked_nll import Pieces, nll_backward, nll_forward

COL_MULTIPLE = 64


@dataclass(frozen=True)
class TailSpec:
    lo: int  # its tokens [lo, hi), which are also its entries of the bias
    hi: int
    table: int  # the output table that holds its rows
    row0: int  # its first row in that table: lo with one shared table, 0 with a table per cluster

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class HeadLayout:
    """What serves which token: static, built once per module (Python ints only, so torch.compile sees constants)."""

    shortlist: int  # V_0
    head_cols: int  # V_h
    tails: tuple[TailSpec, ...]
    n_tables: int
    shared_input: bool  # one table (div_val 1): every tail reads the head's projected rows

    @staticmethod
    def of(bounds: list[tuple[int, int]], div_val: int, col_multiple: int = COL_MULTIPLE) -> HeadLayout:
        shortlist = bounds[0][1]
        tails = tuple(TailSpec(lo, hi, 0 if div_val == 1 else i, lo if div_val == 1 else 0)
                      for i, (lo, hi) in enumerate(bounds[1:], start=1))
        width = shortlist + len(tails)
        return HeadLayout(shortlist, -(-width // col_multiple) * col_multiple, tails,
                          1 if div_val == 1 else len(bounds), div_val == 1)


def head_index(target: Tensor, layout: HeadLayout) -> Tensor:
    """[T]: the head column each target is scored by: its own (shortlist), else its tail cluster's. The cluster is
    a sum of comparisons with Python ints: no cutoff tensor to copy to the device."""
    if not layout.tails:
        return target
    cluster = sum((target >= tail.lo).long() for tail in layout.tails)  # 0 for the head, i for tail cluster i
    return torch.where(cluster == 0, target, layout.shortlist + cluster - 1)


def head_matrix(layout: HeadLayout, table0: Tensor, bias: Tensor, cluster_weight: Tensor | None,
                cluster_bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The head's weights [V_h, D_0] and bias [V_h] in the matmul dtype: shortlist rows, cluster logits, padding."""
    S, pad = layout.shortlist, layout.head_cols - layout.shortlist - len(layout.tails)
    weights, biases = [table0[:S].to(dtype)], [bias[:S].to(dtype)]
    if layout.tails:
        weights.append(cluster_weight.to(dtype))
        biases.append(cluster_bias.to(dtype))
    if pad:
        weights.append(table0.new_zeros(pad, table0.shape[1], dtype=dtype))
        biases.append(bias.new_full((pad,), float("-inf"), dtype=dtype))
    return torch.cat(weights), torch.cat(biases)


def _tail_weight(tables: tuple[Tensor, ...], tail: TailSpec) -> Tensor:
    return tables[tail.table][tail.row0 : tail.row0 + tail.size]


def _pieces(*pieces: tuple[int, int, Tensor | None]) -> Pieces:
    """The pieces whose destination exists (a parameter that needs no gradient has none)."""
    return [piece for piece in pieces if piece[2] is not None]


def _tail_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """A plan's row list [T_i] -> (rows to read, padding read as row 0; which of them are real)."""
    return rows.clamp(min=0), rows >= 0


# AdaptiveNLL's inputs: layout, tiles, x0 [T, D_0], target [T], bias [V], cluster_weight [Z - 1, D_0],
# cluster_bias [Z - 1], then the tables (from input FIRST_TABLE on), one rows tensor per tail, and (per-cluster
# tables only) one input [T_i, D_i] per tail.
FIRST_TABLE = 7


class AdaptiveNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout: HeadLayout, tiles: tuple[int, int], x0: Tensor, target: Tensor, bias: Tensor,
                cluster_weight: Tensor | None, cluster_bias: Tensor | None, *rest: Tensor) -> Tensor:
        tables, rows, tail_xs = _split(layout, rest)
        head_w, head_b = head_matrix(layout, tables[0], bias, cluster_weight, cluster_bias, x0.dtype)
        head_idx = head_index(target, layout)
        nll, head_lse = nll_forward(x0, head_w, head_b, head_idx, rows=tiles[0])
        local_targets, lses = [], []
        for i, tail in enumerate(layout.tails):
            read, real = _tail_rows(rows[i])
            x = x0.index_select(0, read) if layout.shared_input else tail_xs[i]
            local = (target.index_select(0, read) - tail.lo).clamp(0, tail.size - 1)  # padding: any valid column
            tail_nll, lse = nll_forward(x, _tail_weight(tables, tail), bias[tail.lo : tail.hi], local, cols=tiles[1])
            nll.index_add_(0, read, torch.where(real, tail_nll, 0.0))  # padding adds exactly 0 to row 0
            local_targets.append(local)
            lses.append(lse)
        ctx.layout, ctx.tiles = layout, tiles
        ctx.save_for_backward(x0, bias, cluster_weight, cluster_bias, head_w, head_b, head_idx, head_lse,
                              *tables, *rows, *tail_xs, *local_targets, *lses)
        return nll

    @staticmethod
    def backward(ctx, grad: Tensor):
        layout, (row_tile, col_tile) = ctx.layout, ctx.tiles
        x0, bias, cluster_weight, cluster_bias, head_w, head_b, head_idx, head_lse, *rest = ctx.saved_tensors
        n_tails = len(layout.tails)
        tables, rows, tail_xs = _split(layout, rest[: len(rest) - 2 * n_tails])
        local_targets, lses = rest[len(rest) - 2 * n_tails : len(rest) - n_tails], rest[len(rest) - n_tails :]
        need = ctx.needs_input_grad
        # The one gradient buffer per table (and for the bias): every row is written by exactly one cluster's tiles.
        table_grads = [torch.empty_like(t) if need[FIRST_TABLE + j] else None for j, t in enumerate(tables)]
        grad_bias = torch.empty_like(bias) if need[4] else None
        grad_cw = torch.empty_like(cluster_weight) if n_tails and need[5] else None
        grad_cb = torch.empty_like(cluster_bias) if n_tails and need[6] else None
        S = layout.shortlist
        grad_x0 = nll_backward(x0, head_w, head_b, head_idx, head_lse, grad,
                               _pieces((0, S, table_grads[0]), (S, S + n_tails, grad_cw)),
                               _pieces((0, S, grad_bias), (S, S + n_tails, grad_cb)), rows=row_tile)
        grad_tail_xs = []
        for i, tail in enumerate(layout.tails):
            read, real = _tail_rows(rows[i])
            x = x0.index_select(0, read) if layout.shared_input else tail_xs[i]
            table_grad = table_grads[tail.table]
            gx = nll_backward(
                x, _tail_weight(tables, tail), bias[tail.lo : tail.hi], local_targets[i], lses[i],
                torch.where(real, grad.index_select(0, read), 0.0),  # padding rows: no gradient at all
                _pieces((0, tail.size, None if table_grad is None else table_grad[tail.row0 : tail.row0 + tail.size])),
                _pieces((0, tail.size, None if grad_bias is None else grad_bias[tail.lo : tail.hi])), cols=col_tile)
            if layout.shared_input:
                grad_x0.index_add_(0, read, gx)  # padding rows add exact zeros to row 0
            else:
                grad_tail_xs.append(gx.to(tail_xs[i].dtype))
        return (None, None, grad_x0.to(x0.dtype), None, grad_bias, grad_cw, grad_cb, *table_grads,
                *([None] * n_tails), *grad_tail_xs)


def _split(layout: HeadLayout, rest: tuple[Tensor, ...] | list[Tensor]):
    """The Function's trailing inputs -> (tables, one rows tensor per tail, per-tail inputs (per-cluster tables))."""
    n, c = layout.n_tables, len(layout.tails)
    return tuple(rest[:n]), tuple(rest[n : n + c]), tuple(rest[n + c :])


def adaptive_nll(layout: HeadLayout, x0: Tensor, target: Tensor, bias: Tensor, cluster_weight: Tensor | None,
                 cluster_bias: Tensor | None, tables: list[Tensor], rows: tuple[Tensor, ...],
                 tail_xs: list[Tensor]) -> Tensor:
    """-> nll [T] fp32 (float64 for float64 inputs), target [T] in [0, V) (ignored positions clamped by the caller).

    x0 [T, D_0]: the head's (projected) input. rows: per tail, the rows it scores (head_plan.TailPlan.rows).
    tail_xs: with a table per cluster, tail i's projected input on its rows [T_i, D_i]; empty with one table (the
    tails then read x0's rows). The matmuls run in the autocast dtype when autocast is on, else in x0's; the
    parameters go in as they are (cast tile by tile inside)."""
    device = x0.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x0.dtype
    tiles = (chunked_nll.CHUNK_ROWS, chunked_nll.CHUNK_COLS)  # read per call: tests shrink them
    with torch.autocast(device, enabled=False):
        return AdaptiveNLL.apply(layout, tiles, x0.to(dtype), target, bias, cluster_weight, cluster_bias, *tables,
                                 *rows, *(x.to(dtype) for x in tail_xs))
