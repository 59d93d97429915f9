"""`memlm eval` under the `deepspeed` launcher (docs/design.md §4, §9), on CPU (gloo). The deepspeed launcher sees one
CPU "device", so it gets `--num_gpus 2`; with our localhost hostfile it needs `--no_ssh_check --master_addr
127.0.0.1`, and it passes `--local_rank=N` to `memlm` (accepted and ignored: LOCAL_RANK is in the environment).

Training under the three launchers is tested where the README gives their commands: tests/cli/test_readme.py runs
`torchrun --standalone` and `deepspeed --num_gpus 2` as written and asserts the same per-step losses and tokens and
a 2-rank checkpoint from both (a plain `python -m memlm` run is every other training test).
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
    make_data,
    subprocess_train,
)

# `-m 'not slow'` leaves this out: a training and two evaluations in subprocesses, 30 s on 2 busy cores
pytestmark = pytest.mark.slow

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")  # minutes: a deadlocked collective fails fast
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


def test_eval_under_deepspeed_launcher_matches_single_process(data, tmp_path):
    """`memlm eval` with 2 ranks of 4 lanes through the deepspeed launcher counts every token once: same tokens and
    NLL as one process on the same checkpoint (one lane per rank: tests/trainer/inference/test_evaluate.py)."""
    run = tmp_path / "run"
    subprocess_train(ARCH, data, run, train__steps=2, train__save_every=2)
    one_json, ds_json = tmp_path / "one.json", tmp_path / "ds.json"
    proc = subprocess.run([sys.executable, "-m", "memlm", "eval", str(run), "--lanes", "4", "--json", str(one_json)],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = json.loads(proc.stdout.strip().splitlines()[-1])
    deepspeed_launch(tmp_path, ["eval", str(run), "--lanes", "4", "--json", str(ds_json)])
    two = json.loads(ds_json.read_text())
    assert json.loads(one_json.read_text())["tokens"] == one["tokens"]
    assert two["tokens"] == one["tokens"] > 0
    assert two.get("documents") == one.get("documents")
    assert two["nll"] == pytest.approx(one["nll"], rel=1e-5, abs=1e-6)
