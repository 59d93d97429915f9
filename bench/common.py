"""What every script in bench/ shares: where the checkout and the results are, the environment of the commands a
script starts, the figures most of them report (medians of paired ratios), and the one way a result JSON is written.

bench/ is the package `memlm.bench` of a checkout: memlm's own __init__ maps the folders beside it (memlm.models,
..., memlm.bench), so a script imports it as it imports memlm, with no change to sys.path:

    from memlm.bench.common import ROOT, RESULTS, write_result

and runs as `python bench/FOLDER/SCRIPT.py` or `python -m memlm.bench.FOLDER.SCRIPT`, wherever this checkout's memlm
is importable: its environment (`pip install -e .`) or PYTHONPATH=CHECKOUT (the GPU machines; every command a script
starts gets it from child_env below). Two scripts put the checkout on sys.path themselves, each saying why:
bench_peers.py (a bare python3.11, then the peer venv, where memlm is not installed) and bench_fault_check.py (it
imports the test suite's tests.support).

Standard library only at import, as bench/interrupt.py (how a script stops in one line, used beside this module):
bench_peers.py re-executes itself in the peer venv, where memlm's dependencies are absent.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"  # the committed JSON: a script's default --out, never a smoke run's
SHARED_DATA = ROOT.parent / "shared" / "data"
WIKITEXT2 = SHARED_DATA / "wikitext-2"  # the raw WikiText-2 files (wiki.{train,valid,test}.tokens)

# What a launcher (torchrun, the deepspeed launcher, an in-process run) leaves in the environment: a command this
# script starts must choose its own rank, world and rendezvous, so they never pass on.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def child_env(drop: Iterable[str] = (), **values: str) -> dict[str, str]:
    """This process's environment for a command it starts: the launcher variables and DROP removed, the checkout
    first on PYTHONPATH (the child imports memlm from it, whatever is installed), then VALUES set."""
    dropped = set(LAUNCH_VARS) | set(drop)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(values)
    return env


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded: the machine is shared, so every figure is read with it."""
    return [round(x, 2) for x in os.getloadavg()]


def paired_ratio(numerators: Iterable[float], denominators: Iterable[float]) -> float:
    """The median of per-pair ratios a_i / b_i. Two things timed back to back see the same machine, so this moves
    far less with other processes' load than a ratio of the two medians does."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def command_line() -> str:
    """How this script was started, as a shell line relative to the checkout where it lies inside it."""
    script = Path(sys.argv[0]).resolve()
    shown = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    return shlex.join(["python", shown, *sys.argv[1:]])


def provenance() -> dict:
    """When and how a result was made: the date, the command, torch's version and thread count (when this
    process has torch loaded; bench_peers' peer venv has its own torch) and the load average as it is written."""
    torch = sys.modules.get("torch")
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "command": command_line(),
            "torch": getattr(torch, "__version__", None),
            "threads": torch.get_num_threads() if torch is not None else None, "load_average": load_average()}


def write_json(path: str | os.PathLike, payload) -> Path:
    """PAYLOAD as indented JSON at PATH, folders made as needed; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def write_result(path: str | os.PathLike, payload: dict) -> Path:
    """Write a script's result JSON with its `provenance` added; returns the path. The payload's own keys are the
    script's: readers of the committed files (REPORT.md, the README, test_reproduce.py) rely on them."""
    return write_json(path, {**payload, "provenance": provenance()})
