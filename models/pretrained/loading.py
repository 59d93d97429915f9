"""The Hugging Face causal LM behind a pretrained-backbone arch: loaded from a local folder (safetensors only, never a
download) or built from an inline config (random init), then frozen or given LoRA adapters as model.backbone_train
says. The config checks (checks.py) ran before: what is left to refuse here needs transformers itself (a config
that is not a causal LM).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..config import ConfigError
from .shape import LORA_DEFAULT_TARGETS


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()  # its advice on generation settings memlm does not use
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars: a load here takes well under a second
    # peft 0.21 asks the model is_gradient_checkpointing, which transformers 5.24 deprecates: the libraries' own
    # exchange, nothing a memlm user can act on
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    return transformers


def backbone_config(cfg):
    """The transformers config of cfg's backbone; ConfigError if its model_type is not a causal LM."""
    transformers = _transformers()
    if cfg.backbone:
        config = transformers.AutoConfig.from_pretrained(cfg.backbone, local_files_only=True)
    else:
        settings = dict(cfg.backbone_config)
        model_type = settings.pop("model_type")
        settings.setdefault("vocab_size", cfg.vocab_size)
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the family's ids may lie past the vocab
            settings.setdefault(special, None)
        try:
            config = transformers.AutoConfig.for_model(model_type, **settings)
        except ValueError as exc:
            raise ConfigError(f"model.backbone_config: {exc}; model_type names a transformers family "
                              "(gpt2, llama, ...)") from None
    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in causal:
        where = cfg.backbone or "model.backbone_config"
        raise ConfigError(f"{where}: model_type {config.model_type!r} is not a causal language model in "
                          "transformers; name a decoder-only LM (gpt2, llama, ...)")
    return config


def load_causal_lm(cfg) -> nn.Module:
    """The backbone (a transformers *ForCausalLM) in float32, in eval mode as transformers leaves it."""
    transformers = _transformers()
    config = backbone_config(cfg)
    config._attn_implementation = "sdpa"  # the same kernel for folder and inline backbones
    if cfg.backbone:
        lm = transformers.AutoModelForCausalLM.from_pretrained(
            cfg.backbone, config=config, local_files_only=True, use_safetensors=True, dtype=torch.float32)
    else:
        lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return lm


def apply_backbone_train(cfg, lm: nn.Module) -> nn.Module:
    """Freeze the backbone, give it LoRA adapters (peft), or leave it trained whole: model.backbone_train."""
    if cfg.backbone_train == "frozen":
        lm.requires_grad_(False)
    elif cfg.backbone_train == "lora":
        import peft

        targets = list(cfg.lora_targets) or LORA_DEFAULT_TARGETS.get(lm.config.model_type)
        if not targets:
            raise ConfigError(f"model.lora_targets: memlm has no default for {lm.config.model_type!r}; name the "
                              "modules to adapt (e.g. [q_proj, v_proj])")
        lora = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                               target_modules=targets, fan_in_fan_out=lm.config.model_type == "gpt2")
        lm = peft.get_peft_model(lm, lora).base_model.model  # the adapted LM itself: its layers now hold adapters
    return lm
