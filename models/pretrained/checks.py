"""The config checks of the pretrained-backbone archs (hf, hf_rmt, hf_armt), torch-free like models/arch_checks.py.

Everything here is refused before anything runs, in one line naming the key and the fix: no backbone or two, a
folder without safetensors weights (pickled weights only: how to convert them), memlm's own width keys set for a
backbone that has its own, a segment with its memory tokens longer than the backbone's position table.
"""

from __future__ import annotations

from pathlib import Path

from ..arch_checks import memory_bptt
from ..config import BPTT_CHOICES, BPTT_RECIPES, ConfigError, ModelConfig
from .shape import backbone_shape

BACKBONE_TRAIN = ("full", "frozen", "lora")
# memlm's own layers' keys (widths, positions, head, attention kernel): the backbone has its own, so these must stay
# at their defaults (tie_weight: the backbone's tie_word_embeddings; attention: transformers' SDPA)
OWN_WIDTH_KEYS = ("n_layer", "n_head", "d_model", "d_head", "d_inner", "d_embed", "cutoffs", "div_val", "pre_lnorm",
                  "untie_r", "dropout", "dropatt", "clamp_len", "same_length", "init_std", "tie_weight", "attention",
                  "head_loss")
CONVERT = ("python -c \"import sys; from transformers import AutoModelForCausalLM as M; "
           "M.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[1])\" FOLDER "
           "(on a machine you trust: it unpickles)")


def weights_folder(folder: str) -> None:
    """A folder save_pretrained wrote, with safetensors weights; pickles alone are refused with the conversion."""
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"model.backbone: {folder} is not a folder; name a local folder as save_pretrained writes "
                          "it (config.json and model.safetensors), or give model.backbone_config inline")
    if any(path.glob("*.safetensors")):
        return
    if any(path.glob("pytorch_model*.bin")) or any(path.glob("*.pt")):
        raise ConfigError(f"model.backbone: {folder} holds pickled weights only (pytorch_model.bin), which memlm "
                          f"never loads; convert them to safetensors first: {CONVERT}")
    raise ConfigError(f"model.backbone: {folder} has no weights (*.safetensors); save the model there with "
                      "save_pretrained")


def backbone(cfg, memory_rows: int = 0) -> None:
    """The checks every pretrained-backbone arch shares (`hf` has no others); memory_rows: what the arch's forward
    adds to a segment's N tokens."""
    if bool(cfg.backbone) == bool(cfg.backbone_config):
        raise ConfigError(f"arch {cfg.arch!r} needs exactly one of model.backbone (a local folder as save_pretrained "
                          "writes it) and model.backbone_config (a transformers config inline, random init)"
                          + ("; both are set" if cfg.backbone else ""))
    if cfg.backbone:
        weights_folder(cfg.backbone)
    defaults = ModelConfig()
    for name in OWN_WIDTH_KEYS:
        if getattr(cfg, name) != getattr(defaults, name):
            raise ConfigError(f"model.{name} is memlm's own layers' and arch {cfg.arch!r} uses the backbone's; "
                              "remove it (set the backbone's own in model.backbone_config)")
    if cfg.backbone_train not in BACKBONE_TRAIN:
        raise ConfigError(f"model.backbone_train: unknown value {cfg.backbone_train!r}; valid: "
                          f"{', '.join(BACKBONE_TRAIN)}")
    if cfg.backbone_train != "lora":
        changed = [name for name in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
                   if getattr(cfg, name) != getattr(defaults, name)]
        if changed:
            raise ConfigError(f"model.{changed[0]} only applies to model.backbone_train=lora (it is "
                              f"{cfg.backbone_train!r}); remove it or set backbone_train: lora")
    elif cfg.lora_rank < 1 or cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"model.lora_rank must be >= 1, lora_alpha > 0 and lora_dropout in [0, 1); got "
                          f"{cfg.lora_rank}, {cfg.lora_alpha}, {cfg.lora_dropout}")
    shape = backbone_shape(cfg)
    if cfg.backbone_config and shape.vocab_size != cfg.vocab_size:
        raise ConfigError(f"model.backbone_config.vocab_size is {shape.vocab_size} and the data's vocabulary "
                          f"{cfg.vocab_size} (model.vocab_size); leave it out of backbone_config (the data's is used)")
    if cfg.backbone and cfg.vocab_size not in (shape.vocab_size, shape.tokenizer_vocab):
        have = f"its tokenizer.json's {shape.tokenizer_vocab} or " if shape.tokenizer_vocab else ""
        raise ConfigError(f"model.vocab_size is {cfg.vocab_size} (the data's tokenizer) and the backbone "
                          f"{cfg.backbone} reads {have}{shape.vocab_size} tokens: prepare the data with the "
                          f"backbone's tokenizer (memlm prepare ... --tokenizer-from {cfg.backbone})")
    rows = cfg.tgt_len + memory_rows
    if shape.positions and rows > shape.positions:
        raise ConfigError(f"model.tgt_len {cfg.tgt_len} with {rows - cfg.tgt_len} memory rows is {rows} positions "
                          f"and the backbone's position table holds {shape.positions}; lower model.tgt_len or "
                          "model.num_mem_tokens")


def hf_rmt(cfg) -> None:
    memory_bptt(cfg)
    backbone(cfg, memory_rows=2 * cfg.num_mem_tokens)  # [read R | tokens N | write R]
    if cfg.bptt_recipe not in BPTT_RECIPES:
        raise ConfigError(f"model.bptt_recipe: unknown value {cfg.bptt_recipe!r}; valid: {', '.join(BPTT_RECIPES)}")
    for name in ("bptt_start_memory", "memory_init_grad", "bptt_replay_reduction"):
        if getattr(cfg, name) not in ("", *BPTT_CHOICES[name]):
            raise ConfigError(f"model.{name}: unknown value {getattr(cfg, name)!r}; valid: "
                              f"{', '.join(BPTT_CHOICES[name])} (or leave it empty for model.bptt_recipe's)")


def hf_armt(cfg) -> None:
    memory_bptt(cfg)
    backbone(cfg, memory_rows=cfg.num_mem_tokens)  # [tokens N | write R]
    if cfg.assoc_dim < 1:
        raise ConfigError(f"model.assoc_dim must be >= 1 for arch 'hf_armt' (the associative key width; the ARMT "
                          f"paper's is 64), got {cfg.assoc_dim}")
