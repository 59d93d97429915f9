"""Ctrl-C and SIGTERM end a benchmark or reproduction script with one line on stderr and the status a shell
reports for them (130, 143), never a KeyboardInterrupt traceback.

    from memlm.bench.interrupt import stop_in_one_line
    ...
    if __name__ == "__main__":
        sys.exit(stop_in_one_line(main))

Every script in bench/ ends so (tests/bench/test_bench_interrupt.py checks). Standard library only, as
bench/common.py beside it: bench_peers.py re-executes itself in the peer venv, where memlm's dependencies are absent.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Callable

SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived. Raised in the main thread as Python raises KeyboardInterrupt for SIGINT, so the
    libraries that clean up on a KeyboardInterrupt (subprocess.run kills its child) do so for SIGTERM too."""

    def __init__(self, signum: int):
        super().__init__(SIGNAL_NAMES.get(signum, f"signal {signum}"))
        self.signum = signum

    @property
    def status(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return SIGNAL_NAMES.get(self.signum, f"signal {self.signum}")


def raise_on_signals(first: Callable[[int], None] | None = None, again: Callable[[int], None] | None = None) -> None:
    """SIGINT and SIGTERM call first(signum) and raise Stopped in the main thread; any later one only calls
    again(signum): a stop under way (waiting for children, writing the message) is never cut short by a second
    Ctrl-C, which can only hurry it."""
    state: dict[str, int] = {}

    def handler(signum: int, frame) -> None:
        if state:
            if again is not None:
                again(signum)
            return
        state["signum"] = signum
        if first is not None:
            first(signum)
        raise Stopped(signum)

    for signum in SIGNAL_NAMES:
        signal.signal(signum, handler)


def stop_in_one_line(main: Callable[[], object], *, name: str | None = None, on_signal=None, on_repeat=None,
                     wind_down: Callable[[Stopped], str] | None = None) -> int:
    """Run main() (its int result is the exit status); on Ctrl-C or SIGTERM print `NAME: stopped by Ctrl-C` plus
    what wind_down(stop) returns (it ends the script's children, if any) and return 130 or 143."""
    name = name or Path(sys.argv[0]).stem
    raise_on_signals(on_signal, on_repeat)
    try:
        status = main()
    except KeyboardInterrupt as interrupt:  # Stopped, or a KeyboardInterrupt raised before the handlers were in
        stop = interrupt if isinstance(interrupt, Stopped) else Stopped(signal.SIGINT)
        detail = wind_down(stop) if wind_down is not None else ""
        sys.stdout.flush()
        print(f"{name}: stopped by {stop.name}{detail}", file=sys.stderr, flush=True)
        return stop.status
    return status if isinstance(status, int) else 0
