"""No command is silent for more than 10 s before its first line (issue 32; memlm/start_watch.py).

Each command of issue 32's list runs here as a user starts it, in a real process whose start watch waits 0.05 s
instead of 8 s (support/start_watch.py): importing torch takes longer than that on any machine, so the first line on
stderr must be the watch's, `memlm CMD: still loading torch and memlm's modules (0 s)` or the next step the command
names (`still checking the runs and opening the MLflow store`), as a user sees it after 8 s of a slow start.
Without the watch these commands said nothing until their own first line (13 s for generate under load). The
invocations are ones refused after the command's imports (no training, no Ray); `generate` is followed all the way
to its prompt in tests/trainer/inference/test_generate.py.
Cost: ~10 s on 2 cores (7 processes that import torch, two at a time; 27 s at load average 7).
"""

from __future__ import annotations

import pytest

from memlm.start_watch import LOADING
from support import start_watch

# command -> argv refused once the command's modules are loaded
REFUSED_LATE = {
    "export": ["export", "{tmp}/no-run", "--out", "{tmp}/export"],
    "analyze": ["analyze", "{tmp}/no-run"],
    "extrapolate": ["extrapolate", "{tmp}/no-run", "--mult", "1"],
    "longeval": ["longeval", "{tmp}/no-run", "--lengths", "512"],
    "sweep": ["sweep", "{tmp}/no-sweep.yaml"],
    "curriculum": ["curriculum", "tiny/armt", "--task", "passkey", "--segments", "2", "--out", "{tmp}/cur"],
    "prepare": ["prepare", "--corpus", "wikitext", "--input", "{tmp}/no-corpus", "--out", "{tmp}/data"],
}


@pytest.mark.slow
def test_a_slow_start_says_what_it_does_first(tmp_path):
    pending = dict(REFUSED_LATE)
    done = {}
    while pending:  # two at a time: the machine's two cores
        batch = [pending.popitem() for _ in range(min(2, len(pending)))]
        procs = {name: start_watch.start([a.format(tmp=tmp_path) for a in argv]) for name, argv in batch}
        for name, proc in procs.items():
            done[name] = (proc.communicate(timeout=180), proc.returncode)
    seen = {}
    for name, ((out, err), rc) in done.items():
        lines = err.strip().splitlines()
        assert rc == 2 and lines[-1].startswith("memlm: error: "), (name, err[-2000:])
        assert lines[0].startswith(f"memlm {name}: still "), (name, err[-2000:])
        seen[name] = lines[0]
    assert sum(line.startswith(f"memlm {name}: still {LOADING} (") for name, line in seen.items()) >= 5, seen
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # refused: nothing made


def test_a_quick_command_says_nothing_more(capfd):
    """At the real quiet time a command that answers at once prints only its answer, and its watch is gone."""
    import threading

    from memlm.cli import main

    assert main(["config", "--list"]) == 0
    assert not any(t.name == "memlm-heartbeat" for t in threading.enumerate())
    captured = capfd.readouterr()
    assert captured.err == "" and "tiny/txl" in captured.out
