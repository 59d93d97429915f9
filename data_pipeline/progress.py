"""Progress displays: a tqdm bar on a terminal, plain log lines otherwise (no ANSI codes); other ranks stay quiet.

Here, in the lowest layer, so that `prepare` can use it too; training's own per-step display is
trainer.loop.progress.Progress.

    meter = Meter("eval test", total=560, unit="batch")         # any long job: eval, extrapolate, prepare, generate
    meter.update(1, tokens=64)                                   # n units done, tokens done with them
    meter.close()                                                # plain mode: one closing line with the totals

Meter's plain lines come at most every `every_s` seconds, the first after FIRST_LINE_S at most (no command stays
silent longer than 10 s before a line of progress), so a quick job prints only its closing line and a redirected log
of a long one gets a line a quarter-minute, each with what is done, the rate and the ETA (when the total is known).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

PLAIN_EVERY_S = 15.0
FIRST_LINE_S = 8.0  # the first plain line comes this soon (if the job lasts that long)
PROGRESS_ENV = "MEMLM_PROGRESS"  # "0": no progress display (Ray workers: the driver reports their progress)


# A command's start watch (trainer/runtime/heartbeat.py; memlm/cli.py connects it here, since this lowest layer
# imports nothing of memlm) hears what slow step the data code starts, and that a meter's display has begun.
phase_listener: Callable[[str | None], None] | None = None


def phase(what: str | None) -> None:
    """Name the slow step that starts now (None: progress is shown from here), for the command's start watch."""
    if phase_listener is not None:
        phase_listener(what)


def progress_wanted() -> bool:
    return os.environ.get(PROGRESS_ENV, "1") != "0"


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (a bar and colours are fine) rather than a file or pipe."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def format_duration(seconds: float) -> str:
    """H:MM:SS (or "Nh" past a day)."""
    if seconds != seconds or seconds < 0:  # NaN
        return "?"
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 3600:.0f}h"


class Meter:
    """Progress of one job in `unit`s (batches, documents, tasks, tokens), with a token count beside it.

    On a terminal: a tqdm bar (tokens and tokens/s as its postfix). Otherwise: "DESC: 120/560 batch, 7,680 tokens,
    3,850 tokens/s, eta 00:01:10" every `every_s` seconds and once at close(). Silent when `enabled` is false
    (other ranks, callers' quiet mode). Writes to stderr, so the command's result on stdout stays clean."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", *, enabled: bool = True,
                 stream: TextIO | None = None, every_s: float = PLAIN_EVERY_S, tokens_label: str = "tokens"):
        self.desc, self.total, self.unit, self.enabled = desc, total, unit, enabled and progress_wanted()
        self.stream = stream or sys.stderr
        self.every_s, self.tokens_label = every_s, tokens_label
        self.done, self.tokens, self.lines = 0, 0, 0
        self.start = self.last_line = time.monotonic()
        self.bar = None
        self.closed = False
        if self.enabled:
            phase(None)  # its bar, or its first line within FIRST_LINE_S, says the rest
        if enabled and is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True, leave=True)

    def update(self, n: int = 1, tokens: int = 0) -> None:
        if not self.enabled or self.closed:
            return
        self.done += n
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(n)
            if self.tokens:
                self.bar.set_postfix_str(f"{self.tokens:,} {self.tokens_label}, {self.rate():,.0f}/s", refresh=False)
        elif time.monotonic() - self.last_line >= (self.every_s if self.lines else min(self.every_s, FIRST_LINE_S)):
            self._line()

    def rate(self) -> float:
        """Tokens per second so far."""
        return self.tokens / max(time.monotonic() - self.start, 1e-9)

    def eta(self) -> str:
        if not self.total or self.done <= 0:
            return "?"
        elapsed = time.monotonic() - self.start
        return format_duration(elapsed / self.done * max(self.total - self.done, 0))

    def line(self, final: bool = False) -> str:
        """The plain progress line (what a log file gets)."""
        of = f"/{self.total:,}" if self.total else ""
        parts = [f"{self.done:,}{of} {self.unit}"]
        if self.tokens:
            parts.append(f"{self.tokens:,} {self.tokens_label}, {self.rate():,.0f} {self.tokens_label}/s")
        elapsed = format_duration(time.monotonic() - self.start)
        parts.append(f"done in {elapsed}" if final else f"eta {self.eta()}")
        return f"{self.desc}: " + ", ".join(parts)

    def _line(self, final: bool = False) -> None:
        print(self.line(final), file=self.stream, flush=True)
        self.last_line, self.lines = time.monotonic(), self.lines + 1

    def close(self, summary: bool = True) -> None:
        """End the display; in plain mode one closing line with the totals (summary=False: none)."""
        if not self.enabled or self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif summary:
            self._line(final=True)

    def __enter__(self) -> "Meter":
        return self

    def __exit__(self, *exc) -> None:
        self.close(summary=exc[0] is None)
