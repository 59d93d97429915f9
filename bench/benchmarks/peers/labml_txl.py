"""labml-nn's annotated Transformer-XL (labml_nn.transformers.xl) at memlm's shape.

labml-nn ships the layers (`TransformerXLLayer`, `TransformerXL`, `RelativeMultiHeadAttention`, `FeedForward`);
its language model wrapper lives in its Tiny Shakespeare experiment module, which imports torchtext and the
experiment framework, so the benchmark wires the same few pieces itself: token embedding -> TransformerXL ->
linear output, a [N, M + N, 1] mask with the memory fully visible and causal over the segment, and the memory
kept as in that experiment (each layer's input appended to the previous memory, the last M positions kept,
detached by the model). Library defaults otherwise: pre-LayerNorm, learned relative-position tables of
2 x 4096 distances per layer (hard-wired: most of its parameters at these shapes, though only M + N rows are read
per step), biases on v and the output projection, untied input/output embeddings, full softmax.
Tensors are sequence-first ([N, B]) in this library.
"""

from __future__ import annotations

from importlib.metadata import version

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import Runner, Shape


class LabmlLM(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        from labml_nn.transformers.feed_forward import FeedForward
        from labml_nn.transformers.xl import TransformerXL, TransformerXLLayer
        from labml_nn.transformers.xl.relative_mha import RelativeMultiHeadAttention

        D = shape.d_model
        layer = TransformerXLLayer(
            d_model=D, self_attn=RelativeMultiHeadAttention(shape.n_head, D, dropout_prob=0.0),
            feed_forward=FeedForward(D, shape.d_inner, dropout=0.0), dropout_prob=0.0,
        )
        self.src_embed = nn.Embedding(shape.vocab, D)
        self.transformer = TransformerXL(layer, shape.n_layer)
        self.generator = nn.Linear(D, shape.vocab)

    def forward(self, x: Tensor, mem: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """x [N, B] -> logits [N, B, V] and this segment's per-layer inputs (for the memory)."""
        n, m = x.shape[0], mem[0].shape[0] if mem else 0
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = torch.cat([causal.new_ones(n, m), causal], dim=1)[:, :, None]  # [N, M + N, 1]: True = may attend
        h, new_mem = self.transformer(self.src_embed(x), mem, mask)
        return self.generator(h), new_mem


class LabmlTXL(Runner):
    key, label = "labml-txl", "labml-nn Transformer-XL"
    compare_with = "memlm-txl"
    vocab_pattern = r"^(src_embed|generator)\."
    position_pattern = r"\.(key_pos_embeddings|key_pos_bias)$"

    def build(self, shape: Shape) -> nn.Module:
        if shape.d_model != shape.n_head * shape.d_head:
            raise ValueError("labml-nn's attention has d_head = d_model / n_head")
        self.library = f"labml-nn=={version('labml-nn')} (labml=={version('labml')})"
        return LabmlLM(shape)

    def reset_memory(self) -> None:
        self.mem: list[Tensor] = []

    def forward_loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        logits, new_mem = self.model(tokens.t(), self.mem)  # [N, B, V]
        if self.mem:
            merged = [torch.cat([old, new], dim=0) for old, new in zip(self.mem, new_mem)]
        else:
            merged = new_mem
        self.mem = [m[-self.shape.mem_len :] for m in merged]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1), ignore_index=-100)

    def settings(self) -> dict:
        return {"heads": self.shape.n_head, "d_model": self.shape.d_model, "d_ff": self.shape.d_inner,
                "n_layers": self.shape.n_layer, "mem_len": self.shape.mem_len, "dropout": 0.0,
                "relative_position_table": "2 x 4096 learned rows per layer (RelativeMultiHeadAttention.P = 2**12)"}
