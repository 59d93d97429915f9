"""Checkpoints: resume continues the identical trajectory, a killed save leaves the previous checkpoint usable,
multi-rank ZeRO stages agree, and a changed world size is refused. See test_train.py's docstring for what the
DeepSpeed shm op build costs and how CI pays it. Single-process runs share the pytest process; multi-rank runs
and the killed run are subprocesses (torchrun --standalone picks a free port per run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from memlm.cli import main
from support.training import (
    ARCHS,
    REPO,
    child_env,
    losses,
    make_data,
    metrics,
    overrides,
    preset,
    torchrun,
    train_in_process,
)

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")
K = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("ckpt_data"))


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_resume_is_bit_identical(arch, zero, data, tmp_path):
    """K steps, resume to 2K, resume again to 3K == 3K uninterrupted steps, loss for loss (bit for bit)."""
    common = dict(deepspeed__zero_stage=zero, train__save_every=K, train__keep_last=2, train__grad_accum=2)
    common["train__steps"] = 3 * K
    full = losses_of(train_in_process(arch, data, tmp_path / "full", **common))
    split = tmp_path / "split"
    train_in_process(arch, data, split, stop_at=K, **common)
    train_in_process(arch, data, split, resume=True, stop_at=2 * K, **common)
    train_in_process(arch, data, split, resume=True, **common)
    assert losses(split) == full
    kept = sorted(p.name for p in (split / "checkpoints").iterdir() if not p.name.endswith(".py"))  # ZeRO's scripts
    assert kept == ["global_step6", "global_step9", "latest"]


def losses_of(rows):
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
def test_killed_during_save_leaves_previous_checkpoint(data, tmp_path):
    """SIGKILL while checkpoint 2K is being written aside: `latest` still names K, and resuming reaches the
    uninterrupted run's losses."""
    common = overrides(data, train__steps=2 * K, train__save_every=K)
    full = losses_of(train_in_process("txl", data, tmp_path / "full", train__steps=2 * K, train__save_every=K))
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "memlm", "train", preset("txl"), *common, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env({"MEMLM_TEST_SLEEP_IN_SAVE": f"{2 * K}:60"}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    aside = out / "checkpoints" / f".tmp-global_step{2 * K}" / "meta.json"
    deadline = time.time() + 120
    while not aside.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert aside.exists(), "the run never reached the hooked save"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{K}"
    assert not (out / "checkpoints" / f"global_step{2 * K}").exists()
    train_in_process("txl", data, out, resume=True, train__steps=2 * K, train__save_every=K)
    assert losses(out) == full


@pytest.mark.slow
def test_two_ranks_zero_stages_agree_and_resume(data, tmp_path, capsys):
    """2 ranks: ZeRO 1/2/3 give ZeRO 0's losses (float tolerance); ZeRO 2 resume from its mid-run checkpoint is exact
    (the --stop-at path to that checkpoint is the kill matrix's); then a single process resuming the 2-rank checkpoint
    is refused with exit 2 and a message naming both world sizes."""
    runs = {}
    for zero in (0, 1, 2, 3):
        out = tmp_path / f"z{zero}"
        torchrun("txl", data, out, deepspeed__zero_stage=zero, train__steps=2 * K, train__save_every=K)
        runs[zero] = losses(out)
    for zero in (1, 2, 3):
        assert runs[zero].keys() == runs[0].keys()
        for step, loss in runs[0].items():
            assert runs[zero][step] == pytest.approx(loss, rel=1e-5, abs=1e-5), (zero, step)
    # Resume: the ZeRO-2 run as a crash after its step-K save leaves it (its folder, without what came later),
    # resumed under the same launcher, ends on the uninterrupted run's losses.
    split = tmp_path / "z2resumed"
    shutil.copytree(tmp_path / "z2", split)
    shutil.rmtree(split / "checkpoints" / f"global_step{2 * K}")
    (split / "checkpoints" / "latest").write_text(f"global_step{K}")
    (split / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics(split) if row["step"] <= K))
    torchrun("txl", data, split, resume=True, deepspeed__zero_stage=2, train__steps=2 * K, train__save_every=K)
    assert losses(split) == runs[2] and [row["step"] for row in metrics(split)] == list(range(1, 2 * K + 1))

    proc = subprocess.run([sys.executable, "-m", "memlm", "train", preset("txl"),
                           *overrides(data, deepspeed__zero_stage=2, train__steps=2 * K, train__save_every=K),
                           "--out", str(split),
                           "--resume"], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "world_size was 2, now 1" in proc.stderr and "--reshard" in proc.stderr
    assert "Traceback" not in proc.stderr

    # --reshard: a single process takes only the 2-rank run's consolidated weights (fresh optimizer and data).
    fresh = train_in_process("txl", data, tmp_path / "fresh", deepspeed__zero_stage=2, train__steps=2)
    old_rows = metrics(split)
    capsys.readouterr()
    rc = main(["train", preset("txl"), *overrides(data, deepspeed__zero_stage=2, train__steps=2),
               "--out", str(split), "--reshard"])
    assert rc == 0 and "warning: --reshard loaded only the weights" in capsys.readouterr().err
    resharded = metrics(split)[0]
    assert resharded["step"] == 1  # the data and schedule start over; the weights are the trained ones
    # The new step count would collide with the old rows: they are kept aside, not mixed in.
    kept = [json.loads(line) for line in (split / "metrics.before-reshard.jsonl").read_text().splitlines()]
    assert kept == old_rows
    assert resharded["loss"] < fresh[0]["loss"] - 0.05, (resharded, fresh[0])


def test_reshard_reads_a_zero0_checkpoint(data, tmp_path, capsys):
    """--reshard from a ZeRO-0 run (which holds no optimizer partitions for zero_to_fp32 to read): the module
    weights of its model-state file start the new run (a curriculum's next stage, e.g. bench/reproduce)."""
    trained = tmp_path / "z0"
    train_in_process("txl", data, trained, train__steps=3 * K, train__save_every=3 * K)
    fresh = train_in_process("txl", data, tmp_path / "fresh", train__steps=2)
    capsys.readouterr()
    rc = main(["train", preset("txl"), *overrides(data, train__steps=2), "--out", str(trained), "--reshard"])
    assert rc == 0 and "warning: --reshard loaded only the weights" in capsys.readouterr().err
    resharded = metrics(trained)[0]
    assert resharded["step"] == 1 and resharded["loss"] < fresh[0]["loss"] - 0.05, (resharded, fresh[0])


@pytest.mark.parametrize("variant", [
    dict(model__bptt_mode="window", model__mem_len=8, model__aux_loss_weight=0.01),
    dict(model__bptt_mode="window", model__bptt_depth=3, model__bptt_replay_loss="true"),
    dict(model__bptt_mode="chunk", model__mem_len=8, model__cache_memory_rows="false"),
    dict(model__bptt_mode="window", model__mem_len=8, model__bptt_replay_loss="true", model__bptt_recipe="authors"),
], ids=["window-txl-cache-aux", "window-k3-replay-loss", "chunk-token-cache", "window-authors-recipe"])
def test_rmt_resume_mid_window_and_document_is_bit_identical(variant, data, tmp_path):
    """RMT's replay window (or chunk memory) is per-rank checkpoint state: stopping with a full window in the middle
    of documents and resuming gives the uninterrupted run's losses bit for bit."""
    import torch

    common = dict(train__steps=2 * K, train__save_every=K, train__grad_accum=2, **variant)
    full = losses_of(train_in_process("rmt", data, tmp_path / "full", **common))
    split = tmp_path / "split"
    train_in_process("rmt", data, split, stop_at=K, **common)
    state = torch.load(split / "checkpoints" / f"global_step{K}" / "rank0.pt", weights_only=True)["recurrence"]
    if variant["model__bptt_mode"] == "window":
        depth = int(variant.get("model__bptt_depth", 2))
        assert len(state["window"]) == depth  # mid-window: the replay segments are saved
        resets = torch.stack([seg["reset"] for seg in state["window"]])
        assert not resets.all(dim=0).any()  # every lane is inside a document across the saved window
        if variant.get("model__bptt_recipe") == "authors":  # the memories the replay starts from are saved too
            assert len(state["stored"]) == len(state["window"]) and "written" in state
    train_in_process("rmt", data, split, resume=True, **common)
    assert losses(split) == full


@pytest.mark.slow
def test_resume_with_another_bptt_mode_is_refused(data, tmp_path):
    out = tmp_path / "run"
    train_in_process("rmt", data, out, train__steps=2, train__save_every=2)
    proc = subprocess.run([sys.executable, "-m", "memlm", "train", preset("rmt"),
                           *overrides(data, train__steps=4, model__bptt_mode="chunk"), "--out", str(out), "--resume"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'rmt-window' but this run uses 'rmt-chunk'" in proc.stderr and "model.bptt_mode" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step2"


def test_rng_state_carries_the_cuda_generators(monkeypatch):
    """On a GPU dropout draws from the CUDA generators, so a checkpoint must hold them (seen on an H100: a resumed
    run with dropout 0.1 drew other masks from its first step). No GPU here: torch.cuda is stood in for."""
    import torch

    from memlm.trainer.checkpoint.rng import RNGState

    saved = [torch.tensor([1, 2, 3], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = RNGState().state_dict()
    assert state["cuda"] is saved
    RNGState().load_state_dict(state)
    assert restored == [saved]
