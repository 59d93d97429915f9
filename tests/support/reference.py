"""Slow, obvious references for the model tests, written from the papers' definitions over *absolute positions*.

Every reference runs ONE lane: a token stream `tokens[0..T)` cut into segments of N (segment k covers
[kN, kN + N)), with documents starting at the positions in `doc_starts` (each a segment start; 0 is always one).
For every query the set of keys it may see, and their distances, follow from its absolute position, the segment
boundaries and the document starts alone; the references never build a memory tensor, a mask matrix or a
distance index the way the models do. The tests run the model with several lanes whose reset points differ and
compare each lane with its own reference.

Shared with the models: their *weights* only (embedding table, q/k/v/o/r projections, u/v biases, LayerNorm and
FFN parameters, softmax weights), applied here with plain float64 maths. No function of `models/` is called:
not the attention, masking, position, memory, embedding or softmax code. Dropout is off (the models are in eval
mode), so none is drawn here.

Sources (paths under ../shared/papers/):
  [XL]  transformer-xl-recurrent-memory-explainer.txt: line 106 (h~_tau = StopGrad(h_{tau-1}) o h_tau: keys of
        cached positions are the layer inputs computed when they were current), lines 405-420 (score with r_{i-j},
        the global u and v), lines 440-465 (sinusoid encodings of signed distances; the explainer interleaves
        sin/cos, the authors' code, followed here, puts all sines first: a fixed permutation W_R absorbs).
  [LM]  lamemo-look-ahead-memory.txt, cited by line and equation below.
  [RMT] recurrent-memory-transformer.txt, cited by line below; lines 159-171 for its Tr-XL cache (eq. 1).
Where a paper is silent the rule comes from docs/design.md §3 or the authors' code, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# Plain maths over the model's weights (float64). Nothing here is specific to an architecture.


def sinusoid_vec(d: float, dim: int) -> torch.Tensor:
    """R(d) [dim]: sines then cosines (the Transformer-XL authors' layout), inverse frequencies
    1 / 10000^(2f / dim) ([XL] 440-465, Vaswani et al.)."""
    half = dim // 2
    sines = [math.sin(d / 10000 ** (2 * f / dim)) for f in range(half)]
    cosines = [math.cos(d / 10000 ** (2 * f / dim)) for f in range(half)]
    return torch.tensor(sines + cosines, dtype=torch.float64)


def clamped(d: int, clamp_len: int) -> int:
    """Transformer-XL's clamp_len, as the authors' code applies it: a distance ABOVE clamp_len uses R(clamp_len);
    only the maximum is clamped, so negative distances keep their own encodings."""
    return min(d, clamp_len) if clamp_len > 0 else d


class Weights:
    """The model's parameters as float64 tensors, and the per-layer linear maps of the papers. With grad=True (a
    float64 model) the tensors are the parameters themselves, so a reference's loss backpropagates into them."""

    def __init__(self, model, grad: bool = False):
        self.grad = grad
        cfg = self.cfg = model.cfg
        assert not cfg.cutoffs and cfg.embed_dim == cfg.d_model, "references cover the plain softmax"
        self.H, self.E, self.D = cfg.n_head, cfg.d_head, cfg.d_model
        self.table = self.p(model.embed.tables[0].weight)
        self.out_w = self.p(model.head.weights[0])  # tied to the table by default
        self.out_b = self.p(model.head.bias)
        self.final_norm = model.final_norm if cfg.pre_lnorm else None
        self.layers = model.layers
        self.learned = {n: self.p(p) for n, p in model.learned.named_parameters()}
        self._pos: dict[tuple[int, int], torch.Tensor] = {}

    def p(self, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter as float64: detached, or itself with grad=True."""
        return tensor.double() if self.grad else tensor.detach().double()

    def bias(self, name: str, l: int) -> torch.Tensor:
        b = self.learned[name]
        return b[l] if self.cfg.untie_r else b

    def embed(self, token: int) -> torch.Tensor:
        """Token embedding scaled by sqrt(D), as Transformer-XL scales its input embeddings."""
        return self.table[token] * math.sqrt(self.D)

    def _ln(self, norm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape, self.p(norm.weight), self.p(norm.bias), norm.eps)

    def qkv(self, l: int, x: torch.Tensor):
        """Layer input x [D] -> q, k, v [H, E] (pre-LN normalises what they are projected from)."""
        layer = self.layers[l]
        a = self._ln(layer.attn_norm, x) if layer.pre_lnorm else x
        q = self.p(layer.attn.q_net.weight) @ a
        k, v = (self.p(layer.attn.kv_net.weight) @ a).view(2, -1)
        return q.view(self.H, self.E), k.view(self.H, self.E), v.view(self.H, self.E)

    def pos(self, l: int, d: int) -> torch.Tensor:
        """W_R R(d) [H, E] for an already clamped distance d."""
        if (l, d) not in self._pos:
            w = self.p(self.layers[l].attn.r_net.weight)
            self._pos[(l, d)] = (w @ sinusoid_vec(d, self.D)).view(self.H, self.E)
        return self._pos[(l, d)]

    def score(self, l: int, q, k, u, v_bias, d: int) -> torch.Tensor:
        """[XL] 405-420: (q + u).k + (q + v).W_R R(d), scaled by 1/sqrt(E); [H]."""
        return (((q + u) * k).sum(-1) + ((q + v_bias) * self.pos(l, d)).sum(-1)) / math.sqrt(self.E)

    def finish(self, l: int, x: torch.Tensor, context: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection, residual and LayerNorm around the attention, then the FFN: x [D], context [H, E];
        extra [D] is added to the attention's output (the ∞-former's long-term read)."""
        layer = self.layers[l]
        out = x + self.p(layer.attn.o_net.weight) @ context.reshape(-1)
        if extra is not None:
            out = out + extra
        if not layer.pre_lnorm:
            out = self._ln(layer.attn_norm, out)
        lin1, lin2 = layer.ff.net[0], layer.ff.net[3]

        def ffn(y):
            hidden = torch.relu(self.p(lin1.weight) @ y + self.p(lin1.bias))
            return self.p(lin2.weight) @ hidden + self.p(lin2.bias)

        if layer.pre_lnorm:
            return out + ffn(self._ln(layer.ff.norm, out))
        return self._ln(layer.ff.norm, out + ffn(out))

    def nll(self, h: torch.Tensor, target: int) -> float:
        """-log p(target) through the (tied) softmax over the final hidden state; 0 for the ignore index."""
        return float(self.loss(h, target))

    def loss(self, h: torch.Tensor, target: int) -> torch.Tensor:
        """nll as a float64 tensor (in the graph with grad=True)."""
        if target == -100:
            return torch.zeros((), dtype=torch.float64)
        if self.final_norm is not None:
            h = self._ln(self.final_norm, h)
        logits = self.out_w @ h + self.out_b
        return -torch.log_softmax(logits, dim=0)[target]


def softmax_over(scores: list[torch.Tensor], values: list[torch.Tensor]):
    """One softmax over the listed keys: scores K x [H], values K x [H, E] -> context [H, E], log-normaliser [H]."""
    s = torch.stack(scores)  # [K, H]
    lse = torch.logsumexp(s, dim=0)
    p = torch.exp(s - lse)
    return (p[:, :, None] * torch.stack(values)).sum(0), lse


def doc_start_of(i: int, doc_starts) -> int:
    """The document start at or before absolute position i."""
    return max(d for d in doc_starts if d <= i)


def lane_doc_starts(resets, lane: int, seg_len: int) -> set[int]:
    """resets: per segment None or [B] bool (reset before that segment) -> the lane's document starts."""
    return {0} | {k * seg_len for k, r in enumerate(resets) if r is not None and bool(r[lane])}


# ---------------------------------------------------------------------------------------------------------------
# Transformer-XL (and the Transformer+RPE baseline, M = 0)


def txl_sees(i: int, j: int, seg_start: int, doc: int, M: int, same_length: bool) -> bool:
    """Query at absolute position i (segment starting at seg_start, document starting at doc) may attend key j:
    the past of its own document (j <= i, j >= doc) that is in the current segment or among the M positions
    cached before it (j >= seg_start - M: the cache holds the last M positions, [XL] line 106 / [RMT] eq. 1);
    same_length (the authors' evaluation option) additionally keeps i - j < M so every query sees M keys."""
    return doc <= j <= i and j >= seg_start - M and not (same_length and M > 0 and i - j >= M)


def txl_reference(model, tokens: list[int], targets: list[int], seg_len: int, doc_starts) -> list[float]:
    """Per-token NLL of one lane. The layer-l key of position j is the layer-l INPUT of j computed when j was
    current (stop-gradient reuse, [XL] line 106); the score uses R(i - j) with clamp_len on the maximum."""
    W, cfg = Weights(model), model.cfg
    M = cfg.mem_len
    kv: list[dict[int, tuple]] = [{} for _ in range(cfg.n_layer)]  # per layer: position -> q, k, v of its input
    nlls: list[float] = []
    for s in range(0, len(tokens), seg_len):
        cur = range(s, min(s + seg_len, len(tokens)))
        doc = doc_start_of(s, doc_starts)
        h = {i: W.embed(tokens[i]) for i in cur}
        for l in range(cfg.n_layer):
            for i in cur:  # computed once, from the layer input: later segments reuse them as cached keys
                kv[l][i] = W.qkv(l, h[i])
            u, v = W.bias("bias_u", l), W.bias("bias_v", l)
            new_h = {}
            for i in cur:
                q = kv[l][i][0]
                scores, values = [], []
                for j in range(0, i + 1):
                    if txl_sees(i, j, s, doc, M, cfg.same_length):
                        _, k, val = kv[l][j]
                        scores.append(W.score(l, q, k, u, v, clamped(i - j, cfg.clamp_len)))
                        values.append(val)
                ctx, _ = softmax_over(scores, values)
                new_h[i] = W.finish(l, h[i], ctx)
            h = new_h
        nlls += [W.nll(h[i], targets[i]) for i in cur]
    return nlls


# ---------------------------------------------------------------------------------------------------------------
# LaMemo


@dataclass
class LaMemoSegment:
    nll: list[float]  # per token of the segment
    cache: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]  # per layer: position -> (C [H, E], S [H]) after it


def lamemo_memory(seg_start: int, doc: int, M: int) -> range:
    """The memory of the segment starting at seg_start: the last M positions before it, in its document
    ([LM] §2.2 line 239 and §3.1 line 354: X_{tau-1} = [x_{tau-M+1}, ..., x_tau], the segment being
    X_tau = [x_{tau+1}, ..., x_{tau+N}], line 156)."""
    return range(max(doc, seg_start - M), seg_start)


def lamemo_lookahead_keys(i: int, seg_start: int, N: int) -> list[int]:
    """Look-ahead keys of memory position i: [LM] eq. (7) (line 370, "only requires the newest N positions on the
    right", lines 367-368) takes [x_{tau-N+2}, ..., x_{tau+1}], ending at x_{tau+1}, the FIRST token of the
    current segment (X_tau = [x_{tau+1}, ...], line 156): "x_i can attend to position x_j on its right (j > i)
    without causing information leakage as long as j <= tau+1" (lines 357-360; footnote 3, lines 85-86);
    eq. (9)'s softmax "masks position j <= i" (line 392), so only p > i remain (with M < N this is the
    min(M, N) window of docs/design.md §3). Successive windows tile every position to i's right ("the target segment
    moves forward N positions at each iteration", lines 363-364)."""
    return [p for p in range(seg_start - N + 1, seg_start + 1) if p > i]


def lamemo_reference(model, tokens: list[int], targets: list[int], seg_len: int, doc_starts) -> list[LaMemoSegment]:
    """One lane of LaMemo, segment by segment over absolute positions. For the segment starting at s (document
    start d), at every layer l:

      * hidden states: h^0 is the token embedding of every position (memory and current); memory hidden states
        at layers >= 1 are recomputed in THIS segment from h^0 (docs/design.md §3; [LM] lines 433-435: C<-> "are
        further fed to the non-linear transformation defined in Eq. 3 to update representations in higher
        layers"; Figure 4, lines 411-413), h^{l+1}[p] = f(h^l[p] + W_o context[p]) ([LM] eq. (3), lines
        192-207) for memory and current positions alike;
      * current token i: keys j with d <= j <= i (eq. (2)'s causal mask, line 186), j >= s - M (the memory,
        eq. (5), line 245), plus i - j < M under same_length (Transformer-XL's evaluation option, not in the
        paper); score eq. (12) (lines 506-518) with i >= j: (q_i + u).k_j + (q_i + v+).W_R R(|i - j|); its
        context C and log-normaliser S (the log of s->, "the denominator of the softmax in Eq. 2", lines
        447-449) are cached;
      * memory position i (lookahead on): keys lamemo_lookahead_keys(i, s, N); score eq. (12) with j > i:
        (q_i + u).k_p + (q_i + v-).W_R R(|i - p|), the projections shared with the causal attention (lines
        394-396); rpe "xl": eq. (6) (lines 296-302) applied to j > i, i.e. R_{i-j} = R_{-Delta} (lines
        477-479): (q_i + u).k_p + (q_i + v).W_R R(i - p), the signed negative distance; context A,
        log-denominator F ("the denominator of the softmax in Eq. 9", lines 450-451);
        interpolation eq. (10)-(11) (lines 421-452): alpha = s-> / (s-> + s<- + eps) with s-> = exp(S),
        s<- = exp(F), computed here in linear space; C' = alpha C + (1 - alpha) A; S' = log(s-> + s<-), so
        that the next segment's s-> is the denominator over every key C' averages (Appendix A, lines 908-948:
        C' is one softmax over the past and the future keys). interpolate off ("set the memorizing
        coefficient alpha = 0", line 720): C' = A. lookahead off ("only use the causal context
        representations C->", line 722): C' = C, S' = S. The memory position's next-layer input is
        f(h^l[i] + W_o C').
      * cache after the segment: (C', S') of memory positions, (C, S) of current positions, by position.
    """
    W, cfg = Weights(model), model.cfg
    M, N, eps = cfg.mem_len, seg_len, cfg.interp_eps
    cache: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.n_layer)]
    results = []
    for s in range(0, len(tokens), N):
        cur = list(range(s, s + N))
        assert cur[-1] < len(tokens), "whole segments only"
        doc = doc_start_of(s, doc_starts)
        mem = list(lamemo_memory(s, doc, M))
        h = {p: W.embed(tokens[p]) for p in mem + cur}
        new_cache = []
        for l in range(cfg.n_layer):
            u, v_left = W.bias("bias_u", l), W.bias("bias_v", l)
            qkv = {p: W.qkv(l, h[p]) for p in mem + cur}
            ctx = {}
            layer_cache = {}
            for i in cur:
                scores, values = [], []
                for j in mem + cur:
                    if txl_sees(i, j, s, doc, M, cfg.same_length):
                        scores.append(W.score(l, qkv[i][0], qkv[j][1], u, v_left, clamped(abs(i - j), cfg.clamp_len)))
                        values.append(qkv[j][2])
                ctx[i], S = softmax_over(scores, values)
                layer_cache[i] = (ctx[i], S)
            for i in mem:
                C, S = cache[l][i]
                if cfg.lookahead:
                    scores, values = [], []
                    for p in lamemo_lookahead_keys(i, s, N):
                        if cfg.rpe == "xl":
                            sc = W.score(l, qkv[i][0], qkv[p][1], u, v_left, clamped(i - p, cfg.clamp_len))
                        else:
                            v_right = W.bias("bias_v_ahead", l)
                            sc = W.score(l, qkv[i][0], qkv[p][1], u, v_right, clamped(abs(i - p), cfg.clamp_len))
                        scores.append(sc)
                        values.append(qkv[p][2])
                    A, Fn = softmax_over(scores, values)
                    s_past, s_ahead = torch.exp(S), torch.exp(Fn)
                    alpha = s_past / (s_past + s_ahead + eps) if cfg.interpolate else torch.zeros_like(S)
                    C = alpha[:, None] * C + (1 - alpha[:, None]) * A
                    S = torch.log(s_past + s_ahead)
                ctx[i] = C
                layer_cache[i] = (C, S)
            h = {p: W.finish(l, h[p], ctx[p]) for p in mem + cur}
            new_cache.append(layer_cache)
        cache = new_cache
        results.append(LaMemoSegment(nll=[W.nll(h[i], targets[i]) for i in cur], cache=cache))
    return results


# ---------------------------------------------------------------------------------------------------------------
# Recurrent Memory Transformer (+ the Transformer-XL cache)


@dataclass
class RMTSegment:
    nll: list[float]  # per token of the segment
    write: torch.Tensor  # [R, D] final outputs of the write rows (the next segment's memory tokens)
    aux_nll: list[float]  # per write row: NLL of cfg.aux_token_id
    cache: list[list[torch.Tensor | None]]  # per layer: the M slots the next segment's cache holds (None: empty)


def rmt_sees(q_kind: str, q_pos: int, k_kind: str, k_pos: int, from_cache: bool, M: int, same_length: bool,
             read_mem_from_cache: bool, write_mem_from_cache: bool = False) -> bool:
    """Query row (kind, position in the lane's row stream) may attend key row. Kinds: "read", "tok", "write".

    Current segment ([RMT] lines 256-258, 289-291, Figure 6 d): read rows see the read block, both directions
    ("all memory tokens in the read/write block access all other tokens in the same block"); token rows see
    the read block ("allows sequence tokens to attend to memory states produced at the previous segment") and
    are causal among tokens ("the causal attention mask is applied only to tokens"), never the write block
    (they would see the future); write rows "attend to all current segment tokens": the whole segment.
    Cache (Tr-XL + RMT, lines 82-83, 433): token rows read it; the memory rows (read and write blocks) only with
    read_mem_from_cache (the paper is silent; the authors' mask hides it from both blocks, docs/design.md §3), the
    write rows alone with write_mem_from_cache.
    same_length (with M > 0): token rows see no cache or token key M or more rows back.
    """
    if from_cache:
        ok = q_kind == "tok" or read_mem_from_cache or (q_kind == "write" and write_mem_from_cache)
    elif q_kind == "write":
        ok = True
    elif k_kind == "read":
        ok = True
    elif q_kind == "tok" and k_kind == "tok":
        ok = k_pos <= q_pos
    else:
        ok = False
    if ok and same_length and M > 0 and q_kind == "tok" and (from_cache or k_kind == "tok"):
        ok = q_pos - k_pos < M
    return ok


def rmt_reference(model, tokens: list[int], targets: list[int], seg_len: int, doc_starts) -> list[RMTSegment]:
    """One lane of RMT over its ROW STREAM: segment k of the lane contributes rows [read R | tokens N | write R]
    ([RMT] lines 226-249: H~0 = [H_mem o H0 o H_mem]) at row positions k(2R + N) ... k(2R + N) + 2R + N - 1.

      * the read and write rows' layer-0 inputs are both the previous segment's write outputs (lines 262-275:
        H_mem_{tau+1} := H_write_tau), or the learned memory_init at a document start (docs/design.md §3);
      * the Transformer-XL cache ([RMT] eq. 1, lines 159-171: the layer input is [SG(M_-m:) o H]): with
        cache_memory_rows (the authors' code) it holds the last M rows of the row stream before the segment's
        read block, within the document, so a cached row sits at its own row position and its distance to a
        query is the difference of row positions; without it (a memlm variant) it holds the last M TOKEN rows
        of the document, placed right before the read block: the cached token t rows back in the token stream
        (t = 1..M) sits at virtual row position (first read row) - t;
      * keys of cached rows are their layer-l inputs computed when they were current (stop-gradient);
      * score: Transformer-XL's ([XL] 405-420) with the signed distance (query row position - key row
        position), clamp_len on the maximum only (negative distances inside the read/write blocks keep theirs);
      * token rows feed the softmax; every write row's final output predicts cfg.aux_token_id (A.5, lines
        708-711).
    """
    W, cfg = Weights(model), model.cfg
    R, N, M, L = cfg.num_mem_tokens, seg_len, cfg.mem_len, cfg.n_layer
    Q = 2 * R + N
    kinds = ["read"] * R + ["tok"] * N + ["write"] * R
    layer_in: list[dict[int, torch.Tensor]] = [{} for _ in range(L)]  # per layer: row position -> layer input
    kv: list[dict[int, tuple]] = [{} for _ in range(L)]  # per layer: row position -> (q, k, v) of that input
    init = W.learned["memory_init"]
    write = None
    results = []
    for g, s in enumerate(range(0, len(tokens), N)):
        assert s + N <= len(tokens), "whole segments only"
        first = g * Q  # row position of the segment's first read row
        doc = doc_start_of(s, doc_starts)
        doc_first_row = (doc // N) * Q
        mem_in = [init[r] for r in range(R)] if s == doc else list(write)
        rows = list(range(first, first + Q))
        h = dict(zip(rows, mem_in + [W.embed(tokens[t]) for t in range(s, s + N)] + mem_in))

        def cached(first_row: int, seg_start: int):
            """(virtual row position, stored row position) of every key the cache holds for a segment."""
            if cfg.cache_memory_rows:
                return [(p, p) for p in range(max(doc_first_row, first_row - M), first_row)]
            toks = range(max(doc, seg_start - M), seg_start)
            return [(first_row - (seg_start - t), (t // N) * Q + R + t % N) for t in toks]

        for l in range(L):
            for p in rows:  # stored once: later segments reuse these inputs as their cached keys
                layer_in[l][p], kv[l][p] = h[p], W.qkv(l, h[p])
            u, v = W.bias("bias_u", l), W.bias("bias_v", l)
            keys = [(vp, "cache", sp, True) for vp, sp in cached(first, s)]
            keys += [(p, kinds[p - first], p, False) for p in rows]
            new_h = {}
            for p in rows:
                q = kv[l][p][0]
                scores, values = [], []
                for k_pos, k_kind, stored, from_cache in keys:
                    if rmt_sees(kinds[p - first], p, k_kind, k_pos, from_cache, M, cfg.same_length,
                                cfg.read_mem_from_cache, cfg.write_mem_from_cache):
                        _, k, val = kv[l][stored]
                        scores.append(W.score(l, q, k, u, v, clamped(p - k_pos, cfg.clamp_len)))
                        values.append(val)
                ctx, _ = softmax_over(scores, values)
                new_h[p] = W.finish(l, h[p], ctx)
            h = new_h
        write = [h[first + R + N + r] for r in range(R)]
        # what the next segment of this document would find in its cache: slot c of M, oldest first
        nxt = cached(first + Q, s + N)
        slots = []
        for l in range(L):
            by_virtual = {vp: layer_in[l][sp] for vp, sp in nxt}
            slots.append([by_virtual.get(first + Q - M + c) for c in range(M)])
        results.append(RMTSegment(
            nll=[W.nll(h[first + R + t], targets[s + t]) for t in range(N)],
            write=torch.stack(write),
            aux_nll=[W.nll(w, cfg.aux_token_id) for w in write],
            cache=slots,
        ))
    return results


# ---------------------------------------------------------------------------------------------------------------
# Compressive Transformer (Rae et al., 2020; not among ../shared/papers: the rules below are the paper's section 3
# and Algorithm 1-2 as docs/design.md §3 and models/compressive.py's docstring state them)


@dataclass
class CompressiveSegment:
    nll: list[float]
    reconstruction: float  # the segment's attention-reconstruction error, summed over layers (unweighted)


def compressive_reference(model, tokens: list[int], targets: list[int], seg_len: int,
                          doc_starts) -> list[CompressiveSegment]:
    """Per segment s (positions [s, s + N)) of one lane: every layer attends over the compressed slots, the
    memory positions [s - M, s) and the causal past of the segment, all of the current document; memory keys at
    their distances i - j, the C compressed slots (oldest first) as the C positions before the memory. After the
    segment the N oldest rows of [memory | segment], positions [s - M, s - M + N), are compressed c at a time
    (slot = conv over the layer inputs of c consecutive positions); a slot is valid when all c positions are of
    the current document (positions before the lane's first token are empty). Reconstruction: per layer, the
    squared error between the content attention (q.k / sqrt(E), no position term) of the segment's layer inputs
    over the evicted positions and over their slots, mean over queries, heads and widths, summed over layers."""
    W, cfg = Weights(model), model.cfg
    N, M, C, c, L, D = seg_len, cfg.mem_len, cfg.compressed_len, cfg.compression_rate, cfg.n_layer, cfg.d_model
    layer_in: list[dict[int, torch.Tensor]] = [{} for _ in range(L)]  # per layer: position -> its layer input
    slots: list[list[tuple[int, list[torch.Tensor]]]] = [[] for _ in range(L)]  # (first position, per layer)

    def input_of(l: int, p: int) -> torch.Tensor:
        return layer_in[l].get(p, torch.zeros(D, dtype=torch.float64))  # positions < 0: the empty memory

    def compress(l: int, first: int) -> torch.Tensor:
        conv = model.compressors[l].conv
        w, b = conv.weight.detach().double(), conv.bias.detach().double()  # [D, D, c], [D]
        return b + sum(w[:, :, t] @ input_of(l, first + t) for t in range(c))

    def content_attention(l: int, q: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
        if not keys:
            return torch.zeros(W.H, W.E, dtype=torch.float64)
        kv = [W.qkv(l, x)[1:] for x in keys]
        scores = [(q * k).sum(-1) / math.sqrt(W.E) for k, _ in kv]
        ctx, _ = softmax_over(scores, [v for _, v in kv])
        return ctx

    results = []
    for s in range(0, len(tokens), N):
        cur = range(s, s + N)
        doc = doc_start_of(s, doc_starts)
        h = {i: W.embed(tokens[i]) for i in cur}
        evicted = range(s - M, s - M + N)
        new_firsts = list(range(s - M, s - M + N, c))
        error = 0.0
        for l in range(L):
            for i in cur:
                layer_in[l][i] = h[i]
            kept = slots[l][-C:]  # the compressed memory the segment reads, oldest first
            offset = C - len(kept)  # before C slots were made, the first ones are the empty initial memory
            u, v = W.bias("bias_u", l), W.bias("bias_v", l)
            new_h = {}
            for i in cur:
                q = W.qkv(l, h[i])[0]
                scores, values = [], []
                for x, (first, slot) in enumerate(kept):
                    if first >= doc:  # all c positions of the slot are of this document
                        _, k, val = W.qkv(l, slot)
                        scores.append(W.score(l, q, k, u, v, clamped(C + M + (i - s) - (offset + x),
                                                                     cfg.clamp_len)))
                        values.append(val)
                for j in range(max(doc, s - M), i + 1):
                    _, k, val = W.qkv(l, input_of(l, j))
                    scores.append(W.score(l, q, k, u, v, clamped(i - j, cfg.clamp_len)))
                    values.append(val)
                ctx, _ = softmax_over(scores, values)
                new_h[i] = W.finish(l, h[i], ctx)
            # the segment's evicted rows and their compression into this layer's slots
            made = [(first, compress(l, first)) for first in new_firsts]
            for i in cur:
                q = W.qkv(l, h[i])[0]
                old = content_attention(l, q, [input_of(l, j) for j in evicted if j >= doc and j >= 0])
                new = content_attention(l, q, [slot for first, slot in made if first >= doc and first >= 0])
                error += float(((new - old) ** 2).sum()) / (N * W.H * W.E)
            slots[l] += made
            h = new_h
        results.append(CompressiveSegment(nll=[W.nll(h[i], targets[i]) for i in cur], reconstruction=error))
    return results


# ---------------------------------------------------------------------------------------------------------------
# ARMT (Rodkin et al., 2024; not among ../shared/papers: the paper's eqs. 1-4 with the authors' code's epsilon,
# clip and first-segment rule, as models/armt.py's docstring states them)


def dpfp_reference(x: torch.Tensor, nu: int = 3) -> torch.Tensor:
    """Schlag et al.'s DPFP, element by element: x' = [relu(x), relu(-x)] (n = 2d entries), and for j = 1..nu,
    i = 0..n-1 the entry (j - 1) n + i is x'[i] x'[(i - j) mod n]."""
    xp = [max(float(v), 0.0) for v in x] + [max(-float(v), 0.0) for v in x]
    n = len(xp)
    return torch.tensor([xp[i] * xp[(i - j) % n] for j in range(1, nu + 1) for i in range(n)], dtype=torch.float64)


def armt_reference(model, tokens: list[int], targets: list[int], seg_len: int, doc_starts) -> list[list[float]]:
    """Per segment of one lane, the per-token NLL. The segment's rows are its N tokens and then R memory rows whose
    inputs are the learned memory_init; attention is causal over the rows, at distances row - row. Each layer
    first adds to every row what its associative state returns for the row's DPFP query (A^T phi(q) over
    z.phi(q) + eps), then runs the Transformer-XL layer; then each memory row's output m writes, against the state
    before the segment: key k = phi(W_k m), value v = W_v m, gate beta = sigmoid(w_b.m + b), the stored value
    A^T k / (z.k + eps), gamma = clip(1 - (z.k + eps) / (|k|^2 + eps), 0, 1), or 1 when the state is empty;
    A += beta k (v - stored)^T and z += gamma k, summed over the memory rows. A document start empties the state."""
    W, cfg = Weights(model), model.cfg
    N, R, L, D = seg_len, cfg.num_mem_tokens, cfg.n_layer, cfg.d_model
    eps = 1e-5
    memory_init = model.learned.memory_init.detach().double()
    blocks = [{name: getattr(b, name).weight.detach().double() for name in ("query", "key", "value", "beta")}
              for b in model.assoc]
    beta_bias = [float(b.beta.bias.detach()) for b in model.assoc]
    width = 6 * cfg.assoc_dim
    results = []
    for s in range(0, len(tokens), N):
        if s == doc_start_of(s, doc_starts):
            A = [torch.zeros(width, D, dtype=torch.float64) for _ in range(L)]
            z = [torch.zeros(width, dtype=torch.float64) for _ in range(L)]
            empty = True
        rows = [W.embed(tokens[i]) for i in range(s, s + N)] + [memory_init[r] for r in range(R)]
        for l in range(L):
            wts = blocks[l]
            read = []
            for x in rows:
                q = dpfp_reference(wts["query"] @ x)
                read.append(x + (q @ A[l]) / (float(q @ z[l]) + eps))
            rows = read
            qkv = [W.qkv(l, x) for x in rows]
            u, v_bias = W.bias("bias_u", l), W.bias("bias_v", l)
            out = []
            for a in range(len(rows)):
                scores = [W.score(l, qkv[a][0], qkv[b][1], u, v_bias, clamped(a - b, cfg.clamp_len))
                          for b in range(a + 1)]
                ctx, _ = softmax_over(scores, [qkv[b][2] for b in range(a + 1)])
                out.append(W.finish(l, rows[a], ctx))
            rows = out
            delta_A, delta_z = torch.zeros_like(A[l]), torch.zeros_like(z[l])
            for m in rows[N:]:
                k = dpfp_reference(wts["key"] @ m)
                value = wts["value"] @ m
                beta = 1 / (1 + math.exp(-(float(wts["beta"][0] @ m) + beta_bias[l])))
                denominator = float(k @ z[l]) + eps
                stored = (k @ A[l]) / denominator
                gamma = 1.0 if empty else min(max(1 - denominator / (float(k @ k) + eps), 0.0), 1.0)
                delta_A += beta * torch.outer(k, value - stored)
                delta_z += gamma * k
            A[l], z[l] = A[l] + delta_A, z[l] + delta_z
        empty = False
        results.append([W.nll(rows[i], targets[s + i]) for i in range(N)])
    return results
