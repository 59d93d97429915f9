"""Relative attention through FlexAttention: the same maths as `attention.attend`, as one fused kernel on CUDA.

Shape letters (models/shapes.md): B lanes, Q queries, K keys, P relative distances, H heads, E head width.

`attend` builds fp32 [B, H, Q, K] score tensors and makes several passes over them (position gather, mask,
softmax, dropout); on a GPU those passes, not the matmuls, were most of a step's kernel time (bench/README.md, GPU
section). Here the content term is the kernel's own q . k, and the position term is a score modification:
    score(i, j) = (q_i + u) . k_j  +  pos[b, h, i, pos_index[i, j]],   pos = ((q + v) . W_R R(d)) for every d
so the position scores are one [B, H, Q, P] matmul per layer (P distinct distances), gathered per (query, key)
inside the kernel. The mask (causality, same_length, per-lane memory validity, RMT's read/write blocks) is the
caller's `allowed` as a BlockMask, built once per forward and shared by every layer (`flex_mask`). The kernel also
returns the log-normaliser (the logsumexp of the scaled scores, natural log) that LaMemo caches, with its gradient.

Not covered, so `attend` keeps them on its own path (models/attention.py `attention_kernel`): attention dropout
in training (FlexAttention has no dropout), recording the weights (`memlm analyze`), and per-key positions
(LaMemo's look-ahead with M > N, an evaluation setting). On a CPU FlexAttention has no backward (torch 2.13): it is
used there for evaluation only, where it serves as the check that both paths compute the same function.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor


@torch.library.custom_op("memlm::materialized_mask", mutates_args=())
def materialized_mask(allowed: Tensor) -> Tensor:
    """A copy of the mask that inductor cannot see through. Under a whole-model compile the mask is computed in the
    same graph (a concatenation of the lanes' memory flags with the segment's); inductor then inlines that
    computation into the FlexAttention kernel's mask, and torch 2.11 fails to generate the concatenation's masked
    loads there (LoweringException "'function' object has no attribute 'graph'", H200, 2026-11-27,
    bench/results/gpu_profile_h200_call2/gpu_run.log). An opaque op's output is a buffer the kernel just loads."""
    return allowed.clone()


@materialized_mask.register_fake
def _(allowed: Tensor) -> Tensor:
    return torch.empty_like(allowed)


def flex_mask(allowed: Tensor, lanes: int):
    """A BlockMask for `allowed` ([B or 1, Q, K] bool, True where the query may attend to the key) over B = lanes.
    Expanded first: the kernel calls the mask with every lane's index, also for a mask the lanes share."""
    from torch.nn.attention.flex_attention import create_block_mask

    allowed = materialized_mask(allowed.expand(lanes, *allowed.shape[1:]))  # [B, Q, K], its own buffer
    Q, K = allowed.shape[1:]

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ARG001 - the signature FlexAttention calls
        return allowed[b, q_idx, kv_idx]

    return create_block_mask(mask_mod, lanes, None, Q, K, device=allowed.device)


def flex_attend(
    q: Tensor,  # [B, Q, H, E]
    k: Tensor,  # [B, K, H, E]
    v: Tensor,  # [B, K, H, E]
    r_k: Tensor,  # [P, H, E]
    pos_index: Tensor,  # [Q, K] long
    block_mask,  # flex_mask(allowed), expanded over B when the mask is shared by the lanes
    bias_u: Tensor,  # [H, E]
    bias_v: Tensor,  # [H, E]
    need_lognorm: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`attend` without dropout or recording: the context [B, Q, H, E] and the log-normaliser [B, Q, H] (fp32)."""
    from torch.nn.attention.flex_attention import flex_attention

    E = q.shape[-1]
    scale = 1.0 / math.sqrt(E)
    # q + bias_u is fp32 under autocast (an add is not autocast, the biases are fp32 parameters); the einsum path's
    # content matmul autocasts it back to bf16, so the kernel gets the keys' dtype too (fp32 queries beside bf16
    # keys also overflow the kernel's shared memory on an H100).
    query = ((q + bias_u) * scale).to(k.dtype).transpose(1, 2)  # [B, H, Q, E]; scaled here, so the kernel's is 1
    position = torch.einsum("bqhe,phe->bhqp", (q + bias_v) * scale, r_k)  # [B, H, Q, P]
    index = pos_index.to(torch.int32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + position[b, h, q_idx, index[q_idx, kv_idx]]

    args = (query, k.transpose(1, 2), v.transpose(1, 2))
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=1.0, **_lse_request(need_lognorm))
    if torch.compiler.is_compiling():
        # Inside the model's own torch.compile: the kernel is traced into its graph. A warnings context here would
        # break the graph at every layer.
        out = flex_attention(*args, **kwargs)
    else:
        kernel = _compiled_flex() if q.is_cuda else flex_attention
        with warnings.catch_warnings():
            # Uncompiled (CPU evaluation) FlexAttention warns that it materialises the scores: that is the point.
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
            out = kernel(*args, **kwargs)
    if need_lognorm:
        context, lognorm = out if isinstance(out, tuple) else (out, None)
        lognorm = getattr(lognorm, "lse", lognorm)  # AuxOutput (torch >= 2.9) or the bare tensor
        return context.transpose(1, 2), lognorm.float().transpose(1, 2)
    return out.transpose(1, 2), None


def _lse_request(need_lognorm: bool) -> dict:
    """The keyword that asks for the logsumexp: `return_aux=AuxRequest(lse=True)` where it exists (torch >= 2.9,
    the GPU machines' 2.11 included), else the older `return_lse=True`."""
    if not need_lognorm:
        return {}
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


_COMPILED = None


def _compiled_flex():
    """flex_attention under torch.compile, once per process: uncompiled it materialises the scores."""
    global _COMPILED
    if _COMPILED is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED
