"""Recurrent Memory Transformer (Bulatov et al. 2022) on the Transformer-XL backbone, optionally combined with
the Transformer-XL cache (the paper's "Tr-XL + RMT") and with the auxiliary memory loss of its appendix A.5.

Shape letters (models/shapes.md): B lanes, N segment length, M memory length (the Transformer-XL cache's), R memory
tokens, Q queries (2R + N: read | tokens | write), X cached rows (M), K keys (M + Q), P relative distances, L layers,
D model width, H heads, E head width, A attention width (H·E), V vocabulary.

Every layer processes the sequence [read R | tokens N | write R]; the keys are [cache M | read R | tokens N |
write R] at positions 0..K-1. Mask (see `rmt_allowed`): read rows see the read block (both directions); token
rows are causal among tokens and see the read block, never the write block; write rows see the whole segment.
The cache (the past) is visible to token rows, and to the memory rows (read and write blocks) only with
cfg.read_mem_from_cache (cfg.write_mem_from_cache: to the write rows alone). The write block's final outputs are
the next segment's memory tokens, placed at both ends (the paper's H_mem_{t+1} := H_write_t). Only the token rows
feed the softmax.

The Transformer-XL + RMT defaults follow the code the paper's numbers came from (the paper is silent): the memory
rows do not read the cache (read_mem_from_cache: false; the authors' mask sets both the first R and the last R
rows, booydar/LM-RMT mem_transformer.py), and the cache keeps the last M rows of the whole
[read | tokens | write] layer input (cache_memory_rows: true); with cache_memory_rows: false it keeps token rows
only. Either way a cached row sits at its row position: distances are row-index differences in the key list.
Dropout is drawn over the whole [read | tokens | write] input, as the authors drop memory-token embeddings like
token embeddings. With cache_keys_values the cache holds each layer's projected keys and values of those rows instead
of their layer inputs (lucidrains' XL memories; `cached_kv_layer_step`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .attention import attend, relative_encodings, spread_masked
from .backbone import Backbone, LayerInputs
from .decoders import SegmentDecoder
from .flops import head_row_flops, layer_dims, segment_components, softmax_clusters
from .head_plan import TailPlan
from .mask_layout import MaskLayout
from .output import ModelOutput, cut
from .txl import TXLMemory, last_rows, reset_valid, roll_valid

# Block of each query row / key column in rmt_allowed.
CACHE, READ, TOKENS, WRITE = -1, 0, 1, 2


@dataclass
class RMTMemory:
    # [B, R, D] memory tokens the next segment reads (and rewrites), in the autograd graph as the caller left them
    # (the trainer's BPTT schedules cut them: trainer/loop/recurrence.py)
    tokens: Tensor
    fresh: Tensor  # [B] bool: lane holds no memory yet; forward puts the learned initial memory there
    # Transformer-XL cache (rows of [read|tokens|write] or tokens only), detached; M slots (0: none). Its `hidden`
    # holds per layer the rows' layer inputs [B, M, D], or with cache_keys_values their keys and values [B, M, 2A].
    cache: TXLMemory
    # Fields checkpoints of older memlm saved in this state, dropped when one is resumed (the model counted its
    # BPTT transitions until the trainer's schedules alone enforced bptt_depth)
    retired_fields: ClassVar[tuple[str, ...]] = ("transitions",)

    @property
    def valid(self) -> Tensor:
        """[B, M] bool: the Transformer-XL cache's slots holding real positions (the memory interface's valid)."""
        return self.cache.valid

    @property
    def key_valid(self) -> Tensor:
        """[B, X] bool: which cached keys a segment's queries may read, in key order (the memory interface)."""
        return self.cache.valid  # the Transformer-XL cache's (memory tokens are always read)

    def detached(self) -> "RMTMemory":
        """The same state cut from the autograd graph (the cache is never in it)."""
        return dataclasses.replace(self, tokens=cut(self.tokens))


def rmt_allowed(n_mem_tokens: int, n_tokens: int, cache_valid: Tensor, same_length: bool = False,
                read_mem_from_cache: bool = False, write_mem_from_cache: bool = False) -> Tensor:
    """[B, Q, K] bool: which key each query row may attend to (`rmt_layout`)."""
    return rmt_layout(n_mem_tokens, n_tokens, cache_valid, same_length, read_mem_from_cache,
                      write_mem_from_cache).allowed


def rmt_layout(n_mem_tokens: int, n_tokens: int, cache_valid: Tensor, same_length: bool = False,
               read_mem_from_cache: bool = False, write_mem_from_cache: bool = False) -> MaskLayout:
    """Which key each query row may attend to, for the layout in the module docstring; slots as `rmt_positions`.

    cache_valid [B, M] masks empty cache slots (start of a document). With same_length (and a cache) token rows
    see only cache and token keys less than M rows back, as Transformer-XL's evaluation option does.
    """
    R, N = n_mem_tokens, n_tokens
    B, M = cache_valid.shape
    device = cache_valid.device
    q_block = torch.tensor([READ] * R + [TOKENS] * N + [WRITE] * R, device=device)  # [Q]
    k_block = torch.cat([torch.full((M,), CACHE, device=device), q_block])  # [K]
    q_pos = torch.arange(M, M + 2 * R + N, device=device)[:, None]  # [Q, 1] row positions in the key list
    k_pos = torch.arange(M + 2 * R + N, device=device)[None, :]  # [1, K]
    q_block, k_block = q_block[:, None], k_block[None, :]

    token_row = q_block == TOKENS
    memory_row = (q_block == READ) | (q_block == WRITE)
    cache_readers = token_row | (memory_row if read_mem_from_cache else False)
    if write_mem_from_cache:
        cache_readers = cache_readers | (q_block == WRITE)
    structure = (
        ((q_block == WRITE) & (k_block != CACHE))  # write rows gather the whole segment
        | ((k_block == CACHE) & cache_readers)  # the cache is the past
        | (k_block == READ)  # the read memory: visible to every row, both directions inside the block
        | (token_row & (k_block == TOKENS) & (k_pos <= q_pos))  # tokens: causal, never the write block
    )
    if same_length and M > 0:
        far = token_row & ((k_block == CACHE) | (k_block == TOKENS)) & (q_pos - k_pos >= M)
        structure = structure & ~far
    key_valid = torch.cat([cache_valid, cache_valid.new_ones(B, 2 * R + N)], dim=1)  # [B, K]
    return MaskLayout(structure, key_valid, offset=M + R - 1, sign=1)


def rmt_positions(n_mem_tokens: int, n_tokens: int, mem_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Signed distances i - j with queries at positions M..K-1 and keys at 0..K-1.

    Returns the distinct distances [P] (for relative_encodings) and the [Q, K] slot index for `attend`. Allowed
    pairs never look further right than R - 1 (inside the read or write block), so the list starts at -(R - 1);
    pairs further right are masked anyway (their slots are spread over the list, `spread_masked`).
    """
    R, M = n_mem_tokens, mem_len
    Q = 2 * R + n_tokens
    distances = torch.arange(-(R - 1), M + Q, device=device)
    dist = (torch.arange(Q, device=device)[:, None] + M) - torch.arange(M + Q, device=device)[None, :]
    return distances, spread_masked(dist + R - 1, distances.shape[0])


class RecurrentMemoryTransformer(Backbone):
    """RMT: Transformer-XL layers over [read | tokens | write], the write outputs carried to the next segment.

    Backpropagation through time: the memory tokens a segment writes stay in the autograd graph, so a loss reaches
    every earlier segment the caller chained without cutting the state (`RMTMemory.detached()`). How far back is
    the trainer's schedule (trainer/loop/recurrence.py), the one place model.bptt_depth = k is enforced: the paper's
    window (the lane's last k segments replayed before each new one) or chunks of k + 1 new segments.

    The first memory is the learned parameter `memory_init` [R, D]; it is used again, per lane, for every lane
    that is reset or fresh (a parameter, so those lanes' losses reach it). The Transformer-XL cache (mem_len > 0)
    is always detached; emptying it is masking through `valid`.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        self.learned.add("memory_init", (cfg.num_mem_tokens, cfg.d_model), cfg.init_std)

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> RMTMemory:
        # Every lane is fresh: forward substitutes memory_init there. The parameter is not touched here, so
        # this works outside forward (e.g. with ZeRO-3 partitioned parameters); the zeros are never read.
        cfg = self.cfg
        B, R, M, D = batch_size, cfg.num_mem_tokens, cfg.mem_len, cfg.d_model
        width = self.cache_width
        return RMTMemory(
            tokens=torch.zeros(B, R, D, device=device, dtype=dtype),
            fresh=torch.ones(B, dtype=torch.bool, device=device),
            cache=TXLMemory(
                hidden=[torch.zeros(B, M, width, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
                valid=torch.zeros(B, M, dtype=torch.bool, device=device),
            ),
        )

    @property
    def cache_width(self) -> int:
        """The width of a cached row: D (layer inputs) or 2*H*E (projected keys and values, cache_keys_values)."""
        cfg = self.cfg
        return 2 * cfg.n_head * cfg.d_head if cfg.cache_keys_values else cfg.d_model

    def read_memory(self, memory: RMTMemory, reset: Tensor | None, memory_init: Tensor, dtype: torch.dtype) -> Tensor:
        """The memory tokens this segment reads [B, R, D]: the state's, or the learned initial memory in fresh or
        reset lanes."""
        tokens = memory.tokens
        fresh = memory.fresh if reset is None else memory.fresh | reset.to(memory.fresh.device)
        if self.cfg.bptt_choice("memory_init_grad") == "detached":  # the authors' loop at k >= 1: never trained
            memory_init = memory_init.detach()
        init = memory_init.to(dtype)[None].expand(tokens.shape[0], -1, -1)
        return torch.where(fresh[:, None, None], init, tokens.to(dtype))

    def cached_kv_layer_step(self, layer, h: Tensor, cached: Tensor, r: Tensor, pos_index: Tensor, allowed: Tensor,
                             bias_u: Tensor, bias_v: Tensor, kernel_mask, record,
                             pos_offset: int) -> tuple[Tensor, Tensor]:
        """`Backbone.layer_step` with a cache of projected keys and values (cfg.cache_keys_values): cached [B, M, 2A]
        are the keys and values of the last M rows as the segments that wrote them projected them, read as they
        are. Returns the new h [B, Q, D] and the cache for the next segment, [B, M, 2A]: the last M of the cached
        and this segment's rows (all Q rows, or the N token rows without cache_memory_rows), detached."""
        cfg = self.cfg
        R, M = cfg.num_mem_tokens, cfg.mem_len
        q, kv = layer.attn.project_rows(layer.attn_input(h))  # [B, Q, H, E], [B, Q, 2A]
        cached = cached.to(kv.dtype)
        rows = kv if cfg.cache_memory_rows else kv[:, R : kv.shape[1] - R]
        k, v = layer.attn.split_keys_values(torch.cat([cached, kv], dim=1))  # [B, M + Q, H, E]
        context, _ = attend(q, k, v, layer.attn.project_positions(r), pos_index, allowed, bias_u, bias_v,
                            layer.attn.dropatt, need_lognorm=False, record=record, kernel_mask=kernel_mask,
                            pos_offset=pos_offset)
        return layer.finish(h, context), cut(last_rows(cached, rows, M))

    def memory_loss(self, write: Tensor) -> Tensor | None:
        """Paper A.5: the write outputs [B, R, D] predict the fixed token aux_token_id through the same softmax
        head; the weighted mean NLL, or None when the loss is off."""
        cfg = self.cfg
        if cfg.aux_loss_weight <= 0:
            return None
        target = torch.full(write.shape[:2], cfg.aux_token_id, dtype=torch.long, device=write.device)
        nll, _ = self.predict(write, target, False)
        return cfg.aux_loss_weight * nll.mean()

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: RMTMemory,
        reset: Tensor | None = None,  # [B] bool
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan: TailPlan | None = None,  # head_plan.tail_plan(targets) built on the host
    ) -> ModelOutput:
        cfg = self.cfg
        B, N = tokens.shape
        R, M = cfg.num_mem_tokens, cfg.mem_len
        x = self.embed(tokens)  # [B, N, D]
        learned = self.learned.fetch()
        mem = self.read_memory(memory, reset, learned["memory_init"], x.dtype)  # [B, R, D]
        h = self.drop(torch.cat([mem, x, mem], dim=1))  # [B, Q, D]: the same memory at both ends
        valid = reset_valid(memory.cache.valid, reset)
        cached_rows = 2 * R + N if cfg.cache_memory_rows else N  # rows that enter the cache per segment

        layout = rmt_layout(R, N, valid, cfg.same_length, cfg.read_mem_from_cache, cfg.write_mem_from_cache)
        allowed = layout.allowed  # [B, Q, K]
        kernel_mask = self.kernel_mask(layout)  # None on the einsum path
        distances, pos_index = rmt_positions(R, N, M, tokens.device)  # [P], [Q, K]
        r = self.drop(relative_encodings(distances, cfg.d_model, cfg.clamp_len, h.dtype))

        inputs = LayerInputs(r, pos_index, allowed, kernel_mask, layout.offset, learned["bias_u"], learned["bias_v"],
                             "rmt")
        new_cache = []
        for l in range(cfg.n_layer):
            if M and cfg.cache_keys_values:
                h, kv = self.run_layer(l, h, memory.cache.hidden[l], inputs, step=self.cached_kv_layer_step)
                new_cache.append(kv)
                continue
            cached = memory.cache.hidden[l].to(h.dtype)  # [B, M, D]
            if M:
                rows = h if cfg.cache_memory_rows else h[:, R : R + N]  # [B, Q or N, D]
                new_cache.append(cut(last_rows(cached, rows, M)))
            h = self.run_layer(l, h, cached, inputs)

        _, hidden, write = h.split([R, N, R], dim=1)
        nll, logits = self.predict(hidden, targets, return_logits, tail_plan)
        new_memory = RMTMemory(
            tokens=write,
            fresh=torch.zeros_like(memory.fresh),
            cache=TXLMemory(hidden=new_cache if M else memory.cache.hidden, valid=roll_valid(valid, cached_rows, M)),
        )
        return ModelOutput(nll=nll, logits=logits, memory=new_memory, aux_loss=self.memory_loss(write))


# ---------------------------------------------------------------------------------------------------------------
# What the registry entry names besides the model: FLOPs (models/flops.py's conventions), parameters, decoder


def layer_flops(cfg, batch_size: int) -> tuple[dict[str, float], int]:
    """RMT: the segment is [read R | N tokens | write R], so every per-position cost runs over N + 2R positions and
    keys over M + N + 2R; the position term and W_R run over the M + N + 3R - 1 signed distances -(R-1)..K-1; the
    softmax head runs only over the N tokens (plus the R write rows when aux_loss_weight > 0). With cache_keys_values
    the M cached rows' keys and values are read as cached: k and v are projected for the N + 2R rows only."""
    D, A, F_, L, N, M, mm = layer_dims(cfg)
    seg = segment_components()
    R = cfg.num_mem_tokens
    T = N + 2 * R  # [read R | tokens N | write R]
    K = M + T  # [cache M | read R | tokens N | write R]
    P = K + R - 1  # signed distances -(R - 1) .. K - 1 (the read/write blocks look up to R - 1 to the right)
    projected = T if cfg.cache_keys_values else K  # a cache of keys and values is not projected again
    for _ in range(L):
        seg["attn_proj"] += mm(T, D, A) + 2 * mm(projected, D, A) + mm(T, A, D)
        seg["pos_proj"] += mm(P, D, A) / batch_size
        seg["attn_content"] += mm(T, A, K)
        seg["attn_position"] += mm(T, A, P)
        seg["attn_context"] += mm(T, K, A)
        seg["ffn"] += 2 * mm(T, D, F_)
    if cfg.aux_loss_weight > 0:  # the R write rows predict aux_token_id through the same head
        hit = [float(lo <= cfg.aux_token_id < hi) for lo, hi, _ in softmax_clusters(cfg)]
        seg["head"] += R * head_row_flops(cfg, hit, False)  # never with logits
    return seg, N


def extra_params(cfg) -> int:
    """The learned initial memory."""
    return cfg.num_mem_tokens * cfg.d_model


class RMTDecoder(SegmentDecoder):
    """RMT (and Transformer-XL + RMT): the read rows see only the read block (and the cache if
    cfg.read_mem_from_cache), never the tokens, so they go through every layer once at `begin`; token rows then
    attend to [cache | read | tokens so far]. The write rows (the next memory) are only needed when the segment is
    full: the model's forward computes them."""

    def begin(self, memory) -> None:
        cfg, model = self.cfg, self.model
        R, M, N = cfg.num_mem_tokens, cfg.mem_len, cfg.tgt_len
        valid = memory.cache.valid
        B, device = valid.shape[0], valid.device
        dtype = next(model.parameters()).dtype
        self.t = 0
        self._buffers(B, M + R, device, dtype)
        learned = model.learned.fetch()
        read = model.read_memory(memory, None, learned["memory_init"], dtype)  # [B, R, D]
        self.allowed = rmt_allowed(R, N, valid, cfg.same_length, cfg.read_mem_from_cache,
                                   cfg.write_mem_from_cache)  # [B, 2R + N, K]
        distances, self.index = rmt_positions(R, N, M, device)  # [P], [2R + N, K]
        r = relative_encodings(distances, cfg.d_model, cfg.clamp_len, dtype)
        self.r_k = [layer.attn.project_positions(r) for layer in model.layers]
        self.bias = self._biases()
        h = model.drop(read)
        allowed, index = self.allowed[:, :R, : M + R], self.index[:R, : M + R]
        for l, layer in enumerate(model.layers):
            if M and cfg.cache_keys_values:  # the cache holds the rows' keys and values [B, M, 2A] as they are
                q, kv = layer.attn.project_rows(layer.attn_input(h))
                k, v = layer.attn.split_keys_values(torch.cat([memory.cache.hidden[l].to(kv.dtype), kv], dim=1))
            else:
                keys_in = torch.cat([memory.cache.hidden[l].to(dtype), h], dim=1)  # [B, M + R, D]
                q, k, v = layer.attn.project(layer.attn_input(keys_in), n_query=R)
            self.keys[l][:, : M + R], self.values[l][:, : M + R] = k, v
            u, bias_v = self.bias[l]
            context, _ = attend(q, k, v, self.r_k[l], index, allowed, u, bias_v, layer.attn.dropatt, need_lognorm=False)
            h = layer.finish(h, context)

    def extend(self, tokens: Tensor) -> Tensor:
        Q = tokens.shape[1]
        self._check_room(Q)
        R = self.cfg.num_mem_tokens
        h = self.model.drop(self.model.embed(tokens))
        rows = slice(R + self.t, R + self.t + Q)  # token rows follow the read block in the query layout
        h = self._causal_layers(h, rows, self.allowed, self.index)
        self.t += Q
        return self._logp(h)
