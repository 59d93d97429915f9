"""Slow, obvious references for the model tests: explicit loops over positions and heads, math.sin/cos
sinusoids, one lane at a time. They reuse a model's *weights* (and its standard LayerNorm/FFN modules, which
are plain torch) but none of its attention, masking, position or memory code.
"""

from __future__ import annotations

import math

import torch


def sinusoid_vec(d: float, dim: int) -> torch.Tensor:
    half = dim // 2
    sines = [math.sin(d / 10000 ** (2 * f / dim)) for f in range(half)]
    cosines = [math.cos(d / 10000 ** (2 * f / dim)) for f in range(half)]
    return torch.tensor(sines + cosines, dtype=torch.float64)


def split_qkv(layer, x: torch.Tensor, n_head: int, d_head: int):
    """x [D] -> q, k, v each [H, E] using the layer's fused projection."""
    w = torch.cat([layer.attn.q_net.weight, layer.attn.kv_net.weight]).double()  # rows: q, then k, then v
    q, k, v = (w @ x).view(3, n_head, d_head)
    return q, k, v


def pos_key(layer, d: float, clamp_len: int, d_model: int, n_head: int, d_head: int) -> torch.Tensor:
    """W_R R(d) as [H, E], with Transformer-XL's clamping of |d|."""
    if clamp_len > 0:
        d = max(-clamp_len, min(clamp_len, d))
    return (layer.attn.r_net.weight.double() @ sinusoid_vec(d, d_model)).view(n_head, d_head)


def softmax_context(scores: list[torch.Tensor], values: list[torch.Tensor]):
    """scores: list over keys of [H]; values: list over keys of [H, E] -> context [H, E], lognorm [H]."""
    s = torch.stack(scores)  # [K, H]
    lse = torch.logsumexp(s, dim=0)
    p = torch.exp(s - lse)
    ctx = sum(p[j][:, None] * values[j] for j in range(len(values)))
    return ctx, lse


def _ff(layer, h: torch.Tensor) -> torch.Tensor:
    lin1, lin2 = layer.ff.net[0], layer.ff.net[3]
    norm = layer.ff.norm

    def ln(x):
        return torch.nn.functional.layer_norm(x, x.shape, norm.weight.double(), norm.bias.double())

    def net(x):
        return lin2.weight.double() @ torch.relu(lin1.weight.double() @ x + lin1.bias.double()) + lin2.bias.double()

    return h + net(ln(h)) if layer.pre_lnorm else ln(h + net(h))


def attn_in(layer, h: torch.Tensor) -> torch.Tensor:
    if not layer.pre_lnorm:
        return h
    n = layer.attn_norm
    return torch.nn.functional.layer_norm(h, h.shape, n.weight.double(), n.bias.double())


def head_nll(model, h: torch.Tensor, target: int) -> float:
    """NLL of one target from the final hidden state (the softmax head is plain torch, reused as is)."""
    nll, _ = model.predict(h.float()[None, None], torch.tensor([[target]]), False)
    return float(nll[0, 0].detach())


def txl_reference(model, stream: list[int], seg_len: int, mem_len: int, same_length: bool = False) -> list[float]:
    """Per-token NLL of Transformer-XL over one lane's token stream (targets = next token), segment by segment,
    the memory being the last mem_len layer inputs. The final position of the stream has no target."""
    cfg = model.cfg
    H, E, D = cfg.n_head, cfg.d_head, cfg.d_model
    L = cfg.n_layer
    mem: list[list[torch.Tensor]] = [[] for _ in range(L)]  # per layer: list of (abs_pos, hidden)
    nlls = []
    emb = model.embed(torch.tensor(stream)[None])[0].double()
    for start in range(0, len(stream) - 1, seg_len):
        positions = list(range(start, min(start + seg_len, len(stream) - 1)))
        h = {p: emb[p] for p in positions}
        for l, layer in enumerate(model.layers):
            u = (model.learned.bias_u[l] if cfg.untie_r else model.learned.bias_u).double()
            v = (model.learned.bias_v[l] if cfg.untie_r else model.learned.bias_v).double()
            keys = mem[l] + [(p, h[p]) for p in positions]
            kv = {p: split_qkv(layer, attn_in(layer, x), H, E) for p, x in keys}
            new_h = {}
            for i in positions:
                q = kv[i][0]
                scores, values = [], []
                for j, _ in keys:
                    if j > i or (same_length and mem_len > 0 and i - j >= mem_len):
                        continue
                    rk = pos_key(layer, i - j, cfg.clamp_len, D, H, E)
                    scores.append((((q + u) * kv[j][1]).sum(-1) + ((q + v) * rk).sum(-1)) / math.sqrt(E))
                    values.append(kv[j][2])
                ctx, _ = softmax_context(scores, values)
                new_h[i] = _finish(layer, h[i], ctx)
            mem[l] = (mem[l] + [(p, h[p]) for p in positions])[-mem_len:] if mem_len else []
            h = new_h
        for i in positions:
            nlls.append(head_nll(model, h[i], stream[i + 1]))
    return nlls


def _finish(layer, h_in: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    out = h_in + layer.attn.o_net.weight.double() @ context.reshape(-1)
    if not layer.pre_lnorm:
        n = layer.attn_norm
        out = torch.nn.functional.layer_norm(out, out.shape, n.weight.double(), n.bias.double())
    return _ff(layer, out)


def lamemo_reference(model, stream: list[int], seg_len: int, mem_len: int):
    """Per-token NLL of LaMemo over one lane's stream, written as the paper states it (eq. 7-12), position by
    position, with alpha = s_past / (s_past + s_ahead + eps) in linear space. Returns (nlls, cache) where cache
    maps layer -> {abs position: (C [H, E], S [H])} for the final memory."""
    cfg = model.cfg
    H, E, D, L = cfg.n_head, cfg.d_head, cfg.d_model, cfg.n_layer
    eps = cfg.interp_eps
    emb_all = model.embed(torch.tensor(stream)[None])[0].double()
    embed: dict[int, torch.Tensor] = {}
    cache: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(L)]
    mem_pos: list[int] = []
    nlls = []
    for s in range(0, len(stream) - 1, seg_len):
        cur = list(range(s, min(s + seg_len, len(stream) - 1)))
        assert len(cur) == seg_len, "reference assumes whole segments"
        window = min(mem_len, seg_len)
        h = {p: embed[p] for p in mem_pos}
        h.update({p: emb_all[p] for p in cur})
        for l, layer in enumerate(model.layers):
            u = (model.learned.bias_u[l] if cfg.untie_r else model.learned.bias_u).double()
            v_left = (model.learned.bias_v[l] if cfg.untie_r else model.learned.bias_v).double()
            everyone = mem_pos + cur
            kv = {p: split_qkv(layer, attn_in(layer, h[p]), H, E) for p in everyone}
            ctx, lse = {}, {}
            for i in cur:  # causal attention, keys to the left: R(i - j), bias v+
                scores, values = [], []
                for j in everyone:
                    if j > i or (cfg.same_length and i - j >= mem_len):
                        continue
                    rk = pos_key(layer, i - j, cfg.clamp_len, D, H, E)
                    scores.append((((kv[i][0] + u) * kv[j][1]).sum(-1) + ((kv[i][0] + v_left) * rk).sum(-1)) / math.sqrt(E))
                    values.append(kv[j][2])
                ctx[i], lse[i] = softmax_context(scores, values)
            for i in mem_pos:  # look-ahead: keys p in (i, s], the newest `window` positions ending at s
                C, S = cache[l][i]
                if cfg.lookahead:
                    scores, values = [], []
                    for p in range(s - window + 1, s + 1):
                        if p <= i or p not in kv:
                            continue
                        if cfg.rpe == "xl":
                            rk, vb = pos_key(layer, i - p, cfg.clamp_len, D, H, E), v_left
                        else:
                            rk = pos_key(layer, p - i, cfg.clamp_len, D, H, E)
                            vb = (model.learned.bias_v_ahead[l] if cfg.untie_r else model.learned.bias_v_ahead).double()
                        scores.append((((kv[i][0] + u) * kv[p][1]).sum(-1) + ((kv[i][0] + vb) * rk).sum(-1)) / math.sqrt(E))
                        values.append(kv[p][2])
                    A, F = softmax_context(scores, values)
                    alpha = S.exp() / (S.exp() + F.exp() + eps) if cfg.interpolate else torch.zeros_like(S)
                    C = alpha[:, None] * C + (1 - alpha[:, None]) * A
                    S = torch.log(S.exp() + F.exp())
                ctx[i], lse[i] = C, S
            if l < L - 1:
                h = {p: _finish(layer, h[p], ctx[p]) for p in everyone}
            else:
                h = {p: _finish(layer, h[p], ctx[p]) for p in cur}
            cache[l] = {p: (ctx[p], lse[p]) for p in everyone}
        for i in cur:
            nlls.append(head_nll(model, h[i], stream[i + 1]))
            embed[i] = emb_all[i]
        mem_pos = (mem_pos + cur)[-mem_len:]
        cache = [{p: c[p] for p in mem_pos} for c in cache]
    return nlls, cache


def rmt_sees(q_block: str, q_off: int, k_block: str, k_off: int, mem_len: int, same_length: bool) -> bool:
    """RMT visibility, rule by rule. Blocks: "cache", "read", "tok", "write"; offsets count tokens from the
    segment's first token (cache slots are negative: the M positions before it)."""
    if q_block == "write":
        return True  # write rows gather the whole segment
    if k_block == "read":
        return True  # every row reads the memory; read rows see each other both ways
    far = same_length and mem_len > 0 and q_block == "tok" and q_off - k_off >= mem_len
    if k_block == "cache":
        return not far  # the past
    if q_block == "tok" and k_block == "tok":
        return k_off <= q_off and not far  # causal
    return False  # read rows see no tokens; nobody but the write rows sees the write block


def rmt_reference(model, segments, resets, mem_len: int, same_length: bool = False):
    """One lane of the Recurrent Memory Transformer, segment by segment, with explicit loops.

    segments: list of (tokens, targets) lists; resets[s]: segment s starts a new document. Per layer the keys are
    [cache M | read R | tokens N | write R] at positions 0, 1, ...; the score uses R(i - j) with the signed
    distance. Returns per segment: (token nlls, write outputs [R, D] float64, nll of cfg.aux_token_id per write row).
    """
    cfg = model.cfg
    H, E, D, R, M = cfg.n_head, cfg.d_head, cfg.d_model, cfg.num_mem_tokens, mem_len
    init = [model.learned.memory_init[i].double() for i in range(R)]
    mem = None
    cache = [[None] * M for _ in range(cfg.n_layer)]  # per layer, M slots: a layer input, or None (empty)
    results = []
    for (toks, tgts), reset in zip(segments, resets):
        if reset or mem is None:
            mem = init
            cache = [[None] * M for _ in range(cfg.n_layer)]
        N = len(toks)
        emb = model.embed(torch.tensor(toks)[None])[0].double()
        rows = [("read", -1)] * R + [("tok", t) for t in range(N)] + [("write", N)] * R  # (block, offset)
        h = list(mem) + [emb[t] for t in range(N)] + list(mem)
        for l, layer in enumerate(model.layers):
            u = (model.learned.bias_u[l] if cfg.untie_r else model.learned.bias_u).double()
            v = (model.learned.bias_v[l] if cfg.untie_r else model.learned.bias_v).double()
            # keys: (position, block, offset, layer input)
            keys = [(m, "cache", m - M, cache[l][m]) for m in range(M) if cache[l][m] is not None]
            keys += [(M + i, blk, off, h[i]) for i, (blk, off) in enumerate(rows)]
            kv = {pos: split_qkv(layer, attn_in(layer, x), H, E) for pos, _, _, x in keys}
            new_h = []
            for i, (q_blk, q_off) in enumerate(rows):
                q = kv[M + i][0]
                scores, values = [], []
                for j, k_blk, k_off, _ in keys:
                    if not rmt_sees(q_blk, q_off, k_blk, k_off, M, same_length):
                        continue
                    rk = pos_key(layer, (M + i) - j, cfg.clamp_len, D, H, E)
                    scores.append((((q + u) * kv[j][1]).sum(-1) + ((q + v) * rk).sum(-1)) / math.sqrt(E))
                    values.append(kv[j][2])
                ctx, _ = softmax_context(scores, values)
                new_h.append(_finish(layer, h[i], ctx))
            if M:
                cache[l] = (cache[l] + h[R : R + N])[-M:]
            h = new_h
        nlls = [0.0 if tgts[t] == -100 else head_nll(model, h[R + t], tgts[t]) for t in range(N)]
        write = h[R + N :]
        aux = [head_nll(model, w, cfg.aux_token_id) for w in write]
        results.append((nlls, torch.stack(write), aux))
        mem = write
    return results
