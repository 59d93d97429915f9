"""`hf_rmt`: the Recurrent Memory Transformer around a pretrained causal LM, as its authors run it on GPT-2
(booydar/recurrent-memory-transformer, MemoryCell / RecurrentWrapper; Bulatov et al. 2023, "Scaling Transformer to
1M tokens and beyond with RMT").

Shape letters (models/shapes.md): B lanes, N segment length, R memory tokens, Q queries: a segment's rows
(2R + N), D model width.

A segment's rows are [read R | tokens N | write R]: the memory embeddings are input at the start (read) and again at
the end (write), the backbone runs them causally with positions 0..Q-1, and the final hidden states of the write
rows (after the final norm) are the next segment's memory. The head scores the N token rows. The first memory is
the learned `memory_init` [R, D], drawn as the authors do (normal, the embedding table's std); a lane that is fresh
or reset at a document start reads it again. The next memory stays in the autograd graph: how far back a loss
reaches is the trainer's BPTT schedule (model.bptt_depth; trainer/loop/recurrence.py), as for memlm's RMT.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..output import ModelOutput, cut
from .causal_lm import PretrainedCausalLM


@dataclass
class PretrainedRMTMemory:
    tokens: Tensor  # [B, R, D] the memory the next segment reads, in the autograd graph as the caller left it
    fresh: Tensor  # [B] bool: the lane holds no memory yet; forward puts memory_init there

    @property
    def key_valid(self) -> Tensor:
        """[B, 0]: no cached keys; the memory tokens are rows of the segment (the memory interface)."""
        return self.fresh.new_zeros(self.fresh.shape[0], 0)

    def detached(self) -> "PretrainedRMTMemory":
        return dataclasses.replace(self, tokens=cut(self.tokens))


class PretrainedRMT(PretrainedCausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.add_memory_init(cfg.num_mem_tokens)  # [R, D]

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> PretrainedRMTMemory:
        R, D = self.cfg.num_mem_tokens, self.lm.config.hidden_size  # not memory_init's shape: ZeRO-3 partitions it
        return PretrainedRMTMemory(tokens=torch.zeros(batch_size, R, D, device=device, dtype=dtype),
                                   fresh=torch.ones(batch_size, dtype=torch.bool, device=device))

    def read_memory(self, memory: PretrainedRMTMemory, reset: Tensor | None, dtype: torch.dtype) -> Tensor:
        """The memory this segment reads [B, R, D]: the state's, or memory_init in fresh and reset lanes."""
        fresh = memory.fresh if reset is None else memory.fresh | reset.to(memory.fresh.device)
        init = self.read_memory_init()
        if self.cfg.bptt_choice("memory_init_grad") == "detached":  # the authors' loop at k >= 1
            init = init.detach()
        init = init.to(dtype)[None].expand(fresh.shape[0], -1, -1)
        return torch.where(fresh[:, None, None], init, memory.tokens.to(dtype))

    def prefix_rows(self, memory: PretrainedRMTMemory) -> Tensor:
        """The read block [B, R, D] (the incremental decoder's first rows)."""
        return self.read_memory(memory, None, self.memory_init.dtype)

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: PretrainedRMTMemory,
        reset: Tensor | None = None,  # [B] bool: the lane starts a document here
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan=None,  # the adaptive softmax's; a transformers head has none
    ) -> ModelOutput:
        R, N = self.cfg.num_mem_tokens, tokens.shape[1]
        x = self.embed(tokens)  # [B, N, D]
        mem = self.read_memory(memory, reset, x.dtype)  # [B, R, D]
        hidden = self.hidden_states(torch.cat([mem, x, mem], dim=1))  # [B, Q, D]
        nll, logits = self.predict(hidden[:, R:R + N], targets, return_logits)
        written = PretrainedRMTMemory(tokens=hidden[:, R + N:], fresh=torch.zeros_like(memory.fresh))
        return ModelOutput(nll=nll, logits=logits, memory=written)
