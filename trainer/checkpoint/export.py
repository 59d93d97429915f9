"""`memlm export RUN_DIR --out DIR`: a run's latest weights as a folder that leaves memlm's training setup.

The weights come from trainer/checkpoint/weights.py (any ZeRO stage and world size, fp32), are loaded strictly into
the model that the run's config builds (so a folder is never written for weights that do not fit), and are saved as
safetensors in fp32 or bf16, next to the config, the tokenizer files and a model card; pretrained.py says what the
folder holds and reads it back. The folder is written aside and renamed into place, the marker last, so an
interrupted export leaves no half folder under the name; --overwrite replaces an earlier export only, never a folder
of other files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from memlm.models.pretrained.shape import backbone_name
from memlm.trainer.runtime import heartbeat

from .model_card import eval_results, model_card
from .pretrained import (
    ALIASES_KEY,
    BACKBONE_DIR,
    CARD,
    CONFIG,
    DTYPES,
    EXPORT_FORMAT,
    MARKER,
    TOKENIZER_DIR,
    WEIGHTS,
    ExportError,
    is_export,
)
from .run_loader import open_run
from .store import META, read_meta


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32", overwrite: bool = False,
               tag: str | None = None) -> Path:
    """Write the export folder `out` from RUN_DIR's checkpoint (`tag`, default the `latest` one); returns `out`."""
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: give one of {', '.join(DTYPES)}")
    if is_export(run_dir):
        raise ExportError(f"{run_dir} is already an export folder: copy it, or export its run folder")
    run = open_run(run_dir, tag=tag)  # one line for a missing folder, config.yaml or checkpoint
    check_out(out, overwrite)
    cfg, ckpt = run.config, run.checkpoint
    meta = read_meta(ckpt.parent, ckpt.name) if (ckpt / META).is_file() else {}
    data_dir, manifest = run.data()
    tokenizer = run.tokenizer()
    trained_with = (meta.get("tokenizer") or {}).get("sha256")
    if trained_with and trained_with != tokenizer.identity()["sha256"]:
        raise ExportError(f"{data_dir} now holds another tokenizer than {ckpt} was trained with (sha256 "
                          f"{tokenizer.identity()['sha256'][:12]}, trained {trained_with[:12]}): point data.path in "
                          f"{run_dir / CONFIG} at the run's data")

    # The model the run trained (not the evaluation's lengths); the weights are refused when they do not fit it.
    model = run.load_model(model_config=cfg.model)
    backbone = backbone_name(cfg.model)  # a pretrained backbone: its folder, or "inline gpt2"; "" for memlm's layers
    tensors, aliases = stored_tensors(model.state_dict(), DTYPES[dtype])
    step = run.step
    marker = {
        "format": EXPORT_FORMAT, "arch": cfg.model.arch, "dtype": dtype, "vocab_size": cfg.model.vocab_size,
        "parameters": sum(t.numel() for t in tensors.values()), "step": step, "checkpoint": ckpt.name,
        "source_run": str(run_dir.resolve()), "tokenizer": tokenizer.identity(),
        "evaluations": eval_results(run_dir, step), **({"backbone": backbone} if backbone else {}),
    }

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from safetensors.torch import save_file

        metadata = {"format": "pt", "memlm": EXPORT_FORMAT, "arch": cfg.model.arch, "dtype": dtype,
                    "vocab_size": str(cfg.model.vocab_size), ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
        save_file(tensors, str(tmp / WEIGHTS), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp / WEIGHTS, 0o666 & ~umask)  # safetensors creates 0600; a file to hand on reads as its neighbours
        shutil.copyfile(run_dir / CONFIG, tmp / CONFIG)  # exactly what the run trained with
        if backbone:  # what the export builds its backbone from (pretrained.backbone_overrides)
            model.save_backbone_config(tmp / BACKBONE_DIR)
            check_backbone_vocab(tmp / BACKBONE_DIR / "config.json", cfg.model.vocab_size)
        tokenizer.save(tmp / TOKENIZER_DIR)
        (tmp / CARD).write_text(model_card(cfg, marker, manifest, weights_bytes=(tmp / WEIGHTS).stat().st_size),
                                encoding="utf-8")
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_backbone_vocab(config: Path, vocab_size: int) -> None:
    """An export builds its backbone from the saved config, which must then read the data's vocabulary: refuse a
    backbone whose embedding has other rows than the data's ids (a folder whose tokenizer.json is smaller)."""
    rows = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
    if rows != vocab_size:
        raise ExportError(f"the backbone's embedding has {rows} rows and the data's tokenizer {vocab_size} ids: memlm "
                          "export keeps backbones whose embedding matches the data's vocabulary only; resize the "
                          "backbone's embedding to the tokenizer (resize_token_embeddings) and fine-tune again")


def check_out(out: Path, overwrite: bool, ours=is_export, kind: str = "export") -> None:
    """Refuse an --out that holds files, unless --overwrite and `ours(out)`: an earlier export of this `kind` (nothing
    else is deleted). `memlm export --hf-backbone` passes its own marker's test and kind."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file: name a folder")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    if not overwrite:
        raise ExportError(f"--out {out} already holds {len(held)} file(s) ({shown}): choose an empty or new folder, "
                          f"or pass --overwrite to replace an earlier {kind}")
    if not ours(out):
        raise ExportError(f"--out {out} holds files ({shown}) and is not a memlm {kind}, so --overwrite will not "
                          "delete them: choose an empty or new folder")


def replace_folder(tmp: Path, out: Path) -> None:
    """Put the finished folder `tmp` at `out` (an earlier export there is removed only once the new one is in)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def stored_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[dict[str, torch.Tensor],
                                                                                  dict[str, str]]:
    """(name -> tensor to store, name -> stored name for tied tensors). Floating tensors are cast to `dtype`.

    safetensors refuses tensors that share memory; a tied tensor (the softmax head reusing the embedding) is the
    same tensor under two names, so it is stored once and its other name recorded; a partial overlap is copied."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        out = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()
        tensors[name] = out.contiguous().clone()  # its own memory: no overlap with another stored tensor
    return tensors, aliases


def main(args) -> int:
    """The command: export, then one line per file with its size."""
    import contextlib
    import sys

    # DeepSpeed (imported to read the checkpoint) logs to the stdout it finds at import: keep stdout for the listing.
    heartbeat.phase(f"exporting the weights of {args.run_dir}")  # memlm/start_watch.py: a line within 10 s
    with contextlib.redirect_stdout(sys.stderr):
        if getattr(args, "hf_backbone", False):
            from .hf_backbone_export import export_hf_backbone  # a module of its own: the backbone alone

            out = export_hf_backbone(args.run_dir, args.out, dtype=args.dtype, overwrite=args.overwrite)
        else:
            out = export_run(args.run_dir, args.out, dtype=args.dtype, overwrite=args.overwrite)
    heartbeat.phase(None)
    if getattr(args, "hf_backbone", False):
        print(f"{out}: the backbone of {args.run_dir} as a Hugging Face folder (model.backbone={out}), {args.dtype}")
        for path in sorted(p for p in out.iterdir() if p.is_file()):
            print(f"  {path.name}  {path.stat().st_size:,} bytes")
        return 0
    marker = json.loads((out / MARKER).read_text())
    print(f"{out}: {marker['arch']} at step {marker['step']}, {marker['parameters']:,} parameters, {args.dtype}")
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        print(f"  {path.relative_to(out)}  {path.stat().st_size:,} bytes")
    return 0

