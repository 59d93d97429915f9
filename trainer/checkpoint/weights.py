"""A checkpoint's weights as one fp32 module state dict, whatever the ZeRO stage and world size that wrote it.

ZeRO 1-3 (and DeepSpeed's bf16 optimizer) keep the fp32 master weights in the optimizer partitions, which
zero_to_fp32 consolidates; ZeRO-0 keeps no partitions, so the module weights are the model state file itself
(zero_to_fp32 alone fails on such a folder). Both readers unpickle DeepSpeed's files, so the folder is verified first
(safe_load.verify_folder): a file that could run code is refused before anything reads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memlm.trainer.runtime.quiet import import_deepspeed

from .errors import ResumeError
from .safe_load import deepspeed_safe_types, safe_load, verify_folder


def load_weights(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """The fp32 module state dict of a DeepSpeed checkpoint at any ZeRO stage and world size."""
    import_deepspeed(ckpt_dir.parent)  # reading DeepSpeed's files imports it: its start-up lines go to the run's log
    folder = ckpt_dir / tag
    verify_folder(folder)  # zero_to_fp32 unpickles in full: refuse a file that could run code first
    if any(folder.glob("*_optim_states.pt")):
        # ZeRO 1-3 (and DeepSpeed's bf16 optimizer): the fp32 master weights live in the optimizer partitions.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag)
    else:
        # ZeRO-0 keeps no partitions: the module weights are the model state file itself.
        files = sorted(folder.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ResumeError(f"checkpoint {folder} holds neither model nor optimizer states")
        state = safe_load(files[0], allow=deepspeed_safe_types())["module"]
    # An engine wrapping the model may have saved "module."-prefixed names.
    return {k.removeprefix("module."): (v.float() if v.is_floating_point() else v) for k, v in state.items()}
