"""memlm's own models, built through the public contract (`from memlm.models import ModelConfig, build_model`)."""

from __future__ import annotations

from torch import Tensor, nn

from memlm.models import ModelConfig, build_model, map_memory

from .common import Runner, Shape, mean_nll


class MemlmRunner(Runner):
    """memlm at the shape: tied adaptive (or, without cutoffs, plain) softmax, as its WikiText-103 presets.

    Variant "peer-head": one full softmax over the whole vocabulary, untied from the input embedding
    (`cutoffs: []`, `tie_weight: false`), the output layer of lucidrains' RMT and labml-nn's Transformer-XL,
    which have neither adaptive softmax nor tying; used where the head dominates the step (WikiText-103).
    Variant "fast": the same model with its layers compiled (`compile_layers`); on CUDA model.attention and
    model.head_loss "auto" already pick FlexAttention and the chunked head.
    Variant "kv-cache" (RMT + Transformer-XL cache only): `cache_keys_values`, the cache holds projected keys and
    values as lucidrains' XL memories do, instead of layer inputs re-projected every segment.
    """

    library = "memlm"
    vocab_pattern = r"^(embed|head)\."
    arch = "txl"
    variants = ("peer-head", "fast", "kv-cache")

    def __init__(self, shape: Shape, variant: str = "", seed: int = 0, device: str = "cpu"):
        super().__init__(shape, variant, seed, device)
        if variant == "peer-head":
            self.label = f"{self.label} (full softmax, untied)"
        if variant == "fast":
            self.model.compile_layers(dynamic=False)  # one layer's graph (inductor), reused by every layer
            self.label = f"{self.label} (fast: layers compiled)"
        if variant == "kv-cache":
            self.label = self.label.replace("Transformer-XL cache", "cache of keys and values")

    def model_config(self, shape: Shape) -> ModelConfig:
        peer_head = self.variant == "peer-head"
        return ModelConfig(
            arch=self.arch, n_layer=shape.n_layer, n_head=shape.n_head, d_model=shape.d_model, d_head=shape.d_head,
            d_inner=shape.d_inner, vocab_size=shape.vocab, tgt_len=shape.tgt_len, mem_len=self.mem_len(shape),
            dropout=0.0, dropatt=0.0, cutoffs=[] if peer_head else list(shape.cutoffs), div_val=1,
            tie_weight=not peer_head, **self.rmt_options(shape),
            **({"cache_keys_values": True} if self.variant == "kv-cache" else {}),
        )

    def mem_len(self, shape: Shape) -> int:
        return shape.mem_len

    def rmt_options(self, shape: Shape) -> dict:
        return {}

    def build(self, shape: Shape) -> nn.Module:
        self.cfg = self.model_config(shape)
        return build_model(self.cfg)

    def reset_memory(self) -> None:
        self.memory = self.model.init_memory(self.shape.lanes, device=self.device)

    def forward_loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        out = self.model(tokens, self.memory, targets=targets)
        self.memory = map_memory(lambda t: t.detach(), out.memory)
        return mean_nll(out.nll.sum(), targets)

    def settings(self) -> dict:
        keys = ("arch", "n_layer", "n_head", "d_model", "d_head", "d_inner", "vocab_size", "tgt_len", "mem_len",
                "cutoffs", "div_val", "tie_weight", "untie_r", "same_length", "clamp_len", "pre_lnorm", "dropout",
                "num_mem_tokens", "bptt_depth", "cache_keys_values")
        return {k: getattr(self.cfg, k) for k in keys}


class MemlmTXL(MemlmRunner):
    key, label, arch = "memlm-txl", "memlm Transformer-XL", "txl"


class MemlmLaMemo(MemlmRunner):
    key, label, arch = "memlm-lamemo", "memlm LaMemo", "lamemo"


class MemlmRMT(MemlmRunner):
    key, label, arch = "memlm-rmt", "memlm RMT", "rmt"
    notes = ("bptt_depth 0: the memory tokens are detached between steps, as lucidrains' model is when called "
             "segment by segment (its memory-replay BPTT is a separate wrapper path)",)

    def mem_len(self, shape: Shape) -> int:
        return 0

    def rmt_options(self, shape: Shape) -> dict:
        return {"num_mem_tokens": shape.mem_tokens, "bptt_depth": 0}


class MemlmRMTXL(MemlmRMT):
    key, label = "memlm-rmt-xl", "memlm RMT + Transformer-XL cache"

    def mem_len(self, shape: Shape) -> int:
        return shape.mem_len
