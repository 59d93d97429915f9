"""A progress line while the suite runs: `[memlm tests] 612/1,284 done (2 failed, 12 skipped) after 9:30; running:
tests/cli/test_readme.py::test_readme_commands_run_as_written (4:12)`.

Under xdist pytest's own progress is a dot per test and a percentage per line of 72 dots, so a log goes minutes
without a word while two long tests run (issue 32: 1,126+ tests, about 20 minutes on 2 cores, no count). This plugin
(registered by tests/conftest.py, in the process that reports: xdist's controller, or pytest itself without xdist)
prints one line at most every MEMLM_TEST_PROGRESS_S seconds (default 60; 0 turns it off), when a test finishes or
a worker starts one, with the tests done, failed and skipped and the longest-running ones.
"""

from __future__ import annotations

import os
import time

import pytest

PROGRESS_ENV = "MEMLM_TEST_PROGRESS_S"
LABEL = "[memlm tests]"


def interval() -> float:
    try:
        return float(os.environ.get(PROGRESS_ENV, "60"))
    except ValueError:
        return 60.0


class Progress:
    def __init__(self, config: pytest.Config, every_s: float, clock=time.monotonic):
        self.config, self.every_s, self.clock = config, every_s, clock
        self.start = self.last = clock()
        self.total: int | None = None
        self.done, self.failed, self.skipped = 0, 0, 0
        self.running: dict[str, float] = {}  # node id -> when it started

    # -- the count: the controller learns it from the workers' collections, plain pytest from its own
    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.total = max(self.total or 0, len(ids))

    def pytest_collection_finish(self, session):
        if session.items:
            self.total = len(session.items)

    def pytest_runtest_logstart(self, nodeid, location):
        self.running[nodeid] = self.clock()
        self.maybe_say()

    def pytest_runtest_logreport(self, report):
        failed_here = report.failed and report.when in ("setup", "call", "teardown")
        if report.when == "call" or (report.when == "setup" and (report.skipped or report.failed)):
            self.done += 1
            self.failed += failed_here
            self.skipped += report.skipped
        elif report.when == "teardown" and report.failed:
            self.failed += 1  # an error in teardown of a test already counted as done
        if report.when != "setup" or report.skipped or report.failed:  # its test body is over
            self.running.pop(report.nodeid, None)
        self.maybe_say()

    def line(self) -> str:
        now = self.clock()
        total = f"/{self.total:,}" if self.total else ""
        parts = [f"{self.failed} failed"] if self.failed else []
        parts += [f"{self.skipped} skipped"] if self.skipped else []
        extra = f" ({', '.join(parts)})" if parts else ""
        longest = sorted(self.running.items(), key=lambda item: item[1])[:2]
        running = "; running: " + ", ".join(f"{node} ({_clock(now - since)})" for node, since in longest) \
            if longest else ""
        return f"{LABEL} {self.done:,}{total} done{extra} after {_clock(now - self.start)}{running}"

    def maybe_say(self) -> None:
        if self.clock() - self.last < self.every_s:
            return
        self.last = self.clock()
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if reporter._tw.width_of_current_line:  # after a row of dots: a line of its own
                reporter._tw.line()
            reporter.write_line(self.line())


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


def register(config: pytest.Config) -> None:
    """Add the plugin where this process reports (not in xdist's workers, which only run tests)."""
    every_s = interval()
    if every_s > 0 and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Progress(config, every_s), "memlm-progress")


def pytest_configure(config: pytest.Config) -> None:
    """As a plugin of its own (`-p support.progress`: its test runs a small suite with it)."""
    register(config)
