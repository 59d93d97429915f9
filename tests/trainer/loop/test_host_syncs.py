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
MODELS = Path(trainer_loop.__file__).resolve().parents[2] / "models"
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


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# The chunked softmax head with tail clusters: the trainer plans each batch's tail rows on the host and sends the
# plan along (batch_transfer.tail_planner), so the model reads nothing either (models/head_plan.py).
TAILS = {"model__cutoffs": "[64,128]", "model__head_loss": "chunked"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,extra", [("txl", {}), ("rmt", {"model__bptt_replay_loss": "true"}), ("txl", TAILS)])
def test_the_recurrence_and_the_figures_read_once_on_every_device(device, arch, extra, data):
    """The step's own parts without DeepSpeed (which a GPU machine may lack): recurrence.step, backward, advance
    and StepFigures, as train_step uses them, on `device`. Trainer code reads once per step; on a GPU its copies
    are host-to-device, pinned and queued (non_blocking), and the figures equal the CPU run's. With the chunked
    head's tail clusters the model reads nothing at all (its plan came with the batch)."""
    from memlm.data_pipeline.stream import LaneStream
    from memlm.models import build_model
    from memlm.trainer.config.run_config import load_config
    from memlm.trainer.loop.recurrence import make_recurrence
    from memlm.trainer.loop.step_figures import StepFigures

    cfg = load_config(preset(arch), overrides(data, **extra))

    def steps(on: str) -> tuple[list[StepFigures], list[SyncCensus]]:
        torch.manual_seed(0)
        model = build_model(cfg.model).to(on).train()
        recurrence = make_recurrence(cfg.model, model.init_memory(cfg.data.batch_size, device=on), on)
        stream = LaneStream.from_config(cfg.data, "train", mode="train", seg_len=cfg.model.tgt_len)
        figures, censuses = [], []
        for _ in range(3):
            with SyncCensus() as seen:
                nll, count, bad = [], 0, torch.zeros((), dtype=torch.bool, device=on)
                for _ in range(2):
                    micro = recurrence.step(model, lambda: next(stream))
                    micro.loss.backward()
                    bad |= ~torch.isfinite(micro.loss.detach())
                    nll.append(micro.nll)
                    count += micro.count
                    recurrence.advance()
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                figures.append(StepFigures.summed(torch.stack(nll).sum(), count, 0, bad, ~torch.isfinite(norm),
                                                  False, 1, norm))
            model.zero_grad(set_to_none=True)
            censuses.append(seen)
        return figures, censuses

    figures, censuses = steps(device)
    for seen in censuses:
        ours = seen.issued_under(TRAINER)
        assert [e.op for e in ours if not e.op.startswith("copy")] == ["tolist"], seen.report()
        copies = [e for e in ours if e.op.startswith("copy")]
        if extra is TAILS:
            assert seen.issued_under(MODELS) == [], seen.report()
        if device == "cuda":  # tokens, targets, reset of every new segment (+ 3 tail plans): 2 micro-batches
            assert len(copies) == (12 if extra is TAILS else 6) and all(
                e.op == "copy cpu->cuda" and e.non_blocking and e.pinned for e in copies), seen.report()
        else:
            assert copies == [], seen.report()
    if device != "cpu":
        reference, _ = steps("cpu")
        for got, want in zip(figures, reference, strict=True):
            assert got.targets == want.targets and got.nll == pytest.approx(want.nll, rel=1e-4)
