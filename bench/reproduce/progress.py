"""What a reproduction script prints while it works: one line when a run starts, is skipped (an earlier invocation
finished it) or finishes, and every `every` seconds one line naming the commands under way, with the step and ETA
of each training (read from its metrics.jsonl) and the time so far of the others.

    [14:02:10] start txl-s1: train 2,000 steps, then eval valid and test
    [14:03:10] running txl-s1 train step 300/2000, ETA 6:12; lamemo-s1 eval test for 0:40 (3 of 6 runs finished)
"""

from __future__ import annotations

import threading
import time

from memlm.bench.reproduce.children import CHILDREN

_PRINTING = threading.Lock()


def say(text: str) -> None:
    with _PRINTING:  # the queue's threads report side by side: one whole line each
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


class Runs:
    """How many of the experiment's runs are finished, for the progress and stop lines."""

    def __init__(self) -> None:
        self.total = 0  # 0: the script has no runs to count (extrapolate.py: one command)
        self.finished = 0
        self._lock = threading.Lock()

    def plan(self, total: int) -> None:
        self.total = total

    def start(self, name: str, plan: str) -> None:
        say(f"start {name}: {plan}")

    def skip(self, name: str) -> None:
        self._count()
        say(f"skip {name}: finished by an earlier invocation")

    def finish(self, name: str, summary: str) -> None:
        self._count()
        say(f"done {name}: {summary} ({self.tally()})")

    def tally(self) -> str:
        return f"{self.finished} of {self.total} runs finished" if self.total else ""

    def _count(self) -> None:
        with self._lock:  # the queue's threads finish runs side by side
            self.finished += 1


RUNS = Runs()


def report_every(seconds: float) -> None:
    """A line every SECONDS while a command runs (a daemon thread: it never holds the script up)."""

    def loop() -> None:
        while True:
            time.sleep(seconds)
            running = CHILDREN.running()
            if running and CHILDREN.signum is None:
                tally = f" ({RUNS.tally()})" if RUNS.total else ""
                say("running " + "; ".join(child.position() for child in running) + tally)

    threading.Thread(target=loop, daemon=True, name="progress").start()
