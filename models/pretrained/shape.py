"""A Hugging Face backbone's widths, read from its config.json (a folder) or from model.backbone_config (inline),
without torch or transformers: what the config checks and the FLOPs count need.

Shape letters (models/shapes.md): L layers, D model width, H heads, I inner width, V vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError

# Each family's key for each width, then the generic (PretrainedConfig.attribute_map) names
WIDTH_KEYS = {
    "n_layer": ("n_layer", "num_hidden_layers"),
    "d_model": ("n_embd", "hidden_size"),
    "n_head": ("n_head", "num_attention_heads"),
    "d_inner": ("n_inner", "intermediate_size"),
    "positions": ("n_positions", "max_position_embeddings"),
}
# The families whose layer layout memlm counts FLOPs for and tests (gated MLP: three I x D matrices, else two)
FAMILIES = {"gpt2": dict(gated_mlp=False, learned_positions=True, tied_default=True),
            "llama": dict(gated_mlp=True, learned_positions=False, tied_default=False)}
# The modules LoRA adapts when model.lora_targets is empty: each family's attention projections (peft matches a name
# or a dotted suffix of one: GPT-2's attn.c_proj, not its mlp.c_proj)
LORA_DEFAULT_TARGETS = {"gpt2": ["attn.c_attn", "attn.c_proj"], "llama": ["q_proj", "k_proj", "v_proj", "o_proj"]}
# transformers' defaults for a key an inline config leaves out (GPT2Config, LlamaConfig)
FAMILY_DEFAULTS = {"gpt2": dict(n_layer=12, d_model=768, n_head=12, positions=1024),
                   "llama": dict(n_layer=32, d_model=4096, n_head=32, d_inner=11008, positions=2048)}


@dataclass(frozen=True)
class BackboneShape:
    model_type: str
    n_layer: int  # L
    d_model: int  # D
    n_head: int  # H
    n_kv_head: int  # key/value heads (grouped-query attention; H without it)
    d_inner: int  # I
    vocab_size: int  # V: the embedding's rows
    positions: int  # the most positions its learned position table holds (0: rotary, no table)
    tied: bool  # the head shares the embedding's table
    gated_mlp: bool
    tokenizer_vocab: int  # the folder's tokenizer.json's vocabulary (0: none there)


def raw_config(cfg) -> dict[str, Any]:
    """The backbone's config as a mapping: the folder's config.json, or model.backbone_config."""
    if cfg.backbone:
        path = Path(cfg.backbone) / "config.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"model.backbone: {cfg.backbone} has no config.json; name a folder as "
                              "save_pretrained writes it (config.json and model.safetensors)") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.backbone: cannot read {path} ({exc}); name a folder as save_pretrained "
                              "writes it") from None
    return dict(cfg.backbone_config)


def backbone_name(cfg) -> str:
    """How a run names cfg's backbone (its MLflow tag, its export's marker): the folder as an absolute path, or
    "inline MODEL_TYPE" for a config given inline; "" for an arch of memlm's own layers."""
    if cfg.backbone:
        return str(Path(cfg.backbone).resolve())
    if cfg.backbone_config:
        return f"inline {cfg.backbone_config.get('model_type', '')}".strip()
    return ""


def tokenizer_vocab(folder: str) -> int:
    """The vocabulary of the folder's tokenizer.json (its model's vocab plus the added tokens); 0 without one."""
    path = Path(folder) / "tokenizer.json"
    if not folder or not path.is_file():
        return 0
    data = json.loads(path.read_text())
    model = data.get("model")
    if not isinstance(model, dict):  # not Hugging Face's format (memlm's own tokenizer.json names its model file)
        return 0
    vocab = model.get("vocab")  # BPE and WordPiece: token -> id; Unigram: [token, score] pairs, the id their place
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab or [])))
    ids |= {token["id"] for token in data.get("added_tokens", [])}
    return max(ids) + 1 if ids else 0


def backbone_shape(cfg) -> BackboneShape:
    """The widths of cfg's backbone (ConfigError naming the key when one cannot be read)."""
    raw = raw_config(cfg)
    model_type = raw.get("model_type", "")
    if not model_type:
        where = "model.backbone_config" if not cfg.backbone else f"{cfg.backbone}/config.json"
        raise ConfigError(f"{where} has no model_type; give the transformers family, e.g. model_type: gpt2 or llama")

    def width(name: str, default: Any = None) -> int:
        for key in WIDTH_KEYS[name]:
            if raw.get(key) is not None:
                return int(raw[key])
        default = FAMILY_DEFAULTS.get(model_type, {}).get(name, default)
        if default is not None:
            return default
        raise ConfigError(f"model.backbone_config: {model_type} needs {' or '.join(WIDTH_KEYS[name])} (the "
                          f"backbone's {name}); add it")

    family = FAMILIES.get(model_type, dict(gated_mlp=True, learned_positions=False, tied_default=False))
    D = width("d_model")
    H = width("n_head")
    vocab = int(raw["vocab_size"]) if raw.get("vocab_size") is not None else cfg.vocab_size
    return BackboneShape(
        model_type=model_type, n_layer=width("n_layer"), d_model=D, n_head=H,
        n_kv_head=int(raw.get("num_key_value_heads") or H), d_inner=width("d_inner", 4 * D), vocab_size=vocab,
        positions=width("positions", 0) if family["learned_positions"] else 0,
        tied=bool(raw.get("tie_word_embeddings", family["tied_default"])), gated_mlp=family["gated_mlp"],
        tokenizer_vocab=tokenizer_vocab(cfg.backbone))
