"""bench/reproduce/pretrained_longctx.py end to end at its smoke size (issue 37 item 7): a GPT-2-shaped `hf` model
trained on WikiText-2 lines through `memlm train`, exported with --hf-backbone, then the backbone alone and the
backbone with its full context through `memlm curriculum` on passkey (1 and 2 segments), each stage's model scored on
its stage's test samples. Proves the pipeline, never the quality (2 steps a stage). For CI's time, not run again
here: that a rerun redoes no finished curriculum (longctx.py's smoke, tests/bench/test_reproduce.py, the same
machinery), and a memory arch's curriculum on a backbone (the same function with the arch's keys, which
tests/trainer/loop/test_backbone_tokens_tasks.py runs for hf_rmt); every arch's keys are loaded below.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memlm.trainer.loop.curriculum_samples import read_split

pytest.importorskip("transformers")  # the 'pretrained' extra: the test command installs it
# `-m 'not slow'` leaves it out, as the other reproduction smokes: a dozen memlm processes, 50-90 s on 2 busy cores
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def script(*args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "reproduce" / "pretrained_longctx.py"), *args],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc.stdout


def config(run_dir: str | Path) -> dict:
    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())


def test_pretrained_longctx_smoke(tmp_path):
    work = tmp_path / "work"
    command = ("--profile", "smoke", "--work", str(work), "--tasks", "passkey")
    first = script(*command)
    result = json.loads((work / "reproduce_pretrained_longctx_smoke.json").read_text())
    backbone = result["backbone"]
    assert backbone["steps"] == 2 and math.isfinite(backbone["test"]["bpc"]) and backbone["test"]["tgt_len"] == 1024
    folder = work / "backbone"  # a Hugging Face folder: transformers' files, the memory runs' model.backbone
    assert {"config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()}
    runs = {run["arch"]: run for run in result["results"]["passkey"]}
    assert list(runs) == ["hf", "hf_full"] and result["longeval"] == {}
    for arch, run in runs.items():
        assert [stage["segments"] for stage in run["stages"]] == [1, 2]
        for stage in run["stages"]:
            for model in ("own", "final"):
                assert stage[model]["samples"] == 4 and 0.0 <= stage[model]["accuracy"] <= 1.0
            assert stage["baselines"] == {"chance": 1 / 90000} and stage["held_out_answer_nll"] > 0
    summaries = {arch: json.loads((work / "runs" / f"{arch}-passkey" / "curriculum.json").read_text())
                 for arch in runs}
    for stage in summaries["hf"]["stages"]:
        cfg = config(stage["run_dir"])
        assert cfg["model"]["backbone"] == str(folder) and cfg["model"]["tgt_len"] == 128
    full = summaries["hf_full"]["stages"]
    # At 1 segment the full-context model is the no-memory curriculum's own stage; at 2, one segment of 256 bytes
    # holding the very test samples the 2-segment stages read, started from the 1-segment weights.
    assert full[0]["run_dir"] == summaries["hf"]["stages"][0]["run_dir"]
    cfg = config(full[1]["run_dir"])
    assert cfg["model"]["tgt_len"] == 256 and cfg["train"]["init_from"] == full[0]["run_dir"]
    mine, theirs = read_split(cfg["data"]["path"], "test"), read_split(config(
        summaries["hf"]["stages"][1]["run_dir"])["data"]["path"], "test")
    assert len(mine) == len(theirs) == 4
    assert all(len(a) == len(b) and (a == b).all() and n == m for (a, n), (b, m) in zip(mine, theirs))
    assert "| hf: backbone alone, full context | " in first and " bits per byte (segments of 1024)" in first


@pytest.mark.parametrize("arch", ["hf_rmt", "hf_armt", "hf", "hf_full", "hf_rmt_frozen", "hf_rmt_lora"])
def test_every_arch_of_the_experiment_loads_on_its_preset(arch):
    """Each arch's keys on top of the experiment's preset make a valid config of that arch (the curricula the smoke
    leaves out included); the backbone folder is given later, so the preset's inline backbone stands in."""
    from memlm.bench.reproduce.pretrained_longctx import ARCHS, PRESET
    from memlm.trainer.config.run_config import load_config

    cfg = load_config(PRESET, ARCHS[arch])
    assert cfg.model.arch == {"hf_full": "hf", "hf_rmt_frozen": "hf_rmt", "hf_rmt_lora": "hf_rmt"}.get(arch, arch)
    if arch.startswith("hf_rmt") or arch == "hf_armt":
        assert cfg.model.num_mem_tokens == 8
    assert cfg.model.backbone_train == {"hf_rmt_frozen": "frozen", "hf_rmt_lora": "lora"}.get(arch, "full")
