"""The architecture registry: one entry per arch, and the one place that knows which archs exist.

Everything outside the arch's own module asks its entry (`arch_spec(cfg.arch)`) instead of branching on the
name: `build_model`, config validation, the analytic FLOPs and parameters, the trainer's recurrence and
`memlm compare`. Entries name their code as "module:attribute" strings, imported on first use, so this file (and
`ModelConfig`, which reads it) loads without torch. models/README.md says how to add an arch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

MEM_LEN_RULES = ("any", "zero", "positive")
RECURRENCES = ("segment", "memory_bptt")


@dataclass(frozen=True)
class ArchSpec:
    name: str  # model.arch
    summary: str  # one line: the paper and what the memory is
    model: str  # "module:Class" of the nn.Module (Backbone subclass)
    # model.mem_len (the Transformer-XL cache): "zero" (no cache: the arch has none), "positive" (the arch needs
    # one), "any". A rule about the cache only: ARMT has no cache and a memory all the same (has_memory)
    mem_len: str = "any"
    # Whether anything of one segment reaches the next: False only for the baseline that reads every segment alone
    # (memlm analyze reads it; tests/models/test_registry.py checks it against the model)
    has_memory: bool = True
    options: tuple[str, ...] = ()  # ModelConfig keys only this arch reads: another arch must leave them at default
    # "module:function"(cfg, batch_size) -> (FLOPs of one lane's segment by component, head rows): the layers'
    # matmuls as models/flops.py counts them (its docstring); the embedding and softmax head are added there
    layer_flops: str = ""
    # "module:function"(cfg) -> parameters beyond the shared backbone (embedding, head, layers, u, v); "" = none
    extra_params: str = ""
    memory_tokens: str = ""  # the ModelConfig key counting memory tokens per segment (compare's column); "" = none
    # "module:Class"(model) of the incremental decoder `memlm generate` uses (its logits equal the segment forward's)
    decoder: str = ""
    # (key, value) pairs a tiny test model of this arch needs beyond ModelConfig's defaults (8-token segments):
    # what the generic tests (tests/models/test_registry.py) build it with
    test_settings: tuple[tuple[str, Any], ...] = ()
    # The trainer's schedule (trainer/loop/recurrence.py): "segment" (one segment per micro-batch, memory detached
    # between them) or "memory_bptt" (RMT: gradients through the memory over model.bptt_depth segments)
    recurrence: str = "segment"
    # "module:function"(cfg) raising ConfigError: the arch's own config checks, after the shared ones (torch-free;
    # models/arch_checks.py): its options' values, and the combinations it would run only by a rule of its own
    checks: str = ""
    # An arch whose layers are not memlm's (a pretrained backbone's): "module:function"(cfg, batch_size) -> one lane's
    # segment FLOPs by component, the embedding and head included, and "module:function"(cfg) -> every parameter.
    # They replace flops.py's shared count (and layer_flops / extra_params are left empty)
    flops: str = ""
    params: str = ""
    # Whether the layers are memlm's own (backbone.py): built from memlm's width keys (n_layer, d_model, cutoffs, ...)
    # with relative positions, model.attention's kernels and the adaptive softmax. False for a pretrained backbone's
    # (models/pretrained/), whose widths, positions and attention are its config's: then flops and params are set.
    # The generic tests read it (a tiny model's widths; the cases about memlm's layers)
    memlm_layers: bool = True

    def load(self, what: str) -> Any:
        """The object one of this entry's "module:attribute" fields names."""
        module, _, attribute = getattr(self, what).partition(":")
        return getattr(importlib.import_module(module), attribute)


RMT_OPTIONS = ("num_mem_tokens", "bptt_depth", "bptt_mode", "bptt_replay_loss", "aux_loss_weight", "aux_token_id",
               "read_mem_from_cache", "write_mem_from_cache", "cache_memory_rows", "cache_keys_values", "bptt_recipe",
               "bptt_start_memory", "bptt_new_segment_cache", "memory_init_grad", "bptt_replay_reduction")

# The pretrained-backbone archs' own keys (models/pretrained/)
PRETRAINED_OPTIONS = ("backbone", "backbone_config", "backbone_train", "lora_rank", "lora_alpha", "lora_dropout",
                      "lora_targets", "segment_checkpointing")
PRETRAINED_BPTT_OPTIONS = ("num_mem_tokens", "bptt_depth", "bptt_mode", "bptt_replay_loss")
# A tiny random GPT-2 (transformers' config inline): what the generic tests build the pretrained archs with
TINY_GPT2 = (("backbone_config", {"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 64,
                                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
             ("mem_len", 0))
# hf_armt's, at initializer_range 0.1: at GPT-2's 0.02 and width 16 the associative keys are so small that the
# authors' epsilon (1e-5) hides the memory (it moved the next segment's log-probabilities by 2e-7; 0.08 at 0.1)
TINY_GPT2_ARMT = (("backbone_config", {**dict(TINY_GPT2)["backbone_config"], "initializer_range": 0.1}),
                  ("mem_len", 0))

ARCHITECTURES: dict[str, ArchSpec] = {spec.name: spec for spec in (
    ArchSpec("transformer", "Transformer + relative positions, no memory: every segment alone (the baseline)",
             model="memlm.models.txl:TransformerXL", mem_len="zero", has_memory=False,
             layer_flops="memlm.models.txl:layer_flops",
             decoder="memlm.models.txl:TXLDecoder"),
    ArchSpec("txl", "Transformer-XL (Dai et al., 2019): a cache of the last M layer inputs, no gradient into it",
             model="memlm.models.txl:TransformerXL", layer_flops="memlm.models.txl:layer_flops",
             decoder="memlm.models.txl:TXLDecoder"),
    ArchSpec("lamemo", "LaMemo (Ji et al., 2022): the memory looks ahead at the segment and interpolates its context",
             model="memlm.models.lamemo:LaMemo", mem_len="positive",
             options=("lookahead", "interpolate", "rpe", "interp_eps"),
             layer_flops="memlm.models.lamemo:layer_flops", extra_params="memlm.models.lamemo:extra_params",
             decoder="memlm.models.lamemo:LaMemoDecoder", checks="memlm.models.arch_checks:lamemo"),
    ArchSpec("rmt", "Recurrent Memory Transformer (Bulatov et al., 2022): memory tokens read and written per "
             "segment, optionally with the Transformer-XL cache",
             model="memlm.models.rmt:RecurrentMemoryTransformer", options=RMT_OPTIONS,
             layer_flops="memlm.models.rmt:layer_flops", extra_params="memlm.models.rmt:extra_params",
             memory_tokens="num_mem_tokens", recurrence="memory_bptt",
             decoder="memlm.models.rmt:RMTDecoder", test_settings=(("num_mem_tokens", 2),),
             checks="memlm.models.arch_checks:rmt"),
    ArchSpec("compressive", "Compressive Transformer (Rae et al., 2020): Transformer-XL's memory plus C slots of "
             "evicted rows compressed at rate c, trained by attention reconstruction",
             model="memlm.models.compressive:CompressiveTransformer",
             options=("compressed_len", "compression_rate", "compression", "compression_loss_weight"),
             layer_flops="memlm.models.compressive:layer_flops", extra_params="memlm.models.compressive:extra_params",
             decoder="memlm.models.compressive:CompressiveDecoder",
             test_settings=(("compressed_len", 4), ("compression_rate", 2)),
             checks="memlm.models.arch_checks:compressive"),
    ArchSpec("infinite_former", "∞-former (Martins et al., 2022): Transformer-XL's memory plus an unbounded "
             "long-term memory, a continuous signal over J basis functions read by continuous attention",
             model="memlm.models.infinite_former:InfiniteFormer",
             options=("ltm_basis", "ltm_widths", "ltm_samples", "ltm_tau", "ltm_ridge", "ltm_sticky",
                      "ltm_sticky_bins"),
             layer_flops="memlm.models.infinite_former:layer_flops",
             extra_params="memlm.models.infinite_former:extra_params",
             decoder="memlm.models.infinite_former:InfiniteFormerDecoder",
             test_settings=(("ltm_basis", 6), ("ltm_samples", 5)), checks="memlm.models.arch_checks:infinite_former"),
    ArchSpec("armt", "Associative RMT (Rodkin et al., 2024): memory tokens write by the delta rule into an "
             "associative matrix per layer that every row of later segments reads",
             model="memlm.models.armt:AssociativeRMT", mem_len="zero",
             options=("num_mem_tokens", "bptt_depth", "bptt_mode", "bptt_replay_loss", "assoc_dim",
                      "assoc_value_init_std"),
             layer_flops="memlm.models.armt:layer_flops", extra_params="memlm.models.armt:extra_params",
             memory_tokens="num_mem_tokens", recurrence="memory_bptt", decoder="memlm.models.armt:ARMTDecoder",
             test_settings=(("num_mem_tokens", 2), ("assoc_dim", 4), ("assoc_value_init_std", 0.1)),
             checks="memlm.models.arch_checks:armt"),
    ArchSpec("hf", "A pretrained Hugging Face causal LM (GPT-2, Llama, ...) alone: every segment read by itself "
             "(the baseline of hf_rmt and hf_armt)",
             model="memlm.models.pretrained.causal_lm:PretrainedLM", mem_len="zero", has_memory=False,
             options=PRETRAINED_OPTIONS, flops="memlm.models.pretrained.counts:hf_flops",
             decoder="memlm.models.pretrained.causal_lm:PretrainedDecoder",
             params="memlm.models.pretrained.counts:hf_params", test_settings=TINY_GPT2,
             memlm_layers=False, checks="memlm.models.pretrained.checks:backbone"),
    ArchSpec("hf_rmt", "RMT around a pretrained causal LM (Bulatov et al., 2023): memory embeddings read at the "
             "start and written at the end of each segment, as the authors run GPT-2",
             model="memlm.models.pretrained.rmt:PretrainedRMT", mem_len="zero",
             options=PRETRAINED_OPTIONS + PRETRAINED_BPTT_OPTIONS + ("bptt_recipe", "bptt_start_memory",
                                                                     "memory_init_grad", "bptt_replay_reduction"),
             flops="memlm.models.pretrained.counts:hf_rmt_flops",
             decoder="memlm.models.pretrained.causal_lm:PretrainedDecoder",
             params="memlm.models.pretrained.counts:hf_rmt_params", memory_tokens="num_mem_tokens",
             recurrence="memory_bptt", test_settings=TINY_GPT2 + (("num_mem_tokens", 2),), memlm_layers=False,
             checks="memlm.models.pretrained.checks:hf_rmt"),
    ArchSpec("hf_armt", "ARMT around a pretrained causal LM (Rodkin et al., 2024): an associative read and delta-rule "
             "write wrapped around each decoder layer",
             model="memlm.models.pretrained.armt:PretrainedARMT", mem_len="zero",
             options=PRETRAINED_OPTIONS + PRETRAINED_BPTT_OPTIONS + ("assoc_dim", "assoc_value_init_std"),
             flops="memlm.models.pretrained.counts:hf_armt_flops",
             decoder="memlm.models.pretrained.causal_lm:PretrainedDecoder",
             params="memlm.models.pretrained.counts:hf_armt_params", memory_tokens="num_mem_tokens",
             recurrence="memory_bptt",
             test_settings=TINY_GPT2_ARMT + (("num_mem_tokens", 2), ("assoc_dim", 4), ("assoc_value_init_std", 0.1)),
             memlm_layers=False, checks="memlm.models.pretrained.checks:hf_armt"),
)}

ARCHS = tuple(ARCHITECTURES)


def arch_spec(name: str) -> ArchSpec:
    """The registry entry of `name`; a ConfigError listing the registered ones otherwise."""
    spec = ARCHITECTURES.get(name)
    if spec is None:
        from .config import ConfigError  # here: config.py imports this module

        raise ConfigError(f"model.arch: unknown architecture {name!r}; valid: {', '.join(ARCHS)} "
                          "(models/registry.py)")
    return spec
