"""models/flops.py: the analytic parameter count against real models, the analytic FLOPs against
torch.utils.flop_counter on real forward passes, and the LaMemo paper's WikiText-103 base configurations.
"""

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from memlm.models import ARCHITECTURES, ModelConfig, build_model
from memlm.models.flops import (
    PAPER_WT103_FLOPS,
    PAPER_WT103_PARAMS,
    flops_per_token,
    paper_convention_macs,
    paper_wt103_config,
    param_count,
    zipf_cluster_fractions,
)
from support.models import layer_fields, registry_fields, tiny_model_config


def need(arch):
    """Skip (only) when the arch's module cannot be imported yet."""
    module = ARCHITECTURES[arch].model.partition(":")[0]
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 — a module being written may fail in any way
        pytest.skip(f"{module} not importable: {exc!r}")


def tiny(arch, **kw):
    """The arch's registry tiny settings (support.models) at this file's widths (memlm's layers' only: a pretrained
    backbone has its test_settings' own): 6-token segments."""
    spec = ARCHITECTURES[arch]
    return tiny_model_config(**{**registry_fields(spec), **layer_fields(spec, d_model=24, d_head=8, d_inner=40),
                                "tgt_len": 6, **kw})

VARIANTS = {
    "plain": {},
    "untied-untie_r-preln": dict(tie_weight=False, untie_r=True, pre_lnorm=True),
    "adaptive-div1-proj": dict(cutoffs=[10, 30], d_embed=16),
    "adaptive-div2": dict(cutoffs=[10, 30], div_val=2, tie_weight=False),
    "adaptive-div2-proj-tied": dict(cutoffs=[10, 20, 30], div_val=2, d_embed=32, n_layer=3),
}
# A tiny Llama (grouped-query attention, gated MLP, rotary positions, untied head) beside the registry's tiny GPT-2
TINY_LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 64}
GPT2 = dict(ARCHITECTURES["hf"].test_settings)["backbone_config"]
# The pretrained backbones' own variants (their layers are not memlm's: VARIANTS' widths and adaptive softmax are
# memlm's keys, which they refuse)
BACKBONE_VARIANTS = {
    "llama": dict(backbone_config=TINY_LLAMA),
    "gpt2-untied": dict(backbone_config={**GPT2, "tie_word_embeddings": False}),
    "gpt2-lora": dict(backbone_train="lora", lora_rank=3),
    "llama-lora-mlp": dict(backbone_config=TINY_LLAMA, backbone_train="lora", lora_rank=2,
                           lora_targets=["q_proj", "down_proj"]),
}
ARCH_VARIANTS = {  # beyond VARIANTS, for the archs named here
    "lamemo": {"rpe-xl": dict(rpe="xl"), "no-lookahead": dict(lookahead=False, untie_r=True)},
    "rmt": {"cache-aux": dict(mem_len=4, num_mem_tokens=3, aux_loss_weight=0.5, bptt_depth=2)},
    "compressive": {"pool": dict(compression="mean", compressed_len=7, compression_rate=2, mem_len=4)},
    "infinite_former": {"three-widths": dict(ltm_basis=9, ltm_widths=[0.01, 0.05, 0.1])},
    "armt": {"wide-keys": dict(num_mem_tokens=4, assoc_dim=8)},
    "hf": BACKBONE_VARIANTS,
    "hf_rmt": {**BACKBONE_VARIANTS, "five-tokens": dict(num_mem_tokens=5)},
    "hf_armt": {**BACKBONE_VARIANTS, "wide-keys": dict(num_mem_tokens=4, assoc_dim=8)},
}


def param_cases():
    for arch in ARCHITECTURES:
        variants = VARIANTS if ARCHITECTURES[arch].memlm_layers else {"plain": {}}
        for name, kw in {**variants, **ARCH_VARIANTS.get(arch, {})}.items():
            yield pytest.param(arch, kw, id=f"{arch}-{name}")


@pytest.mark.parametrize("arch,kw", list(param_cases()))
def test_param_count_matches_built_model(arch, kw):
    need(arch)
    cfg = tiny(arch, **kw)
    model = build_model(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_param_count_ignores_memory_and_segment_length():
    for arch in ("txl", "lamemo"):
        counts = {param_count(tiny(arch, mem_len=m, tgt_len=n)) for m in (1, 7, 70) for n in (3, 30)}
        assert len(counts) == 1


# ------------------------------------------------------------------------------------------------------------
# FLOPs: analytic vs measured. Plain softmax (no cutoffs) makes the head's cost exact; the adaptive case feeds the
# model targets equal to its inputs and tells the counter the batch's real cluster fractions, which makes it exact
# too.


def cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The flop counter's formula for its CUDA SDPA kernels (the full score matrix, causal or not), for the CPU's
    kernel, which it has no formula for: the pretrained backbones attend through scaled_dot_product_attention."""
    return sdpa_flop_count(query, key, value)


CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa_flops}


def measured_forward_flops(cfg, B, tokens=None, targets=None, return_logits=False):
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    if tokens is None:
        tokens = torch.randint(0, cfg.vocab_size, (B, cfg.tgt_len), generator=gen)
    if targets is None:
        targets = torch.randint(0, cfg.vocab_size, (B, cfg.tgt_len), generator=gen)
    memory = model.init_memory(B)
    with torch.no_grad():
        memory = model(tokens, memory, targets=targets).memory  # a second segment with a non-empty memory
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
            model(tokens, memory, targets=targets, return_logits=return_logits)
    return counter.get_total_flops()


def flop_cases():
    yield pytest.param("transformer", {}, id="transformer")
    yield pytest.param("txl", {}, id="txl-M=N")
    yield pytest.param("txl", dict(mem_len=11, untie_r=True), id="txl-M>N")
    yield pytest.param("txl", dict(mem_len=3, pre_lnorm=True, d_embed=16, tie_weight=False), id="txl-M<N-proj")
    yield pytest.param("lamemo", dict(mem_len=6), id="lamemo-M=N")
    yield pytest.param("lamemo", dict(mem_len=11), id="lamemo-M>N")
    yield pytest.param("lamemo", dict(mem_len=3, n_layer=3), id="lamemo-M<N")
    yield pytest.param("lamemo", dict(mem_len=6, rpe="xl"), id="lamemo-rpe-xl")
    yield pytest.param("lamemo", dict(mem_len=6, lookahead=False), id="lamemo-no-lookahead")
    # (mem_len >= 2: with a single memory row einsum turns the 1x1 look-ahead products into elementwise
    # multiplies, which the flop counter does not see.)
    yield pytest.param("lamemo", dict(mem_len=2, n_layer=1), id="lamemo-one-layer")
    yield pytest.param("rmt", dict(mem_len=0), id="rmt")
    yield pytest.param("rmt", dict(mem_len=6, num_mem_tokens=3, aux_loss_weight=0.3), id="rmt-cache-aux")
    yield pytest.param("rmt", dict(mem_len=6, num_mem_tokens=3, cache_keys_values=True), id="rmt-cache-keys-values")
    yield pytest.param("compressive", dict(mem_len=6), id="compressive-M=N")
    yield pytest.param("compressive", dict(mem_len=2, compressed_len=9, compression_rate=2, pre_lnorm=True),
                       id="compressive-M<N")
    yield pytest.param("compressive", dict(mem_len=6, compression="max"), id="compressive-max-pool")
    yield pytest.param("infinite_former", dict(mem_len=6), id="infinite_former")
    yield pytest.param("infinite_former", dict(mem_len=2, ltm_sticky=True, pre_lnorm=True),
                       id="infinite_former-M<N-sticky")
    yield pytest.param("armt", dict(), id="armt")
    yield pytest.param("armt", dict(num_mem_tokens=5, assoc_dim=2, pre_lnorm=True), id="armt-5-tokens")
    for arch in ("hf", "hf_rmt", "hf_armt"):
        for name, kw in BACKBONE_VARIANTS.items():
            yield pytest.param(arch, kw, id=f"{arch}-{name}")
    yield pytest.param("hf_armt", dict(num_mem_tokens=5, assoc_dim=2), id="hf_armt-5-tokens")
    named = {"transformer", "txl", "lamemo", "rmt", "compressive", "infinite_former", "armt"}
    for arch in sorted(set(ARCHITECTURES) - named):  # a new arch: its registry tiny settings
        yield pytest.param(arch, {}, id=arch)


@pytest.mark.parametrize("arch,kw", list(flop_cases()))
def test_flops_per_token_equals_flop_counter(arch, kw):
    need(arch)
    B = 3
    cfg = tiny(arch, **kw)
    f = flops_per_token(cfg, batch_size=B)
    expected = f["total"] * B * cfg.tgt_len
    measured = measured_forward_flops(cfg, B)
    assert measured == pytest.approx(expected, rel=1e-9), (measured, expected, f)
    parts = [k for k in f if k not in ("total", "macs")]  # the shared components and an arch's own
    assert {"embedding", "attn_proj", "attn_content", "attn_context", "ffn", "head"} <= set(parts)
    if ARCHITECTURES[arch].memlm_layers:  # relative positions (a pretrained backbone's are its own, not counted)
        assert {"pos_proj", "attn_position"} <= set(parts)
    assert f["total"] == pytest.approx(sum(f[k] for k in parts)) and f["macs"] == f["total"] / 2


@pytest.mark.parametrize("arch,extra", [("txl", {}), ("lamemo", {}), ("rmt", {}),
                                        ("rmt", dict(aux_loss_weight=0.2, aux_token_id=25))])
@pytest.mark.parametrize("div_val,d_embed", [(1, 24), (1, 16), (2, 24), (2, 32)])
@pytest.mark.parametrize("return_logits", [False, True])
def test_adaptive_softmax_flops_with_real_cluster_fractions(arch, extra, div_val, d_embed, return_logits):
    """Targets = inputs, so the input and target cluster fractions are the batch's own, and both are exact."""
    need(arch)
    B = 2
    cfg = tiny(arch, cutoffs=[10, 20, 35], div_val=div_val, d_embed=d_embed, mem_len=6, **extra)
    tokens = torch.tensor([[0, 3, 12, 15, 40, 9], [21, 2, 1, 49, 11, 5]])
    edges = [10, 20, 35, 50]
    fractions = [float(((tokens >= lo) & (tokens < hi)).float().mean()) for lo, hi in zip(edges[:-1], edges[1:])]
    f = flops_per_token(cfg, batch_size=B, tail_fractions=fractions, full_softmax=return_logits)
    measured = measured_forward_flops(cfg, B, tokens=tokens, targets=tokens, return_logits=return_logits)
    assert measured == pytest.approx(f["total"] * B * cfg.tgt_len, rel=1e-9)


def test_flops_respond_to_each_term():
    """Sanity of the scaling, independent of the implementation: memory adds attention and re-projection,
    LaMemo adds the look-ahead, RMT adds 2R rows, the tail clusters' share changes the head."""
    base = dict(n_layer=4, n_head=4, d_model=64, d_head=16, d_inner=256, vocab_size=1000, tgt_len=32)
    t0 = flops_per_token(ModelConfig(arch="transformer", mem_len=0, **base))
    t1 = flops_per_token(ModelConfig(arch="txl", mem_len=32, **base))
    t2 = flops_per_token(ModelConfig(arch="txl", mem_len=64, **base))
    lm = flops_per_token(ModelConfig(arch="lamemo", mem_len=32, **base))
    rmt = flops_per_token(ModelConfig(arch="rmt", mem_len=0, num_mem_tokens=4, **base))
    assert t0["total"] < t1["total"] < t2["total"] < lm["total"] * 1.5
    assert t1["ffn"] == t0["ffn"] == t2["ffn"] and t1["head"] == t0["head"]
    assert lm["ffn"] == pytest.approx(t1["ffn"] * (1 + 3 / 4))  # memory rows through the FFN on 3 of 4 layers
    assert rmt["ffn"] == pytest.approx(t0["ffn"] * (32 + 8) / 32) and rmt["head"] == t0["head"]
    ad = dict(base, cutoffs=[100, 500])
    heavy = flops_per_token(ModelConfig(arch="txl", mem_len=32, **ad), tail_fractions=[0.2, 0.1])
    light = flops_per_token(ModelConfig(arch="txl", mem_len=32, **ad), tail_fractions=[0.0, 0.0])
    full = flops_per_token(ModelConfig(arch="txl", mem_len=32, **ad), full_softmax=True)
    assert light["head"] == 2 * 64 * (100 + 2)
    assert heavy["head"] == pytest.approx(light["head"] + 2 * 64 * (0.2 * 400 + 0.1 * 500))
    assert full["head"] == pytest.approx(2 * 64 * (1000 + 2))
    with pytest.raises(ValueError):
        flops_per_token(ModelConfig(arch="txl", **ad), tail_fractions=[0.7, 0.7])


def test_zipf_fractions():
    fr = zipf_cluster_fractions(10, [2, 5])
    harmonic = [1 / r for r in range(1, 11)]
    want = [sum(harmonic[0:2]), sum(harmonic[2:5]), sum(harmonic[5:10])]
    assert fr == pytest.approx([w / sum(harmonic) for w in want])
    wt = zipf_cluster_fractions(267735, [20000, 40000, 200000])
    assert sum(wt) == pytest.approx(1.0) and 0.75 < wt[0] < 0.85


# ------------------------------------------------------------------------------------------------------------
# The LaMemo paper's WikiText-103 base models (Table 1: 151M parameters each, the Compressive Transformer 161M,
# the ∞-former 160M; "#FLOPS" 148M / 157M / 191M / 169M / 235M). The ∞-former's 235M is not reproduced: this
# count gives 175.2M (bench/README.md says why that gap stays open).


@pytest.mark.parametrize("arch", ["transformer", "txl", "lamemo", "compressive", "infinite_former"])
def test_wt103_base_configs(arch):
    need(arch)
    cfg = paper_wt103_config(arch)
    with torch.device("meta"):  # real module construction, no 151M-parameter allocation
        model = build_model(cfg)
    real = sum(p.numel() for p in model.parameters())
    analytic = param_count(cfg)
    f = flops_per_token(cfg)
    full = flops_per_token(cfg, full_softmax=True)
    print(
        f"\nWT103 {arch}: params {real:,} (analytic {analytic:,}; paper {PAPER_WT103_PARAMS[arch] / 1e6:.0f}M) | "
        f"forward FLOPs/token "
        f"{f['total'] / 1e6:.1f}M = {f['macs'] / 1e6:.1f}M MACs (Zipf tails); full-vocabulary head "
        f"{full['macs'] / 1e6:.1f}M MACs | paper #FLOPS {PAPER_WT103_FLOPS[arch] / 1e6:.0f}M"
    )
    assert analytic == real
    # 2%: the compressive model comes out 1.1% low (159.2M; LaMemo does not state its compression rate), the
    # ∞-former 0.5% low (159.2M)
    assert abs(real - PAPER_WT103_PARAMS[arch]) / PAPER_WT103_PARAMS[arch] < 0.02


def test_wt103_lamemo_increment_matches_paper():
    """The paper's LaMemo - Transformer-XL difference (191M - 157M = 34M) is the look-ahead's extra
    multiply-accumulates: q for M positions, look-ahead attention, output projection + FFN for the memory rows on
    15 of 16 layers. (Absolute levels differ by the head convention: see bench/README.md.)"""
    txl, lamemo = flops_per_token(paper_wt103_config("txl")), flops_per_token(paper_wt103_config("lamemo"))
    paper = PAPER_WT103_FLOPS["lamemo"] - PAPER_WT103_FLOPS["txl"]
    assert lamemo["macs"] - txl["macs"] == pytest.approx(paper, rel=0.03)


@pytest.mark.parametrize("arch", ["transformer", "txl", "lamemo", "compressive"])
def test_wt103_paper_convention_reproduces_table_1(arch):
    """MACs of linear layers + q.k and p.v, full-vocabulary head, no W_R / position term: within 2% of the
    paper's 148M / 157M / 191M / 169M (Transformer+RPE comes out 1.4% high: 150.0M; the Compressive Transformer
    0.9% low: 167.4M, with its compression's convolution counted)."""
    got = paper_convention_macs(paper_wt103_config(arch))
    assert got == pytest.approx(PAPER_WT103_FLOPS[arch], rel=0.02)
