"""Precision and offload settings of the trainer on real DeepSpeed (CPU accelerator, gloo), one process.

bf16 must train the same model as fp32 (same data, same initial weights: the losses stay close and the loss
falls); optimizer and parameter offload change where the state lives, not the maths (losses equal the plain
ZeRO run); fp16, which DeepSpeed's CPU accelerator lacks, is refused with one line before any engine exists;
`data.num_workers` > 0 is refused (the trainer reads in process). The peak-memory metric is a real measurement.
"""

from __future__ import annotations

import os

import pytest

from support.training import make_data, overrides, preset, train_in_process

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")

STEPS = 12


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("precision_data"))


def _losses(rows):
    return [r["loss"] for r in rows]


def test_bf16_trains_the_same_model_as_fp32(data, tmp_path):
    fp32 = train_in_process("txl", data, tmp_path / "fp32", train__steps=STEPS, train__lr="3e-3",
                            train__save_every=0)
    bf16 = train_in_process("txl", data, tmp_path / "bf16", train__steps=STEPS, train__lr="3e-3",
                            train__save_every=0, deepspeed__precision="bf16")
    ds = (tmp_path / "bf16" / "ds_config.json").read_text()
    assert '"bf16"' in ds
    # bf16 rounds activations (8 bits of mantissa): close to fp32, but not equal (equal would mean bf16 is off).
    diffs = [abs(a - b) for a, b in zip(_losses(fp32), _losses(bf16))]
    assert max(diffs) < 0.1, diffs
    assert max(diffs) > 0.0
    assert sum(_losses(bf16)[-3:]) / 3 < sum(_losses(bf16)[:3]) / 3 - 0.1


@pytest.mark.parametrize("stage,extra", [
    (2, {"deepspeed__offload_optimizer": "true"}),
    (3, {"deepspeed__offload_optimizer": "true", "deepspeed__offload_params": "true"}),
])
def test_offload_keeps_the_maths(data, tmp_path, stage, extra):
    plain = train_in_process("lamemo", data, tmp_path / "plain", train__steps=6, train__save_every=0,
                             deepspeed__zero_stage=stage)
    offload = train_in_process("lamemo", data, tmp_path / "offload", train__steps=6, train__save_every=0,
                               deepspeed__zero_stage=stage, **extra)
    ds = (tmp_path / "offload" / "ds_config.json").read_text()
    assert '"offload_optimizer"' in ds
    assert _losses(offload) == pytest.approx(_losses(plain), rel=1e-6, abs=1e-6)


def test_peak_memory_metric_is_the_process_peak(data, tmp_path):
    import resource

    rows = train_in_process("txl", data, tmp_path / "run", train__steps=3, train__save_every=0)
    peak_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert all(0 < r["peak_mem_mb"] <= peak_now for r in rows)
    assert [r["peak_mem_mb"] for r in rows] == sorted(r["peak_mem_mb"] for r in rows)  # a peak never falls


@pytest.mark.parametrize("override,named", [
    ("deepspeed.precision=fp16", "deepspeed.precision=fp16 needs CUDA"),
    ("data.num_workers=2", "data.num_workers=2"),
    ("model.attention=flex", "model.attention=flex trains on CUDA GPUs only"),
    ("train.compile=true train.compile_backend=tensorrt", "torch.compile has no backend 'tensorrt'"),
])
def test_settings_this_machine_cannot_run_are_one_line(data, tmp_path, capsys, override, named):
    from memlm.cli import main

    rc = main(["train", preset("txl"), *overrides(data), *override.split(), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and named in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()
