"""DeepSpeed's op cache (trainer/runtime/op_cache.py) and the start-up watch (trainer/runtime/heartbeat.py): two
environments with the same versions keep separate builds, a build that is coming is announced whatever the cache
holds, and a start that goes quiet says what it is doing.

The second environment is the first one's packages reached through other paths (a folder of symlinks to torch and
DeepSpeed put first on PYTHONPATH), which is what a second clone, a worktree or a benchmark venv looks like to the
extension loader: the same versions, other absolute source and include paths in build.ninja. No op is compiled:
the end-to-end test stops the run as soon as it has announced the build.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.training import REPO, child_env, make_data, overrides, preset

# Run in a process of the given environment: its op cache folder, then what its loader would pass for the op.
PROBE = """
import json, os
from memlm.trainer.runtime.process import extension_cache_dir
print(json.dumps({"cache": str(extension_cache_dir())}), flush=True)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from memlm.trainer.runtime.op_cache import _build_inputs
from deepspeed.accelerator import get_accelerator
sources, includes = _build_inputs(get_accelerator().create_op_builder("ShareMemCommBuilder"))
print(json.dumps({"sources": sources, "includes": includes}))
"""


def this_environment() -> dict:
    """PROBE's answer for this process's own environment, computed here."""
    out = io.StringIO()
    with contextlib.suppress(ImportError), contextlib.redirect_stdout(out):
        exec(PROBE, {})
    return _answers(out.getvalue())


def second_environment(root: Path) -> dict:
    """Environment variables that make a child process import torch and DeepSpeed from ROOT/site (symlinks)."""
    import deepspeed
    import torch

    site = root / "site"
    site.mkdir(parents=True)
    for package in (torch, deepspeed):
        (site / package.__name__).symlink_to(Path(package.__file__).parent, target_is_directory=True)
    return {"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}


def probe(env_extra: dict | None = None) -> dict:
    env = child_env(env_extra)
    env.pop("TORCH_EXTENSIONS_DIR", None)  # an in-process run of this test session may have set it
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    return {**_answers(proc.stdout), "error": proc.stderr[-3000:] if proc.returncode else None}


def _answers(stdout: str) -> dict:
    return {k: v for line in stdout.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}


def fake_build(op_dir: Path, paths: list[str]) -> None:
    """An op folder as the loader leaves it: a library and a build.ninja naming these sources and includes."""
    op_dir.mkdir(parents=True)
    (op_dir / "build.ninja").write_text("".join(f"build x: compile {path}\n" for path in paths))
    (op_dir / f"{op_dir.name}.so").write_bytes(b"")


@pytest.mark.slow
def test_two_environments_with_the_same_versions_keep_their_own_build(tmp_path):
    """Before, the cache was keyed by versions and CPU only: both environments got one folder, and each start of
    the other one rebuilt it (27 rebuilds in an hour, issue 32)."""
    first, second = this_environment(), probe(second_environment(tmp_path / "env2"))
    assert first["cache"] != second["cache"]
    assert second["error"] is None, second["error"]
    from memlm.trainer.runtime.op_cache import build_due

    assert first["sources"] != second["sources"]  # the setting under test: same versions, other paths
    op_dir = tmp_path / "cache" / "deepspeed_shm_comm"
    fake_build(op_dir, first["sources"] + first["includes"])
    assert build_due(op_dir, first["sources"], first["includes"]) is None  # its own build: loaded as it is
    due = build_due(op_dir, second["sources"], second["includes"])  # the other's: a build, and it says so
    assert due is not None and "another environment" in due and str(Path(first["sources"][0]).parents[4]) in due


@pytest.mark.slow
def test_a_build_that_is_due_is_announced_although_a_library_exists(tmp_path):
    """A cache holding another environment's build (a TORCH_EXTENSIONS_DIR the user shares): before, the notice
    was printed only when no library existed at all, so this run compiled for minutes in silence. It is stopped as
    soon as it has announced the build."""
    data = make_data(tmp_path / "data")
    cache = tmp_path / "shared_cache"
    other = "/elsewhere/.venv/lib/python3.11/site-packages"
    fake_build(cache / "deepspeed_shm_comm", [f"{other}/deepspeed/ops/csrc/cpu/comm/shm.cpp", f"{other}/torch/include"])
    cmd = [sys.executable, "-m", "memlm", "train", preset("txl"), *overrides(data, train__steps=2),
           "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env({"TORCH_EXTENSIONS_DIR": str(cache)}), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    lines, notice = [], None
    try:
        deadline = time.monotonic() + 120
        while notice is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "building DeepSpeed's CPU communication op" in line:
                notice = line
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the compiler too: nothing is built
        proc.wait()
    assert notice is not None, "".join(lines)[-3000:]
    assert "another environment" in notice and f"{other}/deepspeed" in notice, notice


def test_a_quiet_start_says_what_it_is_doing(capfd):
    from memlm.trainer.runtime import heartbeat

    watch = heartbeat.start("memlm test", quiet_s=0.3, every_s=0.6)
    try:
        watch.phase("loading something slow")
        time.sleep(1.3)  # a line after 0.3 s of silence, then one every 0.6 s
        lines = capfd.readouterr().err.splitlines()
        assert len(lines) >= 2 and all(line.startswith("memlm test: still loading something slow (") for line in lines)
        heartbeat.phase(None)  # nothing slow: quiet
        time.sleep(0.8)
        assert capfd.readouterr().err == ""
        heartbeat.said()  # another line just reached the console: the silence starts over
        heartbeat.phase("building the engine")
        time.sleep(0.15)
        assert capfd.readouterr().err == ""
        time.sleep(0.5)
        assert capfd.readouterr().err.startswith("memlm test: still building the engine (")
    finally:
        heartbeat.stop()
    time.sleep(0.8)
    assert capfd.readouterr().err == ""  # stopped: nothing more


def test_one_ninja_builds_whatever_the_path_says(tmp_path, monkeypatch):
    """ninja 1.11 (the system's) and 1.13 (pip's, in the environment) each rebuild what the other built ("command
    line changed"), so a shell with the environment activated and one without it rebuilt the op in turn. memlm
    builds with the environment's own ninja whatever the PATH says, and sees a build by another ninja as due."""
    from memlm.trainer.runtime import op_cache

    own = Path(sys.executable).parent / "ninja"
    if not own.is_file():
        pytest.skip(f"no ninja beside {sys.executable}")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin", str(own.parent)]))
    assert op_cache.build_ninja() == str(own)
    with op_cache._first_on_path(own.parent):
        assert shutil.which("ninja") == str(own)  # what torch's loader runs
    other = shutil.which("ninja", path="/usr/bin:/bin")
    version = [subprocess.run([n, "--version"], capture_output=True, text=True).stdout for n in (str(own), other or "")
               if n]
    if other is None or len(set(version)) < 2:
        pytest.skip("a second ninja version is needed for the rest")
    source = tmp_path / "source.txt"
    source.write_text("x")
    op_dir = tmp_path / "deepspeed_shm_comm"
    op_dir.mkdir()
    (op_dir / "build.ninja").write_text(f"rule cp\n  command = cp $in $out\nbuild deepspeed_shm_comm.so: cp {source}\n")
    for builder, redoer in ((other, str(own)), (str(own), other)):
        subprocess.run([builder, "-C", str(op_dir)], check=True, capture_output=True)
        assert op_cache.build_due(op_dir, [str(source)], [], ninja=builder) is None
        due = op_cache.build_due(op_dir, [str(source)], [], ninja=redoer)
        assert due is not None and f"ninja ({redoer}) rebuilds" in due, due


def test_processes_that_load_the_op_by_themselves_find_the_same_ninja(tmp_path, monkeypatch):
    """DeepSpeed loads the op by itself where memlm's loader did not run first (deepspeed.initialize called
    directly, as a helper of the evaluation tests does): in CI that process ran the system's ninja on the PATH and
    rebuilt the environment's build, and the next `memlm train` printed the build notice into an error the test
    expected alone. Pointing DeepSpeed at memlm's cache also puts the environment's ninja first on the PATH that
    this process and its children see."""
    from memlm.trainer.runtime import op_cache

    own = Path(sys.executable).parent / "ninja"
    if not own.is_file():
        pytest.skip(f"no ninja beside {sys.executable}")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    assert op_cache.use_own_extension_cache() == str(tmp_path / "cache")
    assert shutil.which("ninja") == str(own)
    child = subprocess.run(["sh", "-c", "command -v ninja"], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(own)
    op_cache.use_own_extension_cache()  # again: the PATH keeps one copy in front
    assert os.environ["PATH"] == os.pathsep.join([str(own.parent), "/usr/bin", "/bin"])
