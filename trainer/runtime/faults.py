"""Fault injection for the tests: every hook that makes a process die, stall or compute garbage at a named point.

Each hook is an environment variable that a test sets on the process it starts (or on itself); unset, every
function here returns at once and changes nothing. They live together so that a reader of the trainer sees one
import for all of them and a test author finds every point in one list.

    MEMLM_TEST_KILL=POINT:STEP[:RANK]   SIGKILL this process at POINT of STEP (on RANK; default every rank), as a
                                        preemption would (tests/trainer/checkpoint/test_kill_matrix.py). POINTs:
                                        step, micro, validation (trainer/loop/train.py); engine-saved, rank-saved,
                                        renamed, latest (trainer/checkpoint/store.py); "enospc" instead fails that
                                        step's save as a full disk would; "error" raises a RuntimeError as that
                                        step starts (a bug on one rank: trainer/runtime/peer_watch.py).
    MEMLM_TEST_SIGNAL=TERM|INT|STOP     the signal MEMLM_TEST_KILL sends instead of SIGKILL: a scheduler's
                                        preemption, Ctrl-C, or a frozen rank (a node gone without a word).
    MEMLM_TEST_SLEEP_IN_SAVE=STEP:SECS  sleep inside the aside-write of that step's checkpoint, so a test can kill
                                        the process mid-checkpoint or let a SIGTERM grace period run out.
    MEMLM_TEST_POISON=STEP:RANK:WHAT,...  "batch": that step's first micro-batch loss is NaN (a corrupted batch);
                                        "param": before that step one weight becomes inf (a corrupted weight,
                                        which no skipped update repairs) (tests/trainer/loop/test_numerical_faults.py).
    MEMLM_TEST_HOLD=POINT@STEP,...:SECONDS:DIR  wait at a Ray trial's or task's point until the test releases it
                                        (hold_point below; tests/cluster/test_multinode_ray.py).
"""

from __future__ import annotations

import errno
import os
import signal
import time

KILL_HOOK = "MEMLM_TEST_KILL"
SIGNAL_HOOK = "MEMLM_TEST_SIGNAL"
SLEEP_HOOK = "MEMLM_TEST_SLEEP_IN_SAVE"
POISON_HOOK = "MEMLM_TEST_POISON"


def kill_point(point: str, step: int, rank: int) -> None:
    """Die here (SIGKILL: no cleanup, no flush) when KILL_HOOK names this point, step and rank; or receive the
    signal SIGNAL_HOOK names there, as if a scheduler or a terminal had sent it at that moment."""
    hook = os.environ.get(KILL_HOOK)
    if not hook:
        return
    name, at, *who = hook.split(":")
    if name == point and int(at) == step and (not who or int(who[0]) == rank):
        if point == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if point == "error":
            raise RuntimeError(f"fault injected at step {step} on rank {rank} ({KILL_HOOK}={hook})")
        os.kill(os.getpid(), getattr(signal, f"SIG{os.environ.get(SIGNAL_HOOK, 'KILL')}"))


def sleep_point(step: int) -> None:
    """Sleep here when SLEEP_HOOK names this step."""
    hook = os.environ.get(SLEEP_HOOK)
    if hook:
        at, seconds = hook.split(":")
        if int(at) == step:
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


# MEMLM_TEST_HOLD=POINT@STEP[,POINT@STEP...]:SECONDS:DIR  wait at POINT of STEP ("any": every step) until the
# test releases this process, at most SECONDS: DIR/POINT-STEP-PID.held is written, and its deletion is the release.
# Set on one Ray node only (`ray start` passes it to that node's workers), it lets a test lose a node while a trial
# or task is known to be running there (tests/cluster/test_multinode_ray.py). Points: "trial" (at each row a sweep
# trial reports, STEP its step: cluster/sweep_trial.py), "extrapolate" (as a task starts, STEP its memory length:
# cluster/extrapolate_task.py).
HOLD_HOOK = "MEMLM_TEST_HOLD"
_held: set[tuple[str, int]] = set()  # a process holds once per point and step (a step may report several rows)


def hold_point(point: str, step: int) -> None:
    """Wait here while the HOLD_HOOK file of this point, step and process exists (up to its SECONDS)."""
    hook = os.environ.get(HOLD_HOOK)
    if not hook:
        return
    where, seconds, folder = hook.split(":", 2)
    if not any(name == point and at in ("any", str(step)) for name, _, at in (w.partition("@") for w in
                                                                              where.split(","))):
        return
    if (point, step) in _held:
        return
    _held.add((point, step))
    held = os.path.join(folder, f"{point}-{step}-{os.getpid()}.held")
    with open(held + ".tmp", "w") as f:  # written aside: a watcher never sees a half-written file
        f.write(f"{point} {step} {os.getpid()}\n")
    os.replace(held + ".tmp", held)
    deadline = time.monotonic() + float(seconds)
    while os.path.exists(held) and time.monotonic() < deadline:
        time.sleep(0.05)
