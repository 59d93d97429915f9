"""Relative-position attention shared by every architecture.

Shape letters (models/shapes.md): B lanes, Q queries, K keys (the rows a layer projects: its cached rows and
the segment), X cached rows, N segment length, P relative distances, H heads, E head width, D model width, I inner
width.

Scores follow Transformer-XL (Dai et al. 2019, Sec. 3.3, the "relative positional encodings" score decomposed into
terms (a)-(d)):
    score(i, j) = (q_i + u) . k_j  +  (q_i + v) . W_R R(dist(i, j))
The position term is computed once per distinct distance ([B, H, Q, P]) and then gathered into [B, H, Q, K]
with an index built by the caller (or, on request, per (query, key) from the gathered encodings), so the same
routine serves causal attention (dist = i - j), LaMemo's look-ahead (dist = j - i, or i - j for the unstable "xl"
variant) and RMT's two-way blocks (signed dist).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from .mask_layout import TritonMask, causal_layout


def sinusoid(distances: Tensor, dim: int) -> Tensor:
    """R(d) for each (possibly negative) distance: [P] -> [P, dim], sines then cosines as in Transformer-XL."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=distances.device, dtype=torch.float32) / dim))
    angles = distances.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def clamp_distances(distances: Tensor, clamp_len: int) -> Tensor:
    """Distances above clamp_len share R(clamp_len); clamp_len <= 0 disables it. Only the maximum is clamped, as in
    the Transformer-XL, LaMemo and RMT authors' code: negative distances (RMT's read/write blocks, LaMemo's "xl"
    look-ahead) keep their own encodings."""
    if clamp_len > 0:
        return distances.clamp(max=clamp_len)
    return distances


class SoftmaxWithLogNorm(torch.autograd.Function):
    """softmax(scores) and logsumexp(scores) over the last dim from one exp pass ([..., K] -> [..., K], [...]).

    Computing them separately (logsumexp, then exp(scores - lognorm)) costs two exp passes and a subtraction
    forward, and their three backward nodes. Backward here: d scores = p * (g_p - sum(g_p * p) + g_lognorm).
    Every row must hold a finite score (attend's callers guarantee an allowed key per query).
    """

    @staticmethod
    def forward(ctx, scores: Tensor) -> tuple[Tensor, Tensor]:
        peak = scores.amax(dim=-1, keepdim=True)
        probs = torch.sub(scores, peak).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        probs.div_(total)
        ctx.save_for_backward(probs)
        return probs, (peak + total.log()).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_probs: Tensor | None, grad_lognorm: Tensor | None) -> Tensor:
        (probs,) = ctx.saved_tensors
        if grad_probs is None:
            return probs * grad_lognorm[..., None]
        grad = grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True)
        if grad_lognorm is not None:
            grad = grad.add_(grad_lognorm[..., None])
        return grad.mul_(probs)


def attend(
    q: Tensor,  # [B, Q, H, E]
    k: Tensor,  # [B, K, H, E]
    v: Tensor,  # [B, K, H, E]
    r_k: Tensor,  # [P, H, E]  projected relative encodings W_R R(d) for each distance slot
    pos_index: Tensor,  # [Q, K] long: which distance slot each (query, key) pair uses
    allowed: Tensor,  # [B or 1, Q, K] bool: True where the query may attend to the key
    bias_u: Tensor,  # [H, E] content bias
    bias_v: Tensor,  # [H, E] position bias
    dropatt: nn.Module,
    per_key_positions: bool = False,
    need_lognorm: bool = True,
    record: Callable[[Tensor], None] | None = None,
    kernel_mask=None,
    pos_offset: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Masked relative attention. Returns the context [B, Q, H, E] and the log-normaliser [B, Q, H] in fp32
    (None when need_lognorm is False: Transformer-XL and RMT discard it, and a plain softmax is cheaper).

    per_key_positions: score the position term per (query, key) from gathered encodings instead of per distinct
    distance; for callers with many more distances than keys per query (LaMemo's look-ahead with M > N).
    Every query row must have at least one allowed key (callers guarantee it). Softmax runs in fp32 so the
    log-normalisers that LaMemo caches are exact under autocast.
    record: called with the attention weights [B, H, Q, K] (before attention dropout) when given; analyses
    (`memlm analyze`) pass one through `Backbone.recorder`, everything else passes None and pays nothing.
    kernel_mask: `Backbone.kernel_mask(layout)`: a FlexAttention BlockMask (model.attention flex) or a
    `TritonMask` (triton); this call then goes through that kernel, unless it needs what only this path has
    (attention dropout in training, recording; per-key positions for FlexAttention, which the Triton kernels
    cover by reading only the position rows a tile needs).
    pos_offset: the layout's `MaskLayout.offset` when its sign is +1, i.e. pos_index[i, j] = pos_offset + i - j for
    every allowed pair (Transformer-XL's and RMT's layouts): the position term is then read out of the per-distance
    scores by strides (`skewed_positions`) instead of gathered through pos_index.
    """
    if kernel_mask is not None and record is None and not (dropatt.training and getattr(dropatt, "p", 0.0) > 0):
        if isinstance(kernel_mask, TritonMask):
            from .attention_triton import rel_attend_triton  # only when chosen: triton is an optional dependency

            layout = kernel_mask.layout
            return rel_attend_triton(q, k, v, r_k, bias_u, bias_v, None, None, layout.offset, layout.sign,
                                     need_lognorm, layout=kernel_mask.tiles)
        if not per_key_positions:
            from .attention_flex import flex_attend  # only when chosen: loads torch.compile's FlexAttention

            return flex_attend(q, k, v, r_k, pos_index, kernel_mask, bias_u, bias_v, need_lognorm)
    B, Q, H, E = q.shape
    K = k.shape[1]
    scale = 1.0 / math.sqrt(E)
    # The scale goes on the queries ([B, Q, H, E]), not on the scores ([B, H, Q, K], larger whenever K > E).
    content = torch.einsum("bqhe,bkhe->bhqk", (q + bias_u) * scale, k)  # [B, H, Q, K]
    q_pos = (q + bias_v) * scale
    if per_key_positions:
        # LaMemo's look-ahead with M > N has M distances but W = N keys per query. Scoring every distance would
        # cost Q*P (M^2, which dominates evaluation at M = 10N); taking each query's W position rows first costs
        # Q*K, like the content term.
        r_sel = r_k[pos_index]  # [Q, K, H, E]
        scores = content + torch.einsum("bqhe,qkhe->bhqk", q_pos, r_sel)
    elif (skewed := skewed_positions(content, q_pos, r_k, pos_offset)) is not None:
        scores = skewed
    else:
        pos_all = torch.einsum("bqhe,phe->bhqp", q_pos, r_k)  # [B, H, Q, P]
        # Summed into the gathered tensor, which is its own (gather's backward needs neither output): an in-place
        # op on einsum's output, a view of its product, would cost autograd a copy of the whole [B, H, Q, K] scores
        # and an as_strided gradient per op.
        scores = pos_all.gather(-1, pos_index.expand(B, H, Q, K)).add_(content)
    if scores.dtype != torch.float32:
        scores = scores.float()
    # The mask as an added 0 / -inf: the same scores (x + 0 = x, x - inf = -inf), and its backward passes the
    # gradient through where masked_fill's writes a masked copy of it.
    scores = scores.add_(mask_bias(allowed)[:, None])
    if need_lognorm:
        probs, lognorm = SoftmaxWithLogNorm.apply(scores)  # [B, H, Q, K], [B, H, Q]
    else:
        lognorm, probs = None, torch.softmax(scores, dim=-1)
    if record is not None:
        record(probs)
    probs = dropatt(probs.to(v.dtype))
    context = torch.einsum("bhqk,bkhe->bqhe", probs, v)
    return context, (lognorm.transpose(1, 2) if lognorm is not None else None)


def _skew(rows: Tensor, batch: int, n_query: int, n_keys: int, start: int) -> Tensor:
    """rows [H, B*Q, P] contiguous (P, a row's length, is W here) -> the [B, H, Q, K] view whose (b, h, i, j) is
    rows[h, b*Q + i, start - i + j] (a column past the row's end reads on into the next row)."""
    H, _, W = rows.shape
    return rows.as_strided((batch, H, n_query, n_keys), (n_query * W, batch * n_query * W, W - 1, 1),
                           rows.storage_offset() + start)


class SkewedPositionAdd(torch.autograd.Function):
    """content [B, H, Q, K] + the position term read out of the per-distance scores rows [H, B*Q, P] (distances in
    reverse order) by strides: position[b, h, i, j] = rows[h, b*Q + i, c - i + j] (`skewed_positions`)."""

    @staticmethod
    def forward(ctx, content: Tensor, rows: Tensor, c: int) -> Tensor:
        B, _, Q, K = content.shape
        ctx.geometry = (rows.shape, B, Q, K, c)
        return content + _skew(rows, B, Q, K, c)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (H, BQ, W), B, Q, K, c = ctx.geometry
        grad_rows = grad.new_zeros(H, BQ, W)
        # Up to W - 1 columns no two pairs share an element of rows: a copy. Past that (Transformer-XL, K = P) a
        # row's last keys share elements with the next row's first ones (a masked pair with an allowed one, whose
        # gradient is exactly zero): those columns are added.
        for j0 in range(0, K, W - 1):
            j1 = min(K, j0 + W - 1)
            part = _skew(grad_rows, B, Q, j1 - j0, c + j0)
            if j0 == 0:
                part.copy_(grad[..., j0:j1])
            else:
                part.add_(grad[..., j0:j1])
        return grad, grad_rows, None


def skewed_positions(content: Tensor, q_pos: Tensor, r_k: Tensor, offset: int | None) -> Tensor | None:
    """content + the position term [B, H, Q, K] for slots slot(i, j) = offset + i - j, the position term read out of
    the per-distance scores by strides: content [B, H, Q, K], q_pos [B, Q, H, E] (bias and scale applied), r_k
    [P, H, E]. None where it does not apply (no offset, a layout it does not fit, under torch.compile, which cannot
    trace as_strided).

    With the distances in reverse order, query i's keys j = 0..K-1 read the consecutive slots c - i + j
    (c = P - 1 - offset) of its own score row: the [B, H, Q, K] term is the score rows [H, B*Q, P] read with a row
    stride of P - 1. No index is read forward, and backward writes the gradient back through the same strides where
    gather's backward zero-fills and scatter-adds through the index (one CPU thread, RMT's [8, 4, 148, 276] scores,
    forward and backward: 1.4x faster). Pairs whose slot is outside [0, P) are masked pairs (the layout allows
    none); they read a neighbouring row's score, finite, which the mask turns into -inf, and get exactly zero
    gradient. The read stays inside the rows when c >= 0 and K <= Q + offset.
    """
    if offset is None or torch.compiler.is_compiling():
        return None
    B, Q, H, E = q_pos.shape
    P, K = r_k.shape[0], content.shape[-1]
    c = P - 1 - offset
    if c < 0 or K > Q + offset or P < 2:
        return None
    rows = torch.bmm(q_pos.permute(2, 0, 1, 3).reshape(H, B * Q, E), r_k.flip(0).permute(1, 2, 0))  # [H, B*Q, P]
    return SkewedPositionAdd.apply(content, rows, c)


def mask_bias(allowed: Tensor) -> Tensor:
    """[..., K] bool -> fp32 of its shape: 0 where allowed, -inf where not (added to the scores)."""
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class RelativeAttention(nn.Module):
    """Projections around `attend`: fused q/k/v, the relative-position key projection W_R and the output."""

    def __init__(self, d_model: int, n_head: int, d_head: int, dropout: float, dropatt: float, init_std: float):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        # q and k/v are separate modules so that every use is a module call (ZeRO-3 gathers parameters in a
        # module's forward) and memory rows, which are keys only, can skip the query projection.
        self.q_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.kv_net = nn.Linear(d_model, 2 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.dropatt = nn.Dropout(dropatt)
        self.drop = nn.Dropout(dropout)
        for lin in (self.q_net, self.kv_net, self.r_net, self.o_net):
            nn.init.normal_(lin.weight, 0.0, init_std)

    def project(self, h: Tensor, n_query: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """[B, K, D] -> q [B, Q, H, E] for the last Q = n_query rows (all when None), k, v [B, K, H, E].

        Memory positions only serve as keys in Transformer-XL and RMT, so their queries are not computed.
        """
        B, T, _ = h.shape
        n_query = T if n_query is None else n_query
        q = self.q_net(h[:, T - n_query :]).view(B, n_query, self.n_head, self.d_head)
        k, v = self.kv_net(h).view(B, T, 2, self.n_head, self.d_head).unbind(dim=2)
        return q, k, v

    def project_with_memory(self, mem: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """mem [B, X, D] rows that serve as keys only, h [B, N, D] -> q [B, N, H, E], k, v [B, X + N, H, E].

        The same projections as `project(cat([mem, h]), n_query=N)`, but the memory rows go through kv_net on
        their own: Transformer-XL's cached rows are detached, so autograd then skips their input gradient
        (B·X·D·2·H·E multiply-adds per layer that the concatenated form computes and throws away).
        """
        B, N, _ = h.shape
        q = self.q_net(h).view(B, N, self.n_head, self.d_head)
        kv = self.kv_net(h) if mem.shape[1] == 0 else torch.cat([self.kv_net(mem), self.kv_net(h)], dim=1)
        k, v = kv.view(B, kv.shape[1], 2, self.n_head, self.d_head).unbind(dim=2)
        return q, k, v

    def project_rows(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h [B, Q, D] -> q [B, Q, H, E] and the keys and values as kv_net gives them, [B, Q, 2*H*E] (a cache of
        projected keys and values keeps them in this form; `split_keys_values` splits them)."""
        B, T, _ = h.shape
        return self.q_net(h).view(B, T, self.n_head, self.d_head), self.kv_net(h)

    def split_keys_values(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """[B, K, 2*H*E] -> k, v [B, K, H, E]."""
        k, v = kv.view(kv.shape[0], kv.shape[1], 2, self.n_head, self.d_head).unbind(dim=2)
        return k, v

    def project_positions(self, r: Tensor) -> Tensor:
        """[P, D] sinusoids -> [P, H, E]."""
        return self.r_net(r).view(r.shape[0], self.n_head, self.d_head)

    def output(self, context: Tensor) -> Tensor:
        """[B, Q, H, E] -> [B, Q, D], with the residual dropout applied."""
        B, T = context.shape[:2]
        return self.drop(self.o_net(context.reshape(B, T, self.n_head * self.d_head)))


class FeedForward(nn.Module):
    """Position-wise FFN with its residual and layer norm (pre- or post-LN)."""

    def __init__(self, d_model: int, d_inner: int, dropout: float, pre_lnorm: bool, init_std: float):
        super().__init__()
        self.pre_lnorm = pre_lnorm
        self.net = nn.Sequential(
            nn.Linear(d_model, d_inner),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(d_inner, d_model),
            nn.Dropout(dropout),
        )
        self.norm = nn.LayerNorm(d_model)
        for lin in (self.net[0], self.net[3]):
            nn.init.normal_(lin.weight, 0.0, init_std)
            nn.init.zeros_(lin.bias)

    def forward(self, h: Tensor) -> Tensor:
        x = self.norm(h) if self.pre_lnorm else h
        # On rows [B*Q, D]: on a [B, Q, D] input nn.Linear returns a view of its 2-D product, and the in-place ReLU
        # on a view costs autograd a copy of the whole [B, Q, I] hidden and an as_strided gradient (zero-filled,
        # then copied) per layer; on rows the product is a tensor of its own. The same products, the same values.
        out = self.net(x.reshape(-1, x.shape[-1])).view(h.shape)
        if self.pre_lnorm:
            return h + out
        return self.norm(h + out)


class RelativeLayer(nn.Module):
    """One decoder layer: relative attention + FFN, both with residuals and layer norm (pre- or post-LN).

    The attention step is split in three so that LaMemo can run two attentions (causal and look-ahead) on the
    same projections and push both results through one output projection and FFN.
    """

    def __init__(self, cfg):
        super().__init__()
        self.pre_lnorm = cfg.pre_lnorm
        self.attn = RelativeAttention(cfg.d_model, cfg.n_head, cfg.d_head, cfg.dropout, cfg.dropatt, cfg.init_std)
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.ff = FeedForward(cfg.d_model, cfg.d_inner, cfg.dropout, cfg.pre_lnorm, cfg.init_std)

    def attn_input(self, h: Tensor) -> Tensor:
        """What q/k/v are projected from: the normalised input under pre-LN, the input itself under post-LN."""
        return self.attn_norm(h) if self.pre_lnorm else h

    def finish(self, h: Tensor, context: Tensor, extra: Tensor | None = None) -> Tensor:
        """Residual + norm around the attention output, then the FFN. h [B, Q, D], context [B, Q, H, E]; extra
        [B, Q, D]: another read added to the attention's output (the ∞-former's long-term memory)."""
        out = h + self.attn.output(context)
        if extra is not None:
            out = out + extra
        if not self.pre_lnorm:
            out = self.attn_norm(out)
        return self.ff(out)


def causal_index(n_query: int, n_mem: int, device: torch.device) -> Tensor:
    """Distance slot i - j for queries at positions n_mem + q over keys 0..n_mem+n_query-1: [Q, K] long.

    Future keys (negative distance) are masked, so any slot serves them; each takes its own (`spread_masked`).
    """
    q_pos = torch.arange(n_query, device=device)[:, None] + n_mem
    k_pos = torch.arange(n_mem + n_query, device=device)[None, :]
    return spread_masked(q_pos - k_pos, n_mem + n_query)


def spread_masked(slot: Tensor, n_slots: int) -> Tensor:
    """Slots below 0 (pairs the mask removes) moved into [0, n_slots) one-to-one along a row instead of all onto
    slot 0: their position gradient is zero, but on a GPU FlexAttention's backward still adds it atomically at
    the slot, and a whole row's masked pairs adding onto one address serialise. Callers guarantee that every
    negative slot is above -n_slots."""
    return torch.where(slot >= 0, slot, slot + n_slots)


def causal_allowed(n_query: int, n_mem: int, mem_valid: Tensor, same_length: bool) -> Tensor:
    """[B, Q, X + Q] bool: causal over the current block, memory slots only where valid (`causal_layout`)."""
    return causal_layout(n_query, n_mem, mem_valid, same_length).allowed


def relative_encodings(distances: Tensor, d_model: int, clamp_len: int, dtype: torch.dtype) -> Tensor:
    """Sinusoids for a list of distances (after clamping): [P] -> [P, D] in the compute dtype."""
    return sinusoid(clamp_distances(distances, clamp_len), d_model).to(dtype)
