"""bench/common.py: how every benchmark and reproduction writes its result and starts its commands, and that no
script in bench/ goes back to a copy of its own."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from memlm.bench.common import child_env, paired_ratio, write_result

ROOT = Path(__file__).resolve().parents[2]


def test_a_result_keeps_its_keys_and_says_when_and_how_it_was_made(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "benchmarks" / "bench_models.py"), "--steps", "3"])
    path = write_result(tmp_path / "new" / "models.json", {"benchmark": "models", "loadavg_before": [1.5, 1, 1]})
    result = json.loads(path.read_text())
    assert list(result) == ["benchmark", "loadavg_before", "provenance"]
    assert result["loadavg_before"] == [1.5, 1, 1]
    made = result["provenance"]
    assert made["command"] == "python bench/benchmarks/bench_models.py --steps 3"  # relative: the same on any machine
    assert made["torch"] == torch.__version__ and made["threads"] == torch.get_num_threads()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", made["date"]) and len(made["load_average"]) == 3


def test_a_command_a_script_starts_picks_its_own_rank_and_imports_this_checkout(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env(drop=("OMP_NUM_THREADS",), DEEPSPEED_TIMEOUT="2")
    assert not {"RANK", "MASTER_PORT", "OMP_NUM_THREADS"} & set(env)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"] and env["DEEPSPEED_TIMEOUT"] == "2"


def test_a_paired_ratio_is_the_median_of_the_ratios_of_pairs():
    assert paired_ratio([2.0, 3.0, 40.0], [1.0, 1.0, 2.0]) == 3.0  # ratios 2, 3, 20
    assert paired_ratio([2.0, 9.0, 4.0], [1.0, 9.0, 1.0]) == 2.0  # ratios 2, 1, 4 (the medians' ratio: 4)
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])  # pairs that do not line up are a bug, never a shorter median


def test_no_script_keeps_its_own_copy_of_the_shared_set_up():
    copies = {}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        if path.name == "common.py" and path.parent.name == "bench":
            continue
        text = path.read_text()
        found = [what for what in ("ROOT = Path(__file__)", "os.getloadavg(") if what in text]
        if found:
            copies[str(path.relative_to(ROOT))] = found
    assert not copies, f"use memlm.bench.common's ROOT and load_average() instead: {copies}"


# The scripts that put the checkout on sys.path themselves, and why (bench/common.py): every other one imports
# memlm.bench as it imports memlm.
OWN_SYS_PATH = {"bench/benchmarks/bench_peers.py": "starts under a bare python3.11, then in the peer venv",
                "bench/benchmarks/bench_fault_check.py": "imports the test suite's tests.support"}


def test_bench_is_the_package_memlm_bench_and_no_script_edits_sys_path():
    edits, top_level = [], []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if "sys.path.insert(" in text or "sys.path.append(" in text:
            edits.append(where)
        top_level += [f"{where}: {line.strip()}" for line in text.splitlines()
                      if re.match(r"\s*(from|import) bench[. ]", line)]
    assert sorted(edits) == sorted(OWN_SYS_PATH), f"import memlm.bench.* instead of editing sys.path: {edits}"
    assert not top_level, "import bench's modules as memlm.bench.* (one module, one name):\n" + "\n".join(top_level)
    assert (ROOT / "bench" / "__init__.py").is_file()


def test_a_bench_script_runs_by_path_from_another_folder(tmp_path):
    """`python bench/...py` puts only the script's folder on sys.path, and no PYTHONPATH names the checkout here:
    memlm.bench comes from the installed memlm (this checkout's: `pip install -e .`); a top-level bench from nowhere."""
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: report.py"), proc.stderr
