"""model.vocab_size from the data when the user did not give one (issue 32).

A prepared DATA_DIR's manifest.json names its tokenizer's size, yet word-level data needed `model.vocab_size=33278`
typed by hand: every preset sets a vocab_size (the tiny ones 256, for bytes), so the run refused the data. What a
user expects of "not given":

- `model.vocab_size=N` on the command line, or in the YAML file they named (not a shipped preset): given. A value
  that differs from the data's is refused, naming both (data_pipeline.shards.check_vocab_size, before any build).
- a shipped preset's value, the named file's or one it inherits: a default for the data it was written for. When the
  data's tokenizer has another size, the manifest's wins, in one line: `memlm train: model.vocab_size 33,278 from
  data/wikitext-2's word tokenizer (tiny/lamemo says 256)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.shards import load_manifest
from memlm.models.config import ConfigError

from . import presets, schema
from .run_config import override_config

KEY = "model.vocab_size"


def given(config: str | Path, overrides) -> bool:
    """Whether the user set model.vocab_size: an override, or the file they named when it is not a preset."""
    keys = overrides.keys() if isinstance(overrides, Mapping) else (str(o).partition("=")[0].strip() for o in overrides)
    if KEY in keys:
        return True
    path = presets.find(config)
    if presets.name_of(path) != str(path):  # a shipped preset: its values are defaults
        return False
    data = schema.read_yaml(path) or {}
    model = data.get("model") if isinstance(data, dict) else None
    return isinstance(model, dict) and "vocab_size" in model


def fit_to_data(cfg, config: str | Path, overrides) -> tuple[object, str | None]:
    """(cfg with the data's vocabulary size when the user gave none, the line that says so, or None)."""
    try:
        tokenizer = load_manifest(cfg.data.path)["tokenizer"]
    except DataError:
        return cfg, None  # no data yet: the run refuses it with its own line, naming data.path
    size = int(tokenizer["vocab_size"])
    if size == cfg.model.vocab_size or given(config, overrides):
        return cfg, None
    source = f"{presets.name_of(presets.find(config))} says {cfg.model.vocab_size:,}"
    try:
        fitted = override_config(cfg, {KEY: size})
    except ConfigError as exc:  # e.g. adaptive softmax cutoffs written for the preset's vocabulary
        raise ConfigError(f"{KEY}={size} from {cfg.data.path}'s {tokenizer['kind']} tokenizer ({source}) does not fit "
                          f"the rest of the config: {exc}") from None
    return fitted, f"{KEY} {size:,} from {cfg.data.path}'s {tokenizer['kind']} tokenizer ({source})"
