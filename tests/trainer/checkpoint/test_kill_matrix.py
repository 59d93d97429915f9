"""The kill matrix: runs SIGKILLed at named points (trainer's MEMLM_TEST_KILL hook: mid-step, between micro-batches,
after DeepSpeed's files, after the rank files, after the rename, after `latest`, mid-validation; an RMT run inside its
replay window, and one around a Hugging Face backbone (hf_rmt); 2 ranks ZeRO-2 mid-step on one rank and
mid-checkpoint) at steps drawn from a fixed seed list, then resumed: every resumed run ends with exactly the losses,
tokens and final weights of the uninterrupted run. The same for a SIGTERM (a scheduler's preemption: the run saves at
that step and exits 143; at 2 ranks only rank 1 gets it, and both stop at the same step) and a Ctrl-C (one line, exit
130) mid-step. Also `memlm eval` killed mid-evaluation (nothing half-written; the rerun gives the reference result)
and a full disk during a save (one line; the previous checkpoint resumes exactly).

One uninterrupted reference per (arch, world size) is shared by its kill points. Killed runs are subprocesses;
1-rank resumes run in-process (no interpreter or DeepSpeed start-up). tests/trainer/checkpoint/test_checkpoint.py keeps
the older
timed kill inside a save.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from memlm.cli import main
from support.training import (
    REPO,
    child_env,
    eval_signalled,
    losses,
    make_data,
    metrics,
    overrides,
    preset,
    torchrun,
    train_in_process,
)

# slow: killed and resumed trainings, 7 min in all on 2 busy cores (`-m 'not slow'` leaves them out); one worker:
# shared references
pytestmark = [pytest.mark.slow, pytest.mark.kill_matrix, pytest.mark.xdist_group("kill_matrix")]

STEPS = 6
COMMON = dict(train__steps=STEPS, train__save_every=2, train__keep_last=5, train__grad_accum=2,
              train__eval_every=3, train__eval_batches=2)
SAVES = (2, 4)  # steps whose checkpoint is written (6 is the last: nothing to resume after it)
ANY = tuple(range(1, STEPS + 1))
# (point, arch, world size, seed): the step is drawn from the point's possible steps with random.Random(seed).
MATRIX = [
    ("step", "txl", 1, 11), ("micro", "txl", 1, 12), ("engine-saved", "txl", 1, 13), ("rank-saved", "txl", 1, 14),
    ("renamed", "txl", 1, 15), ("latest", "txl", 1, 16), ("validation", "txl", 1, 17), ("step", "rmt", 1, 18),
    ("micro", "txl", 2, 19), ("rank-saved", "txl", 2, 20),
    ("sigterm", "txl", 1, 21), ("sigterm", "rmt", 1, 22), ("sigterm", "txl", 2, 23), ("sigint", "txl", 1, 24),
    ("step", "hf_rmt", 1, 25),  # tiny/hf_rmt: a random GPT-2 inline, its replay window full from step 3 on
]
SIGNALS = {"sigterm": "TERM", "sigint": "INT"}  # sent at the mid-step kill point instead of SIGKILL
CHOICES = {"step": ANY, "micro": ANY, "sigterm": ANY[:-1], "sigint": ANY[:-1], "validation": (3, 6),
           "engine-saved": SAVES, "rank-saved": SAVES, "renamed": SAVES, "latest": SAVES}


def kill_step(point: str, seed: int) -> int:
    return random.Random(seed).choice(CHOICES[point])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("kill_data"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted runs, made once each when first asked for."""
    root = tmp_path_factory.mktemp("kill_reference")
    made = {}

    def get(arch: str, world: int):
        if (arch, world) not in made:
            out = root / f"{arch}-{world}"
            if world == 1:
                train_in_process(arch, data, out, **_settings(arch, world))
            else:
                torchrun(arch, data, out, nproc=world, **_settings(arch, world))
            made[arch, world] = out
        return made[arch, world]
    return get


def _settings(arch: str, world: int) -> dict:
    settings = dict(COMMON)
    if world > 1:
        settings["deepspeed__zero_stage"] = 2
    if arch == "rmt":
        settings["model__bptt_depth"] = 2  # a full replay window from step 3 on
    return settings


def final_state(run) -> dict:
    from memlm.trainer.checkpoint.weights import load_weights

    rows = metrics(run)
    evals = {p.name: json.loads(p.read_text()) for p in sorted((run / "eval").glob("step*.json"))}
    return {"losses": losses(run), "tokens": rows[-1]["tokens"], "evals": evals,
            "weights": load_weights(run / "checkpoints", f"global_step{STEPS}")}


def assert_same_run(run, ref) -> None:
    got, want = final_state(run), final_state(ref)
    assert got["losses"] == want["losses"]
    assert got["tokens"] == want["tokens"]
    assert got["evals"].keys() == want["evals"].keys()
    for name in want["evals"]:
        assert {k: v for k, v in got["evals"][name].items()} == want["evals"][name], name
    assert got["weights"].keys() == want["weights"].keys()
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), name


@pytest.mark.parametrize("point,arch,world,seed", MATRIX,
                         ids=[f"{p}-{a}-{w}rank-seed{s}" for p, a, w, s in MATRIX])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(point, arch, world, seed, data, reference, tmp_path):
    ref = reference(arch, world)
    step = kill_step(point, seed)
    rank = 1 if world > 1 and point in ("step", "micro", "sigterm") else 0  # mid-step kills hit the other rank
    out = tmp_path / "run"
    hook = {"MEMLM_TEST_KILL": f"{'step' if point in SIGNALS else point}:{step}:{rank}",
            "MEMLM_TEST_SIGNAL": SIGNALS.get(point, "KILL")}
    if world == 1:
        cmd = [sys.executable, "-m", "memlm", "train", preset(arch), *overrides(data, **_settings(arch, world)),
               "--out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(hook), capture_output=True, text=True, timeout=300)
    else:
        proc = torchrun(arch, data, out, nproc=world, env_extra=hook, check=False, **_settings(arch, world))
    assert proc.returncode != 0, f"the run was never killed at {point}:{step}"
    if point in SIGNALS:
        assert_stopped_cleanly(point, step, world, proc, out)
    assert not (out / "checkpoints" / f"global_step{STEPS}").exists()
    if world == 1:
        train_in_process(arch, data, out, resume=True, **_settings(arch, world))
    else:
        torchrun(arch, data, out, nproc=world, resume=True, **_settings(arch, world))
    assert_same_run(out, ref)
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the resumed save cleared what the kill left


def assert_stopped_cleanly(point: str, step: int, world: int, proc, out) -> None:
    """SIGTERM: a checkpoint at that very step (on every rank), exit 143, one line; Ctrl-C: one line, exit 130.
    No memlm traceback either way (a 2-rank launch's torchrun prints its own, which is not memlm's to change)."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("memlm train: ")]
    assert "trainer/" not in proc.stderr and "memlm/cli.py" not in proc.stderr, proc.stderr[-3000:]
    if point == "sigterm":
        if world == 1:
            assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        stopped = [line for line in lines if "stopped by SIGTERM" in line]
        assert stopped == [f"memlm train: stopped by SIGTERM after step {step}; the last checkpoint is "
                           f"{out / 'checkpoints' / f'global_step{step}'}: rerun with --resume to continue"], lines
        assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{step}"
        assert sorted(p.name for p in (out / "checkpoints" / f"global_step{step}").glob("rank*.pt")) == \
            [f"rank{r}.pt" for r in range(world)]
    else:
        assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        saved = (step - 1) // 2 * 2  # the step counter is still at the last finished step; saves every 2
        last = (f"the last checkpoint is {out / 'checkpoints' / f'global_step{saved}'}: rerun with --resume to continue"
                if saved else "no checkpoint was written: the run starts over")
        assert [line for line in lines if "interrupted" in line] == [
            f"memlm train: interrupted (Ctrl-C) at step {step - 1}; {last}"], lines


def test_memlm_eval_killed_mid_evaluation_leaves_nothing_and_reruns_exactly(reference, tmp_path, capsys):
    """SIGKILL after the second evaluation batch (a stand-in stream that kills its process), then the same
    command again: no half-written JSON anywhere, and the result equals an uninterrupted evaluation's."""
    ref = reference("txl", 1)
    capsys.readouterr()
    assert main(["eval", str(ref), "--json", str(tmp_path / "want.json")]) == 0
    want = json.loads((tmp_path / "want.json").read_text())
    target = tmp_path / "got.json"
    proc = eval_signalled(ref, target, "SIGKILL")
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not target.exists() and not list(tmp_path.glob(".got.json.tmp-*"))
    assert main(["eval", str(ref), "--json", str(target)]) == 0
    assert json.loads(target.read_text()) == want


def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_resumes(data, reference, tmp_path,
                                                                                   monkeypatch, capsys):
    """ENOSPC injected while checkpoint 4 is written (after DeepSpeed's files, at the rank file): one line naming
    the checkpoint and the intact previous one, the aside folder removed, and --resume reaches the reference."""
    ref = reference("txl", 1)
    out = tmp_path / "run"
    monkeypatch.setenv("MEMLM_TEST_KILL", "enospc:4")
    capsys.readouterr()
    rc = main(["train", preset("txl"), *overrides(data, **_settings("txl", 1)), "--out", str(out)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("memlm: error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "No space left on device" in errors[0] and str(out / "checkpoints" / "global_step2") in errors[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"
    assert not list((out / "checkpoints").glob(".tmp-*"))
    monkeypatch.delenv("MEMLM_TEST_KILL")
    train_in_process("txl", data, out, resume=True, **_settings("txl", 1))
    assert_same_run(out, ref)
