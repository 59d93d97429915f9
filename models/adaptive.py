"""Adaptive input embedding and adaptive softmax (Baevski & Auli 2019; Grave et al. 2017), as Transformer-XL uses
them for WikiText-103. With no cutoffs both reduce to one embedding table and one full softmax.

Shape legend: B lanes, N positions, D model width (d_proj), V vocabulary, C clusters (len(cutoffs)).
The vocabulary is split at the cutoffs into a head shortlist [0, c0) and tail clusters [c0, c1), [c1, c2), ...;
cluster i has embedding width d_embed // div_val**i and a projection to/from D when that width differs from D.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[tuple[int, int]]:
    edges = [0] + list(cutoffs) + [vocab_size]
    return list(zip(edges[:-1], edges[1:]))


def cluster_widths(d_embed: int, n_clusters: int, div_val: int) -> list[int]:
    if div_val == 1:
        return [d_embed] * n_clusters
    return [d_embed // div_val**i for i in range(n_clusters)]


class AdaptiveEmbedding(nn.Module):
    """tokens [B, N] -> [B, N, D], scaled by sqrt(D) as in Transformer-XL."""

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int, init_std: float):
        super().__init__()
        self.d_proj = d_proj
        self.scale = math.sqrt(d_proj)
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        # div_val == 1: one table for the whole vocabulary (what the WikiText-103 base model uses).
        n_tables = 1 if div_val == 1 else len(self.bounds)
        widths = cluster_widths(d_embed, len(self.bounds), div_val)[:n_tables]
        sizes = [vocab_size] if div_val == 1 else [hi - lo for lo, hi in self.bounds]
        self.tables = nn.ModuleList(nn.Embedding(n, w) for n, w in zip(sizes, widths))
        self.projs = nn.ParameterList(
            nn.Parameter(torch.empty(d_proj, w)) if w != d_proj else nn.Parameter(torch.empty(0)) for w in widths
        )
        for table in self.tables:
            nn.init.normal_(table.weight, 0.0, init_std)
        for proj in self.projs:
            if proj.numel():
                nn.init.normal_(proj, 0.0, init_std)

    def _project(self, x: Tensor, i: int) -> Tensor:
        proj = self.projs[i]
        return F.linear(x, proj) if proj.numel() else x

    def forward(self, tokens: Tensor) -> Tensor:
        if len(self.tables) == 1:
            return self._project(self.tables[0](tokens), 0) * self.scale
        flat = tokens.reshape(-1)
        out = self.tables[0].weight.new_zeros(flat.shape[0], self.d_proj)
        for i, (lo, hi) in enumerate(self.bounds):
            idx = ((flat >= lo) & (flat < hi)).nonzero(as_tuple=True)[0]
            if idx.numel():
                out = out.index_copy(0, idx, self._project(self.tables[i](flat[idx] - lo), i).to(out.dtype))
        return out.view(*tokens.shape, self.d_proj) * self.scale


class AdaptiveLogSoftmax(nn.Module):
    """hidden [B, N, D] -> per-token NLL [B, N] (0 where target is -100) and, when asked, log-probs [B, N, V].

    Output weights may be tied to an AdaptiveEmbedding (tables and projections); biases and the head's cluster
    logits are always its own.
    """

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int, init_std: float):
        super().__init__()
        self.vocab_size = vocab_size
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.n_clusters = len(self.bounds)
        self.shortlist = self.bounds[0][1]
        self.div_val = div_val
        widths = cluster_widths(d_embed, self.n_clusters, div_val)
        n_tables = 1 if div_val == 1 else self.n_clusters
        sizes = [vocab_size] if div_val == 1 else [hi - lo for lo, hi in self.bounds]
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(n, w)) for n, w in zip(sizes, widths[:n_tables]))
        self.projs = nn.ParameterList(
            nn.Parameter(torch.empty(d_proj, w)) if w != d_proj else nn.Parameter(torch.empty(0))
            for w in widths[:n_tables]
        )
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters - 1, widths[0]))
        self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters - 1))
        for p in list(self.weights) + [p for p in self.projs if p.numel()]:
            nn.init.normal_(p, 0.0, init_std)

    def tie_to(self, embedding: AdaptiveEmbedding) -> None:
        """Share the embedding tables and projections (Transformer-XL's tie_weight with tied projections)."""
        for i, table in enumerate(embedding.tables):
            self.weights[i] = table.weight
            self.projs[i] = embedding.projs[i]

    def _project_in(self, hidden: Tensor, table: int) -> Tensor:
        """hidden [T, D] -> [T, width of table]: the projection into an output table's embedding space."""
        proj = self.projs[table]
        return F.linear(hidden, proj.t()) if proj.numel() else hidden

    def _cluster_logits(self, projected: Tensor, i: int) -> Tensor:
        """Logits over cluster i's own tokens from its projected hidden states [T, w_i] -> [T, size_i]."""
        lo, hi = self.bounds[i]
        if self.div_val == 1:  # one table: cluster i is a slice of it
            return F.linear(projected, self.weights[0][lo:hi], self.bias[lo:hi])
        return F.linear(projected, self.weights[i], self.bias[lo:hi])

    def _tail_input(self, hidden: Tensor, head_input: Tensor, i: int) -> Tensor:
        """With one table every cluster shares the head's projection: reuse it instead of recomputing."""
        return head_input if self.div_val == 1 else self._project_in(hidden, i)

    def _head_logprobs(self, head_input: Tensor) -> Tensor:
        """[T, w_0] -> [T, shortlist + C - 1]: shortlist tokens, then one logit per tail cluster."""
        logits = self._cluster_logits(head_input, 0)
        if self.n_clusters > 1:
            logits = torch.cat([logits, F.linear(head_input, self.cluster_weight, self.cluster_bias)], dim=-1)
        return F.log_softmax(logits.float(), dim=-1)

    def forward(self, hidden: Tensor, targets: Tensor | None, want_logprobs: bool) -> tuple[Tensor | None, Tensor | None]:
        B, N, D = hidden.shape
        flat = hidden.reshape(B * N, D)
        head_input = self._project_in(flat, 0)
        head = self._head_logprobs(head_input)  # [T, shortlist + C - 1]
        logprobs = self._full_logprobs(flat, head_input, head).view(B, N, self.vocab_size) if want_logprobs else None
        if targets is None:
            return None, logprobs
        tgt = targets.reshape(-1)
        if logprobs is not None:
            nll = -logprobs.view(B * N, -1).gather(1, tgt.clamp(min=0)[:, None]).squeeze(1)
        else:
            nll = self._target_nll(flat, head_input, head, tgt)
        return nll.masked_fill(tgt < 0, 0.0).view(B, N), logprobs

    def _target_nll(self, flat: Tensor, head_input: Tensor, head: Tensor, tgt: Tensor) -> Tensor:
        """Only the clusters that hold a target are evaluated, and only on those positions."""
        safe = tgt.clamp(min=0)
        in_head = safe < self.shortlist
        nll = -head.gather(1, torch.where(in_head, safe, 0)[:, None]).squeeze(1)
        nll = torch.where(in_head, nll, torch.zeros_like(nll))
        for i in range(1, self.n_clusters):
            lo, hi = self.bounds[i]
            idx = ((safe >= lo) & (safe < hi)).nonzero(as_tuple=True)[0]
            if not idx.numel():
                continue
            tail_input = self._tail_input(flat[idx], head_input[idx], i)
            tail = F.log_softmax(self._cluster_logits(tail_input, i).float(), dim=-1)
            tok = tail.gather(1, (safe[idx] - lo)[:, None]).squeeze(1)
            nll = nll.index_put((idx,), -(head[idx, self.shortlist + i - 1] + tok))
        return nll

    def _full_logprobs(self, flat: Tensor, head_input: Tensor, head: Tensor) -> Tensor:
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters):
            tail = F.log_softmax(self._cluster_logits(self._tail_input(flat, head_input, i), i).float(), dim=-1)
            parts.append(head[:, self.shortlist + i - 1 : self.shortlist + i] + tail)
        return torch.cat(parts, dim=-1)
