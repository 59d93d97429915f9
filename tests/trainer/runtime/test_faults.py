"""The test seam (trainer/runtime/faults.py): product code passes named points through `faults.at`, each with the
count POINTS declares for it (a step; an extrapolation task's memory length), and nothing else of product code reads
a test hook. What each hook does at a point is checked here in-process; the kill matrix, the preemption, fault and
multi-node tests use them for real. Seconds: no training."""

from __future__ import annotations

import ast
import errno
import threading
from pathlib import Path

import pytest

from memlm.trainer.runtime import faults

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("models", "data_pipeline", "trainer", "cluster", "memlm")


def calls_of_the_seam() -> list[tuple[str, str, list[str]]]:
    """(file:line, point, count keywords) of every `faults.at(...)` in product code."""
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "at"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "faults"):
                    point = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", point,
                                  [k.arg for k in node.keywords if k.arg != "rank"]))
    return found


def test_every_point_product_code_passes_is_declared_with_its_count():
    calls = calls_of_the_seam()
    wrong = [f"{where}: {point} with {counts}" for where, point, counts in calls
             if point not in faults.POINTS or counts != [faults.POINTS[point].counts]]
    assert not wrong, wrong
    assert sorted({point for _, point, _ in calls}) == sorted(faults.POINTS)  # and each declared point is passed
    # The extrapolation task's point counts a memory length, not a step
    assert [counts for _, point, counts in calls if point == "extrapolate"] == [["mem_len"]]


def hook_names_in_code(tree: ast.AST) -> list[str]:
    """The test hooks' variables and names a module's code uses (its docstrings and comments aside)."""
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    names = [node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else node.name
             for node in ast.walk(tree) if isinstance(node, (ast.Name, ast.Attribute, ast.alias))]
    return [name for name in names if name.endswith("_HOOK")] + [
        node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and node.value.startswith("MEMLM_TEST_") and id(node) not in docstrings]


def test_no_product_code_reads_a_test_hook_but_the_seam():
    readers = [str(path.relative_to(ROOT)) for folder in PRODUCT for path in sorted((ROOT / folder).rglob("*.py"))
               if hook_names_in_code(ast.parse(path.read_text(encoding="utf-8")))]
    assert readers == ["trainer/runtime/faults.py"], readers
    # The reader sees a hook that another module reads
    assert hook_names_in_code(ast.parse("import os\nfrom x import HOLD_HOOK\nos.environ.get(HOLD_HOOK)\n"))
    assert hook_names_in_code(ast.parse("import os\nos.environ.get('MEMLM_TEST_HOLD')\n"))


@pytest.mark.parametrize("point, counts", [("extrapolate", {"step": 16}), ("step", {"mem_len": 16}),
                                           ("nowhere", {"step": 1}), ("step", {})])
def test_a_point_or_count_it_does_not_declare_is_refused(point, counts):
    with pytest.raises(TypeError, match="not a test point"):
        faults.at(point, **counts)


def test_unset_every_point_is_a_no_op(monkeypatch):
    for hook in (faults.KILL_HOOK, faults.SLEEP_HOOK, faults.HOLD_HOOK):
        monkeypatch.delenv(hook, raising=False)
    for point, declared in faults.POINTS.items():
        faults.at(point, **{declared.counts: 3}, rank=1)
    assert not faults.holding("trial")


def test_the_kill_hook_raises_at_its_point_step_and_rank_only(monkeypatch):
    monkeypatch.setenv(faults.KILL_HOOK, "enospc:4")
    faults.at("enospc", step=3)
    faults.at("engine-saved", step=4)
    with pytest.raises(OSError) as full:
        faults.at("enospc", step=4, rank=1)  # no rank named: every rank
    assert full.value.errno == errno.ENOSPC
    monkeypatch.setenv(faults.KILL_HOOK, "error:3:1")
    faults.at("error", step=3, rank=0)
    with pytest.raises(RuntimeError, match="fault injected at step 3 on rank 1"):
        faults.at("error", step=3, rank=1)


def test_the_sleep_hook_sleeps_at_rank_saved_only(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setenv(faults.SLEEP_HOOK, "2:7.5")
    faults.at("engine-saved", step=2)
    faults.at("rank-saved", step=1)
    faults.at("rank-saved", step=2)
    assert slept == [7.5]


def test_a_held_task_waits_for_its_release_named_by_its_memory_length(monkeypatch, tmp_path):
    monkeypatch.setenv(faults.HOLD_HOOK, f"trial@4,extrapolate@16:30:{tmp_path}")
    monkeypatch.setattr(faults, "_held", set())
    assert faults.holding("trial")
    faults.at("extrapolate", mem_len=8)  # not named: no hold
    faults.at("trial", step=16)
    released = threading.Event()

    def release():
        while not list(tmp_path.glob("*.held")):
            pass
        (held,) = tmp_path.glob("*.held")
        assert held.name.startswith("extrapolate-16-")
        held.unlink()
        released.set()

    threading.Thread(target=release, daemon=True).start()
    faults.at("extrapolate", mem_len=16)
    assert released.is_set()
    faults.at("extrapolate", mem_len=16)  # once per process and count: no second hold
    assert not list(tmp_path.glob("*.held"))
