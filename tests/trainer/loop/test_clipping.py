"""train.clip is applied once, by whoever applies it: at ZeRO-0 in fp32 the trainer clips from the gradient norm it
computes anyway (trainer/loop/ds_config.trainer_clips: DeepSpeed's own clipping there reads Python floats onto the
device, two blocking copies per step on a GPU), elsewhere DeepSpeed does. Real DeepSpeed engines, one process."""

from __future__ import annotations

import pytest
import torch

from support.training import make_data, overrides, preset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("clipping_data"))


def _trainer(data, tmp_path, name: str, **extra):
    from memlm.data_pipeline.shards import load_manifest
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import Trainer
    from memlm.trainer.runtime import distributed

    cfg = load_config(preset("txl"), overrides(data, train__steps=8, train__grad_accum=2, train__warmup_steps=0,
                                               **extra))
    trainer = Trainer(cfg, tmp_path / name, distributed.setup_env(), {}, load_manifest(data))
    trainer.build()
    return trainer


@pytest.mark.parametrize("clip", [1e-3, 1e3])  # below every step's gradient norm, above it
def test_at_zero0_the_optimizer_sees_the_gradients_clipped_to_train_clip(clip, data, tmp_path):
    trainer = _trainer(data, tmp_path, "z0", train__clip=clip)
    assert trainer.ds_conf["gradient_clipping"] == 0.0  # DeepSpeed leaves them alone: clipped exactly once
    seen = []
    optimizer = trainer.engine.optimizer
    assert isinstance(optimizer, torch.optim.Optimizer)  # ZeRO-0 fp32: the torch optimizer itself
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(float(torch.nn.utils.get_total_norm(
        [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]))))
    for _ in range(3):
        row = trainer.train_step()
        assert seen[-1] == pytest.approx(min(clip, row["grad_norm"]), rel=1e-5), (seen, row)
    assert len(seen) == 3


def test_trainer_clipping_trains_as_deepspeeds_does(data, tmp_path):
    """The same clip (active on every step) applied by the trainer at ZeRO-0 and by DeepSpeed at ZeRO-2: the same
    losses and gradient norms, to float tolerance (the two compute the norm in different orders)."""
    runs = {}
    for zero in (0, 2):
        trainer = _trainer(data, tmp_path, f"z{zero}", train__clip=1e-3, deepspeed__zero_stage=zero)
        assert trainer.ds_conf["gradient_clipping"] == (0.0 if zero == 0 else 1e-3)
        runs[zero] = [trainer.train_step() for _ in range(4)]
    for z0, z2 in zip(runs[0], runs[2], strict=True):
        assert z0["loss"] == pytest.approx(z2["loss"], rel=1e-5) and z0["grad_norm"] > 1e-3
        assert z0["grad_norm"] == pytest.approx(z2["grad_norm"], rel=1e-4)
    assert runs[0][-1]["loss"] != runs[0][0]["loss"]  # it trained
