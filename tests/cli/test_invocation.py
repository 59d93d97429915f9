"""The hint the demo prints must be typeable: `memlm` only when the PATH finds this installation."""

import os
import subprocess
import sys
from pathlib import Path

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
