"""`memlm export RUN_DIR --out DIR --hf-backbone`: the backbone of a run around a pretrained model (archs hf, hf_rmt,
hf_armt) as a Hugging Face model folder, the next run's `model.backbone`.

DIR is what save_pretrained writes: config.json and model.safetensors with transformers' own parameter names (LoRA
merged into the weights it adapts, ARMT's layer wrappers taken off: models/pretrained/plain.py), plus tokenizer.json,
a byte copy of the backbone tokenizer the run's data was prepared with (`memlm prepare --tokenizer-from FOLDER`),
when it was; data in memlm's own tokenizers (bytes, word, sentencepiece) has no such file, and a run on the folder
prepares its data the same way. The memory (hf_rmt's memory_init, hf_armt's associative projections) is not a
backbone's and is left out: the folder is the backbone a memory is added to next, or any transformers user's model.

Why a mode of `memlm export` and not a subfolder every export writes: the folder holds the backbone's weights, which
the memlm export already holds in its own model.safetensors (every weight, for load_pretrained and `memlm
eval/generate DIR`); writing both each time would double every export of a pretrained backbone for a use only some
runs have. Beside the model's files, memlm-backbone.json records where the weights came from (run, step, arch,
what was left out); it also marks the folder as one --overwrite may replace.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from memlm.data_pipeline.hf_tokenizer import KIND as HF_KIND
from memlm.models.pretrained.shape import backbone_name
from memlm.models.registry import arch_spec

from .export import check_backbone_vocab, check_out, replace_folder
from .pretrained import DTYPES, ExportError, is_export
from .run_loader import open_run

MARKER = "memlm-backbone.json"
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def export_hf_backbone(run_dir: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32",
                       overwrite: bool = False) -> Path:
    """Write the Hugging Face folder `out` from RUN_DIR's latest weights (a run or an export folder); returns `out`."""
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: give one of {', '.join(DTYPES)}")
    run = open_run(run_dir)  # one line for a missing folder, config.yaml or checkpoint
    cfg = run.config
    if arch_spec(cfg.model.arch).memlm_layers:
        raise ExportError(f"--hf-backbone: {run_dir} is a {cfg.model.arch} run, whose layers are memlm's own, not a "
                          "Hugging Face backbone's: export it without --hf-backbone")
    check_out(out, overwrite, ours=is_backbone_export, kind="--hf-backbone export")
    tokenizer = run.tokenizer()
    model = run.load_model(model_config=cfg.model)

    from memlm.models.pretrained.plain import plain_backbone  # imports transformers' model classes

    lm = plain_backbone(model).to(DTYPES[dtype])
    if tokenizer.kind == HF_KIND and lm.config.bos_token_id is None:
        lm.config.bos_token_id = tokenizer.boundary_id  # what `memlm prepare --tokenizer-from` reads as the boundary
    # The memory's own tensors: memory_init (model.learned) and ARMT's projections (AssociativeLayer.assoc)
    left_out = sorted(name for name in model.state_dict() if not name.startswith("lm.") or ".assoc." in name)
    marker = {"arch": cfg.model.arch, "step": run.step, "source_run": str(run_dir.resolve()), "dtype": dtype,
              "backbone": backbone_name(cfg.model), "backbone_train": cfg.model.backbone_train,
              "lora_merged": cfg.model.backbone_train == "lora", "memory_left_out": left_out,
              "tokenizer": tokenizer.identity() if tokenizer.kind == HF_KIND else None}

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from transformers.utils import logging as hf_logging  # the plain backbone's own library, loaded above

        hf_logging.disable_progress_bar()  # save_pretrained's one-shard bar: the command lists the files itself
        lm.save_pretrained(tmp, safe_serialization=True)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp / "model.safetensors", 0o666 & ~umask)  # safetensors creates 0600, as in export.py
        check_backbone_vocab(tmp / "config.json", cfg.model.vocab_size)
        if tokenizer.kind == HF_KIND:
            (tmp / "tokenizer.json").write_bytes(tokenizer.content)  # the backbone's file, byte for byte
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def is_backbone_export(out: Path) -> bool:
    """A folder an earlier --hf-backbone export wrote (its marker, and not a memlm export's)."""
    return (out / MARKER).is_file() and not is_export(out)


