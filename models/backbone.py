"""Pieces every architecture shares: adaptive embedding and softmax, relative-position biases, layer stack.

Shape letters (models/shapes.md): B lanes, N segment length, Q queries (the segment's rows), X cached rows,
K keys (X + Q), P relative distances, L layers, D model width, H heads, E head width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from .attention import RelativeLayer, attend
from .config import ModelConfig
from .head_plan import TailPlan
from .mask_layout import MaskLayout, TritonMask


class LearnedTensors(nn.Module):
    """Free-standing learned tensors (position biases, RMT's initial memory), read through a module call.

    ZeRO-3 gathers a module's parameters only while its forward runs, and again for backward through hooks on
    that forward's tensor outputs; parameters read straight off the top-level model would stay partitioned.
    """

    def add(self, name: str, shape: tuple[int, ...], init_std: float) -> None:
        self.register_parameter(name, nn.Parameter(torch.randn(shape) * init_std))

    def forward(self) -> tuple[Tensor, ...]:
        return tuple(self._parameters.values())

    def fetch(self) -> dict[str, Tensor]:
        """{name: tensor} for use inside the model's forward."""
        return dict(zip(self._parameters, self()))


@dataclass
class LayerInputs:
    """What every layer of one forward attends with, built once per forward: `Backbone.run_layer` hands each layer
    these with its own biases and recorder."""

    r: Tensor  # [P, D] relative encodings of the P distances pos_index names
    pos_index: Tensor  # [Q, X + Q] long
    allowed: Tensor  # [B or 1, Q, X + Q] bool
    kernel_mask: Any  # kernel_mask(layout) or None (einsum path)
    pos_offset: int | None  # the layout's offset where pos_index[i, j] = offset + i - j (attend); None: gathered
    bias_u: Tensor  # [H, E], or [L, H, E] with untie_r (layer_bias picks the layer's)
    bias_v: Tensor
    record: str | None  # the kind the analyses receive the attention weights as ("causal", "rmt"); None: never


class Backbone(nn.Module):
    """Embedding -> (architecture-specific layer loop) -> adaptive softmax.

    Subclasses implement `init_memory` and `forward`. No parameter or buffer depends on tgt_len or mem_len:
    those are read from `self.cfg` at every call, so changing them (evaluation with a longer memory) is a
    matter of configuration.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        d_embed = cfg.embed_dim
        self.embed = AdaptiveEmbedding(cfg.vocab_size, d_embed, cfg.d_model, cfg.cutoffs, cfg.div_val, cfg.init_std)
        self.head = AdaptiveLogSoftmax(cfg.vocab_size, d_embed, cfg.d_model, cfg.cutoffs, cfg.div_val, cfg.init_std,
                                       head_loss=cfg.head_loss)
        if cfg.tie_weight:
            self.head.tie_to(self.embed)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(RelativeLayer(cfg) for _ in range(cfg.n_layer))
        # Transformer-XL's global content bias u and position bias v ([L, H, E] when untied per layer).
        self.bias_shape = (cfg.n_layer, cfg.n_head, cfg.d_head) if cfg.untie_r else (cfg.n_head, cfg.d_head)
        self.learned = LearnedTensors()
        self.learned.add("bias_u", self.bias_shape, cfg.init_std)
        self.learned.add("bias_v", self.bias_shape, cfg.init_std)
        # Pre-LN stacks leave the residual stream unnormalised; normalise once before the softmax.
        self.final_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_lnorm else nn.Identity()
        # Analyses only (trainer/inference/analyze.py): an object with add(kind, layer, tensor) that receives attention
        # weights (and LaMemo's alpha) during forward. A plain attribute, not a module: never saved or moved.
        self.recorder = None

    def record_to(self, kind: str, layer: int) -> Callable[[Tensor], None] | None:
        """The callable `attend` reports weights to for (kind, layer), or None when nothing is recording."""
        recorder = self.recorder
        if recorder is None:
            return None
        return lambda tensor: recorder.add(kind, layer, tensor)

    def kernel_mask(self, layout: MaskLayout):
        """The mask `attend` takes for this forward's attention kernel (model.attention): a FlexAttention BlockMask
        ("flex"; "auto" on CUDA), a TritonMask ("triton"), or None (the einsum path). Built once per forward,
        shared by the layers."""
        choice = self.cfg.attention
        if choice == "eager" or (choice == "auto" and layout.structure.device.type != "cuda"):
            return None
        if choice == "triton":
            from .attention_triton import triton_layout  # only when chosen: triton is an optional dependency

            return TritonMask(layout, triton_layout(layout.structure, layout.key_valid))
        from .attention_flex import flex_mask  # only when chosen: loads torch.compile's FlexAttention

        return flex_mask(layout.allowed, layout.key_valid.shape[0])

    def layer_step(
        self,
        layer: RelativeLayer,
        h: Tensor,  # [B, Q, D] the segment's rows (RMT: memory tokens around them)
        cached: Tensor,  # [B, X, D] this layer's cached rows from earlier segments
        r: Tensor,  # [P, D] relative encodings of the P distances pos_index names
        pos_index: Tensor,  # [Q, X + Q] long
        allowed: Tensor,  # [B or 1, Q, X + Q] bool
        bias_u: Tensor,  # [H, E]
        bias_v: Tensor,  # [H, E]
        kernel_mask,  # kernel_mask(layout) or None (einsum path)
        record: Callable[[Tensor], None] | None,
        pos_offset: int | None = None,  # the layout's offset when pos_index[i, j] = offset + i - j (attend)
    ) -> Tensor:
        """One decoder layer over h attending to its cache and itself (Transformer-XL's recurrence, RMT's cache):
        the new h [B, Q, D]. LaMemo has its own. `compile_layers` compiles this, the one graph every layer reuses."""
        q, k, v = layer.attn.project_with_memory(layer.attn_input(cached), layer.attn_input(h))  # k, v [B, K, H, E]
        context, _ = attend(q, k, v, layer.attn.project_positions(r), pos_index, allowed, bias_u, bias_v,
                            layer.attn.dropatt, need_lognorm=False, record=record, kernel_mask=kernel_mask,
                            pos_offset=pos_offset)
        return layer.finish(h, context)

    def run_layer(self, l: int, h: Tensor, cached: Tensor, inputs: LayerInputs, *extra, step=None, **named):
        """Layer l over the rows h and its cached rows: `layer_step` (or `step`, an arch's own variant taking the
        same leading arguments) with the layer's biases and the analyses' recorder. extra, named: what an arch's
        step takes beyond them (the ∞-former's long-term memory, LaMemo's look-ahead). The one layer loop body
        every arch's forward runs."""
        record = self.record_to(inputs.record, l) if inputs.record else None
        return (step or self.layer_step)(self.layers[l], h, cached, inputs.r, inputs.pos_index, inputs.allowed,
                                         self.layer_bias(inputs.bias_u, l), self.layer_bias(inputs.bias_v, l),
                                         inputs.kernel_mask, record, inputs.pos_offset, *extra, **named)

    def compile_layers(self, **options) -> None:
        """torch.compile one layer's work (`layer_step`) instead of the whole forward: every layer runs the same
        graph, so the compile costs one layer's, not n_layer unrolled ones' (on an H100 a whole 16-layer forward
        outran 100 s of compile). The embedding, the masks and the head stay eager. options: torch.compile's."""
        self.layer_step = torch.compile(self.layer_step, **options)  # an instance attribute: shadows the method

    def layer_bias(self, bias: Tensor, layer: int) -> Tensor:
        return bias[layer] if self.cfg.untie_r else bias

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [B, N] -> dropped-out embeddings [B, N, D]."""
        return self.drop(self.embed(tokens))

    def predict(self, hidden: Tensor, targets: Tensor | None, return_logits: bool,
                tail_plan: TailPlan | None = None) -> tuple[Tensor | None, Tensor | None]:
        """hidden [B, N, D] -> (nll [B, N] or None, log-probs [B, N, V] or None). tail_plan: the adaptive softmax's
        tail rows of these targets, built on the host (head_plan.py); without it the head finds them on the device,
        at a host sync per tail cluster."""
        if targets is None and not return_logits:  # e.g. RMT's replayed segments, which only carry memory
            return None, None
        return self.head(self.drop(self.final_norm(hidden)), targets, return_logits, plan=tail_plan)
