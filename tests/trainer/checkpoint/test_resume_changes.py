"""Resuming with a changed config (trainer/checkpoint/resume_policy.py): a changed learning rate, schedule length,
weight decay apply from the resumed step and say so in one line, the run folder's config.yaml says what trains and
config_changes.jsonl keeps the history; a change a resume cannot make, and a changed model or memory shape, is one
line before anything is built, and the folder is left as it was.

Before: the new train.lr was silently replaced by the checkpoint's (while config.yaml recorded it), the weight decay
likewise, and a changed shape was DeepSpeed's 50-line traceback (issue 32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from memlm.cli import main
from memlm.trainer.config.run_config import load_config
from memlm.trainer.loop.schedule import lr_factor
from support.training import make_data, metrics, overrides, preset

pytestmark = pytest.mark.slow

COMMON = dict(train__steps=4, train__save_every=2, train__eval_every=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("resume_changes_data"))


@pytest.fixture(scope="module")
def stopped(data, tmp_path_factory):
    """A txl run of 4 steps stopped after its step-2 checkpoint (lr 1e-3, warmup 2, cosine)."""
    run = tmp_path_factory.mktemp("resume_changes") / "run"
    assert main(["train", preset("txl"), *overrides(data, **COMMON), "--out", str(run), "--stop-at", "2"]) == 0
    return run


def snapshot(run) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def resume(data, run, *changed: str) -> int:
    return main(["train", preset("txl"), *overrides(data, **COMMON), *changed, "--out", str(run), "--resume"])


def test_a_changed_lr_schedule_and_weight_decay_apply_from_the_resumed_step(data, stopped, tmp_path, capsys):
    run = shutil.copytree(stopped, tmp_path / "run")
    capsys.readouterr()
    assert resume(data, run, "train.steps=6", "train.lr=5e-4", "train.weight_decay=0.01") == 0
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "config changed" in line]
    assert said == ["memlm train: config changed since the checkpoint, applied from step 2: train.steps 4 -> 6, "
                    "train.lr 0.001 -> 0.0005, train.weight_decay 0.0 -> 0.01 (learning rate at this step 0.001 -> "
                    "0.0005); config.yaml says so and config_changes.jsonl keeps the history"], err

    cfg = load_config(run / "config.yaml")  # the record says what trained from step 3 on
    assert (cfg.train.lr, cfg.train.steps, cfg.train.weight_decay) == (5e-4, 6, 0.01)
    rows = {row["step"]: row for row in metrics(run)}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert rows[2]["lr"] == pytest.approx(1e-3 * lr_factor(1, steps=4, warmup_steps=2, schedule="cosine",
                                                            min_lr_ratio=0.0))
    for step in (3, 4, 5, 6):  # the new peak rate along the new 6-step schedule
        want = 5e-4 * lr_factor(step - 1, steps=6, warmup_steps=2, schedule="cosine", min_lr_ratio=0.0)
        assert rows[step]["lr"] == pytest.approx(want), step
    saved = torch.load(run / "checkpoints" / "global_step6" / "mp_rank_00_model_states.pt", weights_only=False)
    group = saved["optimizer"]["param_groups"][0]
    assert (group["weight_decay"], group["initial_lr"]) == (0.01, 5e-4)

    history = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in entry.items() if k != "time"} for entry in history] == [
        {"step": 2, "checkpoint": "global_step2",
         "changed": {"train.steps": [4, 6], "train.lr": [0.001, 0.0005], "train.weight_decay": [0.0, 0.01]}}]


@pytest.mark.parametrize("change, said", [
    ("train.adam_betas=[0.8,0.99]", "with train.adam_betas changed ([0.9, 0.999] -> [0.8, 0.99]): the saved moment "
                                    "estimates"),
    ("train.optimizer=adamw", "with train.optimizer changed ('adam' -> 'adamw')"),
    ("train.seed=7", "with train.seed changed (1111 -> 7)"),
    ("deepspeed.zero_stage=2", "with deepspeed.zero_stage changed (0 -> 2): the optimizer state is saved in that "
                               "layout; set it back, or pass --reshard"),
    ("train.steps=1 train.warmup_steps=0", "with train.steps=1: the checkpoint is already at step 2"),
    ("model.d_model=64", "the model's shape changed (model.d_model was 32, now 64): parameter embed.tables.0.weight "
                         "is (256, 32) in the checkpoint, (256, 64) now"),
    ("model.n_layer=3", "the model's shape changed (model.n_layer was 2, now 3): parameter layers.2."),
    ("model.mem_len=16", "the model's shape changed (model.mem_len was 8, now 16): the recurrent memory.hidden[0] is "
                         "(2, 8, 32) in the checkpoint, (2, 16, 32) now"),
])
def test_a_change_a_resume_cannot_make_is_one_line_and_changes_nothing(data, stopped, change, said, capsys):
    before = snapshot(stopped)
    capsys.readouterr()
    assert resume(data, stopped, *change.split()) == 2
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if line.startswith("memlm: error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err) and "[rank0]" not in "\n".join(err), err
    assert errors[0].startswith(f"memlm: error: cannot resume from {stopped / 'checkpoints' / 'global_step2'}")
    assert said in errors[0], errors[0]
    assert snapshot(stopped) == before
