"""Shared by test_train.py and test_checkpoint.py: a tiny prepared corpus, config building, run launching."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from memlm.models.registry import ARCHITECTURES

REPO = Path(__file__).resolve().parents[2]
DEEPSPEED = Path(sys.executable).parent / "deepspeed"  # the launcher installed beside this interpreter
# Every registered arch (each has its tiny preset, configs/tiny/ARCH.yaml): the trainer tests run them all.
ARCHS = tuple(ARCHITECTURES)
# Launcher variables a test process may carry from an in-process run; subprocesses must pick their own.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def make_data(root: Path, shard_tokens: int | None = None) -> Path:
    """A textdir corpus of short random-word documents, prepared with the bytes tokenizer (vocab 256); shard_tokens
    cuts each split into several shards (default: one per split)."""
    from memlm.data_pipeline.prepare import prepare

    rng = random.Random(0)
    words = "the cat sat on a mat and the dog ran far away with a big red ball".split()
    for split, n in (("train", 40), ("valid", 6), ("test", 6)):
        (root / "corpus" / split).mkdir(parents=True)
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
            (root / "corpus" / split / f"{i}.txt").write_text(text)
    sizes = {} if shard_tokens is None else {"shard_tokens": shard_tokens}
    prepare("textdir", root / "corpus", root / "data", tokenizer="bytes", workers=1, progress=False, **sizes)
    return root / "data"


def overrides(data: Path, **extra) -> list[str]:
    """The tiny presets (2 layers, d_model 32, 2 heads x 16, N 8, M 8, B 2) without tracking or validation."""
    base = {"data.path": str(data), "tracking.enabled": "false", "train.eval_every": "0", "train.log_every": "1"}
    base.update({k.replace("__", "."): str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def preset(arch: str) -> str:
    """The tiny CPU preset of `arch`, by name: memlm finds it from any working folder (configs/tiny/ARCH.yaml)."""
    return f"tiny/{arch}"


def flags(resume: bool, stop_at: int | None) -> list[str]:
    return (["--resume"] if resume else []) + ([f"--stop-at={stop_at}"] if stop_at else [])


def train_in_process(arch: str, data: Path, out: Path, resume: bool = False, stop_at: int | None = None,
                     **extra) -> list[dict]:
    """One single-process run through the CLI entry (same process: no interpreter or DeepSpeed start-up)."""
    from memlm.cli import main

    rc = main(["train", preset(arch), *overrides(data, **extra), "--out", str(out)] + flags(resume, stop_at))
    assert rc == 0
    return metrics(out)


def torchrun(arch: str, data: Path, out: Path, nproc: int = 2, resume: bool = False, stop_at: int | None = None,
             env_extra: dict | None = None, check: bool = True, **extra) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N -m memlm train ...` (standalone picks a free port per run)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "memlm", "train", preset(arch), *overrides(data, **extra), "--out", str(out)]
    return _launch(cmd + flags(resume, stop_at), env_extra, check)


def subprocess_train(arch: str, data: Path, out: Path, resume: bool = False, env_extra: dict | None = None,
                     check: bool = True, **extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "memlm", "train", preset(arch), *overrides(data, **extra), "--out", str(out)]
    return _launch(cmd + (["--resume"] if resume else []), env_extra, check)


def child_env(env_extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update({"DEEPSPEED_TIMEOUT": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    env.update(env_extra or {})
    return env


def _launch(cmd: list[str], env_extra: dict | None, check: bool) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(env_extra), capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a resumed run appends to metrics.jsonl, so later lines win for a repeated step."""
    return {row["step"]: row["loss"] for row in metrics(run_dir)}


def eval_signalled(run_dir: Path, target: Path, signal_name: str, at_batch: int = 3) -> subprocess.CompletedProcess:
    """`memlm eval RUN_DIR --json TARGET` in a subprocess whose evaluation stream sends its own process
    `signal_name` ("SIGKILL", "SIGINT") when batch `at_batch` is read: a kill or a Ctrl-C at a known point."""
    script = ("import os, signal, sys\n"
              "import memlm.trainer.inference.evaluate as ev\n"
              "class Signalled(ev.LaneStream):\n"
              "    served = 0\n"
              "    def __next__(self):\n"
              "        Signalled.served += 1\n"
              f"        if Signalled.served == {at_batch}:\n"
              f"            os.kill(os.getpid(), signal.{signal_name})\n"
              "        return super().__next__()\n"
              "ev.LaneStream = Signalled\n"
              "from memlm.cli import main\n"
              f"sys.exit(main(['eval', {str(run_dir)!r}, '--json', {str(target)!r}]))\n")
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=300)
