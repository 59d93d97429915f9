"""Host syncs of the training step: the trainer's own code reads the device once per optimizer step (the step's
figures, where the non-finite skip is decided: trainer/loop/step_figures.py) and moves batches without a read.

The census (tests/support/sync_census.py) records every sync-prone operation of a real Trainer's step (real
DeepSpeed engine, one process, CPU) with the Python frame that asked for it, so the trainer's own sites are told
from the model's (models/) and DeepSpeed's, which are printed but not asserted here. On the CPU no copy crosses
devices; what a copy to a GPU does is decided by batch_transfer.copy_options, tested as the pure function it is,
and the flags it returns reach the copy (seen by the census on a copy to the meta device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memlm.trainer.loop as trainer_loop
from memlm.trainer.loop.batch_transfer import CopyOptions, copy_options, options_for, segment_to_device, to_device
from support.sync_census import SyncCensus
from support.training import make_data, overrides, preset

LOOP = Path(trainer_loop.__file__).resolve().parent  # trainer/loop/: the trainer's step lives here
TRAINER = LOOP.parent
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("host_syncs_data"))


# -- the census itself ---------------------------------------------------------------------------------------------
def test_the_census_sees_each_kind_of_sync_and_who_asked():
    t = torch.arange(6.0)
    with SyncCensus() as census:
        int(t.sum())  # a scalar read
        t.tolist()  # a read with no aten call on the CPU
        t.nonzero()  # an output sized by the data
        t[t > 2]  # boolean-mask indexing: nonzero inside the kernel
        t.to("meta", non_blocking=True)  # a copy between devices
        t.numpy()  # host data read through numpy: refuses device tensors, never a sync
        t * 2  # ordinary work
    ops = [e.op for e in census.events]
    assert ops == ["read", "tolist", "nonzero", "masked index", "copy cpu->meta"], census.report()
    assert all(e.issued_under(HERE) and not e.issued_under(TRAINER) for e in census.events)
    assert census.events[0].origin.endswith("test_the_census_sees_each_kind_of_sync_and_who_asked")
    assert census.events[-1].non_blocking is True and census.events[-1].pinned is False


# -- moving a batch ------------------------------------------------------------------------------------------------
def test_batches_go_to_a_gpu_pinned_and_queued_and_elsewhere_as_they_are():
    assert copy_options("cuda", cuda_available=True) == CopyOptions(pin=True, non_blocking=True)
    # Pinning needs CUDA; without it (or to the CPU, where `.to` copies nothing) a plain copy.
    for device_type, cuda in (("cuda", False), ("cpu", True), ("cpu", False), ("meta", True)):
        assert copy_options(device_type, cuda_available=cuda) == CopyOptions(pin=False, non_blocking=False)
    assert options_for("cpu") == CopyOptions(pin=False, non_blocking=False)
    assert options_for("cuda:0") == CopyOptions(pin=torch.cuda.is_available(), non_blocking=torch.cuda.is_available())

    t = torch.arange(4)
    with SyncCensus() as census:
        to_device(t, "meta", CopyOptions(pin=False, non_blocking=True))
    assert [(e.op, e.non_blocking) for e in census.events] == [("copy cpu->meta", True)], census.report()
    if torch.cuda.is_available():
        assert to_device(t, "cpu", CopyOptions(pin=True, non_blocking=False)).is_pinned()
    else:  # asked to pin, it does: torch refuses without an accelerator
        with pytest.raises(RuntimeError, match="accelerator"):
            to_device(t, "cpu", CopyOptions(pin=True, non_blocking=False))


def test_a_segment_moves_with_its_scored_targets_counted_on_the_host():
    from memlm.data_pipeline.stream import Batch

    targets = torch.tensor([[5, -100, 7, -100], [-100, -100, -100, 1]])
    batch = Batch(torch.ones(2, 4, dtype=torch.long), targets, torch.tensor([True, False]), torch.ones(2, dtype=bool))
    with SyncCensus() as census:
        moved = segment_to_device(batch, "cpu", options_for("cpu"))
    assert moved.scored == 3 and census.events == [], census.report()
    assert torch.equal(moved.targets, targets) and torch.equal(moved.reset, batch.reset)


# -- the trainer's step --------------------------------------------------------------------------------------------
def _trainer(data, tmp_path, arch: str, zero: int, **extra):
    from memlm.data_pipeline.shards import load_manifest
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.train import Trainer
    from memlm.trainer.runtime import distributed

    cfg = load_config(preset(arch), overrides(data, deepspeed__zero_stage=zero, train__steps=8, train__grad_accum=2,
                                              **extra))
    trainer = Trainer(cfg, tmp_path / "run", distributed.setup_env(), {}, load_manifest(data))
    trainer.build()
    return trainer


@pytest.mark.parametrize("arch,zero,extra", [
    ("txl", 0, {}),
    ("txl", 2, {}),
    ("rmt", 0, {"model__bptt_depth": 2, "model__bptt_replay_loss": "true"}),  # replayed segments scored too
])
def test_the_trainer_reads_the_device_once_per_step(arch, zero, extra, data, tmp_path):
    """Two micro-batches per step, under the census: the trainer's code (trainer/) asks for exactly one sync-prone
    operation per step, the read of the step's figures; logged steps add only DeepSpeed's own gradient norm at
    ZeRO 1-3 (read for the metrics row). What the model and DeepSpeed ask for is printed (pytest -s), not
    asserted: those are theirs."""
    trainer = _trainer(data, tmp_path, arch, zero, **extra)
    trainer.train_step()  # the first step sets up lazily (optimizer state); its syncs are not the steady state
    for log in (False, True):
        with SyncCensus() as census:
            row = trainer.train_step(log=log)
        assert not row["skipped"]
        ours = census.issued_under(TRAINER)
        want = ["tolist at step_figures.py"]
        if log and zero > 0:
            want.append("read at train.py")
        assert [f"{e.op} at {Path(e.origin.split(':')[0]).name}" for e in ours] == want, census.report()
        assert (row["grad_norm"] is not None) == log
        print(f"\n{arch} ZeRO-{zero} log={log}:\n{census.report()}")
