"""Model configuration: one dataclass for every architecture, validated in `validate()`.

Memory length (`mem_len`), target length (`tgt_len`), `clamp_len` and `same_length` are run-time settings:
no parameter or saved buffer depends on them, so a checkpoint trained with one memory length loads into a
model built with another (docs/design.md §3).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any

from memlm.errors import MemlmError

from .registry import ARCHITECTURES, ARCHS, arch_spec  # noqa: F401 - ARCHS is read from here too

RPE_KINDS = ("disentangled", "xl")
BPTT_MODES = ("window", "chunk")
ATTENTION_KERNELS = ("auto", "eager", "flex", "triton")
HEAD_LOSSES = ("auto", "full", "chunked")
COMPRESSIONS = ("conv", "mean", "max")  # Compressive Transformer: 1D convolution (the paper's best) or pooling
# RMT's window BPTT: four choices where memlm's training step and the RMT authors' loop (booydar/LM-RMT) differ.
# Each option left "" takes its value from model.bptt_recipe; values: (memlm's, the authors').
BPTT_RECIPES = ("memlm", "authors")
BPTT_CHOICES = {
    # The memory the replay of the window starts from: written by the previous step's replay (current weights, one
    # step old), or stored when the oldest window segment was new (weights k steps old).
    "bptt_start_memory": ("replayed", "stored"),
    # The Transformer-XL cache the new segment reads: the one the previous new segment left, or the one the replay
    # just recomputed. Either way the window keeps, and replays with, the one from before the replay (the authors'
    # prev_mems holds the previous new segment's output).
    "bptt_new_segment_cache": ("stored", "replayed"),
    # The learned initial memory: trained from the first step, or read detached. The authors' recipe detaches it
    # for bptt_depth >= 1 only (their replay starts from a detached copy); at 0 their loop has no replay and its
    # first batch reads the live parameter (`bptt_choice`).
    "memory_init_grad": ("trained", "detached"),
    # bptt_replay_loss's reduction: one mean over every scored token, or the sum of per-segment means (--bptt_bp).
    "bptt_replay_reduction": ("token_mean", "segment_sum"),
}


class ConfigError(MemlmError, ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


@dataclass
class ModelConfig:
    arch: str = "txl"
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    d_head: int = 16
    d_inner: int = 64
    vocab_size: int = 100
    tgt_len: int = 8
    mem_len: int = 8
    dropout: float = 0.0
    dropatt: float = 0.0
    pre_lnorm: bool = False
    untie_r: bool = False  # per-layer u/v biases instead of the global pair
    clamp_len: int = -1  # relative distances beyond this use R(clamp_len); <= 0 means no clamping
    same_length: bool = False  # every query sees the same number of keys (Transformer-XL evaluation option)
    init_std: float = 0.02
    # How attention runs: "eager" (einsums; the reference, and the CPU path), "flex" (FlexAttention, one fused kernel
    # on CUDA; models/attention_flex.py), "triton" (memlm's own kernels, the position term made per tile;
    # models/attention_triton.py; CUDA, or a CPU under TRITON_INTERPRET=1), "auto" = flex on CUDA, eager elsewhere.
    # Same function either way.
    attention: str = "auto"
    # How training computes the softmax head's NLL: "full" (fp32 log-probabilities of every row over the vocabulary),
    # "chunked" (a chunk of rows at a time, never all the rows' at once; models/chunked_nll.py), "auto" = chunked on
    # CUDA. Same function either way.
    head_loss: str = "auto"
    # Adaptive input and softmax (Baevski & Auli); empty cutoffs means one plain softmax.
    d_embed: int = 0  # 0 means d_model
    cutoffs: list[int] = field(default_factory=list)
    div_val: int = 1
    tie_weight: bool = True
    # LaMemo
    lookahead: bool = True
    interpolate: bool = True
    rpe: str = "disentangled"
    interp_eps: float = 1e-6
    # RMT
    num_mem_tokens: int = 0
    # Every scored segment's loss backpropagates through exactly the last bptt_depth memory transitions.
    # window (the paper): one new segment per micro-batch, the previous bptt_depth segments replayed before it;
    # chunk: bptt_depth + 1 new segments per micro-batch, detached between chunks (reach 0..k, cheaper).
    bptt_depth: int = 0
    bptt_mode: str = "window"
    bptt_replay_loss: bool = False  # window mode: also score the replayed segments (default: the new one only)
    aux_loss_weight: float = 0.0
    aux_token_id: int = 0
    # Transformer-XL + RMT (mem_len > 0), as the RMT authors' code ran it by default:
    # The memory rows (read AND write blocks) also attend to the Transformer-XL cache; the authors' mask hides it
    # from both blocks unless their read_mem_from_cache is set.
    read_mem_from_cache: bool = False
    # Only the write rows attend to the cache (memlm's behaviour before it followed the authors' mask).
    write_mem_from_cache: bool = False
    cache_memory_rows: bool = True  # the cache keeps the last M rows of [read | tokens | write], not tokens only
    # The cache holds each layer's projected keys and values (with the weights of the segment that wrote them, no
    # gradient), as lucidrains' recurrent-memory-transformer-pytorch's XL memories do, instead of its layer inputs
    # re-projected with the current weights every segment, as Transformer-XL and the RMT authors' code do: fewer
    # FLOPs per step (no k/v projection of the M cached rows, forward or weight gradient), another model.
    cache_keys_values: bool = False
    # Window BPTT as memlm trains it ("memlm") or as the RMT authors' loop does ("authors"); see BPTT_CHOICES.
    bptt_recipe: str = "memlm"
    bptt_start_memory: str = ""
    bptt_new_segment_cache: str = ""
    memory_init_grad: str = ""
    bptt_replay_reduction: str = ""
    # Compressive Transformer (Rae et al., 2020): compressed memory slots per layer (the "external memory"), the
    # compression rate c (tgt_len must divide by it), the compression function, and the weight of the
    # attention-reconstruction loss that alone trains it
    compressed_len: int = 0
    compression_rate: int = 3
    compression: str = "conv"
    compression_loss_weight: float = 1.0
    # ∞-former (Martins et al., 2022): the long-term memory's Gaussian basis functions per layer (J), the widths
    # they come in (J / len(widths) centres evenly on [0, 1] per width), the samples S of the old signal each
    # update reads, the fraction tau of [0, 1] the old signal is contracted into, the ridge penalty, and sticky
    # memories (sample the old signal where the last segment's attention went, over ltm_sticky_bins bins).
    # Defaults: the authors' Transformer-XL code (its sorting experiments); models/infinite_former.py.
    ltm_basis: int = 0
    ltm_widths: list[float] = field(default_factory=lambda: [0.01, 0.05])
    ltm_samples: int = 512
    ltm_tau: float = 0.75
    ltm_ridge: float = 1.0
    ltm_sticky: bool = False
    ltm_sticky_bins: int = 128
    # ARMT (Rodkin et al., 2024): the associative memory's key width before the DPFP feature map (d_mem; 0 = off).
    # Its memory tokens and BPTT are RMT's keys above (num_mem_tokens, bptt_depth, bptt_mode, bptt_replay_loss).
    assoc_dim: int = 0
    # The value projection W_v's initial std; 0 = zeros, the authors' (they start from a pretrained backbone, which
    # a zero W_v leaves unchanged until it learns)
    assoc_value_init_std: float = 0.0
    # Pretrained backbones (archs hf, hf_rmt, hf_armt; models/pretrained/): a Hugging Face causal LM is the layers,
    # its own embedding, positions and head included. Exactly one of: `backbone`, a local folder as
    # save_pretrained writes it (config.json and safetensors weights), or `backbone_config`, a transformers config
    # inline (its model_type and keys; random init: from scratch, and the tests). The backbone's widths are its own:
    # the shared width keys above stay at their defaults for these archs.
    backbone: str = ""
    backbone_config: dict[str, Any] = field(default_factory=dict)
    # What training updates besides the memory (always trained): "full" every backbone weight, "frozen" none,
    # "lora" low-rank adapters (peft) on lora_targets (empty = the family's attention projections)
    backbone_train: str = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=list)
    # Recompute each segment's backbone forward in the backward instead of keeping its activations
    # (torch.utils.checkpoint): a BPTT window of k segments then holds k segments' inputs, not their activations
    segment_checkpointing: bool = False

    def bptt_choice(self, name: str) -> str:
        """The value of one of BPTT_CHOICES: the option's own, else its bptt_recipe's."""
        if getattr(self, name):
            return getattr(self, name)
        if name == "memory_init_grad" and self.bptt_recipe == "authors" and self.bptt_depth == 0:
            return "trained"  # k = 0: the authors' loop skips the replay branch, the only place it detaches
        return BPTT_CHOICES[name][BPTT_RECIPES.index(self.bptt_recipe)]

    @property
    def embed_dim(self) -> int:
        return self.d_embed or self.d_model

    def validate(self) -> "ModelConfig":
        """Raise ConfigError naming the first impossible setting; return self when all is well."""
        arch_spec(self.arch)  # an unknown arch: one error listing the registered ones
        for name in ("n_layer", "n_head", "d_model", "d_head", "d_inner", "vocab_size", "tgt_len", "div_val"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.mem_len < 0:
            raise ConfigError(f"model.mem_len must be >= 0, got {self.mem_len}")
        if self.d_embed < 0:
            raise ConfigError(f"model.d_embed must be >= 0 (0 means d_model), got {self.d_embed}")
        for name in ("dropout", "dropatt"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"model.attention: unknown kernel {self.attention!r}; "
                              f"valid: {', '.join(ATTENTION_KERNELS)}")
        if self.attention == "triton" and importlib.util.find_spec("triton") is None:
            raise ConfigError("model.attention: triton needs the triton package (pip install triton==3.9.0), or "
                              "choose auto, eager or flex")
        if self.head_loss not in HEAD_LOSSES:
            raise ConfigError(f"model.head_loss: unknown kind {self.head_loss!r}; valid: {', '.join(HEAD_LOSSES)}")
        if self.init_std <= 0:
            raise ConfigError(f"model.init_std must be > 0, got {self.init_std}")
        self._validate_cutoffs()
        self._validate_arch_options()
        return self

    def _validate_cutoffs(self) -> None:
        cuts = list(self.cutoffs)
        if cuts and (cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= self.vocab_size):
            raise ConfigError(
                f"model.cutoffs must be strictly increasing values in [1, vocab_size={self.vocab_size}), got {cuts}"
            )
        if self.div_val > 1 and not cuts:
            raise ConfigError("model.div_val > 1 needs model.cutoffs (adaptive input/softmax); "
                              "set cutoffs or div_val: 1")
        if self.div_val > 1 and self.embed_dim // self.div_val ** len(cuts) < 1:
            raise ConfigError(
                f"model.div_val={self.div_val} shrinks the last cluster's embedding below width 1; lower div_val"
            )

    def _validate_arch_options(self) -> None:
        defaults = ModelConfig()
        spec = arch_spec(self.arch)
        if spec.mem_len == "zero" and self.mem_len != 0:
            raise ConfigError(f"model.mem_len must be 0 for arch {self.arch!r} (it has no cache: {spec.summary}); "
                              "use arch 'txl' for a cache")
        if spec.mem_len == "positive" and self.mem_len < 1:
            raise ConfigError(f"model.mem_len must be >= 1 for arch {self.arch!r}; use arch 'transformer' for no "
                              "memory")
        for other in ARCHITECTURES.values():  # the options only other archs read stay at their defaults
            foreign = [name for name in other.options if name not in spec.options]
            for name in foreign:
                if getattr(self, name) != getattr(defaults, name):
                    owners = " or ".join(repr(a.name) for a in ARCHITECTURES.values() if name in a.options)
                    raise ConfigError(f"model.{name} only applies to arch {owners} (arch is {self.arch!r}); "
                                      "remove it")
        if spec.checks:  # the arch's own, its registry entry's (models/arch_checks.py)
            spec.load("checks")(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
