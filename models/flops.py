"""Analytic parameter counts and forward FLOPs per predicted token for every architecture.

Shape letters (models/shapes.md): B lanes, N segment length (the target length), M memory length, K keys
(M + N), W look-ahead window (min(M, N)), L layers, D model width, H heads, E head width, A attention width (H·E),
I inner width (d_inner; F_ in the code), V vocabulary, R memory tokens (RMT), Z clusters of the adaptive softmax
(len(cutoffs) + 1).

What `flops_per_token` counts
-----------------------------
* Matrix multiplications only, 2 FLOPs per multiply-accumulate (so halve `total` for "MACs", the unit that
  fvcore/thop-style counters and many papers call FLOPs). Not counted: embedding lookups, sinusoids, biases,
  layer norms, activations, softmax/logsumexp, masking, gathers, LaMemo's interpolation — all O(D) or O(K) per
  token per layer, small next to the matmuls.
* Forward pass only (a training step costs about 3x: forward + backward).
* Per *predicted* token: one lane's work for one segment divided by the N tokens it predicts. The one exception
  is the relative-position projection W_R R(d): the model computes it once per segment for the whole batch, so it
  is divided by `batch_size * N` (`batch_size=1` by default: the per-lane cost).
* Attention is counted as computed: the full score matrix for every query over every key slot (masked entries
  included), and the position term once per (query, distance slot) before it is gathered into the score matrix.
* Memory positions are re-projected every segment (Transformer-XL caches layer *inputs*): k and v for M memory
  positions per layer; q only for the N current tokens (`RelativeAttention.project(h, n_query=N)`).
* The adaptive softmax projects the head input once per token and, with div_val == 1 (one shared table), reuses
  that projection for the tail clusters.
* Each arch's own terms: its `layer_flops` docstring, in its module (models/README.md).

Adaptive softmax assumption
---------------------------
Every token pays for the head: the shortlist [0, cutoffs[0]) plus one logit per tail cluster (and the head's
projection when its width differs from D). Tail cluster i is paid only by the tokens whose target falls in it
(what `AdaptiveLogSoftmax` does when training without logits), so its cost is weighted by the fraction of tokens
in that cluster. By default those fractions come from Zipf's law (frequency ∝ 1/rank, the vocabulary sorted by
frequency, as adaptive softmax requires): the mass of ranks [lo, hi) is (H_hi - H_lo) / H_V with H the harmonic
numbers. For WikiText-103 (cutoffs 20k/40k/200k) that puts ~80% of tokens in the shortlist and ~20% in the
tails; pass measured `tail_fractions` for a real corpus. Input tokens are assumed to follow the same
distribution (adaptive *input* projections, div_val > 1, are weighted the same way). `full_softmax=True` counts
every cluster for every token (generation / `return_logits=True`, and apparently how the LaMemo paper counted).
With div_val == 1 the tails share the head's projection, counted once.
"""

from __future__ import annotations

from .config import ModelConfig
from .registry import arch_spec

# LaMemo paper, Table 1: "#Params" and "#FLOPS" per model (the Compressive Transformer's as LaMemo reports it)
PAPER_WT103_PARAMS = {"transformer": 151e6, "txl": 151e6, "lamemo": 151e6, "compressive": 161e6,
                      "infinite_former": 160e6}
PAPER_WT103_FLOPS = {"transformer": 148e6, "txl": 157e6, "lamemo": 191e6, "compressive": 169e6,
                     "infinite_former": 235e6}
# Each arch's own keys at that size (its configs/paper/wt103 preset)
PAPER_WT103_OPTIONS = {"compressive": dict(compressed_len=150, compression_rate=3),
                       "infinite_former": dict(ltm_basis=150, ltm_sticky=True)}


def paper_wt103_config(arch: str) -> ModelConfig:
    """The LaMemo paper's WikiText-103 base model (Transformer-XL base): 16 layers, 10 heads x 41, d_model 410,
    d_inner 2100, adaptive input/softmax with cutoffs 20k/40k/200k, div_val 1, tied weights, N = M = 150
    (M = 0 for the Transformer+RPE baseline); the Compressive Transformer with 150 compressed slots at rate 3,
    the ∞-former with 150 basis functions and sticky memories (configs/paper/wt103/)."""
    extra = PAPER_WT103_OPTIONS.get(arch, {})
    return ModelConfig(
        arch=arch, n_layer=16, n_head=10, d_model=410, d_head=41, d_inner=2100, vocab_size=267735,
        cutoffs=[20000, 40000, 200000], div_val=1, tie_weight=True, tgt_len=150,
        mem_len=0 if arch_spec(arch).mem_len == "zero" else 150, dropout=0.1, **extra,
    ).validate()


# ----------------------------------------------------------------------------------------------------------
# Adaptive input / softmax geometry


def softmax_clusters(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(lo, hi, width) for every cluster; the widths follow models/adaptive.py."""
    edges = [0] + list(cfg.cutoffs) + [cfg.vocab_size]
    de = cfg.embed_dim
    widths = [de] * (len(edges) - 1) if cfg.div_val == 1 else [de // cfg.div_val**i for i in range(len(edges) - 1)]
    return [(lo, hi, w) for (lo, hi), w in zip(zip(edges[:-1], edges[1:]), widths)]


def zipf_cluster_fractions(vocab_size: int, cutoffs: list[int], exponent: float = 1.0) -> list[float]:
    """Fraction of tokens in every cluster (head first) when token frequency ∝ rank**-exponent."""
    edges = [0] + list(cutoffs) + [vocab_size]
    # Partial sums of r**-s for r = 1..n, at the cluster edges only (exact sum, float64 precision is plenty).
    prefix, total, r = {0: 0.0}, 0.0, 1
    for edge in edges[1:]:
        while r <= edge:
            total += r ** -exponent
            r += 1
        prefix[edge] = total
    return [(prefix[hi] - prefix[lo]) / total for lo, hi in zip(edges[:-1], edges[1:])]


def _cluster_fractions(cfg: ModelConfig, tail_fractions: list[float] | None) -> list[float]:
    if not cfg.cutoffs:
        return [1.0]
    if tail_fractions is None:
        return zipf_cluster_fractions(cfg.vocab_size, cfg.cutoffs)
    tails = [float(f) for f in tail_fractions]
    if len(tails) != len(cfg.cutoffs) or any(f < 0 for f in tails) or sum(tails) > 1 + 1e-9:
        raise ValueError(f"tail_fractions needs {len(cfg.cutoffs)} non-negative fractions summing to <= 1, got {tails}")
    return [1.0 - sum(tails)] + tails


def _embedding_flops(cfg: ModelConfig, fractions: list[float]) -> float:
    """Adaptive-input projections per input token (lookups are free)."""
    D = cfg.d_model
    clusters = softmax_clusters(cfg)
    if cfg.div_val == 1:
        w = clusters[0][2]
        return 2.0 * w * D if w != D else 0.0
    return sum(f * 2.0 * w * D for f, (_, _, w) in zip(fractions, clusters) if w != D)


def head_row_flops(cfg: ModelConfig, fractions: list[float], full_softmax: bool) -> tuple[float, float]:
    """Softmax-head FLOPs per scored row."""
    D = cfg.d_model
    clusters = softmax_clusters(cfg)
    n_tail = len(clusters) - 1
    lo0, hi0, w0 = clusters[0]
    proj0 = 2.0 * D * w0 if w0 != D else 0.0
    flops = proj0 + 2.0 * w0 * (hi0 - lo0 + n_tail)
    for f, (lo, hi, w) in zip(fractions[1:], clusters[1:]):
        weight = 1.0 if full_softmax else f
        if cfg.div_val != 1 and w != D:
            flops += weight * 2.0 * D * w
        flops += weight * 2.0 * w * (hi - lo)
    return flops


# ----------------------------------------------------------------------------------------------------------
# FLOPs


def flops_per_token(
    cfg: ModelConfig,
    *,
    tail_fractions: list[float] | None = None,
    batch_size: int = 1,
    full_softmax: bool = False,
) -> dict[str, float]:
    """Forward FLOPs per predicted token for cfg (module docstring: what is counted and what is assumed).

    Returns a breakdown — embedding, attn_proj (q, k, v, output), pos_proj (W_R R), attn_content (q k^T),
    attn_position (the relative-position term), attn_context (probabilities x v), ffn, head — plus `total`
    (their sum) and `macs` (total / 2).
    """
    cfg.validate()
    N = cfg.tgt_len
    spec = arch_spec(cfg.arch)
    if spec.flops:  # a backbone not memlm's counts itself (its registry entry)
        seg = spec.load("flops")(cfg, batch_size)
        out = {k: v / N for k, v in seg.items()}
        out["total"] = sum(out.values())
        out["macs"] = out["total"] / 2
        return out
    fractions = _cluster_fractions(cfg, tail_fractions)
    seg = dict(embedding=0.0, attn_proj=0.0, pos_proj=0.0, attn_content=0.0, attn_position=0.0,
               attn_context=0.0, ffn=0.0, head=0.0)
    head_row = head_row_flops(cfg, fractions, full_softmax)
    seg["embedding"] = N * _embedding_flops(cfg, fractions)

    layers, head_rows = arch_spec(cfg.arch).load("layer_flops")(cfg, batch_size)
    for name, value in layers.items():  # an arch may add components of its own (the compressive memory's)
        seg[name] = seg.get(name, 0.0) + value

    seg["head"] += head_rows * head_row
    out = {k: v / N for k, v in seg.items()}
    out["total"] = sum(out.values())
    out["macs"] = out["total"] / 2
    return out


def paper_convention_macs(cfg: ModelConfig) -> float:
    """Per-token cost in the convention that reproduces the LaMemo paper's Table 1 "#FLOPS" (to ~1.5%):
    multiply-accumulates of the linear layers and of the attention's q.k and p.v products, every token paying
    the whole output layer (all clusters), without the relative-position projection W_R R and position term."""
    f = flops_per_token(cfg, full_softmax=True)
    return (f["total"] - f["pos_proj"] - f["attn_position"]) / 2


# ----------------------------------------------------------------------------------------------------------
# Parameters


def param_count(cfg: ModelConfig) -> int:
    """Number of distinct parameters (tied tensors counted once) of build_model(cfg), computed from cfg alone."""
    cfg.validate()
    if arch_spec(cfg.arch).params:  # a backbone not memlm's counts itself (its registry entry)
        return arch_spec(cfg.arch).load("params")(cfg)
    D, A, F_, L, H, E = cfg.d_model, cfg.n_head * cfg.d_head, cfg.d_inner, cfg.n_layer, cfg.n_head, cfg.d_head
    clusters = softmax_clusters(cfg)
    n_tables = 1 if cfg.div_val == 1 else len(clusters)
    sizes = [cfg.vocab_size] if cfg.div_val == 1 else [hi - lo for lo, hi, _ in clusters]
    widths = [w for _, _, w in clusters][:n_tables]
    tables = sum(n * w for n, w in zip(sizes, widths)) + sum(D * w for w in widths if w != D)
    embedding = tables
    head = cfg.vocab_size + (len(clusters) - 1) * (widths[0] + 1)  # bias, cluster logits (weight + bias)
    if not cfg.tie_weight:
        head += tables
    layer = 3 * D * A + D * A + A * D + 2 * D  # qkv, W_R, output, attention LayerNorm
    layer += D * F_ + F_ + F_ * D + D + 2 * D  # FFN and its LayerNorm
    n_bias = (L if cfg.untie_r else 1) * H * E
    total = embedding + head + L * layer + 2 * n_bias  # u, v
    if cfg.pre_lnorm:
        total += 2 * D  # final LayerNorm
    spec = arch_spec(cfg.arch)
    if spec.extra_params:
        total += spec.load("extra_params")(cfg)
    return total


# ----------------------------------------------------------------------------------------------------------
# What each arch's layer_flops (in its own module, named by its registry entry: one lane's segment, by component,
# and the head's rows) builds on.


def matmul_flops(rows: float, d_in: int, d_out: int) -> float:
    """FLOPs of one [rows, d_in] x [d_in, d_out] product."""
    return 2.0 * rows * d_in * d_out


def layer_dims(cfg: ModelConfig) -> tuple:
    """D, A, I, L, N, M (the legend above; I is F_ where it is unpacked) and the matmul counter."""
    return cfg.d_model, cfg.n_head * cfg.d_head, cfg.d_inner, cfg.n_layer, cfg.tgt_len, cfg.mem_len, matmul_flops


def segment_components() -> dict[str, float]:
    return dict(attn_proj=0.0, pos_proj=0.0, attn_content=0.0, attn_position=0.0, attn_context=0.0, ffn=0.0,
                head=0.0)


if __name__ == "__main__":  # python -m memlm.models.flops: the WikiText-103 table
    for arch in PAPER_WT103_PARAMS:
        cfg = paper_wt103_config(arch)
        f, full = flops_per_token(cfg), flops_per_token(cfg, full_softmax=True)
        print(f"{arch:12s} params {param_count(cfg):,}  FLOPs/token {f['total'] / 1e6:6.1f}M "
              f"(MACs {f['macs'] / 1e6:5.1f}M; full-softmax MACs {full['macs'] / 1e6:5.1f}M; paper convention "
              f"{paper_convention_macs(cfg) / 1e6:5.1f}M; paper {PAPER_WT103_FLOPS[arch] / 1e6:.0f}M)")
