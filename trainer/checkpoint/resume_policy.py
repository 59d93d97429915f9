"""What `memlm train --resume` does with a config that differs from the one its checkpoint was trained with.

Before this, a changed `train.lr` was silently ignored (DeepSpeed restores the optimizer's and the scheduler's saved
rates) while the run folder's config.yaml recorded the new value, and a changed model shape was a 50-line DeepSpeed
traceback (issue 32). Now every changed key either applies from the resumed step, said in one line, or is refused
in one line before anything is built; config.yaml says what trains and config_changes.jsonl keeps what changed
(config_record.py). Each key's rule, and why (docs/design.md §4 has the table):

Applies from the resumed step (what a user of DeepSpeed or Transformer-XL who edits them expects):
- the learning-rate schedule, `train.lr`, `train.warmup_steps`, `train.schedule`, `train.min_lr_ratio` and
  `train.steps`: the schedule is recomputed from the new values at the step the scheduler has reached (a longer
  run stretches the decay; the line says the rate before and after);
- the optimizer's per-group settings `train.weight_decay` and `train.adam_eps`: set on the restored groups (they
  shape each update, not the saved moment estimates);
- everything the engine, the loop or the forward reads fresh at every start: `train.clip`, `train.grad_accum`,
  the save/eval/log cadences, compile settings, timeouts, dropout, tracking, eval settings, ZeRO's bucket sizes.

Refused (set it back, or start over another way):
- `train.optimizer` and `train.adam_betas`: the saved moment estimates (and Adam's bias correction) belong to the
  old update rule; continuing them under another one is neither run;
- `train.seed` and `data.seed`: they chose the initial weights and the data order, and the checkpoint continues
  its own random and stream state; a new value would apply to nothing;
- `train.init_from`: only a run's first start loads it; a resume continues its own weights;
- DeepSpeed's state layout, `deepspeed.zero_stage`, `precision`, `offload_optimizer`, `offload_params`,
  `torch_adam` and `loss_scale`: the optimizer state is saved in that layout (`--reshard` continues from the
  weights alone);
- a changed model shape (model_fit.py) and a changed arch, world size or tokenizer (store.check_compatible).

Keys not listed apply as they are. The checkpoint's own config is in its meta.json ("config", flattened); a
checkpoint written before that is compared with the run folder's config.yaml.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlm.data_pipeline.remote.location import redact
from memlm.trainer.config.run_config import flatten, load_config

from .errors import ResumeError
from .model_fit import check_model_fits

SCHEDULE_KEYS = ("train.lr", "train.warmup_steps", "train.schedule", "train.min_lr_ratio", "train.steps")
GROUP_KEYS = ("train.weight_decay", "train.adam_eps")  # set on the optimizer's restored param groups
RESHARD = ("set it back, or pass --reshard to continue from the weights alone (optimizer state, lr schedule and data "
           "position start over)")
NEW_RUN = "set it back, or start a new run folder from these weights (train.init_from=RUN_DIR)"
REFUSED: dict[str, tuple[str, str]] = {  # key: (why it cannot change on resume, what to do)
    "train.optimizer": ("the saved moment estimates belong to the old update rule", NEW_RUN),
    "train.adam_betas": ("the saved moment estimates and Adam's bias correction were accumulated with the old "
                         "betas", NEW_RUN),
    "train.seed": ("it chose the initial weights, and the resumed run continues the checkpoint's random state",
                   "set it back (a new seed applies to a new run folder)"),
    "data.seed": ("it chose the data order, and the resumed stream continues the checkpoint's",
                  "set it back (a new seed applies to a new run folder)"),
    "train.init_from": ("only a run's first start loads it; a resume continues the checkpoint's own weights",
                        "set it back, or start a new run folder (or --overwrite)"),
    **{f"deepspeed.{key}": ("the optimizer state is saved in that layout", RESHARD)
       for key in ("zero_stage", "precision", "offload_optimizer", "offload_params", "torch_adam", "loss_scale")},
}


@dataclass(frozen=True)
class Change:
    key: str
    was: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.was)} -> {_show(self.now)}"


def saved_config(folder: Path, run_dir: Path) -> dict[str, Any] | None:
    """The flattened config checkpoint FOLDER was trained with: its meta.json's, else the run folder's config.yaml
    (a checkpoint written before meta.json held it), else None."""
    meta = Path(folder) / "meta.json"
    try:
        saved = json.loads(meta.read_text()).get("config")
    except (OSError, ValueError):
        saved = None
    if saved is not None:
        return saved
    config_yaml = Path(run_dir) / "config.yaml"
    if not config_yaml.is_file():
        return None
    try:
        return flatten(load_config(config_yaml))
    except ValueError:  # a config an older memlm wrote that this one no longer reads: nothing to compare
        return None


def changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[Change]:
    """Every key whose value differs, in the config's order (JSON turns tuples into lists: compared as lists)."""
    if saved is None:
        return []
    return [Change(key, saved[key], value) for key, value in current.items()
            if key in saved and _plain(saved[key]) != _plain(value)]


def check(found: list[Change], folder: Path, step: int) -> None:
    """ResumeError for the first change a resume cannot make (REFUSED, or train.steps below the checkpoint's step)."""
    for change in found:
        if change.key in REFUSED:
            why, fix = REFUSED[change.key]
            raise ResumeError(f"cannot resume from {folder} with {change.key} changed ({_show(change.was)} -> "
                              f"{_show(change.now)}): {why}; {fix}")
        if change.key == "train.steps" and change.now < step:
            raise ResumeError(f"cannot resume from {folder} with train.steps={change.now}: the checkpoint is already "
                              f"at step {step}; give train.steps >= {step}")


def model_changes(found: list[Change]) -> dict[str, tuple[Any, Any]]:
    """The changed keys that can change a shape: the model's and the lanes per rank."""
    return {c.key: (c.was, c.now) for c in found if c.key.startswith("model.") or c.key == "data.batch_size"}


def applied_line(found: list[Change], step: int, lr: tuple[float, float] | None) -> str:
    """The one line that says what a resume changed: `config changed at step 10, applied from here: train.lr 0.001 ->
    0.0005 (learning rate at this step 0.00095 -> 0.00048); config_changes.jsonl keeps the history`."""
    said = ", ".join(map(str, found))
    rate = ""
    if lr is not None and any(c.key in SCHEDULE_KEYS for c in found):
        rate = f" (learning rate at this step {lr[0]:.3g} -> {lr[1]:.3g})"
    return (f"config changed since the checkpoint, applied from step {step}: {said}{rate}; config.yaml says so and "
            "config_changes.jsonl keeps the history")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _show(value: Any) -> str:
    """A value as the resume lines print it; a URL's credentials (data.path) redacted."""
    return repr(redact(value)) if isinstance(value, str) else str(value)


def check_resume(cfg, run_dir: Path, folder: Path, step: int) -> list[Change]:
    """The changes resuming `cfg` from checkpoint FOLDER (at `step`) would make; ResumeError, in one line and
    before anything is built, for one it cannot make or a model that no longer fits the checkpoint."""
    found = changes(saved_config(folder, run_dir), flatten(cfg))
    check(found, folder, step)
    check_model_fits(cfg.model, cfg.data.batch_size, folder, model_changes(found))
    return found
