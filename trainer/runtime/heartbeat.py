"""A start that is slow says so: `memlm train: still building DeepSpeed's CPU communication op (40 s)`.

Between its first line and its first metrics row a run loads DeepSpeed's op (minutes when it must be built),
starts the process group, builds the engine, loads a checkpoint and opens MLflow; each is usually seconds, any can
take minutes, and nothing in them prints to the console (library output goes to RUN_DIR/library.log). A run that
said nothing for minutes looked hung (issue 32: 227 s of silence before step 1). So rank 0 keeps one watch while it
starts: the code names what it is doing (`phase`), and a thread prints that phase when the console has been
quiet for QUIET_S seconds, then every EVERY_S seconds while the same silence lasts. The first line of progress
(a metrics row, a progress bar) ends it.

The line goes to the console even while file descriptor 2 is redirected into library.log (quiet.into_library_log):
the watch writes to a copy of the descriptor taken when it started. It writes to the descriptor, not to
sys.stderr, also where sys.stderr was replaced (a test's capture): a line the run's own output never counts on.
"""

from __future__ import annotations

import os
import sys
import threading
import time

QUIET_S = 8.0  # console silence before the first line: under the 10 s after which a start looks hung
EVERY_S = 30.0  # then one line per this many seconds of the same phase


class Heartbeat:
    """Says `LABEL: still PHASE (N s)` after QUIET_S seconds of silence, then every EVERY_S; see the module doc."""

    def __init__(self, label: str, quiet_s: float = QUIET_S, every_s: float = EVERY_S, clock=time.monotonic):
        self.label, self.quiet_s, self.every_s, self.clock = label, quiet_s, every_s, clock
        self._what: str | None = None
        self._since = self._last_line = clock()
        self._lines = 0  # printed since the console last heard something else
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._fd, self._stream = _console()
        self._thread = threading.Thread(target=self._run, name="memlm-heartbeat", daemon=True)
        self._thread.start()

    def phase(self, what: str | None) -> None:
        """What the process does from now on (None: nothing slow, stay quiet)."""
        with self._lock:
            if what != self._what:
                self._what, self._since = what, self.clock()

    def said(self) -> None:
        """Something else just reached the console: the silence starts again."""
        with self._lock:
            self._last_line, self._lines = self.clock(), 0

    def take_over(self, previous: "Heartbeat") -> None:
        """Go on from `previous`'s count of the console's silence: a watch that replaces another (memlm train's,
        after the one the `memlm` command starts while it imports) must not restart the 8 s."""
        with self._lock, previous._lock:
            self._last_line, self._lines = previous._last_line, previous._lines

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def line_due(self) -> str | None:
        """The line to print now, if one is due (also marks it printed)."""
        with self._lock:
            now = self.clock()
            wait = self.quiet_s if self._lines == 0 else self.every_s
            if self._what is None or now - self._last_line < wait:
                return None
            self._last_line, self._lines = now, self._lines + 1
            return f"{self.label}: still {self._what} ({now - self._since:.0f} s)"

    def _run(self) -> None:
        tick = min(0.5, self.quiet_s / 4, self.every_s / 4)  # how late a line may come
        while not self._stopped.wait(tick):
            line = self.line_due()
            if line is None:
                continue
            try:
                if self._fd is not None:
                    os.write(self._fd, (line + "\n").encode())
                else:
                    self._stream.write(line + "\n")
                    self._stream.flush()
            except (OSError, ValueError):  # a closed console is no reason to disturb the run
                return


def _console():
    """(a copy of descriptor 2, None); (None, sys.stderr) where the process has no descriptor 2."""
    try:
        return os.dup(2), None
    except OSError:
        return None, sys.stderr


# The process's watch (one at a time): the trainer starts it on rank 0; code anywhere names its phase.
_current: Heartbeat | None = None


def start(label: str, **options) -> Heartbeat:
    """The process's watch from now on; one already running hands over its silence count (take_over)."""
    global _current
    previous = _current
    stop()
    _current = Heartbeat(label, **options)
    if previous is not None:
        _current.take_over(previous)
    return _current


def phase(what: str | None) -> None:
    """Name what this process does now, for its watch (nothing without one: other ranks, other commands)."""
    if _current is not None:
        _current.phase(what)


def said() -> None:
    if _current is not None:
        _current.said()


def stop() -> None:
    """End the watch: the first line of progress came, or the run is over."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None
