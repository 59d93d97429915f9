"""SIGTERM, the way schedulers preempt a job (SLURM, Kubernetes, Ray, torchrun and the deepspeed launcher passing
it on to their ranks): finish the step, checkpoint, leave with exit status 143 and the MLflow run KILLED.

    stop = StopRequest(grace_s=30, rank=0)
    with stop.installed():          # SIGTERM now only sets stop.requested (and starts the grace clock)
        ... train; after each step all ranks agree on stop.requested, save, raise Preempted(...)

Why a flag and not an exception in the handler: a signal can arrive anywhere, mid-backward or inside a collective;
stopping there would leave ranks waiting for each other and no checkpoint. The flag is summed over ranks in the
step's one all-reduce (trainer/loop/train.py), so every rank stops at the same step boundary even when the signal
reached only one of them. If no step boundary comes within `grace_s` (a step or validation pass longer than the
scheduler's patience, a stuck peer), the process says so in one line and exits 143 without a checkpoint: the last
one stays intact, and a later `--resume` continues from it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: what a shell and the schedulers report for a job ended by SIGTERM


class Preempted(Exception):
    """Training stopped for a SIGTERM after saving; the command line prints the message and exits 143."""

    exit_status = EXIT_PREEMPTED


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message says at which step and where the last checkpoint is."""


class StopRequest:
    def __init__(self, grace_s: float, rank: int = 0, describe_last=lambda: ""):
        self.grace_s, self.rank, self.describe_last = grace_s, rank, describe_last
        self.requested = False
        self._timer: threading.Timer | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """SIGTERM sets the flag for the duration of the block. Signal handlers belong to the main thread: run
        elsewhere (a Ray Tune trial's thread) the block installs nothing and the caller's own stop applies."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._timer is not None:
                self._timer.cancel()

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:  # a launcher passing the same signal on again
            return
        self.requested = True
        if self.rank == 0:
            print(f"memlm train: SIGTERM received: saving a checkpoint at the end of this step (within "
                  f"{self.grace_s:g} s, train.stop_grace_s)", file=sys.stderr, flush=True)
        if self.grace_s > 0:
            self._timer = threading.Timer(self.grace_s, self._give_up)
            self._timer.daemon = True
            self._timer.start()

    def _give_up(self) -> None:
        if self.rank == 0:
            print(f"memlm train: no step boundary within {self.grace_s:g} s of SIGTERM: leaving without a new "
                  f"checkpoint; {self.describe_last()}", file=sys.stderr, flush=True)
        os._exit(EXIT_PREEMPTED)
