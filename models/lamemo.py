"""LaMemo: look-ahead memory (Ji et al., NAACL 2022), docs/design.md §3.

Shape letters (models/shapes.md): B lanes, N segment length, M memory length, X cached rows (M here), Q queries (the
decoder's new tokens), K keys (M + N), W look-ahead window (min(M, N)), L layers, D model width, H heads, E head width.

State per layer, for the M memory positions: the cached attention output C (per head, before the output
projection) and its log-normaliser S (logsumexp of every scaled score that position has attended to so far,
fp32), plus the layer-0 inputs (token embeddings) of the last M positions. Memory hidden states at layers >= 1
are *recomputed* every segment, in the graph, from the layer-0 memory:

1. current tokens: causal attention over memory + current keys, Transformer-XL style, with the disentangled RPE
   (position term R(|i - j|), direction bias v+ for keys on the left);
2. memory tokens look ahead: memory position i attends to the W newest positions ending at the first token of
   the current segment, only to p > i, score (q_i + u) k_p + (q_i + v-) W_R R(p - i) -> context A, lognorm F;
3. interpolation alpha = s_past / (s_past + s_ahead + eps), computed from S and F in log space;
   C' = alpha C + (1 - alpha) A feeds the output projection, residual, norm and FFN shared with the current
   tokens, giving the next layer's memory input;
4. cache: S <- [logaddexp(S, F); current lognorms], C <- [C'; current contexts], detached, last M kept.

The windows of successive segments tile everything to a memory position's right without gap or overlap, so for
one layer C' is one softmax over (its causal keys and every look-ahead key so far) and alpha is its past mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .attention import RelativeLayer, attend, causal_allowed, causal_index, relative_encodings, spread_masked
from .backbone import Backbone, LayerInputs
from .decoders import SegmentDecoder
from .flops import layer_dims, segment_components
from .head_plan import TailPlan
from .mask_layout import MaskLayout, causal_layout
from .output import ModelOutput, cut, map_memory
from .txl import reset_valid, roll_valid


@dataclass
class LaMemoMemory:
    embed: Tensor  # [B, M, D] layer-0 inputs of the last M positions (detached)
    context: list[Tensor]  # L x [B, M, H, E] cached attention outputs C (detached)
    lognorm: list[Tensor]  # L x [B, M, H] fp32 log-normalisers S (detached)
    valid: Tensor  # [B, M] bool: slot holds a real position of the current document

    @property
    def key_valid(self) -> Tensor:
        """[B, X] bool: which cached keys a segment's queries may read, in key order (the memory interface)."""
        return self.valid

    def detached(self) -> "LaMemoMemory":
        """The state cut from the autograd graph (the memory interface every arch's state has)."""
        return map_memory(torch.Tensor.detach, self)


def lookahead_layout(n_mem: int, n_cur: int, key_valid: Tensor) -> tuple[int, Tensor, Tensor]:
    """Where the look-ahead window starts in the K keys, which (memory query, window key) pairs are allowed
    ([B, M, W]) and the distance slot p - i - 1 of each pair ([M, W]); distances run 1..M."""
    start, layout = lookahead_mask_layout(n_mem, n_cur, key_valid)
    window = torch.arange(start, n_mem + 1, device=key_valid.device)[None, :]
    ahead = window - torch.arange(n_mem, device=key_valid.device)[:, None]  # [M, W] p - i
    return start, layout.allowed, spread_masked(ahead - 1, n_mem)  # M distances 1..M: slots 0..M-1


def lookahead_mask_layout(n_mem: int, n_cur: int, key_valid: Tensor) -> tuple[int, MaskLayout]:
    """The look-ahead window's start in the K keys ([B, K] key_valid) and its mask: memory query i reads window
    keys p > i, at slot p - i - 1 = (start - 1) - (i - j) for window column j."""
    window = min(n_mem, n_cur)
    start = n_mem + 1 - window  # the window ends at key n_mem: the first token of the current segment
    key_pos = torch.arange(start, n_mem + 1, device=key_valid.device)[None, :]
    query_pos = torch.arange(n_mem, device=key_valid.device)[:, None]
    structure = key_pos - query_pos > 0  # [M, W]
    return start, MaskLayout(structure, key_valid[:, start : n_mem + 1], offset=start - 1, sign=-1)


class LaMemo(Backbone):
    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.rpe == "disentangled":
            # bias_v (from Backbone) serves as v+, for keys to the left; v- is for look-ahead keys.
            self.learned.add("bias_v_ahead", self.bias_shape, cfg.init_std)

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> LaMemoMemory:
        cfg = self.cfg
        B, M, L = batch_size, cfg.mem_len, cfg.n_layer
        return LaMemoMemory(
            embed=torch.zeros(B, M, cfg.d_model, device=device, dtype=dtype),
            context=[torch.zeros(B, M, cfg.n_head, cfg.d_head, device=device, dtype=dtype) for _ in range(L)],
            lognorm=[torch.zeros(B, M, cfg.n_head, device=device, dtype=torch.float32) for _ in range(L)],
            valid=torch.zeros(B, M, dtype=torch.bool, device=device),
        )

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: LaMemoMemory,
        reset: Tensor | None = None,  # [B] bool
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan: TailPlan | None = None,  # head_plan.tail_plan(targets) built on the host
    ) -> ModelOutput:
        cfg = self.cfg
        B, N = tokens.shape
        M, L = cfg.mem_len, cfg.n_layer
        device = tokens.device
        valid = reset_valid(memory.valid, reset)
        h_cur = self.embed_tokens(tokens)  # [B, N, D]
        h_layer0 = h_cur
        dtype = h_cur.dtype
        h_mem = memory.embed.to(dtype)  # [B, M, D]

        layout_cur = causal_layout(N, M, valid, cfg.same_length)
        allowed_cur = layout_cur.allowed  # [B, N, K]
        index_cur = causal_index(N, M, device)  # [N, K]
        r_cur = self.drop(relative_encodings(torch.arange(M + N, device=device), cfg.d_model, cfg.clamp_len, dtype))
        key_valid = torch.cat([valid, valid.new_ones(B, N)], dim=1)  # [B, K]
        start, allowed_ahead, index_ahead = lookahead_layout(M, N, key_valid)
        mask_cur = self.kernel_mask(layout_cur)  # None on the einsum path
        # FlexAttention has no per-key positions (M > N); the Triton kernels read only the rows a tile needs
        ahead_kernel = cfg.lookahead and M and (M <= N or cfg.attention == "triton")
        mask_ahead = self.kernel_mask(lookahead_mask_layout(M, N, key_valid)[1]) if ahead_kernel else None
        # Look-ahead distances 1..M. The authors draw a dropout mask for these encodings of their own; without
        # dropout (or in eval) they equal rows 1..M of r_cur, so the disentangled path reuses those projections.
        if cfg.rpe == "xl":  # Transformer-XL's signed encoding R(i - p) for keys on the right (unstable, ablation)
            r_ahead = self.drop(relative_encodings(-torch.arange(1, M + 1, device=device), cfg.d_model,
                                                   cfg.clamp_len, dtype))
        elif self.training and cfg.dropout > 0:
            r_ahead = self.drop(relative_encodings(torch.arange(1, M + 1, device=device), cfg.d_model,
                                                   cfg.clamp_len, dtype))
        else:
            r_ahead = None

        learned = self.learned.fetch()
        inputs = LayerInputs(r_cur, index_cur, allowed_cur, mask_cur, None, learned["bias_u"], learned["bias_v"],
                             "causal")
        new_context, new_lognorm = [], []
        rows = torch.cat([h_mem, h_cur], dim=1)  # [B, K, D] the layer input over memory and segment
        for l in range(L):
            v_ahead = None
            if cfg.lookahead:
                v_ahead = self.layer_bias(learned["bias_v" if cfg.rpe == "xl" else "bias_v_ahead"], l)
            rows, ctx_all, lognorm_all = self.run_layer(
                l, rows, memory.context[l].to(dtype), inputs, memory.lognorm[l], r_ahead, start, index_ahead,
                allowed_ahead, mask_ahead, v_ahead, l == L - 1, (self.record_to("lookahead", l),
                                                                   self.record_to("alpha", l)))
            new_context.append(cut(ctx_all[:, -M:]))
            new_lognorm.append(cut(lognorm_all[:, -M:]))

        nll, logits = self.predict(rows, targets, return_logits, tail_plan)  # the last layer's rows: the segment's
        new_memory = LaMemoMemory(
            embed=cut(torch.cat([memory.embed.to(dtype), h_layer0], dim=1)[:, -M:]),
            context=new_context,
            lognorm=new_lognorm,
            valid=roll_valid(valid, N, M),
        )
        return ModelOutput(nll=nll, logits=logits, memory=new_memory)

    def layer_step(
        self,
        layer: RelativeLayer,
        rows: Tensor,  # [B, K, D] this layer's input over the memory positions and the segment (K = M + N)
        ctx_mem: Tensor,  # [B, M, H, E] the memory's cached attention context
        r_cur: Tensor,  # [M + N, D] encodings of distances 0..M+N-1
        index_cur: Tensor, allowed_cur: Tensor,  # the segment's causal attention
        bias_u: Tensor, bias_v: Tensor,  # [H, E] each
        mask_cur, record_causal, pos_offset: int | None,  # its kernel mask, the analyses' receiver, None (gathered)
        lognorm_mem: Tensor,  # [B, M, H] the cached context's log-normaliser
        r_ahead: Tensor | None,  # [M, D] look-ahead encodings, None where rows 1..M of r_cur serve
        start: int, index_ahead: Tensor, allowed_ahead: Tensor, mask_ahead,  # the memory's look-ahead
        bias_v_ahead: Tensor | None,  # [H, E]
        last: bool,  # the last layer: its memory rows feed nothing, only the cache is updated
        records: tuple,  # (lookahead, alpha) receivers or None (analyses)
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One LaMemo layer: the segment attends causally to memory and itself; the memory looks ahead at the
        segment and its context is interpolated with the cached one (eq. 10-11). Returns the next layer's rows
        ([B, K, D]; the last layer's: the segment's alone, [B, N, D]), this layer's updated context [B, K, H, E]
        and log-normaliser [B, K, H] (the cache keeps the last M). Rows travel whole between layers, not split
        into memory and segment views, so every layer's input has one layout and `compile_layers` makes two
        graphs (the inner layers' and the last one's)."""
        M = self.cfg.mem_len
        N = rows.shape[1] - M
        record_ahead, record_alpha = records
        q, k, v = layer.attn.project(layer.attn_input(rows))  # [B, K, H, E] each
        r_k = layer.attn.project_positions(r_cur)  # [M + N, H, E] distances 0..M+N-1
        ctx_cur, lognorm_cur = attend(q[:, M:], k, v, r_k, index_cur, allowed_cur, bias_u, bias_v, layer.attn.dropatt,
                                      record=record_causal, kernel_mask=mask_cur, pos_offset=pos_offset)
        if self.cfg.lookahead:
            r_k_ahead = r_k[1 : M + 1] if r_ahead is None else layer.attn.project_positions(r_ahead)
            window = slice(start, M + 1)
            ctx_ahead, lognorm_ahead = attend(
                q[:, :M], k[:, window], v[:, window], r_k_ahead, index_ahead, allowed_ahead, bias_u, bias_v_ahead,
                layer.attn.dropatt, per_key_positions=M > N,  # M distances, only W = N keys per query
                record=record_ahead, kernel_mask=mask_ahead,
            )
            ctx_mem, lognorm_mem = self.interpolate(ctx_mem, lognorm_mem, ctx_ahead, lognorm_ahead,
                                                     record=record_alpha)
        ctx_all = torch.cat([ctx_mem, ctx_cur], dim=1)  # [B, K, H, E]
        lognorm_all = torch.cat([lognorm_mem, lognorm_cur], dim=1)  # [B, K, H]
        if last:
            return layer.finish(rows[:, M:], ctx_cur), ctx_all, lognorm_all
        return layer.finish(rows, ctx_all), ctx_all, lognorm_all

    def interpolate(
        self, ctx_past: Tensor, lognorm_past: Tensor, ctx_ahead: Tensor, lognorm_ahead: Tensor,
        record: Callable[[Tensor], None] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """C' = alpha C + (1 - alpha) A with alpha = s_past / (s_past + s_ahead + eps) (eq. 10-11), and the
        updated log-normaliser logaddexp(S, F). ctx_* [B, M, H, E], lognorm_* [B, M, H].

        S, F and alpha stay in fp32 (they are exponentials of large sums); the mix itself runs in the compute
        dtype. With interpolate off (ablation) alpha = 0: C' = A. record: receives alpha [B, M, H] (analyses).
        """
        log_past_and_ahead = torch.logaddexp(lognorm_past, lognorm_ahead)
        if not self.cfg.interpolate:
            return ctx_ahead, log_past_and_ahead
        log_total = log_past_and_ahead
        if self.cfg.interp_eps > 0:
            log_total = torch.logaddexp(log_total, torch.full_like(log_total, math.log(self.cfg.interp_eps)))
        alpha = torch.exp(lognorm_past - log_total)
        if record is not None:
            record(alpha)
        alpha = alpha[..., None].to(ctx_ahead.dtype)  # [B, M, H, 1]
        return alpha * ctx_past + (1.0 - alpha) * ctx_ahead, log_past_and_ahead


# ---------------------------------------------------------------------------------------------------------------
# What the registry entry names besides the model: FLOPs (models/flops.py's conventions), parameters, decoder


def layer_flops(cfg, batch_size: int) -> tuple[dict[str, float], int]:
    """LaMemo: Transformer-XL's causal attention, plus per layer q for the M memory positions, the look-ahead
    attention (M queries over W keys; the position term per (query, window key), i.e. M x W, though the distances
    span 1..M), and on every layer except the last the output projection and FFN for the M memory positions (memory
    hidden states at layers >= 1 are recomputed every segment from the layer-0 memory; at the last layer only the
    cached context is updated)."""
    D, A, F_, L, N, M, mm = layer_dims(cfg)
    seg = segment_components()
    K, W = M + N, min(M, N)
    for layer in range(L):
        not_last = layer < L - 1
        rows_out = K if not_last else N  # memory rows get output projection + FFN except at the last layer
        seg["attn_proj"] += 3 * mm(K, D, A) + mm(rows_out, A, D)
        seg["pos_proj"] += mm(K, D, A) / batch_size
        seg["attn_content"] += mm(N, A, K)
        seg["attn_position"] += mm(N, A, K)
        seg["attn_context"] += mm(N, K, A)
        if cfg.lookahead:
            if cfg.rpe == "xl":
                seg["pos_proj"] += mm(M, D, A) / batch_size  # separate encodings R(i - p) for the look-ahead
            seg["attn_content"] += mm(M, A, W)
            seg["attn_position"] += mm(M, A, min(M, N))  # per (query, window key): W of the M distances
            seg["attn_context"] += mm(M, W, A)
        seg["ffn"] += 2 * mm(rows_out, D, F_)
    return seg, N


def extra_params(cfg) -> int:
    """v- for the look-ahead direction (the disentangled encoding)."""
    return (cfg.n_layer if cfg.untie_r else 1) * cfg.n_head * cfg.d_head if cfg.rpe == "disentangled" else 0


class LaMemoDecoder(SegmentDecoder):
    """LaMemo: the memory's hidden states at layers >= 1 are refreshed by the look-ahead, whose window ends at the
    segment's *first* token. So the first `extend` of a segment runs the model's layer loop on [memory | first
    tokens] (look-ahead + interpolation, exactly as forward), which fixes the memory keys/values of every layer for
    the rest of the segment; later tokens attend causally to those and to the segment's cache. No later token of the
    segment can change them (the window never reaches past the first token), so this is exact."""

    def begin(self, memory) -> None:
        cfg, model = self.cfg, self.model
        M, N = cfg.mem_len, cfg.tgt_len
        B, device = memory.valid.shape[0], memory.valid.device
        dtype = next(model.parameters()).dtype
        self.memory, self.t = memory, 0
        self._buffers(B, M, device, dtype)
        self.allowed = causal_allowed(N, M, memory.valid, cfg.same_length)  # [B, N, M + N]
        self.index = causal_index(N, M, device)  # [N, M + N]
        key_valid = torch.cat([memory.valid, memory.valid.new_ones(B, N)], dim=1)  # [B, M + N]
        self.start, self.allowed_ahead, self.index_ahead = lookahead_layout(M, N, key_valid)
        r = relative_encodings(torch.arange(M + N, device=device), cfg.d_model, cfg.clamp_len, dtype)
        self.r_k = [layer.attn.project_positions(r) for layer in model.layers]
        if cfg.rpe == "xl":
            r_ahead = relative_encodings(-torch.arange(1, M + 1, device=device), cfg.d_model, cfg.clamp_len, dtype)
            self.r_k_ahead = [layer.attn.project_positions(r_ahead) for layer in model.layers]
        else:  # distances 1..M: rows of the causal encodings, as the model's forward takes them in eval mode
            self.r_k_ahead = [r_k[1 : M + 1] for r_k in self.r_k]
        self.bias = self._biases()
        learned = model.learned.fetch()
        bias_ahead = learned["bias_v"] if cfg.rpe == "xl" else learned.get("bias_v_ahead")
        self.bias_ahead = [model.layer_bias(bias_ahead, l) for l in range(cfg.n_layer)]

    def extend(self, tokens: Tensor) -> Tensor:
        Q = tokens.shape[1]
        self._check_room(Q)
        h = self.model.embed_tokens(tokens)
        if self.t == 0:
            h = self._first_block(h)
        else:
            h = self._causal_layers(h, slice(self.t, self.t + Q), self.allowed, self.index)
        self.t += Q
        return self._logp(h)

    def _first_block(self, h_cur: Tensor) -> Tensor:
        """The model's layer loop on [memory | the segment's first Q tokens]: returns the tokens' last hidden
        [B, Q, D] and leaves every layer's memory and token keys/values in the buffers."""
        cfg, model, memory = self.cfg, self.model, self.memory
        M, Q, L = cfg.mem_len, h_cur.shape[1], cfg.n_layer
        h_mem = memory.embed.to(h_cur.dtype)  # [B, M, D] layer-0 memory inputs
        allowed, index = self.allowed[:, :Q, : M + Q], self.index[:Q, : M + Q]
        window = slice(self.start, M + 1)
        for l, layer in enumerate(model.layers):
            u, bias_v = self.bias[l]
            keys_in = torch.cat([h_mem, h_cur], dim=1)  # [B, M + Q, D]
            q, k, v = layer.attn.project(layer.attn_input(keys_in))
            self.keys[l][:, : M + Q], self.values[l][:, : M + Q] = k, v
            ctx_cur, _ = attend(q[:, M:], k, v, self.r_k[l], index, allowed, u, bias_v, layer.attn.dropatt,
                                need_lognorm=False)
            if l == L - 1:  # the last layer's memory output feeds nothing
                return layer.finish(h_cur, ctx_cur)
            ctx_mem = memory.context[l].to(h_cur.dtype)
            if cfg.lookahead:
                ctx_ahead, lognorm_ahead = attend(
                    q[:, :M], k[:, window], v[:, window], self.r_k_ahead[l], self.index_ahead, self.allowed_ahead,
                    u, self.bias_ahead[l], layer.attn.dropatt, per_key_positions=M > cfg.tgt_len)
                ctx_mem, _ = model.interpolate(ctx_mem, memory.lognorm[l], ctx_ahead, lognorm_ahead)
            out = layer.finish(keys_in, torch.cat([ctx_mem, ctx_cur], dim=1))
            h_mem, h_cur = out[:, :M], out[:, M:]
        return h_cur
