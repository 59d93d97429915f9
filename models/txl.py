"""Transformer-XL (Dai et al. 2019) and the no-memory Transformer+RPE baseline (the same model with mem_len 0).

Shape letters (models/shapes.md): B lanes, N segment length, M memory length, X cached rows (M here; the
Compressive Transformer's decoder adds its slots), K keys (X + N), P relative distances, L layers, D model width,
H heads, E head width.

Per layer the cache holds the layer *inputs* of the last M positions, detached (stop-gradient); keys and values
of memory positions are recomputed with the current weights. Memory is fixed-size: slots that hold nothing
(start of a document, after a reset) are masked out through `valid`, never zero-filled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import causal_allowed, causal_index, relative_encodings
from .backbone import Backbone, LayerInputs
from .decoders import SegmentDecoder
from .flops import layer_dims, segment_components
from .head_plan import TailPlan
from .mask_layout import causal_layout
from .output import ModelOutput, cut, map_memory


@dataclass
class TXLMemory:
    hidden: list[Tensor]  # L x [B, M, D] layer inputs of the last M positions (detached)
    valid: Tensor  # [B, M] bool: slot holds a real position of the current document

    @property
    def key_valid(self) -> Tensor:
        """[B, X] bool: which cached keys a segment's queries may read, in key order (the memory interface)."""
        return self.valid

    def detached(self) -> "TXLMemory":
        """The state cut from the autograd graph (the memory interface every arch's state has)."""
        return map_memory(torch.Tensor.detach, self)


def reset_valid(valid: Tensor, reset: Tensor | None) -> Tensor:
    """Empty the memory of lanes that start a new document: [B, M] -> [B, M]."""
    if reset is None:
        return valid
    return valid & ~reset.to(valid.device)[:, None]


def last_rows(mem: Tensor, h: Tensor, n: int) -> Tensor:
    """The last n rows of cat([mem, h], dim=1) ([B, M, D], [B, N, D] -> [B, n, D]), without the concatenation
    when h alone holds them."""
    if h.shape[1] >= n:
        return h[:, h.shape[1] - n :]
    return torch.cat([mem[:, mem.shape[1] - (n - h.shape[1]) :], h], dim=1)


def roll_valid(valid: Tensor, n_new: int, mem_len: int) -> Tensor:
    """Append n_new real positions and keep the last mem_len slots, contiguous: a slice of the concatenation has
    another stride than the state it replaces, and a compiled forward guards on strides (one recompile of the whole
    model at the second segment)."""
    if mem_len == 0:  # an empty slice keeps its source's strides, and `contiguous` leaves an empty tensor as it is
        return valid.new_zeros(valid.shape[0], 0)
    rolled = torch.cat([valid, valid.new_ones(valid.shape[0], n_new)], dim=1)[:, valid.shape[1] + n_new - mem_len :]
    return rolled.contiguous()


class TransformerXL(Backbone):
    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> TXLMemory:
        M, D = self.cfg.mem_len, self.cfg.d_model
        return TXLMemory(
            hidden=[torch.zeros(batch_size, M, D, device=device, dtype=dtype) for _ in range(self.cfg.n_layer)],
            valid=torch.zeros(batch_size, M, dtype=torch.bool, device=device),
        )

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: TXLMemory,
        reset: Tensor | None = None,  # [B] bool
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan: TailPlan | None = None,  # head_plan.tail_plan(targets) built on the host
    ) -> ModelOutput:
        cfg = self.cfg
        B, N = tokens.shape
        M = cfg.mem_len
        valid = reset_valid(memory.valid, reset)
        h = self.embed_tokens(tokens)  # [B, N, D]

        layout = causal_layout(N, M, valid, cfg.same_length)
        allowed = layout.allowed  # [B, N, K]
        kernel_mask = self.kernel_mask(layout)  # None on the einsum path
        pos_index = causal_index(N, M, tokens.device)  # [N, K]
        r = self.drop(relative_encodings(torch.arange(M + N, device=tokens.device), cfg.d_model, cfg.clamp_len,
                                         h.dtype))

        learned = self.learned.fetch()
        inputs = LayerInputs(r, pos_index, allowed, kernel_mask, layout.offset, learned["bias_u"], learned["bias_v"],
                             "causal")
        new_hidden = []
        for l in range(cfg.n_layer):
            mem_in = memory.hidden[l].to(h.dtype)  # [B, M, D]
            if M:
                new_hidden.append(cut(last_rows(mem_in, h, M)))
            h = self.run_layer(l, h, mem_in, inputs)

        nll, logits = self.predict(h, targets, return_logits, tail_plan)
        new_memory = TXLMemory(hidden=new_hidden if M else memory.hidden, valid=roll_valid(valid, N, M))
        return ModelOutput(nll=nll, logits=logits, memory=new_memory)


# ---------------------------------------------------------------------------------------------------------------
# What the registry entry names besides the model: FLOPs (models/flops.py's conventions), parameters, decoder


def layer_flops(cfg, batch_size: int) -> tuple[dict[str, float], int]:
    """Transformer-XL (and the memoryless Transformer, M = 0): N queries over K = M + N keys per layer."""
    D, A, F_, L, N, M, mm = layer_dims(cfg)
    seg = segment_components()
    K = M + N
    for _ in range(L):
        seg["attn_proj"] += mm(N, D, A) + 2 * mm(K, D, A) + mm(N, A, D)  # q (current), k v (all keys), output
        seg["pos_proj"] += mm(K, D, A) / batch_size  # W_R R(0..K-1), shared by the batch
        seg["attn_content"] += mm(N, A, K)
        seg["attn_position"] += mm(N, A, K)  # distance slots 0..K-1
        seg["attn_context"] += mm(N, K, A)
        seg["ffn"] += 2 * mm(N, D, F_)
    return seg, N


class TXLDecoder(SegmentDecoder):
    """Transformer-XL and the no-memory baseline (M = 0): memory keys come from the cached layer inputs. An arch
    whose cache holds more rows before them (the Compressive Transformer's slots) names them in `cached_rows`."""

    def cached_rows(self, memory, l: int) -> Tensor:
        """Layer l's X cached rows [B, X, D] in key order (memory.key_valid's)."""
        return memory.hidden[l]

    def begin(self, memory) -> None:
        cfg, model = self.cfg, self.model
        key_valid = memory.key_valid  # [B, X]
        (B, P), N, device = key_valid.shape, cfg.tgt_len, key_valid.device  # P: X, the cached rows
        dtype = next(model.parameters()).dtype
        self.t = 0
        self._buffers(B, P, device, dtype)
        self.allowed = causal_allowed(N, P, key_valid, cfg.same_length)  # [B, N, X + N]
        self.index = causal_index(N, P, device)  # [N, X + N]
        r = relative_encodings(torch.arange(P + N, device=device), cfg.d_model, cfg.clamp_len, dtype)
        self.r_k = [layer.attn.project_positions(r) for layer in model.layers]
        self.bias = self._biases()
        if P:
            for l, layer in enumerate(model.layers):
                _, k, v = layer.attn.project(layer.attn_input(self.cached_rows(memory, l).to(dtype)), n_query=0)
                self.keys[l][:, :P], self.values[l][:, :P] = k, v

    def extend(self, tokens: Tensor) -> Tensor:
        Q = tokens.shape[1]
        self._check_room(Q)
        h = self._causal_layers(self.model.embed_tokens(tokens), slice(self.t, self.t + Q), self.allowed, self.index)
        self.t += Q
        return self._logp(h)
