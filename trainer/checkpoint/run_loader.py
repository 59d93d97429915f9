"""The one way to load a trained run: what `memlm eval`, `generate`, `longeval`, `analyze`, `export` and
`load_pretrained` read from a run folder (config.yaml + checkpoints/, written by `memlm train`) or an export folder
(`memlm export`, pretrained.py).

    run = open_run("runs/x", mem_len=64)         # the resolved config, which weights, their step: nothing loaded yet
    data_dir, manifest = run.data()              # the data folder it names, its vocabulary checked against the model
    model = run.load_model(device="cuda")        # the weights, strictly, in eval mode
    model, tokenizer, run = load_run("runs/x")   # all three at once (generate, longeval, analyze)

The config is the run's own with the evaluation's settings applied (`eval.*`: memory length is configuration only, so
the same weights load at any --mem-len). A run folder's weights are its `latest` checkpoint (or `tag`) at any ZeRO
stage and world size (weights.py); an export folder's are its safetensors, and it carries its tokenizer, so it needs
no data folder except to be evaluated. Every way a folder can be missing or broken is refused with one line naming
the file and the fix (ConfigError, DataError, ResumeError or ExportError, which the CLI prints as `memlm: error:`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.hf_tokenizer import check_backbone_tokenizer
from memlm.data_pipeline.remote.location import Location, as_location, is_remote, location_of
from memlm.data_pipeline.remote.tokenizer_files import tokenizer_folder
from memlm.data_pipeline.shards import check_vocab_size, load_manifest
from memlm.data_pipeline.tokenizers import Tokenizer, load_tokenizer
from memlm.models import ModelConfig, build_model
from memlm.models.config import ConfigError
from memlm.trainer.config.run_config import RunConfig, eval_model_config, load_config, override_config

from . import pretrained
from .store import find_checkpoint, step_of
from .weights import load_weights

CONFIG = "config.yaml"


@dataclass(frozen=True)
class TrainedRun:
    """A run or export folder, checked and resolved; its weights are read by `load_model` only."""

    path: Path
    config: RunConfig  # the run's resolved config, the evaluation's settings applied
    export: pretrained.ExportInfo | None  # the marker of an export folder; None for a run folder
    checkpoint: Path | None  # RUN_DIR/checkpoints/TAG of a run folder; None for an export folder
    step: int | None  # the training step of the weights

    @property
    def model_config(self) -> ModelConfig:
        """The model the evaluation builds: the run's model with eval's lengths and options (eval_model_config)."""
        return eval_model_config(self.config)

    @property
    def weights(self) -> Path:
        """Where the weights come from, for progress lines: the checkpoint folder or the export folder."""
        return self.checkpoint if self.checkpoint is not None else self.path

    def data(self, data_dir: str | os.PathLike | None = None, split: str | None = None) -> tuple[Path | Location, dict]:
        """(data folder, its manifest): `data_dir`, else the config's data.path. Refused in one line: a missing
        folder, a missing `split`, data tokenized otherwise than an export, a vocabulary other than the model's.
        A URL comes back as its Location (data.remote's retries and cache; str() without credentials)."""
        if data_dir:
            folder = as_location(data_dir, self.config.data) if is_remote(data_dir) else Path(data_dir)
        else:
            folder = location_of(self.config.data) if is_remote(self.config.data.path) else Path(self.config.data.path)
        try:
            manifest = load_manifest(folder)  # DataError naming the folder when it is missing
        except DataError as exc:
            if self.export is None:
                raise
            # An export travels without its data: say how to point it at a copy.
            raise DataError(f"{exc}; or give the export its data with --data DATA_DIR") from None
        splits = manifest.get("splits", {})
        if split is not None and split not in splits:
            raise DataError(f"{folder} has no split {split!r} (it has: {', '.join(splits)})")
        if self.export is not None:
            pretrained.check_data_tokenizer(self.export, manifest, folder)
        check_vocab_size(manifest, self.model_config.vocab_size)
        check_backbone_tokenizer(manifest, self.model_config.backbone, folder)
        return folder, manifest

    def tokenizer(self) -> Tokenizer:
        """An export's own tokenizer (no data folder needed), else the one of the data the run was trained on."""
        if self.export is not None:
            return pretrained.load_export_tokenizer(self.export)
        folder, manifest = self.data()
        return load_tokenizer(tokenizer_folder(folder, manifest))

    def load_model(self, device: str | torch.device = "cpu",
                   model_config: ModelConfig | None = None) -> torch.nn.Module:
        """The model of `model_config` (default: the evaluation's, self.model_config) with the weights loaded
        strictly, in eval mode on `device`."""
        mcfg = model_config or self.model_config
        if self.export is not None:
            model = pretrained.build_export_model(self.export, mcfg)
        else:
            model = build_model(mcfg)
            model.load_state_dict(load_weights(self.checkpoint.parent, self.checkpoint.name), strict=True)
        return model.eval().to(device)


def open_run(run_dir: str | os.PathLike, *, tag: str | None = None, split: str = "test", tgt_len: int | None = None,
             mem_len: int | None = None, mem_mult: float | None = None, clamp_len: int | None = None,
             same_length: bool | None = None) -> TrainedRun:
    """RUN_DIR (a run or an export folder) resolved: its config with the evaluation settings given (None keeps the
    run's own), and its checkpoint `tag` (default the `latest` one; an export folder holds one set of weights)."""
    run_dir = Path(run_dir)
    config = resolve_eval_config(run_dir, split, tgt_len, mem_len, mem_mult, clamp_len, same_length)
    if pretrained.is_export(run_dir):
        export = pretrained.read_export(run_dir)
        return TrainedRun(run_dir, config, export, None, export.step)
    ckpt_dir, tag = find_checkpoint(run_dir, tag)
    return TrainedRun(run_dir, config, None, ckpt_dir / tag, step_of(tag))


def load_run(run_dir: str | os.PathLike, mem_len: int | None = None, tag: str | None = None,
             device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Tokenizer, TrainedRun]:
    """(model in eval mode on `device`, tokenizer, the TrainedRun) of RUN_DIR; mem_len: another memory length than
    the run's."""
    run = open_run(run_dir, tag=tag, mem_len=mem_len)
    tokenizer = run.tokenizer()
    return run.load_model(device), tokenizer, run


def load_pretrained(path: str | os.PathLike, expect_arch: str | None = None, expect_vocab_size: int | None = None,
                    mem_len: int | None = None, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer) of an export folder: `from memlm import load_pretrained`.

    expect_arch / expect_vocab_size: refuse (ExportError, one line) a folder of another arch or vocabulary.
    mem_len: another memory length than the run's (memory length is configuration only)."""
    pretrained.check_expected(pretrained.read_export(path), expect_arch, expect_vocab_size)
    model, tokenizer, _ = load_run(path, mem_len=mem_len, device=device)
    return model, tokenizer


def resolve_eval_config(run_dir: Path, split: str, tgt_len, mem_len, mem_mult, clamp_len, same_length) -> RunConfig:
    """The run's resolved config with the evaluation settings applied (and validated: impossible ones refused)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir} does not exist")
    config_path = run_dir / CONFIG
    if not config_path.is_file():
        raise ConfigError(f"{config_path} is missing: {run_dir} is not a run folder written by `memlm train`")
    if mem_len is not None and mem_mult is not None:
        raise ConfigError(f"--mem-len {mem_len} and --mem-mult {mem_mult} are both set; give one")
    # An export's backbone is built from its own config (pretrained.backbone_overrides), not the folder trained from
    cfg = load_config(config_path, pretrained.backbone_overrides(run_dir) if pretrained.is_export(run_dir) else {})
    overrides: dict[str, Any] = {"eval.split": split}
    if tgt_len is not None:
        overrides["eval.tgt_len"] = tgt_len
    if mem_len is not None:  # an explicit length replaces a multiplier stored in the run's eval section
        overrides.update({"eval.mem_len": mem_len, "eval.mem_mult": 0.0})
    if mem_mult is not None:
        if mem_mult <= 0:
            raise ConfigError(f"--mem-mult must be > 0, got {mem_mult}")
        overrides.update({"eval.mem_mult": float(mem_mult), "eval.mem_len": -1})
    if clamp_len is not None:
        overrides["eval.clamp_len"] = clamp_len
    if same_length is not None:
        overrides["eval.same_length"] = same_length
    return override_config(cfg, overrides)
