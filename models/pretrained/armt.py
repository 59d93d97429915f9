"""`hf_armt`: the Associative Recurrent Memory Transformer around a pretrained causal LM, as its authors run it on
GPT-2 and Llama (RodkinIvan/associative-recurrent-memory-transformer: an associative wrapper around each decoder
layer; Rodkin et al., 2024).

Shape letters (models/shapes.md): B lanes, N segment length, R memory tokens, Q queries: a segment's rows
(N + R), L layers, D model width, F feature width of the associative keys (2 nu assoc_dim).

A segment's rows are [tokens N | write R], the write rows being the learned `memory_init` [R, D] in every segment
(ARMT carries no memory tokens between segments). Each decoder layer l is wrapped: before it, every row reads the
layer's associative state (A_l, z_l); after it, the write rows' outputs update that state by the delta rule, with the
authors' epsilon, clip and first-write gamma. The read and the write are memlm's ARMT's (models/armt.py,
`AssociativeBlock`), the same equations around a transformers layer instead of memlm's. The state stays in the
autograd graph; the trainer's BPTT schedule decides how far back a loss reaches.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor, nn

from ..armt import DPFP_NU, ARMTMemory, AssociativeBlock
from ..output import ModelOutput
from .causal_lm import PretrainedCausalLM


class AssociativeLayer(nn.Module):
    """A transformers decoder layer with the associative read before it and the write after it. The state it
    reads is handed in per forward (`state`), its write read back (`written`): set and taken inside the function
    a segment runs, so a recomputation under segment checkpointing reads the same state."""

    def __init__(self, layer: nn.Module, assoc: AssociativeBlock, num_mem_tokens: int):
        super().__init__()
        self.layer, self.assoc, self.num_mem_tokens = layer, assoc, num_mem_tokens
        self.state: tuple[Tensor, Tensor, Tensor] | None = None  # (A [B, F, D], z [B, F], fresh [B])
        self.written: tuple[Tensor, Tensor] | None = None
        self.writes = True  # False while the incremental decoder runs token rows only

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        assoc, norm, fresh = self.state
        hidden_states = hidden_states + self.assoc.read(hidden_states, assoc, norm)  # [B, Q, D]
        out = self.layer(hidden_states, *args, **kwargs)
        if self.writes:
            rows = out[0] if isinstance(out, tuple) else out  # [B, Q, D]
            self.written = self.assoc.write(rows[:, -self.num_mem_tokens:], assoc, norm, fresh)
        return out


class PretrainedARMT(PretrainedCausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        config = self.lm.config
        D = config.hidden_size
        # The associative projections' init: the backbone's own initializer_range; W_v zeros (assoc_value_init_std:
        # 0, the authors'), so the wrapped model starts as the backbone
        widths = dataclasses.replace(cfg, d_model=D, init_std=getattr(config, "initializer_range", cfg.init_std))
        layers = self.decoder_layers()
        for l in range(len(layers)):
            layers[l] = AssociativeLayer(layers[l], AssociativeBlock(widths), cfg.num_mem_tokens)
        self.add_memory_init(cfg.num_mem_tokens)  # [R, D]

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> ARMTMemory:
        B, D, F = batch_size, self.lm.config.hidden_size, 2 * DPFP_NU * self.cfg.assoc_dim
        L = len(self.decoder_layers())
        return ARMTMemory(assoc=[torch.zeros(B, F, D, device=device, dtype=dtype) for _ in range(L)],
                          norm=[torch.zeros(B, F, device=device, dtype=dtype) for _ in range(L)],
                          fresh=torch.ones(B, dtype=torch.bool, device=device))

    def state_in(self, memory: ARMTMemory, reset: Tensor | None, dtype) -> tuple[list, list, Tensor]:
        """The state this segment reads: empty in fresh and reset lanes. -> (A per layer, z per layer, fresh [B])."""
        fresh = memory.fresh if reset is None else memory.fresh | reset.to(memory.fresh.device)
        keep = (~fresh).to(dtype)
        return ([a.to(dtype) * keep[:, None, None] for a in memory.assoc],
                [z.to(dtype) * keep[:, None] for z in memory.norm], fresh)

    @contextlib.contextmanager
    def reading(self, memory: ARMTMemory):
        """The layers read `memory` and write nothing (the incremental decoder's token rows)."""
        assoc, norm, fresh = self.state_in(memory, None, self.memory_init.dtype)
        layers = self.decoder_layers()
        for l, layer in enumerate(layers):
            layer.state, layer.writes = (assoc[l], norm[l], fresh), False
        try:
            yield
        finally:
            for layer in layers:
                layer.state, layer.writes = None, True

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: ARMTMemory,
        reset: Tensor | None = None,  # [B] bool: the lane starts a document here
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan=None,  # the adaptive softmax's; a transformers head has none
    ) -> ModelOutput:
        B, N = tokens.shape
        x = self.embed(tokens)  # [B, N, D]
        assoc, norm, fresh = self.state_in(memory, reset, x.dtype)
        memory_init = self.read_memory_init().to(x.dtype)[None].expand(B, -1, -1)  # [B, R, D]
        rows = torch.cat([x, memory_init], dim=1)  # [B, Q, D]
        L = len(assoc)
        out = self.run_segment(lambda *t: self.run_associative(t[0], t[1:1 + L], t[1 + L:1 + 2 * L], t[-1]),
                               rows, *assoc, *norm, fresh)
        hidden, new_assoc, new_norm = out[0], list(out[1:1 + L]), list(out[1 + L:])
        nll, logits = self.predict(hidden[:, :N], targets, return_logits)
        return ModelOutput(nll=nll, logits=logits,
                           memory=ARMTMemory(assoc=new_assoc, norm=new_norm, fresh=torch.zeros_like(fresh)))

    def run_associative(self, rows: Tensor, assoc, norm, fresh: Tensor) -> tuple[Tensor, ...]:
        """One segment through the wrapped layers: (final hidden [B, Q, D], A_1..A_L, z_1..z_L)."""
        layers = self.decoder_layers()
        for l, layer in enumerate(layers):
            layer.state = (assoc[l], norm[l], fresh)
        try:
            hidden = self.run_decoder(rows)
            written = [layer.written for layer in layers]
        finally:
            for layer in layers:
                layer.state = layer.written = None
        return (hidden, *(a for a, _ in written), *(z for _, z in written))
