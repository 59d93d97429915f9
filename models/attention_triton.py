"""Relative-position attention as custom Triton kernels (forward and backward): `rel_attend_triton`.

Shape letters (models/shapes.md): B lanes, Q queries, K keys, P relative distances (the distance slots), H heads,
E head width, BQ query tile rows, BK key tile rows, nQT query tiles (ceil(Q / BQ)), nKT key tiles (ceil(K / BK)),
NG copies of the d r_k accumulator.

The same function as `attention.attend` (without attention dropout or recording), for layouts whose distance slot
is affine in (query, key): d(i, j) = offset + sign * (i - j), and whose mask is a [Q, K] structure shared by the
lanes and-ed with a per-lane key validity [B, K]:
    Transformer-XL:  offset = M, sign +1 (attention.causal_index; future keys are masked)
    RMT:             offset = M + R - 1, sign +1 (rmt.rmt_positions)
    LaMemo ahead:    offset = start - 1, sign -1 (lamemo.lookahead_layout: slot (start + j) - i - 1)
FlexAttention (attention_flex.py) reads a [B, H, Q, P] position tensor per score and a [B, Q, K] mask; here the
position term is made per tile from the R rows the tile needs, and whole tiles with no allowed pair are skipped
(attention_triton_kernels.py says how). On a CPU the kernels run under TRITON_INTERPRET=1 (the tests do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from . import attention_triton_kernels as kernels

# d r_k is accumulated with atomics into at most this many fp32 copies, summed after: programs that add into the same
# slots at the same moment wait on each other, and copies spread them. Programs collide in lockstep: those of one
# head walk their key tiles in step, and a tile's slots depend only on (query tile - key tile) (LaMemo's look-ahead:
# every query tile starts at its diagonal, so all of them hit one band together). So the copy is chosen by lane
# and query tile, (b * nQT + qt) mod NG. On an H200 with 4 copies chosen by lane alone, LaMemo's look-ahead backward
# (3x fewer pairs than Transformer-XL's) took longer than Transformer-XL's; 16 by (lane, query tile) is unmeasured.
DR_COPIES = 16
# Launch settings per kernel; benchmarks may change them.
LAUNCH = {"fwd": dict(num_warps=4, num_stages=2), "bwd_kv": dict(num_warps=4, num_stages=2),
          "bwd_q": dict(num_warps=4, num_stages=2)}


def _empty(shape, dtype, device) -> Tensor:
    """Every output buffer the kernels write whole comes from here (the tests fill it with NaN to prove that)."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class TritonLayout:
    """The mask and which tiles hold an allowed pair, for one (structure, key_valid) and one tiling. Built once per
    forward (`triton_layout`) and shared by every layer that attends with that mask."""
    structure: Tensor  # [Q, K] int8
    key_valid: Tensor  # [B, K] int8
    q_spans: Tensor  # [B, nQT, 2] int32: per query tile, the key tiles [first, end) it visits
    k_spans: Tensor  # [B, nKT, 2] int32: per key tile, the query tiles [first, end) that visit it
    block_q: int
    block_k: int


def _spans(live: Tensor) -> Tensor:
    """[..., n] bool -> [..., 2] int32: from the first live index to one past the last ([0, 0) when none is)."""
    n = live.shape[-1]
    index = torch.arange(n, device=live.device)
    first = torch.where(live, index, n).amin(dim=-1)
    end = torch.where(live, index + 1, 0).amax(dim=-1)
    return torch.stack([first.clamp(max=end), end], dim=-1).to(torch.int32).contiguous()


def triton_layout(structure: Tensor, key_valid: Tensor, block_q: int = 32, block_k: int = 32) -> TritonLayout:
    """structure [Q, K] bool (shared by the lanes), key_valid [B, K] bool -> the kernels' layout.

    A (query tile, key tile) pair is live for lane b when some pair inside is allowed; each tile visits the span
    from its first to its last live partner, so causal layouts skip the future and lanes with empty memory skip
    the memory's tiles. Device work only (no host sync)."""
    Q, K = structure.shape
    B = key_valid.shape[0]
    n_qt, n_kt = triton.cdiv(Q, block_q), triton.cdiv(K, block_k)
    padded = torch.zeros(n_qt * block_q, n_kt * block_k, dtype=torch.bool, device=structure.device)
    padded[:Q, :K] = structure
    seen = padded.view(n_qt, block_q, n_kt * block_k).any(dim=1)  # [nQT, K'] some query of the tile sees key j
    valid = torch.zeros(B, n_kt * block_k, dtype=torch.bool, device=structure.device)
    valid[:, :K] = key_valid
    live = (seen[None] & valid[:, None, :]).view(B, n_qt, n_kt, block_k).any(dim=-1)  # [B, nQT, nKT]
    return TritonLayout(structure.to(torch.int8).contiguous(), key_valid.to(torch.int8).contiguous(),
                        _spans(live), _spans(live.transpose(1, 2)), block_q, block_k)


def _precision(dtype: torch.dtype) -> str:
    """fp32 products as torch's own fp32 matmuls run them (tf32 only where torch allows it); ignored for fp16/bf16."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _strides(t: Tensor) -> list[int]:
    return list(t.stride())


class _RelAttend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, r_k, bias_u, bias_v, layout: TritonLayout, offset: int, sign: int):
        B, Q, H, E = q.shape
        K, P = k.shape[1], r_k.shape[0]
        BQ, BK = layout.block_q, layout.block_k
        n_qt = triton.cdiv(Q, BQ)
        scale = 1.0 / math.sqrt(E)
        out = _empty((B, Q, H, E), v.dtype, q.device)
        lse = _empty((B, Q, H), torch.float32, q.device)
        kernels.fwd_kernel[(B * H * n_qt,)](
            q, k, v, r_k, bias_u, bias_v, layout.structure, layout.key_valid, layout.q_spans, out, lse,
            *_strides(q), *_strides(k), *_strides(v), *_strides(r_k), *_strides(bias_u), *_strides(bias_v),
            layout.structure.stride(0), layout.key_valid.stride(0), *layout.q_spans.stride()[:2],
            *_strides(out), *_strides(lse),
            H, Q, K, P, E, n_qt, offset, scale,
            SIGN=sign, BQ=BQ, BK=BK, BAND=triton.next_power_of_2(BQ + BK - 1), BE=_padded(E),
            PREC=_precision(k.dtype), **LAUNCH["fwd"],
        )
        ctx.save_for_backward(q, k, v, r_k, bias_u, bias_v, out, lse)
        ctx.layout, ctx.offset, ctx.sign = layout, offset, sign
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, r_k, bias_u, bias_v, out, lse = ctx.saved_tensors
        layout, offset, sign = ctx.layout, ctx.offset, ctx.sign
        B, Q, H, E = q.shape
        K, P = k.shape[1], r_k.shape[0]
        BQ, BK = layout.block_q, layout.block_k
        n_qt, n_kt = triton.cdiv(Q, BQ), triton.cdiv(K, BK)
        scale = 1.0 / math.sqrt(E)
        if d_out is None:
            d_out = torch.zeros_like(out)
        # ds = p * (do . v - delta + d lse) with delta_i = do_i . o_i (the softmax backward; d lse adds p * d lse).
        dl = (d_out.float() * out.float()).sum(-1)  # [B, Q, H]
        if d_lse is not None:
            dl = dl - d_lse
        dl = dl.contiguous()
        common = dict(SIGN=sign, BQ=BQ, BK=BK, BE=_padded(E), PREC=_precision(k.dtype))
        inputs = (q, k, v, r_k, bias_u, bias_v, layout.structure, layout.key_valid)
        input_strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(r_k), *_strides(bias_u),
                         *_strides(bias_v), layout.structure.stride(0), layout.key_valid.stride(0))

        dk = _empty((B, K, H, E), k.dtype, q.device)
        dv = _empty((B, K, H, E), v.dtype, q.device)
        kernels.bwd_kv_kernel[(B * H * n_kt,)](
            *inputs, layout.k_spans, d_out, lse, dl, dk, dv,
            *input_strides, *layout.k_spans.stride()[:2],
            *_strides(d_out), *_strides(lse), *_strides(dk),
            H, Q, K, P, E, n_kt, offset, scale,
            BAND=triton.next_power_of_2(BQ + BK - 1), **common, **LAUNCH["bwd_kv"],
        )

        dq = _empty((B, Q, H, E), q.dtype, q.device)
        du = _empty((B, n_qt, H, E), torch.float32, q.device)  # per-tile partial sums of d bias_u
        dw = _empty((B, n_qt, H, E), torch.float32, q.device)  # and of d bias_v
        copies = min(DR_COPIES, B * n_qt)
        dr = torch.zeros((copies, P, H, E), dtype=torch.float32, device=q.device)  # atomics add into it
        kernels.bwd_q_kernel[(B * H * n_qt,)](
            *inputs, layout.q_spans, d_out, lse, dl, dq, du, dw, dr,
            *input_strides, *layout.q_spans.stride()[:2],
            *_strides(d_out), *_strides(lse), *_strides(dq), *_strides(du), *_strides(dr),
            H, Q, K, P, E, n_qt, offset, scale, copies,
            **common, **LAUNCH["bwd_q"],
        )
        d_r = dr.sum(0).to(r_k.dtype)
        d_u = du.sum((0, 1)).to(bias_u.dtype)
        d_w = dw.sum((0, 1)).to(bias_v.dtype)
        return dq, dk, dv, d_r, d_u, d_w, None, None, None


def _interpreted() -> bool:
    """Whether the kernels were decorated under TRITON_INTERPRET=1 (Triton decides at import, not at launch)."""
    return type(kernels.fwd_kernel).__name__ == "InterpretedFunction"


def _padded(E: int) -> int:
    """E padded to a power of two, at least 16 (tl.dot's smallest side)."""
    return max(16, triton.next_power_of_2(E))


def rel_attend_triton(
    q: Tensor,  # [B, Q, H, E]
    k: Tensor,  # [B, K, H, E]
    v: Tensor,  # [B, K, H, E]
    r_k: Tensor,  # [P, H, E] projected relative encodings, one row per distance slot
    bias_u: Tensor,  # [H, E] content bias
    bias_v: Tensor,  # [H, E] position bias
    structure: Tensor | None,  # [Q, K] bool, shared by the lanes (None when `layout` is given)
    key_valid: Tensor | None,  # [B, K] bool (None when `layout` is given)
    offset: int,
    sign: int,
    need_lognorm: bool = True,
    *,
    layout: TritonLayout | None = None,  # triton_layout(structure, key_valid), when several calls share the mask
    block_q: int = 32,  # 32 and 64 ran alike on an H200 (bench_triton_attention.py); 32 spills no registers
    block_k: int = 32,
) -> tuple[Tensor, Tensor | None]:
    """Masked relative attention with slot d(i, j) = offset + sign * (i - j): the context [B, Q, H, E] (v's
    dtype) and the log-normaliser [B, Q, H] in fp32 (None unless need_lognorm), as `attention.attend` returns them.

    Every query row must have an allowed key. Slots outside [0, P) may occur only at masked pairs (they read 0).
    Products run in k's dtype (r_k is cast to it), accumulation and softmax in fp32; the biases may be fp32 beside
    bf16 activations, as under autocast. Differentiable in q, k, v, r_k, both biases, and through the lognorm.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign}")
    if layout is None:
        layout = triton_layout(structure, key_valid, block_q, block_k)
    if layout.block_q != layout.block_k:
        raise ValueError("block_q must equal block_k (the backward holds a tile's band in two halves of block_k)")
    B, Q, H, E = q.shape
    if k.shape[0] != B or v.shape != k.shape or k.shape[2:] != (H, E) or r_k.shape[1:] != (H, E):
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} r_k {tuple(r_k.shape)}")
    if layout.structure.shape != (Q, k.shape[1]) or layout.key_valid.shape != (B, k.shape[1]):
        raise ValueError("the layout's structure must be [Q, K] and its key_valid [B, K]")
    if not q.is_cuda and not _interpreted():
        raise RuntimeError("rel_attend_triton runs on CUDA tensors (or on the CPU with the kernels imported under "
                           "TRITON_INTERPRET=1)")
    context, lognorm = _RelAttend.apply(q, k, v, r_k.to(k.dtype), bias_u, bias_v, layout, offset, sign)
    return context, (lognorm if need_lognorm else None)
