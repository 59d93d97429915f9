"""How memlm is reached: the hint the demo prints must be typeable (`memlm` only when the PATH finds this
installation), and Python started in the folder above a clone named memlm finds the package."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _ask(path: str, cwd: Path) -> str:
    code = "from memlm.invocation import memlm_command as m; print(m())"
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_bare_memlm_only_when_the_path_finds_this_installation(tmp_path):
    if not (VENV_BIN / "memlm").exists():
        import pytest

        pytest.skip("no memlm console script beside this python")
    without = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                              if p and Path(p).resolve() != VENV_BIN.resolve())
    assert _ask(f"{VENV_BIN}{os.pathsep}{without}", tmp_path) == "memlm"
    typed = _ask(without, VENV_BIN.parent.parent)  # from the folder holding .venv: a relative path
    assert typed == os.path.relpath(VENV_BIN / "memlm", VENV_BIN.parent.parent)
    assert (VENV_BIN.parent.parent / typed).exists()
    assert _ask(without, tmp_path) == str(VENV_BIN / "memlm")  # from elsewhere: absolute


def test_python_started_above_a_clone_named_memlm_finds_the_package(tmp_path):
    """Issue 32: there `import memlm` found the clone's folder first, as an empty namespace package, and `from memlm
    import load_pretrained` failed with "cannot import name 'load_pretrained' from 'memlm' (unknown location)". The
    checkout's own __init__.py makes that folder the package it holds. (The clone here: the checkout's files,
    linked.)"""
    clone = tmp_path / "memlm"
    clone.mkdir()
    for name in ("__init__.py", "pyproject.toml", "memlm", "models", "data_pipeline", "trainer", "cluster", "configs"):
        (clone / name).symlink_to(ROOT / name)
    code = "from memlm import load_pretrained; import memlm.cli; print(load_pretrained.__module__, memlm.cli.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["memlm.trainer.checkpoint.run_loader", str(ROOT / "memlm" / "cli.py")]


@pytest.mark.parametrize("folder", ["ci-check", "main"])
def test_pytest_runs_in_a_clone_of_any_name(tmp_path, folder):
    """pytest imports the folder above tests/ through its __init__.py: as a package named after the clone, or, where
    the name is no identifier (ci-check), as a plain module "__init__" without a __path__. The checkout's __init__.py
    raised NameError there and every test of the suite errored at setup; it now acts only under the name memlm."""
    clone = tmp_path / folder
    (clone / "tests").mkdir(parents=True)
    for name in ("__init__.py", "memlm", "models", "data_pipeline", "trainer", "cluster", "configs"):
        (clone / name).symlink_to(ROOT / name)
    (clone / "tests" / "test_one.py").write_text("def test_one():\n    assert True\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
