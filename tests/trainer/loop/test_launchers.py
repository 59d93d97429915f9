"""The three ways `memlm train` starts (docs/design.md §4, §9): plain `python -m memlm`, `torchrun --standalone` and the
`deepspeed` launcher, all on CPU (gloo). The deepspeed launcher sees one CPU "device", so it gets `--num_gpus 2`;
with our localhost hostfile it needs `--no_ssh_check --master_addr 127.0.0.1`, and it passes `--local_rank=N`
to `memlm` (accepted and ignored: LOCAL_RANK is in the environment). Every launch is a subprocess (~10-15 s
each on 2 cores once DeepSpeed's shm op is cached; see test_train.py's docstring for that build).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.training import (
    DEEPSPEED,
    REPO,
    child_env,
    losses,
    make_data,
    metrics,
    overrides,
    preset,
    subprocess_train,
    torchrun,
)

# `-m 'not slow'` leaves these out: three launchers' trainings, 3.5 min on 2 busy cores
pytestmark = pytest.mark.slow

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")  # minutes: a deadlocked collective fails fast
STEPS = 4
ARCH = "txl"



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("launch_data"))


def deepspeed_launch(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`deepspeed --hostfile H --num_gpus 2 ... --module memlm ARGS` on localhost with a free port."""
    from memlm.trainer.runtime.distributed import free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [str(DEEPSPEED), "--hostfile", str(hostfile), "--num_gpus", "2", "--no_ssh_check",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--module", "memlm", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-4000:]}"
    return proc


def test_three_launchers_train(data, tmp_path):
    """deepspeed launcher and torchrun (2 ranks) give the same per-step losses; a plain process (1 rank) trains
    the same steps on half the tokens per step."""
    common = dict(train__steps=STEPS, train__save_every=STEPS)
    ds_out, tr_out, one_out = tmp_path / "ds", tmp_path / "torchrun", tmp_path / "plain"
    deepspeed_launch(tmp_path, ["train", preset(ARCH), *overrides(data, **common), "--out", str(ds_out)])
    torchrun(ARCH, data, tr_out, **common)
    subprocess_train(ARCH, data, one_out, **common)

    ds_rows, tr_rows, one_rows = metrics(ds_out), metrics(tr_out), metrics(one_out)
    for rows in (ds_rows, tr_rows, one_rows):
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ds_losses, tr_losses = losses(ds_out), losses(tr_out)
    for step, loss in tr_losses.items():
        assert ds_losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step
    # 2 ranks x 2 lanes x 8 targets per step at most under both launchers; one rank does half of that.
    assert [r["tokens"] for r in ds_rows] == [r["tokens"] for r in tr_rows]
    assert ds_rows[-1]["tokens"] == 2 * one_rows[-1]["tokens"] > 0
    for out in (ds_out, tr_out, one_out):
        assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS}"
    world = json.loads((ds_out / "checkpoints" / f"global_step{STEPS}" / "meta.json").read_text())
    assert world.get("world_size") == 2, world


def test_eval_under_deepspeed_launcher_matches_single_process(data, tmp_path):
    """`memlm eval` with 2 ranks through the deepspeed launcher counts every token once: same tokens and NLL as
    one process on the same checkpoint."""
    run = tmp_path / "run"
    subprocess_train(ARCH, data, run, train__steps=2, train__save_every=2)
    one_json, ds_json = tmp_path / "one.json", tmp_path / "ds.json"
    proc = subprocess.run([sys.executable, "-m", "memlm", "eval", str(run), "--json", str(one_json)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = json.loads(proc.stdout.strip().splitlines()[-1])
    deepspeed_launch(tmp_path, ["eval", str(run), "--json", str(ds_json)])
    two = json.loads(ds_json.read_text())
    assert json.loads(one_json.read_text())["tokens"] == one["tokens"]
    assert two["tokens"] == one["tokens"] > 0
    assert two.get("documents") == one.get("documents")
    assert two["nll"] == pytest.approx(one["nll"], rel=1e-5, abs=1e-6)
