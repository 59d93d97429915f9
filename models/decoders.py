"""Incremental decoding inside one segment: the current segment's keys and values are cached per layer, so a new
token costs attention over the M memory keys (plus RMT's R read rows) and the t tokens before it, never a rerun
of the segment. Each arch's registry entry names its decoder; `trainer.inference.generate` uses it. Exact
against the models' own segment forward (tests/trainer/inference/test_generate.py).

Shape letters (models/shapes.md): B lanes, N segment length (cfg.tgt_len), M memory length, X cached rows, R memory
tokens (RMT), Q queries (the new tokens of one `extend` call), t tokens already in the segment, L layers, D model
width, H heads, E head width, V vocabulary.

Contract of every decoder:
    decoder.begin(memory)          # the model's memory at a segment start (what its forward returned last)
    logp = decoder.extend(tokens)  # [B, Q] -> [B, Q, V] log-probs of the next token after each new token
A segment holds at most N tokens; when it is full the caller runs the model's own forward over it to get the next
memory (see `trainer.inference.generate.Session`), so the memory rule lives in one place, the model.

Each arch's decoder lives in its module, beside the model it must equal (models/README.md): most
extend Transformer-XL's `TXLDecoder` (models/txl.py) through its hooks, LaMemo's and RMT's are their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import attend
from .registry import arch_spec


class SegmentDecoder:
    """Shared bookkeeping: per-layer key/value buffers [B, X + N, H, E] whose first X rows (memory keys) are
    filled at the segment start, and the count t of tokens already in the segment."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cfg = model.cfg
        self.t = 0

    def _buffers(self, batch: int, prefix: int, device, dtype) -> None:
        cfg = self.cfg
        shape = (batch, prefix + cfg.tgt_len, cfg.n_head, cfg.d_head)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.prefix = prefix

    def _biases(self) -> list[tuple[Tensor, Tensor]]:
        learned = self.model.learned.fetch()
        return [(self.model.layer_bias(learned["bias_u"], l), self.model.layer_bias(learned["bias_v"], l))
                for l in range(self.cfg.n_layer)]

    def _check_room(self, n_new: int) -> None:
        if self.t + n_new > self.cfg.tgt_len:
            raise ValueError(f"segment overflow: {self.t} + {n_new} tokens > segment length {self.cfg.tgt_len}")

    def _causal_layers(self, h: Tensor, rows: slice, allowed: Tensor, index: Tensor) -> Tensor:
        """Run the new tokens h [B, Q, D] through every layer against the cached keys; store their own keys.

        rows: where the new queries sit among the query rows of `allowed` and `index` (the whole segment's layout:
        [B, N, X + N] and [N, X + N] for Transformer-XL); the keys are the buffers' first prefix + t + Q rows."""
        Q = h.shape[1]
        n_keys = self.prefix + self.t + Q
        allowed, index = allowed[:, rows, :n_keys], index[rows, :n_keys]
        at = slice(self.prefix + self.t, n_keys)
        for l, layer in enumerate(self.model.layers):
            h = self.layer_input(l, h)
            q, k, v = layer.attn.project(layer.attn_input(h))
            self.keys[l][:, at], self.values[l][:, at] = k, v
            u, bias_v = self.bias[l]
            context, _ = attend(q, self.keys[l][:, :n_keys], self.values[l][:, :n_keys], self.r_k[l], index, allowed,
                                u, bias_v, layer.attn.dropatt, need_lognorm=False)
            h = layer.finish(h, context, extra=self.layer_extra(l, q))
        return h

    def layer_input(self, l: int, h: Tensor) -> Tensor:
        """Layer l's input from the rows h [B, Q, D] before it: h here; ARMT adds its associative read."""
        return h

    def layer_extra(self, l: int, q: Tensor) -> Tensor | None:
        """What an arch adds to layer l's attention output for the queries q [B, Q, H, E] (RelativeLayer.finish's
        extra): nothing here; the ∞-former's long-term memory."""
        return None

    def _logp(self, h: Tensor) -> Tensor:
        return self.model.predict(h, None, True)[1]


def make_decoder(model: torch.nn.Module) -> SegmentDecoder:
    """The incremental decoder the model's registry entry names."""
    return arch_spec(model.cfg.arch).load("decoder")(model)
