"""Adaptive input embedding and adaptive softmax (Baevski & Auli 2019; Grave et al. 2017), as Transformer-XL uses
them for WikiText-103. With no cutoffs both reduce to one embedding table and one full softmax.

Shape letters (models/shapes.md): B lanes, N segment length (the positions), D model width (d_proj), V vocabulary,
V_0 shortlist (cutoffs[0]), V_i vocabulary of tail cluster i, Z clusters (len(cutoffs) + 1: the head and Z - 1
tails), D_0 head's input width, D_i input width of tail cluster i, T rows of a flattened batch.
The vocabulary is split at the cutoffs into a head shortlist [0, c0) and tail clusters [c0, c1), [c1, c2), ...;
cluster i has embedding width d_embed // div_val**i and a projection to/from D when that width differs from D.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adaptive_nll import HeadLayout, adaptive_nll, head_index
from .head_plan import TailPlan, tail_plan
from .softmax_nll import fits, linear_softmax_nll


def cluster_bounds(vocab_size: int, cutoffs: list[int]) -> list[tuple[int, int]]:
    edges = [0] + list(cutoffs) + [vocab_size]
    return list(zip(edges[:-1], edges[1:]))


def cluster_widths(d_embed: int, n_clusters: int, div_val: int) -> list[int]:
    if div_val == 1:
        return [d_embed] * n_clusters
    return [d_embed // div_val**i for i in range(n_clusters)]


def add_projections(module: nn.Module, widths: list[int], d_proj: int, init_std: float) -> None:
    """Register `proj{i}` [d_proj, w] for each table whose width w differs from d_proj.

    They are direct parameters of the module that uses them (no ParameterList/Dict child), because ZeRO-3 gathers
    a module's own parameters when its forward runs and would leave a child container's partitioned.
    """
    module.n_tables = len(widths)
    for i, w in enumerate(widths):
        if w != d_proj:
            setattr(module, f"proj{i}", nn.Parameter(torch.empty(d_proj, w).normal_(0.0, init_std)))


def table_projections(module: nn.Module) -> list[nn.Parameter | None]:
    """Per table: its [d_proj, width] projection, or None where the width already is d_proj."""
    return [getattr(module, f"proj{i}", None) for i in range(module.n_tables)]


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
        add_projections(self, widths, d_proj, init_std)
        for table in self.tables:
            nn.init.normal_(table.weight, 0.0, init_std)

    @property
    def projs(self) -> list[nn.Parameter | None]:
        return table_projections(self)

    def _project(self, x: Tensor, i: int) -> Tensor:
        proj = self.projs[i]
        return x if proj is None else F.linear(x, proj)

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

    def __init__(self, vocab_size: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int, init_std: float,
                 head_loss: str = "auto"):
        super().__init__()
        self.vocab_size = vocab_size
        self.head_loss = head_loss  # model.head_loss: how the training NLL's head part is computed
        self.bounds = cluster_bounds(vocab_size, cutoffs)
        self.n_clusters = len(self.bounds)
        self.shortlist = self.bounds[0][1]
        self.div_val = div_val
        widths = cluster_widths(d_embed, self.n_clusters, div_val)
        n_tables = 1 if div_val == 1 else self.n_clusters
        sizes = [vocab_size] if div_val == 1 else [hi - lo for lo, hi in self.bounds]
        for i, (n, w) in enumerate(zip(sizes, widths[:n_tables])):  # direct parameters: see add_projections
            setattr(self, f"weight{i}", nn.Parameter(torch.empty(n, w).normal_(0.0, init_std)))
        add_projections(self, widths[:n_tables], d_proj, init_std)
        self.layout = HeadLayout.of(self.bounds, div_val)  # the chunked path's static description (Python ints)
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        # Tail-cluster logits of the head; absent without cutoffs (zero-size parameters break ZeRO-3 partitioning).
        if self.n_clusters > 1:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters - 1, widths[0]))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters - 1))

    @property
    def weights(self) -> list[nn.Parameter]:
        """Per table: its output weights [size, width]."""
        return [getattr(self, f"weight{i}") for i in range(self.n_tables)]

    @property
    def projs(self) -> list[nn.Parameter | None]:
        return table_projections(self)

    def tie_to(self, embedding: AdaptiveEmbedding) -> None:
        """Share the embedding tables and projections (Transformer-XL's tie_weight with tied projections)."""
        for i, table in enumerate(embedding.tables):
            setattr(self, f"weight{i}", table.weight)
        for i, proj in enumerate(embedding.projs):
            if proj is not None:
                setattr(self, f"proj{i}", proj)

    def _project_in(self, hidden: Tensor, table: int) -> Tensor:
        """hidden [T, D] -> [T, width of table]: the projection into an output table's embedding space."""
        proj = self.projs[table]
        return hidden if proj is None else F.linear(hidden, proj.t())

    def _cluster_logits(self, projected: Tensor, i: int) -> Tensor:
        """Logits over cluster i's own tokens from its projected hidden states [T, D_i] -> [T, V_i]."""
        lo, hi = self.bounds[i]
        if self.div_val == 1:  # one table: cluster i is a slice of it
            return F.linear(projected, _rows(self.weights[0], lo, hi), _rows(self.bias, lo, hi))
        return F.linear(projected, self.weights[i], _rows(self.bias, lo, hi))

    def _tail_input(self, hidden: Tensor, head_input: Tensor, i: int) -> Tensor:
        """With one table every cluster shares the head's projection: reuse it instead of recomputing."""
        return head_input if self.div_val == 1 else self._project_in(hidden, i)

    def _head_logprobs(self, head_input: Tensor) -> Tensor:
        """[T, D_0] -> [T, V_0 + Z - 1]: shortlist tokens, then one logit per tail cluster."""
        logits = self._cluster_logits(head_input, 0)
        if self.n_clusters > 1:
            logits = torch.cat([logits, F.linear(head_input, self.cluster_weight, self.cluster_bias)], dim=-1)
        return F.log_softmax(logits.float(), dim=-1)

    def forward(self, hidden: Tensor, targets: Tensor | None, want_logprobs: bool,
                plan: TailPlan | None = None) -> tuple[Tensor | None, Tensor | None]:
        """plan: which rows each tail cluster scores (head_plan.tail_plan of these targets, built on the host): with
        it the chunked NLL has no host sync and compiles whole. Read only by the chunked NLL (training); without it
        that path finds the rows itself (one sync per tail cluster)."""
        B, N, D = hidden.shape
        flat = hidden.reshape(B * N, D)
        head_input = self._project_in(flat, 0)
        if targets is not None and not want_logprobs and self._chunked(hidden.device):
            return self._target_nll_chunked(flat, head_input, targets.reshape(-1), plan).view(B, N), None
        if targets is not None and not want_logprobs and self.n_clusters == 1 and fits(head_input, self.weights[0]):
            # one fp32 softmax: its gradient's [T, V] part formed in forward, while the logits are in the cache
            tgt = targets.reshape(-1)
            nll = linear_softmax_nll(head_input, self.weights[0], self.bias, tgt.clamp(min=0))
            return nll.masked_fill(tgt < 0, 0.0).view(B, N), None
        head = self._head_logprobs(head_input)  # [T, V_0 + Z - 1]
        logprobs = self._full_logprobs(flat, head_input, head).view(B, N, self.vocab_size) if want_logprobs else None
        if targets is None:
            return None, logprobs
        tgt = targets.reshape(-1)
        if logprobs is not None:
            nll = -logprobs.view(B * N, -1).gather(1, tgt.clamp(min=0)[:, None]).squeeze(1)
        else:
            nll = self._target_nll(flat, head_input, head, tgt)
        return nll.masked_fill(tgt < 0, 0.0).view(B, N), logprobs

    def _chunked(self, device: torch.device) -> bool:
        return self.head_loss == "chunked" or (self.head_loss == "auto" and device.type == "cuda")

    def _target_nll_chunked(self, flat: Tensor, head_input: Tensor, tgt: Tensor, plan: TailPlan | None) -> Tensor:
        """The head and the tails in tiles (adaptive_nll.py): no [T, V_i] logits held whole, each tail only on the
        rows the plan gives it, one gradient per table."""
        safe = tgt.clamp(min=0)
        rows = self._planned_rows(safe, plan) if self.n_clusters > 1 else ()
        tail_xs = [] if self.layout.shared_input else [self._project_in(flat.index_select(0, r.clamp(min=0)), i)
                                                       for i, r in enumerate(rows, start=1)]
        cluster = (self.cluster_weight, self.cluster_bias) if self.n_clusters > 1 else (None, None)
        nll = adaptive_nll(self.layout, head_input, safe, self.bias, *cluster, self.weights, rows, tail_xs)
        return nll.masked_fill(tgt < 0, 0.0)

    def _planned_rows(self, safe: Tensor, plan: TailPlan | None) -> tuple[Tensor, ...]:
        """Per tail cluster, the rows it scores: the plan's, checked on the device against the targets (no sync: a
        plan from other targets stops the run at its next sync instead of training on a wrong loss), or found here."""
        if plan is None:
            return _find_tail_nll_rows(safe, self.bounds).rows
        if plan.bounds != tuple(self.bounds[1:]):
            raise ValueError(f"tail plan for clusters {plan.bounds}, the head has {tuple(self.bounds[1:])}")
        for (lo, hi), rows in zip(plan.bounds, plan.rows):
            read, real = rows.clamp(min=0), rows >= 0
            target = safe.index_select(0, read)
            inside = (safe >= lo) & (safe < hi)
            torch._assert_async(((~real) | ((target >= lo) & (target < hi))).all()
                                & (real.sum() == inside.sum()), "tail plan does not match the targets")
        return plan.rows

    def _target_nll(self, flat: Tensor, head_input: Tensor, head: Tensor, tgt: Tensor) -> Tensor:
        """Only the clusters that hold a target are evaluated, and only on those positions."""
        safe = tgt.clamp(min=0)
        nll = -head.gather(1, head_index(safe, self.layout)[:, None]).squeeze(1)  # its own column or its cluster's
        return nll + self._tail_nll(flat, head_input, safe) if self.n_clusters > 1 else nll

    @torch.compiler.disable
    def _tail_nll(self, flat: Tensor, head_input: Tensor, safe: Tensor) -> Tensor:
        """[T]: -log p(token | its tail cluster) for targets in a tail cluster, 0 for the others; each cluster's
        softmax only on its own rows. Never compiled: how many rows a cluster gets changes every batch, and in a
        compiled graph that would be a recompile (or a host sync inside it) per step. Called only when there are
        tail clusters: a plain softmax compiles without a break."""
        nll = torch.zeros(safe.shape, dtype=torch.float32, device=safe.device)
        for i in range(1, self.n_clusters):
            lo, hi = self.bounds[i]
            idx = ((safe >= lo) & (safe < hi)).nonzero(as_tuple=True)[0]
            if not idx.numel():
                continue
            tail_input = self._tail_input(flat[idx], head_input[idx], i)
            tail = F.log_softmax(self._cluster_logits(tail_input, i).float(), dim=-1)
            tok = tail.gather(1, (safe[idx] - lo)[:, None]).squeeze(1)
            nll = nll.index_put((idx,), -tok)
        return nll

    def _full_logprobs(self, flat: Tensor, head_input: Tensor, head: Tensor) -> Tensor:
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters):
            tail = F.log_softmax(self._cluster_logits(self._tail_input(flat, head_input, i), i).float(), dim=-1)
            parts.append(head[:, self.shortlist + i - 1 : self.shortlist + i] + tail)
        return torch.cat(parts, dim=-1)


def _rows(t: Tensor, lo: int, hi: int) -> Tensor:
    """t[lo:hi], or t itself when that is all of it (one softmax over the whole vocabulary): a slice's backward
    zero-fills a gradient of t's whole size and copies the slice's into it, a [V, D] write and copy per step."""
    return t if lo == 0 and hi == t.shape[0] else t[lo:hi]


@torch.compiler.disable
def _find_tail_nll_rows(safe: Tensor, bounds: list[tuple[int, int]]) -> TailPlan:
    """No plan given: find each tail's rows on the device (`nonzero`, one host sync per tail cluster). Outside
    torch.compile (data-dependent sizes); its rows are marked dynamic, so the graph after it is not recompiled for
    each new count."""
    return tail_plan(safe, [lo for lo, _ in bounds[1:]], bounds[-1][1], host=False)
