"""The README's test command in a sitting (issue 32): a line of progress while xdist runs, and a quick subset.

Progress: a small suite of its own under `-n 2` with the progress plugin (support/progress.py) every 0.3 s prints
the count of finished tests out of the collected ones, failures and skips included; xdist alone printed dots.
The quick subset: `-m "not slow"` must leave out the tests that take the suite's minutes (the slowest ones of a full
run, measured with --durations, carry the `slow` mark) and keep the rest.
Cost: ~6 s (a 2-worker pytest of 14 tiny tests; one collection of the suite).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SUITE = """
import time
import pytest

@pytest.mark.parametrize("i", range(12))
def test_sleeps(i):
    time.sleep(0.1)

def test_skipped():
    pytest.skip("skipped on purpose")

def test_fails():
    assert False
"""


@pytest.mark.slow
def test_progress_lines_count_finished_tests_under_xdist(tmp_path):
    (tmp_path / "test_small.py").write_text(SUITE)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "MEMLM_TEST_PROGRESS_S": "0.3"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "support.progress",
                           "-p", "no:cacheprovider", "test_small.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]  # the failing test
    lines = re.findall(r"^\[memlm tests\] (\d+)/14 done(?: \((.*?)\))? after \d+:\d\d", proc.stdout, re.M)
    assert len(lines) >= 2, proc.stdout[-3000:]
    counts = [int(done) for done, _ in lines]
    assert counts == sorted(counts) and counts[-1] <= 14, counts
    assert any("1 failed" in extra and "1 skipped" in extra for _, extra in lines) or counts[-1] < 14, lines


@pytest.mark.slow
def test_the_quick_subset_leaves_the_slow_tests_out():
    # tests/cli/ alone: collecting the whole suite imports every test module (40 s on 2 busy cores)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                           "-p", "no:cacheprovider", str(TESTS / "cli")], cwd=TESTS.parent, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    quick = {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}
    assert "tests/cli/test_readme.py::test_readme_commands_run_as_written" not in quick
    assert "tests/cli/test_demo.py::test_demo_end_to_end" not in quick
    assert "tests/cli/test_readme.py::test_commands_are_found_and_substituted" in quick  # quick ones stay
    deselected = int(re.search(r"(\d+) deselected", proc.stdout).group(1))
    assert deselected >= 2, proc.stdout[-500:]
