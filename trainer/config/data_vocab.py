"""model.vocab_size from the data when the user did not give one (issue 32).

A prepared DATA_DIR's manifest.json names its tokenizer's size, yet word-level data needed `model.vocab_size=33278`
typed by hand: every preset sets a vocab_size (the tiny ones 256, for bytes), so the run refused the data. What a
user expects of "not given":

- `model.vocab_size=N` on the command line, or in the YAML file they named (not a shipped preset): given. A value
  that differs from the data's is refused, naming both (data_pipeline.shards.check_vocab_size, before any build).
- a shipped preset's value, the named file's or one it inherits: a default for the data it was written for. When the
  data's tokenizer has another size, the manifest's wins, in one line: `memlm train: model.vocab_size 33,278 from
  data/wikitext-2's word tokenizer (tiny/lamemo says 256)`. The data's size is set before the config is checked
  (issue 37): a pretrained backbone's folder checks the size against its tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.remote.location import redact
from memlm.data_pipeline.shards import load_manifest
from memlm.models.config import ConfigError, ModelConfig

from . import presets, schema
from .run_config import apply_overrides, load_config

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


def load_fitted(config: str | Path, overrides) -> tuple[object, str | None]:
    """(the validated RunConfig of `config` and `overrides`, with the data's vocabulary size when the user gave none;
    the line that says so, or None).

    The size is set before the config is checked, not after: a pretrained backbone's folder checks model.vocab_size
    against its own tokenizer.json (models/pretrained/checks.py), which a preset's 256 would fail before the data
    prepared with that tokenizer (memlm prepare --tokenizer-from FOLDER) could say its size."""
    tree = apply_overrides(schema.load_tree(presets.find(config), find_parent=presets.find), overrides)
    path = str((tree.get("data") or {}).get("path") or "")
    shown = redact(path)  # a URL's credentials never reach a message
    written = (tree.get("model") or {}).get("vocab_size", ModelConfig().vocab_size)
    try:
        tokenizer = load_manifest(path)["tokenizer"]
    except DataError:
        return load_config(config, overrides), None  # no data yet: the run refuses it with its own line
    size = int(tokenizer["vocab_size"])
    if size == written or given(config, overrides):
        return load_config(config, overrides), None
    source = f"{presets.name_of(presets.find(config))} says {written:,}"
    sized = {**overrides, KEY: size} if isinstance(overrides, Mapping) else [*overrides, f"{KEY}={size}"]
    try:
        cfg = load_config(config, sized)
    except ConfigError as exc:  # e.g. adaptive softmax cutoffs written for the preset's vocabulary
        try:
            load_config(config, overrides)
        except ConfigError as without:
            if str(without) == str(exc):  # not the vocabulary's doing: the config's own mistake, as it is
                raise without from None
        raise ConfigError(f"{KEY}={size} from {shown}'s {tokenizer['kind']} tokenizer ({source}) does not fit the "
                          f"rest of the config: {exc}") from None
    return cfg, f"{KEY} {size:,} from {shown}'s {tokenizer['kind']} tokenizer ({source})"
