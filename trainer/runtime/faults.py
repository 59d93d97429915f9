"""The test seam: every place product code lets a test make its process die, stall or compute garbage, named here.

Product code passes a named point, `faults.at("renamed", step=step, rank=rank)`, and a test chooses what happens
there through an environment variable it sets on the process it starts (or on itself); unset, `at` returns at once
and changes nothing. POINTS below names every point, the file that passes it and what its count is (a training
step; for an extrapolation task its memory length), and `at` refuses a point or a count it does not declare, so a
reader of the trainer sees one call per point and a test author finds every point in one list
(tests/trainer/runtime/test_faults.py checks each call in product code against it).

    MEMLM_TEST_KILL=POINT:STEP[:RANK]   SIGKILL this process at POINT of STEP (on RANK; default every rank), as a
                                        preemption would (tests/trainer/checkpoint/test_kill_matrix.py); "enospc"
                                        instead fails that step's save as a full disk would, "error" raises a
                                        RuntimeError as that step starts (a bug on one rank:
                                        trainer/runtime/peer_watch.py).
    MEMLM_TEST_SIGNAL=TERM|INT|STOP     the signal MEMLM_TEST_KILL sends instead of SIGKILL: a scheduler's
                                        preemption, Ctrl-C, or a frozen rank (a node gone without a word).
    MEMLM_TEST_SLEEP_IN_SAVE=STEP:SECS  sleep at point "rank-saved" (inside the aside-write of that step's
                                        checkpoint), so a test can kill the process mid-checkpoint or let a SIGTERM
                                        grace period run out.
    MEMLM_TEST_POISON=STEP:RANK:WHAT,...  "batch": that step's first micro-batch loss is NaN (a corrupted batch);
                                        "param": before that step one weight becomes inf (a corrupted weight,
                                        which no skipped update repairs) (tests/trainer/loop/test_numerical_faults.py);
                                        values, not points: the trainer passes them through a Poison.
    MEMLM_TEST_HOLD=POINT@N,...:SECONDS:DIR  wait at POINT of count N ("any": every count) until the test releases
                                        this process (below; tests/cluster/test_multinode_ray.py).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    where: str  # the file that passes it, and when
    counts: str = "step"  # what its count is: the keyword `at` takes it by


POINTS = {
    "error": Point("trainer/loop/train.py, as a step starts (MEMLM_TEST_KILL raises there)"),
    "step": Point("trainer/loop/train.py, after a step's first micro-batch: a preemption mid-step"),
    "micro": Point("trainer/loop/train.py, between micro-batches"),
    "validation": Point("trainer/loop/train.py, before a validation pass is recorded"),
    "engine-saved": Point("trainer/checkpoint/store.py, DeepSpeed's files of a checkpoint written aside"),
    "enospc": Point("trainer/checkpoint/store.py, the same moment (MEMLM_TEST_KILL fails the save: a full disk)"),
    "rank-saved": Point("trainer/checkpoint/store.py, this rank's own file written aside (MEMLM_TEST_SLEEP_IN_SAVE)"),
    "renamed": Point("trainer/checkpoint/store.py, the checkpoint folder renamed into place"),
    "latest": Point("trainer/checkpoint/store.py, `latest` naming it"),
    "trial": Point("cluster/sweep_trial.py, at each row a sweep trial reports"),
    "extrapolate": Point("cluster/extrapolate_task.py, as an extrapolation task starts", counts="mem_len"),
}
SLEEP_AT = "rank-saved"  # the point MEMLM_TEST_SLEEP_IN_SAVE sleeps at


def at(point: str, *, rank: int = 0, **count: int) -> None:
    """Product code is at `point` with its count (`step=...`, or what POINTS says it counts) on `rank`: whatever
    hook a test set for it happens now (kill, signal, raise, sleep, hold); unset, nothing."""
    declared = POINTS.get(point)
    if declared is None or list(count) != [declared.counts]:
        raise TypeError(f"faults.at({point!r}, {', '.join(count)}): not a test point of trainer/runtime/faults.py "
                        f"with that count ({declared.counts if declared else 'no such point'})")
    n = count[declared.counts]
    _kill(point, n, rank)
    if point == SLEEP_AT:
        _sleep(n)
    _hold(point, n)


def holding(point: str) -> bool:
    """Whether a test holds processes at some point (MEMLM_TEST_HOLD set): code that must wrap a callback to pass
    `point` only wraps it then."""
    return point in POINTS and bool(os.environ.get(HOLD_HOOK))


KILL_HOOK = "MEMLM_TEST_KILL"
SIGNAL_HOOK = "MEMLM_TEST_SIGNAL"
SLEEP_HOOK = "MEMLM_TEST_SLEEP_IN_SAVE"
POISON_HOOK = "MEMLM_TEST_POISON"


def _kill(point: str, step: int, rank: int) -> None:
    """Die here (SIGKILL: no cleanup, no flush) when KILL_HOOK names this point, step and rank; or receive the
    signal SIGNAL_HOOK names there, as if a scheduler or a terminal had sent it at that moment."""
    hook = os.environ.get(KILL_HOOK)
    if not hook:
        return
    name, at_step, *who = hook.split(":")
    if name == point and int(at_step) == step and (not who or int(who[0]) == rank):
        if point == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if point == "error":
            raise RuntimeError(f"fault injected at step {step} on rank {rank} ({KILL_HOOK}={hook})")
        os.kill(os.getpid(), getattr(signal, f"SIG{os.environ.get(SIGNAL_HOOK, 'KILL')}"))


def _sleep(step: int) -> None:
    """Sleep here when SLEEP_HOOK names this step."""
    hook = os.environ.get(SLEEP_HOOK)
    if hook:
        at_step, seconds = hook.split(":")
        if int(at_step) == step:
            time.sleep(float(seconds))


class Poison:
    """The POISON_HOOK injections for this rank (none unless the variable is set)."""

    def __init__(self, rank: int):
        self.at: dict[int, str] = {}
        for item in filter(None, os.environ.get(POISON_HOOK, "").split(",")):
            step, at_rank, what = item.split(":")
            if int(at_rank) == rank:
                self.at[int(step)] = what

    def param(self, step: int, module) -> None:
        if self.at.get(step) == "param":
            import torch

            with torch.no_grad():
                next(module.parameters()).view(-1)[0] = float("inf")

    def loss(self, step: int, micro: int, loss):
        return loss * float("nan") if self.at.get(step) == "batch" and micro == 0 else loss


# MEMLM_TEST_HOLD=POINT@N[,POINT@N...]:SECONDS:DIR  wait at POINT of count N ("any": every count) until the test
# releases this process, at most SECONDS: DIR/POINT-N-PID.held is written, and its deletion is the release. Set on
# one Ray node only (`ray start` passes it to that node's workers), it lets a test lose a node while a trial or task
# is known to be running there (tests/cluster/test_multinode_ray.py): "trial" at a step, "extrapolate" at a memory
# length.
HOLD_HOOK = "MEMLM_TEST_HOLD"
_held: set[tuple[str, int]] = set()  # a process holds once per point and count (a step may report several rows)


def _hold(point: str, n: int) -> None:
    """Wait here while the HOLD_HOOK file of this point, count and process exists (up to its SECONDS)."""
    hook = os.environ.get(HOLD_HOOK)
    if not hook:
        return
    where, seconds, folder = hook.split(":", 2)
    if not any(name == point and count in ("any", str(n)) for name, _, count in (w.partition("@") for w in
                                                                                 where.split(","))):
        return
    if (point, n) in _held:
        return
    _held.add((point, n))
    held = os.path.join(folder, f"{point}-{n}-{os.getpid()}.held")
    with open(held + ".tmp", "w") as f:  # written aside: a watcher never sees a half-written file
        f.write(f"{point} {n} {os.getpid()}\n")
    os.replace(held + ".tmp", held)
    deadline = time.monotonic() + float(seconds)
    while os.path.exists(held) and time.monotonic() < deadline:
        time.sleep(0.05)
