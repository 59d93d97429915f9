"""What a plain `memlm train` process does to the machine around it (trainer/runtime/distributed.py): its torch
rendezvous,
gloo and DeepSpeed listen on loopback only, and a DeepSpeed op lock left by a killed process does not hang it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from support.ray_listeners import ListenerWatch, address_namespace
from support.training import REPO, child_env, make_data, overrides, preset

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("train_process_data"))


def test_a_plain_train_listens_on_loopback_only(data, tmp_path):
    """Run in a network where the machine has another address (tests/support/ray_listeners.py): torch's store binds
    every
    interface by itself, so before this a single process listened on `*` for its whole run."""
    cmd = [sys.executable, "-m", "memlm", "train", preset("txl"), *overrides(data, train__steps=30),
           "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(address_namespace() + cmd, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    watch = ListenerWatch(proc.pid, interval=0.2)
    watch.start()
    _, err = proc.communicate(timeout=300)
    watch.finish()
    assert proc.returncode == 0, err[-3000:]
    assert watch.seen, "no listening socket was ever seen: the watch did not see the run"
    assert watch.not_loopback() == []


def test_a_dead_processs_op_lock_does_not_hang_training(data, tmp_path):
    """torch's extension loader waits forever for a `lock` file in the op's folder; a process killed while loading
    DeepSpeed's CPU op leaves one. A copy of this environment's op cache (under another XDG_CACHE_HOME, so the
    lock never touches the real one) with such a lock: the run removes it and trains."""
    from memlm.trainer.runtime.process import extension_cache_dir

    real = extension_cache_dir()
    if not (real / "deepspeed_shm_comm").is_dir():  # the first DeepSpeed start of this environment builds it
        subprocess.run([sys.executable, "-m", "memlm", "train", preset("txl"), *overrides(data, train__steps=1),
                        "--out", str(tmp_path / "warm")], cwd=REPO, env=child_env(), check=True, timeout=600)
    cache_home = tmp_path / "cache"
    env = child_env({"XDG_CACHE_HOME": str(cache_home), "HOME": str(tmp_path)})
    env.pop("TORCH_EXTENSIONS_DIR", None)  # set in this process by an earlier in-process run: the real cache
    script = "from memlm.trainer.runtime.process import extension_cache_dir as d; print(d())"
    probe = subprocess.run([sys.executable, "-c", script],
                           cwd=REPO, env=env, capture_output=True, text=True, check=True)
    copy = type(real)(probe.stdout.strip())
    shutil.copytree(real / "deepspeed_shm_comm", copy / "deepspeed_shm_comm",
                    ignore=shutil.ignore_patterns("lock"))
    (copy / "deepspeed_shm_comm" / "lock").touch()
    proc = subprocess.run([sys.executable, "-m", "memlm", "train", preset("txl"), *overrides(data, train__steps=2),
                           "--out", str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (copy / "deepspeed_shm_comm" / "lock").exists()
