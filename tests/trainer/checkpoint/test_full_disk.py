"""A full disk, met at any point of a run, is one `memlm: error:` line naming what could not be written and the last
good checkpoint, exit 2, with the checkpoints and the metrics intact (trainer/checkpoint/disk_full.py).

On a real filesystem of 16 MiB: a tmpfs mounted in a mount namespace of the child process's own
(support/full_disk.py). The child (this file run as a script) trains in-process, one scenario after another, and
prints what each returned and said:

    at start   a fresh run into a filesystem already full: the first write is DeepSpeed's output into library.log
               (before: a traceback from DeepSpeed's print)
    mid-save   a run stopped at its step-2 checkpoint, the disk filled to 64 KiB free, resumed: checkpoint 4 does
               not fit (before: a 51-line traceback, `RuntimeError: [enforce fail at inline_container.cc:672]`)
    at resume  the same run with the disk full to the last block, resumed: metrics rows and checkpoint files meet it
               (each row once: a resume drops the rows after its checkpoint, written aside and renamed)
    after      space freed, resumed again: it continues from the step-2 checkpoint to the end
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
if str(TESTS) not in sys.path:  # run as the child script
    sys.path.insert(0, str(TESTS))

from support.full_disk import fill, in_small_filesystem  # noqa: E402
from support.training import REPO, child_env, make_data, overrides, preset  # noqa: E402

pytestmark = pytest.mark.slow

SIZE_KIB = 16 * 1024
STEPS = dict(train__steps=4, train__save_every=2, train__eval_every=0)


def train(data: Path, out: Path, *flags: str) -> dict:
    """`memlm train` in this process: its exit status, its stderr lines, and an exception it let through."""
    from memlm.cli import main

    err, raised, rc = io.StringIO(), None, None
    with contextlib.redirect_stderr(err):
        try:
            rc = main(["train", preset("txl"), *overrides(data, **STEPS), "--out", str(out), *flags])
        except BaseException as exc:  # noqa: BLE001 - what the command line would have printed as a traceback
            raised = f"{type(exc).__name__}: {exc}"
    return {"rc": rc, "err": err.getvalue().splitlines(), "raised": raised}


def child(data: Path, disk: Path) -> None:
    results = {}
    filler = fill(str(disk))
    results["at start"] = train(data, disk / "fresh")
    os.unlink(filler)

    run = disk / "run"
    results["first"] = train(data, run, "--stop-at", "2")
    metrics_before = (run / "metrics.jsonl").read_text()
    filler = fill(str(disk), leave_bytes=64 * 1024)
    results["mid-save"] = train(data, run, "--resume")
    results["mid-save"]["latest"] = (run / "checkpoints" / "latest").read_text().strip()
    results["mid-save"]["leftovers"] = sorted(p.name for p in (run / "checkpoints").glob(".tmp-*"))
    os.unlink(filler)

    filler = fill(str(disk))
    results["at resume"] = train(data, run, "--resume")
    rows = (run / "metrics.jsonl").read_text()
    results["at resume"]["steps"] = [json.loads(line)["step"] for line in rows.splitlines()]
    results["at resume"]["first rows kept"] = rows.startswith(metrics_before)
    os.unlink(filler)

    results["after"] = train(data, run, "--resume")
    results["after"]["steps"] = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    results["after"]["first rows kept"] = (run / "metrics.jsonl").read_text().startswith(metrics_before)
    results["after"]["latest"] = (run / "checkpoints" / "latest").read_text().strip()
    print(json.dumps(results))


def one_error(result: dict) -> str:
    """The scenario's single error line; fails when there is a traceback, another error line, or none."""
    errors = [line for line in result["err"] if line.startswith("memlm: error:")]
    assert result["raised"] is None and result["rc"] == 2 and len(errors) == 1, result
    return errors[0]


def test_a_full_disk_anywhere_is_one_line_naming_the_file_and_the_last_checkpoint(tmp_path):
    data = make_data(tmp_path / "data")
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = in_small_filesystem(str(disk), SIZE_KIB, [sys.executable, __file__, str(data), str(disk)])
    if cmd is None:
        pytest.skip("no mount namespace on this machine (neither `unshare -m` as root nor `unshare -rm`)")
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])

    line = one_error(results["at start"])
    assert f"cannot write {disk / 'fresh' / 'library.log'} (No space left on device)" in line, line
    assert "no checkpoint was written yet" in line

    assert results["first"]["rc"] == 0, results["first"]
    ckpts = disk / "run" / "checkpoints"
    line = one_error(results["mid-save"])
    assert f"cannot write checkpoint {ckpts / 'global_step4'} (No space left on device" in line, line
    assert f"the previous checkpoint {ckpts / 'global_step2'} is intact and `latest` names it" in line
    assert results["mid-save"]["latest"] == "global_step2" and results["mid-save"]["leftovers"] == []

    # Which write meets the full disk first varies: tmpfs lets small writes overshoot its size a little (per-CPU
    # block counters), so metrics rows may still go in where a checkpoint does not.
    line = one_error(results["at resume"])
    assert line.startswith("memlm: error: cannot write ") and str(disk / "run") in line, line
    assert "No space left on device" in line
    assert f"checkpoint {ckpts / 'global_step2'} is intact" in line
    assert results["at resume"]["steps"] in ([1, 2], [1, 2, 3], [1, 2, 3, 4])  # each step once, whole rows
    assert results["at resume"]["first rows kept"]

    after = results["after"]
    assert after["rc"] == 0 and after["raised"] is None, after
    assert after["steps"] == [1, 2, 3, 4] and after["first rows kept"] and after["latest"] == "global_step4"


if __name__ == "__main__":
    child(Path(sys.argv[1]), Path(sys.argv[2]))
