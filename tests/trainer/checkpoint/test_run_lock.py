"""One writer per run folder (trainer/checkpoint/run_lock.py): while a `memlm train` writes a folder, a second start
into it is refused in one line naming the holder's pid, whatever its flags, and changes nothing; once the holder is
killed, the next start takes the folder over, says so, and each step is written once.

Before: two `memlm train` started at once into the same new folder both ran, every metrics row twice and the same
checkpoints written by both (issue 32). The holder here is a real `memlm train` kept inside its step-1 save
(MEMLM_TEST_SLEEP_IN_SAVE) until the test kills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from memlm.cli import main
from support.training import REPO, child_env, make_data, metrics, overrides, preset

pytestmark = pytest.mark.slow

LOCK_FILE = ".memlm-train.lock"  # in the run folder


def _whole_json(path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def snapshot(run) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_second_train_into_a_folder_in_use_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
    data = make_data(tmp_path / "data")
    run = tmp_path / "run"
    argv = ["train", preset("txl"), *overrides(data, train__steps=3, train__save_every=1), "--out", str(run)]
    holder = subprocess.Popen([sys.executable, "-m", "memlm", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=child_env({"MEMLM_TEST_SLEEP_IN_SAVE": "1:300"}))
    try:
        # The holder is asleep once its save's last file, meta.json, is whole (trainer/checkpoint/store.py writes it
        # just before the sleep): earlier, the step's files are still being written (seen under load: the snapshot
        # below caught an empty model-states file).
        deadline = time.monotonic() + 240
        while not _whole_json(run / "checkpoints" / ".tmp-global_step1" / "meta.json"):
            assert holder.poll() is None, holder.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the holder never reached its sleep inside the step-1 save"
            time.sleep(0.2)
        before = snapshot(run)
        for flags in ([], ["--resume"], ["--overwrite"]):
            capsys.readouterr()
            assert main(argv + flags) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(f"memlm: error: {run} is being trained into by memlm train "
                                                       f"pid {holder.pid} on "), err
            assert snapshot(run) == before
        assert (run / LOCK_FILE).read_text().startswith(f"memlm train pid {holder.pid} on ")
    finally:
        holder.kill()  # SIGKILL: no cleanup, as a preempted or OOM-killed run
        holder.wait()
    assert holder.returncode == -signal.SIGKILL

    capsys.readouterr()
    assert main(argv + ["--resume"]) == 0  # its folder holds a metrics row and no checkpoint: --resume starts over
    err = capsys.readouterr().err.splitlines()
    assert any(f"named memlm train pid {holder.pid} on " in line and "ended without releasing it" in line
               for line in err), err
    assert [row["step"] for row in metrics(run)] == [1, 2, 3]
    assert (run / LOCK_FILE).read_text() == ""  # released: the next start finds no dead run's lock
    assert os.path.isfile(run / "checkpoints" / "global_step3" / "meta.json")
