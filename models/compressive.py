"""Compressive Transformer (Rae et al., 2020): Transformer-XL's memory plus a compressed memory.

Shape letters (models/shapes.md): B lanes, N segment length, M memory length, C compressed slots, c compression
rate (N / c slots per segment), X cached rows (C + M, a query reads them besides the segment), K keys, L layers,
D model width, H heads, E head width.

Per layer l the state holds the layer inputs of the last M positions (Transformer-XL's memory) and C compressed
slots. A segment pushes N rows out of [memory | segment] (the oldest N); they are compressed at rate c (a 1D
convolution of kernel and stride c, the paper's best, or mean / max pooling) into N / c slots appended to the
compressed memory, whose oldest slots leave. Every layer attends over [compressed C | memory M | segment N] with
Transformer-XL's relative positions, a compressed slot counting as one position. A slot is valid when all c rows
it compresses were positions of the current document; a reset empties both memories.

The compression is trained by the attention-reconstruction loss alone: the memories are stop-gradient (as in
Transformer-XL), so the language-model loss never reaches it. Per layer, the loss is the squared error between the
layer's content attention (no position term) of its input over the evicted rows and over their compression, with
stop-gradient into the input, the evicted rows and the layer's own weights (the paper's Algorithm 2); summed over
layers, averaged over elements, weighted by compression_loss_weight, and returned as the output's aux_loss.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import RelativeLayer, causal_index, relative_encodings
from .backbone import Backbone, LayerInputs
from .flops import layer_dims
from .head_plan import TailPlan
from .mask_layout import causal_layout
from .output import ModelOutput, cut, map_memory
from .txl import TXLDecoder, reset_valid, roll_valid
from .txl import layer_flops as txl_layer_flops


@dataclass
class CompressiveMemory:
    hidden: list[Tensor]  # L x [B, M, D] layer inputs of the last M positions (detached)
    valid: Tensor  # [B, M] bool: slot holds a real position of the current document
    compressed: list[Tensor]  # L x [B, C, D] compressed slots, oldest first (detached)
    compressed_valid: Tensor  # [B, C] bool: slot compresses c real positions of the current document

    @property
    def key_valid(self) -> Tensor:
        """[B, X] bool: which cached keys a segment's queries may read, in key order (the memory interface)."""
        return torch.cat([self.compressed_valid, self.valid], dim=1)  # [compressed | memory]

    def detached(self) -> "CompressiveMemory":
        return map_memory(torch.Tensor.detach, self)


class Compressor(nn.Module):
    """f_c: [B, N, D] rows -> [B, N / c, D] slots."""

    def __init__(self, d_model: int, rate: int, kind: str, init_std: float):
        super().__init__()
        self.rate, self.kind = rate, kind
        self.conv = nn.Conv1d(d_model, d_model, kernel_size=rate, stride=rate) if kind == "conv" else None
        if self.conv is not None:
            nn.init.normal_(self.conv.weight, 0.0, init_std)
            nn.init.zeros_(self.conv.bias)

    def forward(self, rows: Tensor) -> Tensor:
        x = rows.transpose(1, 2)  # [B, D, N]
        if self.kind == "conv":
            x = self.conv(x)
        elif self.kind == "mean":
            x = F.avg_pool1d(x, self.rate, self.rate)
        else:
            x = F.max_pool1d(x, self.rate, self.rate)
        return x.transpose(1, 2)


@contextlib.contextmanager
def weights_as_constants(module: nn.Module):
    """The module's parameters take no gradient inside (stop-gradient into the main network); inputs still do.
    Read through module calls, so ZeRO-3's gathering hooks run as usual."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


class CompressiveTransformer(Backbone):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.compressors = nn.ModuleList(Compressor(cfg.d_model, cfg.compression_rate, cfg.compression, cfg.init_std)
                                         for _ in range(cfg.n_layer))

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> CompressiveMemory:
        cfg = self.cfg
        zeros = lambda rows: [torch.zeros(batch_size, rows, cfg.d_model, device=device, dtype=dtype)  # noqa: E731
                              for _ in range(cfg.n_layer)]
        return CompressiveMemory(
            hidden=zeros(cfg.mem_len), valid=torch.zeros(batch_size, cfg.mem_len, dtype=torch.bool, device=device),
            compressed=zeros(cfg.compressed_len),
            compressed_valid=torch.zeros(batch_size, cfg.compressed_len, dtype=torch.bool, device=device),
        )

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: CompressiveMemory,
        reset: Tensor | None = None,  # [B] bool
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan: TailPlan | None = None,  # head_plan.tail_plan(targets) built on the host
    ) -> ModelOutput:
        cfg = self.cfg
        B, N = tokens.shape
        M, C, c = cfg.mem_len, cfg.compressed_len, cfg.compression_rate
        valid = reset_valid(memory.valid, reset)  # [B, M]
        compressed_valid = reset_valid(memory.compressed_valid, reset)  # [B, C]
        h = self.embed_tokens(tokens)  # [B, N, D]

        P = C + M  # X, the cached rows
        layout = causal_layout(N, P, torch.cat([compressed_valid, valid], dim=1), cfg.same_length)
        allowed = layout.allowed  # [B, N, X + N]
        kernel_mask = self.kernel_mask(layout)  # None on the einsum path
        pos_index = causal_index(N, P, tokens.device)  # [N, X + N]
        r = self.drop(relative_encodings(torch.arange(P + N, device=tokens.device), cfg.d_model, cfg.clamp_len,
                                         h.dtype))
        # The N rows leaving [memory | segment] this segment, and which of their slots compress real positions.
        leaving_valid = torch.cat([valid, valid.new_ones(B, N)], dim=1)[:, :N]  # [B, N]
        new_slots_valid = leaving_valid.view(B, N // c, c).all(dim=-1)  # [B, N / c]

        learned = self.learned.fetch()
        inputs = LayerInputs(r, pos_index, allowed, kernel_mask, None, learned["bias_u"], learned["bias_v"], "causal")
        new_hidden, new_compressed, reconstruction = [], [], []
        for l, layer in enumerate(self.layers):
            mem_in = memory.hidden[l].to(h.dtype)  # [B, M, D]
            compressed_in = memory.compressed[l].to(h.dtype)  # [B, C, D]
            rows = torch.cat([mem_in, h], dim=1)  # [B, M + N, D] this layer's inputs, oldest first
            leaving = rows[:, :N].detach()  # stop-gradient: the memory is
            slots = self.compressors[l](leaving)  # [B, N / c, D], in the compressor's graph only
            if M:
                new_hidden.append(cut(rows[:, N:]))
            new_compressed.append(cut(torch.cat([compressed_in, slots], dim=1)[:, -C:]))
            if self.training and cfg.compression_loss_weight > 0:
                reconstruction.append(self.reconstruction_error(layer, h, leaving, leaving_valid, slots,
                                                                new_slots_valid))
            h = self.run_layer(l, h, torch.cat([compressed_in, mem_in], dim=1), inputs)

        nll, logits = self.predict(h, targets, return_logits, tail_plan)
        new_memory = CompressiveMemory(
            hidden=new_hidden if M else memory.hidden, valid=roll_valid(valid, N, M),
            compressed=new_compressed,
            # contiguous: a compiled forward guards on strides, and a slice's differ from the state it replaces
            compressed_valid=torch.cat([compressed_valid, new_slots_valid], dim=1)[:, -C:].contiguous(),
        )
        aux = cfg.compression_loss_weight * torch.stack(reconstruction).sum() if reconstruction else None
        return ModelOutput(nll=nll, logits=logits, memory=new_memory, aux_loss=aux)

    def reconstruction_error(self, layer: RelativeLayer, h: Tensor, leaving: Tensor, leaving_valid: Tensor,
                             slots: Tensor, slots_valid: Tensor) -> Tensor:
        """Mean squared difference of the layer's content attention of h [B, N, D] over the evicted rows
        [B, N, D] and over their compression [B, N / c, D]; gradient only into `slots` (so the compressor)."""
        E = self.cfg.d_head
        with weights_as_constants(layer):
            q, _, _ = layer.attn.project(layer.attn_input(h.detach()))  # [B, N, H, E]
            q = q.detach()

            def content_attention(keys_in: Tensor, key_valid: Tensor) -> Tensor:
                _, k, v = layer.attn.project(layer.attn_input(keys_in), n_query=0)  # [B, K, H, E]
                scores = torch.einsum("bqhe,bkhe->bhqk", q, k).float() / math.sqrt(E)
                keep = key_valid[:, None, None, :]
                scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
                weights = torch.softmax(scores, dim=-1) * keep  # a lane with no valid key attends nowhere
                return torch.einsum("bhqk,bkhe->bqhe", weights.to(v.dtype), v)

            target = content_attention(leaving, leaving_valid).detach()
            got = content_attention(slots, slots_valid)
        return (got.float() - target.float()).pow(2).mean()


# ---------------------------------------------------------------------------------------------------------------
# What the registry entry names besides the model: FLOPs (models/flops.py's conventions), parameters, decoder


def layer_flops(cfg, batch_size: int) -> tuple[dict[str, float], int]:
    """Compressive Transformer: Transformer-XL over X = C + M cached rows, plus the compression of the N evicted
    rows per layer (a [c D] x [D] matmul per slot; pooling counts nothing). The attention-reconstruction loss is
    training-only and not counted, as the backward is not."""
    D, _, _, L, N, M, mm = layer_dims(cfg)
    seg, rows = txl_layer_flops(replace(cfg, mem_len=cfg.compressed_len + M), batch_size)
    if cfg.compression == "conv":
        seg["compression"] = L * mm(N // cfg.compression_rate, cfg.compression_rate * D, D)
    return seg, rows


def extra_params(cfg) -> int:
    """The compressor of every layer: a [D, D, c] convolution and its bias (pooling has none)."""
    return cfg.n_layer * (cfg.d_model * cfg.d_model * cfg.compression_rate + cfg.d_model) \
        if cfg.compression == "conv" else 0


class CompressiveDecoder(TXLDecoder):
    """Compressive Transformer: Transformer-XL's decoder over X = C + M cached rows, [compressed | memory]."""

    def cached_rows(self, memory, l: int) -> Tensor:
        return torch.cat([memory.compressed[l], memory.hidden[l]], dim=1)  # [B, C + M, D]
