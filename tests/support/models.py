"""The tiny model configs the model tests build: one builder, each test file fixing what it varies."""

from __future__ import annotations

import torch

from memlm.models import ModelConfig, arch_spec

# 2 layers, d 32, 2 heads x 16, d_inner 64, vocabulary 50, N = M = 8: small enough for the slow references.
TINY = dict(arch="txl", n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, vocab_size=50, tgt_len=8, mem_len=8)
# TINY's widths of memlm's own layers: an arch whose layers are a pretrained backbone's (its entry's memlm_layers is
# False) refuses them, its widths being its backbone config's (its test_settings: a tiny GPT-2)
MEMLM_WIDTHS = ("n_layer", "n_head", "d_model", "d_head", "d_inner")


def tiny_model_config(**fields) -> ModelConfig:
    """TINY with `fields` replaced (without TINY's layer widths for an arch whose layers are not memlm's)."""
    base = TINY
    if not arch_spec(fields.get("arch", TINY["arch"])).memlm_layers:
        base = {key: value for key, value in TINY.items() if key not in MEMLM_WIDTHS}
    return ModelConfig(**{**base, **fields})


def layer_fields(spec, **fields) -> dict:
    """`fields`, settings of memlm's own layers (widths, cutoffs, dropout, ...) a test adds to every arch, for an arch
    whose layers are memlm's; none for a pretrained backbone's, which refuses them (models/pretrained/checks.py)."""
    return fields if spec.memlm_layers else {}


# A tiny model's mem_len under each registry cache rule (models/registry.py MEM_LEN_RULES)
MEM_LEN = {"zero": 0, "positive": 4, "any": 4}


def registry_fields(spec) -> dict:
    """The settings a tiny model of the registry entry `spec` needs: its arch, its cache rule's mem_len, its
    test_settings. What the tests that run every registered arch build it with, a new arch included."""
    return {"arch": spec.name, "mem_len": MEM_LEN[spec.mem_len], **dict(spec.test_settings)}


def registry_config(spec, **fields) -> ModelConfig:
    """TINY with `spec`'s registry_fields, then `fields`, replaced."""
    return tiny_model_config(**{**registry_fields(spec), **fields})


def perturbed(model):
    """Fresh LayerNorms and biases are trivial (ones and zeros): make the reference use them for real."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model
