"""memlm's user-facing errors share one base, memlm.errors.MemlmError, which the command line catches once: each kind,
raised inside any command, is one line `memlm: error: MESSAGE` and its exit status (2; 3 and no line of its own for a
quiet PeerFailure); anything else still raises. Each kind keeps the built-in base that callers catch (the Ray tasks
retry RuntimeError, not ValueError). Seconds: the command is a stand-in module, nothing trains."""

from __future__ import annotations

import sys
import types

import pytest

from memlm import cli
from memlm.cluster.errors import ClusterError
from memlm.data_pipeline.format import DataError
from memlm.errors import MemlmError
from memlm.models.config import ConfigError
from memlm.trainer.checkpoint.disk_full import DiskFullError
from memlm.trainer.checkpoint.errors import CheckpointWriteError, ResumeError, UnsafeCheckpointError
from memlm.trainer.checkpoint.pretrained import ExportError
from memlm.trainer.checkpoint.run_folder import RunFolderError
from memlm.trainer.checkpoint.run_lock import RunFolderBusy
from memlm.trainer.loop.preemption import Preempted
from memlm.trainer.loop.train import TrainingStopped
from memlm.trainer.runtime.peer_watch import PeerFailure
from memlm.trainer.tracking.errors import TrackingError

# Every kind a user may meet, with the built-in base each had before the common one (and keeps)
KINDS = [(ConfigError, ValueError), (DataError, ValueError), (ResumeError, ValueError),
         (CheckpointWriteError, ValueError), (UnsafeCheckpointError, ValueError), (DiskFullError, ValueError),
         (ExportError, ValueError), (RunFolderError, ValueError), (RunFolderBusy, ValueError),
         (TrainingStopped, ValueError), (TrackingError, RuntimeError), (ClusterError, RuntimeError),
         (PeerFailure, RuntimeError)]


def run_raising(monkeypatch, exc: BaseException) -> int:
    """`memlm demo` with the demo replaced by one that raises `exc`."""
    fake = types.ModuleType("memlm.demo")

    def fail(args):
        raise exc

    fake.main = fail
    monkeypatch.setitem(sys.modules, "memlm.demo", fake)
    import memlm

    monkeypatch.setattr(memlm, "demo", fake, raising=False)
    return cli.main(["demo"])


@pytest.mark.parametrize("kind, builtin", KINDS, ids=[kind.__name__ for kind, _ in KINDS])
def test_each_kind_is_one_line_and_its_exit_status(kind, builtin, monkeypatch, capsys):
    assert issubclass(kind, MemlmError) and issubclass(kind, builtin)
    expected = 3 if kind is PeerFailure else 2
    assert run_raising(monkeypatch, kind("the thing at fault; the fix")) == expected
    assert capsys.readouterr().err == "memlm: error: the thing at fault; the fix\n"


def test_a_quiet_peer_failure_leaves_the_line_to_the_rank_that_prints_it(monkeypatch, capsys):
    assert run_raising(monkeypatch, PeerFailure("rank 1 failed", quiet=True)) == 3
    assert capsys.readouterr().err == ""


def test_a_preemption_is_a_status_line_not_an_error(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert run_raising(monkeypatch, Preempted("stopped at step 4 for SIGTERM; resume with --resume")) == 143
    assert capsys.readouterr().err == "memlm demo: stopped at step 4 for SIGTERM; resume with --resume\n"


@pytest.mark.parametrize("other", [ValueError("a bug"), RuntimeError("a bug"), KeyError("a bug")])
def test_any_other_exception_still_raises(other, monkeypatch):
    with pytest.raises(type(other)):
        run_raising(monkeypatch, other)
