"""Ctrl-C and SIGTERM stop a benchmark in one line with the shell's status (130, 143), never a traceback, and every
script in bench/ (the benchmarks, the reproductions, the report) is run through that stop (bench/interrupt.py). The
reproduction scripts, which also stop their children, are stopped for real in test_reproduce.py."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# `-m 'not slow'` leaves these out: benchmark processes stopped by signals, 20 s in all on 2 busy cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = sorted(ROOT.glob("bench/benchmarks/bench_*.py")) + [ROOT / "bench" / "report.py"] + [
    ROOT / "bench" / "reproduce" / f"{name}.py"
    for name in ("wikitext2", "rmt_tasks", "tasks_small", "extrapolate", "longctx", "longctx_eval")]


@pytest.mark.parametrize("signum, terminal", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c-at-the-terminal", "sigterm-to-the-script"])
def test_a_benchmark_stops_in_one_line(tmp_path, signum, terminal):
    # bench_models prints a line per dtype: after the first of many, it is inside its timed steps (torch code).
    out = tmp_path / "models.json"
    tiny = ["--archs", "txl", "--dtypes", ",".join(["fp32"] * 500), "--n-layer", "1", "--d-model", "32", "--n-head",
            "2", "--d-head", "16", "--d-inner", "64", "--vocab", "100", "--batch", "2", "--tgt-len", "8",
            "--mem-len", "8", "--warmup", "1", "--steps", "3", "--threads", "1", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "benchmarks" / "bench_models.py"), *tiny], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    first = proc.stdout.readline()
    assert first.startswith("[fp32] txl"), first + proc.stderr.read()
    (os.killpg if terminal else os.kill)(proc.pid, signum)
    stdout, stderr = proc.communicate(timeout=120)
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert proc.returncode == 128 + signum
    assert stderr == f"bench_models: stopped by {name}\n", stderr
    assert "Traceback" not in stdout and not out.exists()


def test_every_bench_script_stops_through_the_shared_helper():
    """A bare main() prints a KeyboardInterrupt traceback on Ctrl-C: every entry point hands main to
    stop_in_one_line, directly or through run_experiment."""
    bare = []
    for path in ENTRY_POINTS:
        tree = ast.parse(path.read_text())
        guard = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        calls = {node.func.id for node in ast.walk(guard[-1]) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Name)} if guard else set()
        if not calls & {"stop_in_one_line", "run_experiment"}:
            bare.append(str(path.relative_to(ROOT)))
    assert not bare, (f"{bare}: import stop_in_one_line from memlm.bench.interrupt and end with "
                      "`sys.exit(stop_in_one_line(main))` in the __main__ block")


STUBBORN_DRIVER = '''
import subprocess, sys
from memlm.bench.reproduce.children import CHILDREN
from memlm.bench.reproduce.experiment import run_experiment

# A child that ignores Ctrl-C, with a grandchild in a process group of its own (as Ray's processes are) doing the
# same: only the SIGKILL after the grace period, to the whole session, ends them.
IGNORE = "import os, signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
GRANDCHILD = IGNORE + "os.setpgrp(); time.sleep(300)"
CHILD = IGNORE + f"subprocess.Popen([sys.executable, '-c', {{GRANDCHILD!r}}]); time.sleep(300)"


def main():
    CHILDREN.grace = 1
    CHILDREN.run([sys.executable, "-c", CHILD], stdout=subprocess.DEVNULL, cwd=".", env=None, name="stubborn",
                 what="sleep")


sys.exit(run_experiment(main))
'''


def test_a_child_that_ignores_ctrl_c_is_killed_after_the_grace_period(tmp_path):
    import psutil

    driver = tmp_path / "driver.py"
    driver.write_text(STUBBORN_DRIVER.format())
    proc = subprocess.Popen([sys.executable, str(driver)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    script = psutil.Process(proc.pid)
    while len(script.children(recursive=True)) < 2:  # the child and its grandchild are up
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    seen = script.children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stdout == ""
    assert stderr.startswith("driver: stopped by Ctrl-C: ended stubborn (sleep for ") and ", killed); " in stderr
    assert stderr.count("\n") == 1
    left = []
    for p in seen:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.cmdline())
                p.kill()  # after noting it: a failing run of this test leaves nothing behind either
        except psutil.NoSuchProcess:
            pass
    assert not left, left
