"""Associative Recurrent Memory Transformer (ARMT; Rodkin et al., 2024): RMT's memory tokens write, through the
delta rule, into an associative matrix per layer, which every row of the next segments reads.

Shape letters (models/shapes.md): B lanes, N segment length, R memory tokens, Q queries (the N + R rows, [tokens N
| memory R]), L layers, D model width, d associative key width (assoc_dim, before the feature map), F feature width
(2 nu d, after it), H heads, E head width.

Rows are [tokens N | memory R], causal: the memory tokens at the end see the whole segment, the tokens never see
them. The memory tokens' inputs are the learned `memory_init` [R, D] in every segment: as in the authors' code
(RodkinIvan/associative-recurrent-memory-transformer, modeling_amt/language_modeling.py), their outputs are not
carried to the next segment as RMT's are. What carries over is, per layer l, the associative state: A [B, F, D]
(stored as the paper's A transposed) and z [B, F].

Layer l on a segment (the paper's eqs. 1-4; the epsilon, the clip and the detached gamma are the authors' code's):
  read, before the layer, every row h:   h <- h + phi(W_q h)^T A / (z^T phi(W_q h) + eps)
  the layer (Transformer-XL relative attention + FFN) on the rows;
  write, from the memory rows' outputs m_i, i = 1..R, all against the state before this segment:
      k_i = phi(W_k m_i), v_i = W_v m_i, beta_i = sigmoid(w_b . m_i + b_b)
      vbar_i = A^T k_i / (z^T k_i + eps)          the value already stored under k_i
      gamma_i = clip(1 - (z^T k_i + eps) / (|k_i|^2 + eps), 0, 1), detached
      A <- A + sum_i beta_i k_i (v_i - vbar_i)^T,  z <- z + sum_i gamma_i k_i
phi is DPFP (Schlag et al., 2021) with nu = 3: x' = [relu(x), relu(-x)], phi(x) = [x', x', x'] * [roll(x', 1),
roll(x', 2), roll(x', 3)]. A lane with an empty state (a fresh lane, a document start) has A = 0 and z = 0: its
reads are exactly 0 and its first write takes gamma = 1, as the authors' first segment does. W_v starts at zero
(the authors', model.assoc_value_init_std: 0), so a new model is the backbone until W_v learns.

Gradients flow through A and z across segments, as far back as the caller chains the state without cutting it
(`ARMTMemory.detached()`): the trainer's BPTT schedules (trainer/loop/recurrence.py) replay the last bptt_depth
segments, or run chunks of bptt_depth + 1, as for RMT. The authors backpropagate through every segment of a sample.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import causal_index, relative_encodings
from .backbone import Backbone, LayerInputs
from .flops import layer_dims, matmul_flops
from .head_plan import TailPlan
from .mask_layout import causal_layout
from .output import ModelOutput, cut, map_memory
from .txl import TXLDecoder
from .txl import layer_flops as txl_layer_flops

EPS = 1e-5  # the authors' epsilon in both denominators
DPFP_NU = 3


@dataclass
class ARMTMemory:
    assoc: list[Tensor]  # L x [B, F, D] the associative matrices (A transposed), in the graph as the caller left them
    norm: list[Tensor]  # L x [B, F] the normalisers z
    fresh: Tensor  # [B] bool: the lane's state is empty (its next write takes gamma = 1)
    # Fields checkpoints of older memlm saved in this state, dropped when one is resumed: the model's count of its
    # BPTT transitions, and an empty Transformer-XL cache the trainer's window once needed (it is optional now)
    retired_fields: ClassVar[tuple[str, ...]] = ("transitions", "cache")

    @property
    def key_valid(self) -> Tensor:
        """[B, 0]: no cached keys; the associative state is read by every row (the memory interface)."""
        return self.fresh.new_zeros(self.fresh.shape[0], 0)

    def detached(self) -> "ARMTMemory":
        """The state cut from the autograd graph."""
        return map_memory(cut, self)


def dpfp(x: Tensor, nu: int = DPFP_NU) -> Tensor:
    """Deterministic parameter-free projection: [..., d] -> [..., 2 nu d], non-negative."""
    x = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    return torch.cat([x] * nu, dim=-1) * torch.cat([torch.roll(x, j, dims=-1) for j in range(1, nu + 1)], dim=-1)


class AssociativeBlock(nn.Module):
    """One layer's projections into and out of its associative state."""

    def __init__(self, cfg):
        super().__init__()
        D, d = cfg.d_model, cfg.assoc_dim
        self.query = nn.Linear(D, d, bias=False)
        self.key = nn.Linear(D, d, bias=False)
        self.value = nn.Linear(D, D, bias=False)
        self.beta = nn.Linear(D, 1)
        for linear in (self.query, self.key, self.beta):
            nn.init.normal_(linear.weight, 0.0, cfg.init_std)
        nn.init.zeros_(self.beta.bias)
        # The authors' zeros by default: a new model starts as its backbone
        nn.init.normal_(self.value.weight, 0.0, cfg.assoc_value_init_std) if cfg.assoc_value_init_std > 0 \
            else nn.init.zeros_(self.value.weight)

    def read(self, h: Tensor, assoc: Tensor, norm: Tensor) -> Tensor:
        """h [B, Q, D] -> what the state returns for each row [B, Q, D] (exactly 0 where the state is empty)."""
        q = dpfp(self.query(h))  # [B, Q, F]
        return torch.einsum("btf,bfd->btd", q, assoc) / (torch.einsum("btf,bf->bt", q, norm)[..., None] + EPS)

    def write(self, m: Tensor, assoc: Tensor, norm: Tensor, fresh: Tensor) -> tuple[Tensor, Tensor]:
        """The memory rows' outputs m [B, R, D] into the state: the new (A [B, F, D], z [B, F])."""
        k = dpfp(self.key(m))  # [B, R, F]
        v = self.value(m)  # [B, R, D]
        beta = torch.sigmoid(self.beta(m))  # [B, R, 1]
        denominator = torch.einsum("brf,bf->br", k, norm) + EPS  # [B, R]
        stored = torch.einsum("brf,bfd->brd", k, assoc) / denominator[..., None]  # vbar [B, R, D]
        gamma = (1 - denominator / (k.pow(2).sum(-1) + EPS)).clamp(0, 1).detach()
        gamma = torch.where(fresh[:, None], torch.ones_like(gamma), gamma)  # the first write: gamma = 1
        assoc = assoc + torch.einsum("brf,brd->bfd", k, beta * (v - stored))
        norm = norm + torch.einsum("br,brf->bf", gamma, k)
        return assoc, norm


class AssociativeRMT(Backbone):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.learned.add("memory_init", (cfg.num_mem_tokens, cfg.d_model), cfg.init_std)
        self.assoc = nn.ModuleList(AssociativeBlock(cfg) for _ in range(cfg.n_layer))

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> ARMTMemory:
        cfg = self.cfg
        B, width = batch_size, 2 * DPFP_NU * cfg.assoc_dim
        return ARMTMemory(
            assoc=[torch.zeros(B, width, cfg.d_model, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
            norm=[torch.zeros(B, width, device=device, dtype=dtype) for _ in range(cfg.n_layer)],
            fresh=torch.ones(B, dtype=torch.bool, device=device),
        )

    def state_in(self, memory: ARMTMemory, reset: Tensor | None, dtype) -> tuple[list, list, Tensor]:
        """The state this segment reads: empty for fresh or reset lanes. -> (A per layer, z per layer, fresh [B])."""
        fresh = memory.fresh if reset is None else memory.fresh | reset.to(memory.fresh.device)
        keep = (~fresh).to(dtype)
        return ([a.to(dtype) * keep[:, None, None] for a in memory.assoc],
                [z.to(dtype) * keep[:, None] for z in memory.norm], fresh)

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: ARMTMemory,
        reset: Tensor | None = None,  # [B] bool
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan: TailPlan | None = None,  # head_plan.tail_plan(targets) built on the host
    ) -> ModelOutput:
        cfg = self.cfg
        B, N = tokens.shape
        R = cfg.num_mem_tokens
        x = self.embed(tokens)  # [B, N, D]
        learned = self.learned.fetch()
        assoc, norm, fresh = self.state_in(memory, reset, x.dtype)
        h = self.drop(torch.cat([x, learned["memory_init"].to(x.dtype)[None].expand(B, -1, -1)], dim=1))  # [B, Q, D]
        none = fresh.new_zeros(B, 0)
        layout = causal_layout(N + R, 0, none, False)
        allowed = layout.allowed  # [B, Q, Q]
        kernel_mask = self.kernel_mask(layout)
        pos_index = causal_index(N + R, 0, tokens.device)  # [Q, Q]
        r = self.drop(relative_encodings(torch.arange(N + R, device=tokens.device), cfg.d_model, cfg.clamp_len,
                                         h.dtype))
        empty = h[:, :0]  # [B, 0, D]: no cache
        inputs = LayerInputs(r, pos_index, allowed, kernel_mask, None, learned["bias_u"], learned["bias_v"], None)
        new_assoc, new_norm = [], []
        for l in range(cfg.n_layer):
            h = h + self.assoc[l].read(h, assoc[l], norm[l])
            h = self.run_layer(l, h, empty, inputs)
            a, z = self.assoc[l].write(h[:, N:], assoc[l], norm[l], fresh)
            new_assoc.append(a)
            new_norm.append(z)

        nll, logits = self.predict(h[:, :N], targets, return_logits, tail_plan)
        new_memory = ARMTMemory(assoc=new_assoc, norm=new_norm, fresh=torch.zeros_like(fresh))
        return ModelOutput(nll=nll, logits=logits, memory=new_memory)


# ---------------------------------------------------------------------------------------------------------------
# What the registry entry names besides the model: FLOPs (models/flops.py's conventions), parameters, decoder


def layer_flops(cfg, batch_size: int) -> tuple[dict[str, float], int]:
    """ARMT: Transformer-XL's layers over T = N + R rows with no cache (the head scores the N tokens), plus per
    layer the associative read of every row and the write of the R memory rows ("associative"). DPFP, the norms
    and the gates' nonlinearities are elementwise and not counted."""
    D, _, _, L, N, _, mm = layer_dims(cfg)
    R, d = cfg.num_mem_tokens, cfg.assoc_dim
    width = 2 * DPFP_NU * d
    seg, _ = txl_layer_flops(replace(cfg, tgt_len=N + R, mem_len=0), batch_size)
    T = N + R
    read = mm(T, D, d) + mm(T, width, D) + mm(T, width, 1)  # W_q; A; z
    write = mm(R, D, d) + mm(R, D, D) + mm(R, D, 1)  # W_k, W_v, w_b
    write += mm(R, width, 1) + mm(R, width, D) + matmul_flops(width, R, D) + matmul_flops(1, R, width)
    seg["associative"] = L * (read + write)
    return seg, N


def extra_params(cfg) -> int:
    """Per layer W_q, W_k [d, D], W_v [D, D], w_b and its bias; and the memory tokens' inputs [R, D]."""
    D = cfg.d_model
    return cfg.n_layer * (2 * cfg.assoc_dim * D + D * D + D + 1) + cfg.num_mem_tokens * D


class ARMTDecoder(TXLDecoder):
    """ARMT: Transformer-XL's decoder with no cache, each layer's input first adding its associative read. The
    state is fixed for the segment (the model writes after it), and the memory rows come after every token, so
    the tokens' logits need neither."""

    def begin(self, memory) -> None:
        super().begin(memory)
        dtype = self.keys[0].dtype
        assoc, norm, _ = self.model.state_in(memory, None, dtype)
        self.assoc, self.norm = assoc, norm

    def layer_input(self, l: int, h: Tensor) -> Tensor:
        return h + self.model.assoc[l].read(h, self.assoc[l], self.norm[l])
