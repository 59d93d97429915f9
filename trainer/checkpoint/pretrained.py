"""Reading an export folder (`memlm export`, export.py): weights, config and tokenizer without DeepSpeed or pickle.

    from memlm import load_pretrained
    model, tokenizer = load_pretrained("exports/txl")          # eval mode, on the CPU (run_loader.py)

An export folder holds:
    memlm-export.json    the marker (format, arch, dtype, vocab size, step, tokenizer identity); written last
    model.safetensors    the weights (fp32 or bf16); a tied tensor is stored once, its other names in the metadata
    config.yaml          the run's resolved config (model, data, eval sections ...), as `memlm train` wrote it
    tokenizer/           the data's tokenizer files (tokenizer.json, spm.model for sentencepiece)
    backbone/config.json a pretrained backbone's transformers config (archs hf, hf_rmt, hf_armt only): the model
                         is built from it, the folder it was trained from not needed (model.safetensors holds every
                         weight, the backbone's included)
    README.md            the model card
Nothing in it is a pickle, so loading it runs no code. `memlm eval DIR`, `memlm generate DIR` and the other commands
that read a trained run take such a folder as they take a run folder (run_loader.py reads both). A folder whose files
disagree (another arch's weights, a config edited afterwards), or a caller expecting another arch or vocabulary, is
refused with one line naming the difference (ExportError, which the CLI prints as `memlm: error: ...`, exit 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from memlm.data_pipeline.tokenizers import load_tokenizer
from memlm.models import build_model

from .errors import ResumeError

EXPORT_FORMAT = "memlm-export/1"
MARKER = "memlm-export.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"
TOKENIZER_DIR = "tokenizer"
BACKBONE_DIR = "backbone"  # BACKBONE_DIR/config.json: a pretrained backbone's transformers config
CARD = "README.md"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALIASES_KEY = "aliases"  # safetensors metadata: {name: stored name} for tensors tied to another (JSON)
REEXPORT = "export the run again (`memlm export RUN_DIR --out DIR --overwrite`) rather than editing the folder"


class ExportError(ResumeError):
    """An export folder that cannot be written or read as asked; the message names the file and the fix."""


@dataclass(frozen=True)
class ExportInfo:
    """What the marker says about an export folder."""

    path: Path
    arch: str
    dtype: str
    vocab_size: int
    step: int | None
    tokenizer: dict  # the tokenizer's identity: kind, vocab_size, sha256, boundary_id
    marker: dict


def is_export(path: str | os.PathLike) -> bool:
    """A folder written by `memlm export` (it holds the marker), as opposed to a run folder."""
    return (Path(path) / MARKER).is_file()


def read_export(path: str | os.PathLike) -> ExportInfo:
    """The marker of export folder `path`, checked; ExportError for a folder that is not a complete export."""
    path = Path(path)
    marker_path = path / MARKER
    if not marker_path.is_file():
        what = "does not exist" if not path.exists() else f"has no {MARKER}, so it is not a memlm export folder"
        raise ExportError(f"{path} {what}: write one with `memlm export RUN_DIR --out {path}`")
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        fmt = marker["format"]
        info = ExportInfo(path=path, arch=str(marker["arch"]), dtype=str(marker["dtype"]),
                          vocab_size=int(marker["vocab_size"]), step=marker.get("step"),
                          tokenizer=dict(marker["tokenizer"]), marker=marker)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{marker_path} is not a readable export marker ({type(exc).__name__}: {exc}); "
                          f"{REEXPORT}") from None
    if fmt != EXPORT_FORMAT:
        raise ExportError(f"{marker_path} has format {fmt!r}; this memlm reads {EXPORT_FORMAT!r}: upgrade memlm or "
                          "export the run with this one")
    for name in (WEIGHTS, CONFIG, TOKENIZER_DIR) + ((f"{BACKBONE_DIR}/config.json",) if marker.get("backbone") else ()):
        if not (path / name).exists():
            raise ExportError(f"export folder {path} has no {name}: it is incomplete; {REEXPORT}")
    return info


def backbone_overrides(path: str | os.PathLike) -> dict:
    """The config overrides that build an export's pretrained backbone from its own BACKBONE_DIR/config.json (the
    weights come from model.safetensors), in place of the folder or inline config the run trained with; {} for a
    folder without one."""
    config = Path(path) / BACKBONE_DIR / "config.json"
    if not config.is_file():
        return {}
    try:
        backbone = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{config} is not a readable transformers config ({type(exc).__name__}: {exc}); "
                          f"{REEXPORT}") from None
    return {"model.backbone": "", "model.backbone_config": backbone}


def check_expected(info: ExportInfo, arch: str | None = None, vocab_size: int | None = None) -> None:
    """Refuse an export of another arch or vocabulary than the caller's model (one line, naming both)."""
    if arch is not None and info.arch != arch:
        raise ExportError(f"{info.path} holds a {info.arch} model, not {arch}: load it as {info.arch} or export a "
                          f"{arch} run")
    if vocab_size is not None and info.vocab_size != vocab_size:
        raise ExportError(f"{info.path} has a vocabulary of {info.vocab_size} ids ({info.tokenizer.get('kind')} "
                          f"tokenizer), not {vocab_size}: use a model and data of its tokenizer ({info.path}/"
                          f"{TOKENIZER_DIR})")


def check_data_tokenizer(info: ExportInfo, manifest: dict, data_dir: Path) -> None:
    """Refuse evaluating an export on data tokenized otherwise: the ids would mean other tokens."""
    data_tok, own = manifest.get("tokenizer", {}), info.tokenizer
    if (int(data_tok.get("vocab_size", -1)), data_tok.get("sha256")) != (info.vocab_size, own.get("sha256")):
        raise ExportError(
            f"{data_dir} was tokenized with a {data_tok.get('kind')} tokenizer of {data_tok.get('vocab_size')} ids "
            f"(sha256 {str(data_tok.get('sha256'))[:12]}) but {info.path} was trained with a {own.get('kind')} one of "
            f"{info.vocab_size} ids (sha256 {str(own.get('sha256'))[:12]}): give --data a folder prepared with "
            f"`memlm prepare ... --tokenizer-from {info.path / TOKENIZER_DIR}`")


def load_export_weights(info: ExportInfo, model: torch.nn.Module) -> None:
    """Load model.safetensors strictly into `model` (built from the folder's config), upcast to its dtype.

    Refused before anything is copied: a file of another arch (its metadata), and any parameter missing, extra or
    of another shape (the first one, in the model's order)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = info.path / WEIGHTS
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        stored = load_file(str(path))
        aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ExportError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                          f"{REEXPORT}") from None
    file_arch = metadata.get("arch")
    if file_arch != model.cfg.arch:
        raise ExportError(f"{path} holds {file_arch or 'an unnamed'} weights but {info.path / CONFIG} describes a "
                          f"{model.cfg.arch} model; {REEXPORT}")
    state = dict(stored)
    for name, target in aliases.items():
        if target not in stored:
            raise ExportError(f"{path}: tied tensor {name} names {target}, which the file does not hold; {REEXPORT}")
        state[name] = stored[target]
    expected = model.state_dict()
    first = first_difference(state, expected)
    if first:
        raise ExportError(f"{path} does not fit the {model.cfg.arch} model of {info.path / CONFIG}: {first}; "
                          f"{REEXPORT}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)


def first_difference(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    """'' when `state` has exactly `expected`'s names and shapes; else the first difference, in words."""
    for name, want in expected.items():
        if name not in state:
            return f"parameter {name} {list(want.shape)} is missing from the file"
        if tuple(state[name].shape) != tuple(want.shape):
            return (f"parameter {name} is {list(state[name].shape)} in the file but {list(want.shape)} in the "
                    "model")
    extra = [name for name in state if name not in expected]
    return f"the file holds {extra[0]}, which the model has no parameter for" if extra else ""


def build_export_model(info: ExportInfo, mcfg) -> torch.nn.Module:
    """The model of `mcfg` (the folder's config, eval settings applied) with the folder's weights, on the CPU."""
    if (mcfg.arch, mcfg.vocab_size) != (info.arch, info.vocab_size):
        raise ExportError(f"{info.path / CONFIG} describes a {mcfg.arch} model of {mcfg.vocab_size} ids but "
                          f"{info.path / MARKER} a {info.arch} one of {info.vocab_size}; {REEXPORT}")
    model = build_model(mcfg)
    load_export_weights(info, model)
    return model


def load_export_tokenizer(info: ExportInfo):
    """The folder's tokenizer, checked against the identity the marker recorded at export."""
    tokenizer = load_tokenizer(info.path / TOKENIZER_DIR)
    if tokenizer.identity().get("sha256") != info.tokenizer.get("sha256"):
        raise ExportError(f"{info.path / TOKENIZER_DIR} is not the tokenizer {info.path / MARKER} recorded (its "
                          f"files changed); {REEXPORT}")
    return tokenizer
