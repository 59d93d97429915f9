"""No command is silent for more than 10 s before its first line of progress (issue 32): the command's start watch.

Before it prints anything a command imports torch (and DeepSpeed, MLflow, Ray, matplotlib) and loads weights; on a
busy 2-core machine (load average 6) that is where the silence was: `memlm generate` 8-13 s, `memlm export` 16 s,
`memlm analyze` 11 s, `memlm longeval` 12 s, and `import torch` alone took 7 s. So the `memlm` command starts the
process's watch (trainer/runtime/heartbeat.py) for every command, before the command imports anything heavy, with
the import as its phase: after 8 s of silence it prints `memlm generate: still loading torch and memlm's modules
(8 s)`. The command then names each slow step it takes (`heartbeat.phase("loading the weights of ...")`) and clears
the phase, heartbeat.phase(None), where its own output begins; `memlm train` and `memlm eval` start their own
watch, which goes on from this one's count of the silence.
"""

from __future__ import annotations

import contextlib
import os

from memlm.trainer.runtime import heartbeat

LOADING = "loading torch and memlm's modules"  # the first phase: what a command does before its own code runs


@contextlib.contextmanager
def watched(command: str):
    """The command's start watch on rank 0 (other ranks of a launch stay quiet), stopped when the command ends."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    # QUIET_S read now rather than as the default argument bound at import: tests shorten it in the child process
    heartbeat.start(f"memlm {command}", quiet_s=heartbeat.QUIET_S)
    heartbeat.phase(LOADING)
    try:
        yield
    finally:
        heartbeat.stop()
