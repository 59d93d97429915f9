"""Incremental decoding inside one segment: the current segment's keys and values are cached per layer, so a new
token costs attention over the M memory keys (plus RMT's R read rows) and the t tokens before it, never a rerun
of the segment. Each arch's registry entry names its decoder; `trainer.inference.generate` uses it. Exact
against the models' own segment forward (tests/trainer/inference/test_generate.py).

Shape legend: B lanes, N segment length (cfg.tgt_len), M memory length, R memory tokens (RMT), Q new tokens of
one `extend` call, t tokens already in the segment, L layers, D model width, H heads, E head width, V vocabulary.

Contract of every decoder:
    decoder.begin(memory)          # the model's memory at a segment start (what its forward returned last)
    logp = decoder.extend(tokens)  # [B, Q] -> [B, Q, V] log-probs of the next token after each new token
A segment holds at most N tokens; when it is full the caller runs the model's own forward over it to get the next
memory (see `trainer.inference.generate.Session`), so the memory rule lives in one place, the model.

What each architecture needs beyond Transformer-XL's cache:
* LaMemo: the memory's hidden states at layers >= 1 are refreshed by the look-ahead, whose window ends at the
  segment's *first* token (models/lamemo.py). So the first `extend` of a segment runs the model's layer loop on
  [memory | first tokens] (look-ahead + interpolation, exactly as forward), which fixes the memory keys/values of
  every layer for the rest of the segment; later tokens attend causally to those and to the segment's cache. No
  later token of the segment can change them (the window never reaches past the first token), so this is exact.
* RMT: the read rows see only the read block (and the cache if cfg.read_mem_from_cache), never the tokens, so
  they go through every layer once at `begin`; token rows then attend to [cache | read | tokens so far]. The
  write rows (the next memory) are only needed when the segment is full: the model's forward computes them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import attend, causal_allowed, causal_index, relative_encodings
from .lamemo import lookahead_layout
from .rmt import rmt_allowed, rmt_positions


class SegmentDecoder:
    """Shared bookkeeping: per-layer key/value buffers [B, P + N, H, E] whose first P rows (memory keys) are
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

        rows: where the new queries sit in the query layout of `allowed` [B, Q_all, K_all] / `index` [Q_all, K_all];
        the keys are the buffers' first prefix + t + Q rows."""
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


class TXLDecoder(SegmentDecoder):
    """Transformer-XL and the no-memory baseline (M = 0): memory keys come from the cached layer inputs. An arch
    whose cache holds more rows before them (the Compressive Transformer's slots) names them in `cached_rows`."""

    def cached_rows(self, memory, l: int) -> Tensor:
        """Layer l's P cached rows [B, P, D] in key order (memory.key_valid's)."""
        return memory.hidden[l]

    def begin(self, memory) -> None:
        cfg, model = self.cfg, self.model
        key_valid = memory.key_valid  # [B, P]
        (B, P), N, device = key_valid.shape, cfg.tgt_len, key_valid.device
        dtype = next(model.parameters()).dtype
        self.t = 0
        self._buffers(B, P, device, dtype)
        self.allowed = causal_allowed(N, P, key_valid, cfg.same_length)  # [B, N, P + N]
        self.index = causal_index(N, P, device)  # [N, P + N]
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


class LaMemoDecoder(SegmentDecoder):
    """LaMemo: the first extend of a segment refreshes the memory at every layer (see the module docstring)."""

    def begin(self, memory) -> None:
        cfg, model = self.cfg, self.model
        M, N = cfg.mem_len, cfg.tgt_len
        B, device = memory.valid.shape[0], memory.valid.device
        dtype = next(model.parameters()).dtype
        self.memory, self.t = memory, 0
        self._buffers(B, M, device, dtype)
        self.allowed = causal_allowed(N, M, memory.valid, cfg.same_length)  # [B, N, M + N]
        self.index = causal_index(N, M, device)  # [N, M + N]
        key_valid = torch.cat([memory.valid, memory.valid.new_ones(B, N)], dim=1)  # [B, M + N]
        self.start, self.allowed_ahead, self.index_ahead = lookahead_layout(M, N, key_valid)
        r = relative_encodings(torch.arange(M + N, device=device), cfg.d_model, cfg.clamp_len, dtype)
        self.r_k = [layer.attn.project_positions(r) for layer in model.layers]
        if cfg.rpe == "xl":
            r_ahead = relative_encodings(-torch.arange(1, M + 1, device=device), cfg.d_model, cfg.clamp_len, dtype)
            self.r_k_ahead = [layer.attn.project_positions(r_ahead) for layer in model.layers]
        else:  # distances 1..M: rows of the causal encodings, as the model's forward takes them in eval mode
            self.r_k_ahead = [r_k[1 : M + 1] for r_k in self.r_k]
        self.bias = self._biases()
        learned = model.learned.fetch()
        bias_ahead = learned["bias_v"] if cfg.rpe == "xl" else learned.get("bias_v_ahead")
        self.bias_ahead = [model.layer_bias(bias_ahead, l) for l in range(cfg.n_layer)]

    def extend(self, tokens: Tensor) -> Tensor:
        Q = tokens.shape[1]
        self._check_room(Q)
        h = self.model.embed_tokens(tokens)
        if self.t == 0:
            h = self._first_block(h)
        else:
            h = self._causal_layers(h, slice(self.t, self.t + Q), self.allowed, self.index)
        self.t += Q
        return self._logp(h)

    def _first_block(self, h_cur: Tensor) -> Tensor:
        """The model's layer loop on [memory | the segment's first Q tokens]: returns the tokens' last hidden
        [B, Q, D] and leaves every layer's memory and token keys/values in the buffers."""
        cfg, model, memory = self.cfg, self.model, self.memory
        M, Q, L = cfg.mem_len, h_cur.shape[1], cfg.n_layer
        h_mem = memory.embed.to(h_cur.dtype)  # [B, M, D] layer-0 memory inputs
        allowed, index = self.allowed[:, :Q, : M + Q], self.index[:Q, : M + Q]
        window = slice(self.start, M + 1)
        for l, layer in enumerate(model.layers):
            u, bias_v = self.bias[l]
            keys_in = torch.cat([h_mem, h_cur], dim=1)  # [B, M + Q, D]
            q, k, v = layer.attn.project(layer.attn_input(keys_in))
            self.keys[l][:, : M + Q], self.values[l][:, : M + Q] = k, v
            ctx_cur, _ = attend(q[:, M:], k, v, self.r_k[l], index, allowed, u, bias_v, layer.attn.dropatt,
                                need_lognorm=False)
            if l == L - 1:  # the last layer's memory output feeds nothing
                return layer.finish(h_cur, ctx_cur)
            ctx_mem = memory.context[l].to(h_cur.dtype)
            if cfg.lookahead:
                ctx_ahead, lognorm_ahead = attend(
                    q[:, :M], k[:, window], v[:, window], self.r_k_ahead[l], self.index_ahead, self.allowed_ahead,
                    u, self.bias_ahead[l], layer.attn.dropatt, per_key_positions=M > cfg.tgt_len)
                ctx_mem, _ = model.interpolate(ctx_mem, memory.lognorm[l], ctx_ahead, lognorm_ahead)
            out = layer.finish(keys_in, torch.cat([ctx_mem, ctx_cur], dim=1))
            h_mem, h_cur = out[:, :M], out[:, M:]
        return h_cur


class RMTDecoder(SegmentDecoder):
    """RMT (and Transformer-XL + RMT): read rows through every layer at begin, then causal token rows."""

    def begin(self, memory) -> None:
        cfg, model = self.cfg, self.model
        R, M, N = cfg.num_mem_tokens, cfg.mem_len, cfg.tgt_len
        valid = memory.cache.valid
        B, device = valid.shape[0], valid.device
        dtype = next(model.parameters()).dtype
        self.t = 0
        self._buffers(B, M + R, device, dtype)
        learned = model.learned.fetch()
        read, _ = model.read_memory(memory, None, learned["memory_init"], dtype)  # [B, R, D]
        self.allowed = rmt_allowed(R, N, valid, cfg.same_length, cfg.read_mem_from_cache,
                                   cfg.write_mem_from_cache)  # [B, 2R + N, K]
        distances, self.index = rmt_positions(R, N, M, device)  # [P], [2R + N, K]
        r = relative_encodings(distances, cfg.d_model, cfg.clamp_len, dtype)
        self.r_k = [layer.attn.project_positions(r) for layer in model.layers]
        self.bias = self._biases()
        h = model.drop(read)
        allowed, index = self.allowed[:, :R, : M + R], self.index[:R, : M + R]
        for l, layer in enumerate(model.layers):
            if M and cfg.cache_keys_values:  # the cache holds the rows' keys and values [B, M, 2HE] as they are
                q, kv = layer.attn.project_rows(layer.attn_input(h))
                k, v = layer.attn.split_keys_values(torch.cat([memory.cache.hidden[l].to(kv.dtype), kv], dim=1))
            else:
                keys_in = torch.cat([memory.cache.hidden[l].to(dtype), h], dim=1)  # [B, M + R, D]
                q, k, v = layer.attn.project(layer.attn_input(keys_in), n_query=R)
            self.keys[l][:, : M + R], self.values[l][:, : M + R] = k, v
            u, bias_v = self.bias[l]
            context, _ = attend(q, k, v, self.r_k[l], index, allowed, u, bias_v, layer.attn.dropatt, need_lognorm=False)
            h = layer.finish(h, context)

    def extend(self, tokens: Tensor) -> Tensor:
        Q = tokens.shape[1]
        self._check_room(Q)
        R = self.cfg.num_mem_tokens
        h = self.model.drop(self.model.embed(tokens))
        rows = slice(R + self.t, R + self.t + Q)  # token rows follow the read block in the query layout
        h = self._causal_layers(h, rows, self.allowed, self.index)
        self.t += Q
        return self._logp(h)


def make_decoder(model: torch.nn.Module) -> SegmentDecoder:
    """The incremental decoder the model's registry entry names."""
    from .registry import arch_spec

    return arch_spec(model.cfg.arch).load("decoder")(model)
