"""DeepSpeed on a memory wrapped around a pretrained backbone (tiny/hf_rmt, tiny/hf_armt: random GPT-2s inline):
ZeRO-3 over 2 ranks trains what ZeRO-0 trains, and bf16 trains on one. Exact resume (ZeRO 0 and 2, and after a
SIGKILL) is test_checkpoint.py's and test_kill_matrix.py's, which run every arch's tiny preset.

ZeRO-3 partitions every parameter and gathers it only while its module's forward runs: memory_init is read through
a module call for that reason (models/pretrained/causal_lm.py); read off the model, it stayed partitioned (init_memory
failed) and would never have been gathered for the forward.
"""

from __future__ import annotations

import os

import pytest
import torch

from memlm.trainer.checkpoint.weights import load_weights
from support.training import losses, make_data, torchrun, train_in_process

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")
pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it
STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("pretrained_ds_data"))


@pytest.mark.slow
def test_two_ranks_at_zero3_train_what_zero0_trains(data, tmp_path):
    """2 ranks (gloo, DeepSpeed's CPU accelerator): the same losses at every step and the same final weights,
    every one of them (the backbone's, memory_init) consolidated from ZeRO-3's partitions: a parameter ZeRO-3 never
    gathered for the forward would have kept its initial values (Adam moves them ~1e-3 a step)."""
    runs = {}
    for zero in (0, 3):
        torchrun("hf_rmt", data, tmp_path / f"z{zero}", deepspeed__zero_stage=zero, train__steps=STEPS,
                 train__save_every=0)
        runs[zero] = losses(tmp_path / f"z{zero}")
    assert sorted(runs[3]) == list(range(1, STEPS + 1))
    assert runs[3] == pytest.approx(runs[0], rel=1e-5, abs=1e-5)
    tag = f"global_step{STEPS}"
    sharded, whole = (load_weights(tmp_path / f"z{zero}" / "checkpoints", tag) for zero in (3, 0))
    assert sharded.keys() == whole.keys() and "learned.memory_init" in whole
    for name, tensor in whole.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["hf_rmt", "hf_armt"])
def test_bf16_on_one_rank_follows_fp32(data, tmp_path, arch):
    """deepspeed.precision=bf16 (the engine casts the wrapped model and the carried memory to bf16, fp32 master
    weights): the losses of fp32 to bf16's rounding, over steps whose replay window fills."""
    common = dict(train__steps=4, train__save_every=0)
    fp32 = train_in_process(arch, data, tmp_path / "fp32", **common)
    bf16 = train_in_process(arch, data, tmp_path / "bf16", deepspeed__precision="bf16", **common)
    assert [r["step"] for r in bf16] == [1, 2, 3, 4]
    for want, got in zip(fp32, bf16, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2), (got["step"], got["loss"], want["loss"])
    assert any(got["loss"] != want["loss"] for want, got in zip(fp32, bf16))  # bf16 did compute in bf16
