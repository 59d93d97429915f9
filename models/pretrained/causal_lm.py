"""The pretrained-backbone archs' shared module, and `hf`, the backbone alone (every segment read by itself).

Shape letters (models/shapes.md): B lanes, N segment length, R memory tokens, Q queries: the rows a segment's forward
runs ([read R | tokens N | write R] for RMT), D model width, V vocabulary.

The backbone is a transformers *ForCausalLM (loading.py): its own embedding, positions (learned for GPT-2, rotary for
Llama: a segment's rows take positions 0..Q-1, as the RMT and ARMT authors run it), layers, final norm and head.
memlm feeds it input embeddings and reads the final hidden states (after the final norm, transformers'
last_hidden_state); the head scores the N token rows only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..backbone import LearnedTensors
from ..output import ModelOutput, cut, map_memory
from .loading import apply_backbone_train, load_causal_lm


@dataclass
class NoMemory:
    fresh: Tensor  # [B] bool, kept so the state has the lanes first like every state (nothing reads it)

    @property
    def key_valid(self) -> Tensor:
        """[B, 0]: no cached keys (the memory interface)."""
        return self.fresh.new_zeros(self.fresh.shape[0], 0)

    def detached(self) -> "NoMemory":
        return map_memory(cut, self)


class PretrainedCausalLM(nn.Module):
    """A transformers causal LM behind memlm's model contract; the memory archs build on it (rmt.py, armt.py)."""

    recorder = None  # memlm analyze's attention statistics: not recorded inside a transformers model

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.lm = apply_backbone_train(cfg, load_causal_lm(cfg))
        self.lm.train()  # nn.Module's default (from_pretrained leaves eval mode): the trainer switches it

    @property
    def decoder(self) -> nn.Module:
        """The transformers base model (GPT2Model, LlamaModel): embeddings in, last_hidden_state out."""
        return self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.base_model

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [B, N] -> the backbone's input embeddings [B, N, D]."""
        return self.lm.get_input_embeddings()(tokens)

    def embedding_std(self) -> Tensor:
        """The std of the backbone's embedding table (a 0-d float32 tensor): the RMT authors' scale for the initial
        memory. A tensor, not a float: a model built on the meta device for its shapes (trainer/checkpoint/
        model_fit.py) has no value to read."""
        return self.lm.get_input_embeddings().weight.detach().float().std()

    def add_memory_init(self, rows: int) -> None:
        """The learned initial memory `memory_init` [rows, D], drawn as the RMT authors do (normal, the embedding
        table's std). Held in a LearnedTensors and read through its call (`read_memory_init`): ZeRO-3 gathers a
        parameter only while its module's forward runs (models/backbone.py), and this model's own forward is not
        one of those."""
        self.learned = LearnedTensors()
        self.learned.add("memory_init", (rows, self.lm.config.hidden_size), self.embedding_std())

    def read_memory_init(self) -> Tensor:
        """memory_init [R, D] inside a forward (gathered under ZeRO-3)."""
        return self.learned.fetch()["memory_init"]

    @property
    def memory_init(self) -> nn.Parameter:
        """The parameter itself (its gradient, its shape before DeepSpeed partitions it); forward reads it through
        read_memory_init."""
        return self.learned.memory_init

    def save_backbone_config(self, folder) -> None:
        """The backbone's transformers config as save_pretrained writes it (FOLDER/config.json): what `memlm export`
        keeps, so that an export builds its backbone without the folder it was trained from."""
        self.lm.config.save_pretrained(folder)

    def hidden_states(self, rows: Tensor) -> Tensor:
        """rows [B, Q, D] input embeddings -> final hidden states [B, Q, D] (after the final norm)."""
        return self.run_segment(self.run_decoder, rows)

    def run_decoder(self, rows: Tensor) -> Tensor:
        return self.decoder(inputs_embeds=rows, use_cache=False).last_hidden_state

    def run_segment(self, fn, *tensors: Tensor):
        """fn(*tensors), a segment's pass through the backbone; with model.segment_checkpointing in training, its
        activations are recomputed in the backward instead of kept (fn must take all it reads as arguments)."""
        if self.cfg.segment_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *tensors, use_reentrant=False)
        return fn(*tensors)

    def predict(self, hidden: Tensor, targets: Tensor | None, return_logits: bool) -> tuple:
        """hidden [B, N, D] -> (nll [B, N] or None, log-probabilities [B, N, V] or None), in float32 at least."""
        if targets is None and not return_logits:
            # a segment window BPTT replays: only its memory is read, so the head is not run (it was, and thrown
            # away: a third of a replay's forward at bench_pretrained_memory.py's cpu shape)
            return None, None
        logits = self.lm.get_output_embeddings()(hidden)  # [B, N, V]
        logp = F.log_softmax(logits if logits.dtype in (torch.float32, torch.float64) else logits.float(), dim=-1)
        nll = None
        if targets is not None:
            # rows flattened, not logp.transpose(1, 2): the transposed [B, V, N] view takes nll_loss's 2-d path,
            # which on the CPU cost 2.7x the loss of the flat rows (45 ms against 16 ms at B 4, N 128, V 8192)
            nll = F.nll_loss(logp.flatten(0, 1), targets.flatten(), ignore_index=-100,
                             reduction="none").view_as(targets)  # [B, N]
        return nll, (logp if return_logits else None)

    def compile_layers(self, **options) -> None:
        """train.compile_scope: layer: each decoder layer compiled (the transformers layers are the layers here)."""
        for layer in self.decoder_layers():
            layer.compile(**options)

    def prefix_rows(self, memory) -> Tensor | None:
        """The rows a segment's forward runs before its tokens (RMT's read memory [B, R, D]); None: none."""
        return None

    def reading(self, memory):
        """A context in which the backbone reads `memory` from inside its layers (ARMT's associative state)."""
        return contextlib.nullcontext()

    def decoder_layers(self) -> nn.ModuleList:
        """The backbone's decoder layers in order (GPT2Model.h, LlamaModel.layers)."""
        n_layer = self.lm.config.num_hidden_layers
        for module in self.decoder.children():
            if isinstance(module, nn.ModuleList) and len(module) == n_layer:
                return module
        raise TypeError(f"{type(self.decoder).__name__}: no ModuleList of its {n_layer} layers")


class PretrainedLM(PretrainedCausalLM):
    """`hf`: the backbone alone, each segment read by itself (the no-memory baseline beside hf_rmt and hf_armt)."""

    def init_memory(self, batch_size: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> NoMemory:
        return NoMemory(fresh=torch.ones(batch_size, dtype=torch.bool, device=device))

    def forward(
        self,
        tokens: Tensor,  # [B, N]
        memory: NoMemory,
        reset: Tensor | None = None,  # [B] bool: nothing to reset
        targets: Tensor | None = None,  # [B, N], -100 = ignore
        return_logits: bool = False,
        tail_plan=None,  # the adaptive softmax's; a transformers head has none
    ) -> ModelOutput:
        hidden = self.hidden_states(self.embed(tokens))  # [B, N, D]
        nll, logits = self.predict(hidden, targets, return_logits)
        return ModelOutput(nll=nll, logits=logits, memory=NoMemory(fresh=torch.zeros_like(memory.fresh)))


class PretrainedDecoder:
    """`memlm generate`'s incremental decoder for the pretrained archs (models/decoders.py's contract): the backbone's
    own key/value cache (transformers' DynamicCache) holds the segment's rows so far, the prefix rows (RMT's read
    memory) first; a new token runs through the backbone once, at the position it has in the segment's forward."""

    def __init__(self, model: PretrainedCausalLM):
        self.model, self.cfg, self.t = model, model.cfg, 0

    def begin(self, memory) -> None:
        from transformers import DynamicCache

        self.memory, self.t = memory, 0
        self.cache = DynamicCache(config=self.model.lm.config)
        rows = self.model.prefix_rows(memory)
        if rows is not None:
            self._run(rows)

    def extend(self, tokens: Tensor) -> Tensor:
        """tokens [B, Q] -> log-probabilities of the next token after each [B, Q, V]."""
        if self.t + tokens.shape[1] > self.cfg.tgt_len:
            raise ValueError(f"segment overflow: {self.t} + {tokens.shape[1]} tokens > segment length "
                             f"{self.cfg.tgt_len}")
        hidden = self._run(self.model.embed(tokens))  # [B, Q, D]
        self.t += tokens.shape[1]
        return self.model.predict(hidden, None, True)[1]

    def _run(self, rows: Tensor) -> Tensor:
        with self.model.reading(self.memory):
            return self.model.decoder(inputs_embeds=rows, cache=self.cache, use_cache=True).last_hidden_state
