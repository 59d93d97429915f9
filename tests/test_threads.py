"""Threads that fit the cores (trainer/runtime.py): every memlm process sets torch's thread count to the cores it
owns, so processes that share a machine never oversubscribe it; and the DeepSpeed op cache is keyed by the
environment. The side-by-side tests read the thread counts the processes chose (their one stderr line), never a
timing. They start real training processes without OMP_NUM_THREADS (child_env sets it; these tests remove it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from test_launchers import DEEPSPEED
from train_support import REPO, child_env, make_data, overrides, preset
from trainer import runtime

CHOICE = re.compile(r"memlm (\w+):(?: rank (\d+))? (\d+) torch threads? \((.+)\)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("threads_data"))


def env_without_threads(**extra) -> dict:
    env = child_env(extra)
    env.pop("OMP_NUM_THREADS", None)
    return env


def choices(stderr: str) -> list[tuple[str, int, str]]:
    return [(m.group(2) or "0", int(m.group(3)), m.group(4)) for m in CHOICE.finditer(stderr)]


def test_choice_rules():
    cores = runtime.affinity_cores()
    assert runtime.choose_threads(env={}).threads == cores
    assert runtime.choose_threads(env={"LOCAL_WORLD_SIZE": "2"}).threads == max(1, cores // 2)  # torchrun, Ray Train
    assert runtime.choose_threads(env={"LOCAL_SIZE": str(4 * cores)}).threads == 1  # deepspeed launcher; >= 1
    assert runtime.choose_threads(env={"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "2"}) == runtime.ThreadChoice(3, "OMP_NUM_THREADS")
    ray = runtime.choose_threads(cpus=2, env={"OMP_NUM_THREADS": "1"})  # a Ray task's reservation wins
    assert ray.threads == 2 and "Ray" in ray.reason


def test_bad_omp_num_threads_is_named_and_ignored(capsys):
    choice = runtime.choose_threads(env={"OMP_NUM_THREADS": "lots"})
    assert choice.threads == runtime.affinity_cores()
    assert "ignoring OMP_NUM_THREADS='lots'" in capsys.readouterr().err


def test_two_ranks_under_the_deepspeed_launcher_share_the_cores(data, tmp_path):
    """The deepspeed launcher sets no OMP_NUM_THREADS: each of its 2 ranks must take half the cores."""
    from trainer.distributed import free_port

    from trainer.distributed import shm_buffer_path

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    port = str(free_port())
    cmd = [str(DEEPSPEED), "--hostfile", str(hostfile), "--num_gpus", "2", "--no_ssh_check", "--master_addr",
           "127.0.0.1", "--master_port", port, "--module", "memlm", "train", preset("txl"),
           *overrides(data, train__steps=2, train__save_every=0), "--out", str(tmp_path / "ds")]
    proc = subprocess.run(cmd, cwd=REPO, env=env_without_threads(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DeepSpeed's 66 MB shared-memory all-reduce buffers (one per rank, in RAM) are gone once the run is
    buffers = [shm_buffer_path(rank, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for rank in (0, 1)]
    assert not any(b.exists() for b in buffers), buffers
    got = choices(proc.stderr + proc.stdout)
    cores = len(os.sched_getaffinity(0))
    assert sorted(rank for rank, _, _ in got) == ["0", "1"], got
    assert all(n == max(1, cores // 2) and "/ 2 local rank" in why for _, n, why in got), got
    assert sum(n for _, n, _ in got) <= max(cores, 2)


def test_two_trainers_side_by_side_on_their_own_cores(data, tmp_path):
    """Two plain `memlm train` processes at once, each started on its own core (as a scheduler or taskset would
    place them): each takes the one core it owns instead of one thread per core of the machine."""
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "this test needs 2 cores (CI has 2)"
    procs = []
    for i, core in enumerate(cores[:2]):
        cmd = [sys.executable, "-m", "memlm", "train", preset("txl"),
               *overrides(data, train__steps=3, train__save_every=0), "--out", str(tmp_path / f"run{i}")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env_without_threads(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, preexec_fn=lambda c=core: os.sched_setaffinity(0, {c})))
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    got = [choices(err) for _, err in outputs]
    assert [[n for _, n, _ in g] for g in got] == [[1], [1]], got
    assert all("1 cores in the affinity mask / 1 local rank" in g[0][2] for g in got), got


def test_a_plain_trainer_takes_every_core_it_owns(data, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memlm", "train", preset("txl"),
                           *overrides(data, train__steps=2, train__save_every=0), "--out", str(tmp_path / "one")],
                          cwd=REPO, env=env_without_threads(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [n for _, n, _ in choices(proc.stderr)] == [len(os.sched_getaffinity(0))]


def test_op_cache_is_keyed_by_the_environment(monkeypatch):
    base = {"py": "3.11.7", "torch": "2.13.0", "deepspeed": "0.19.8"}
    same = runtime.extension_cache_dir(dict(base))
    assert same == runtime.extension_cache_dir(dict(base))  # the same versions share their builds
    assert runtime.extension_cache_dir({**base, "torch": "2.11.0"}) != same  # another environment: its own folder
    assert runtime.extension_cache_dir({**base, "deepspeed": "0.18.0"}) != same
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert runtime.use_own_extension_cache() == str(runtime.extension_cache_dir())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert runtime.use_own_extension_cache() == "/somewhere/else"  # the user's choice wins


def test_a_stale_op_build_lock_is_named_in_one_warning(tmp_path, capsys):
    """A builder killed mid-build leaves `lock` behind and DeepSpeed waits on it forever: memlm names it."""
    import os

    from trainer.runtime import STALE_LOCK_SECONDS, warn_stale_build_locks

    fresh, old = tmp_path / "op_a" / "lock", tmp_path / "op_b" / "lock"
    for lock in (fresh, old):
        lock.parent.mkdir()
        lock.touch()
    now = old.stat().st_mtime + STALE_LOCK_SECONDS + 60
    os.utime(fresh, (now - 10, now - 10))  # a build that is running right now
    assert warn_stale_build_locks(tmp_path, now=now) == [old]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(old) in lines[0] and "delete it" in lines[0]
    assert warn_stale_build_locks(tmp_path / "missing") == []
