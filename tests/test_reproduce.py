"""The reproduction experiments (bench/reproduce/) end to end at seconds-long sizes, and the answer accuracy the
copy/reverse experiment reads from `memlm eval`.

The smoke runs prove the pipeline: every file is written, perplexities are over every token of the split and
accuracies over the answer tokens only. They never judge quality (3 training steps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "reproduce" / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


def _finite_numbers(payload) -> bool:
    text = json.dumps(payload)
    return "NaN" not in text and "Infinity" not in text


def test_wikitext2_and_extrapolation_smoke(tmp_path):
    work = tmp_path / "wt2"
    _script("wikitext2.py", "--profile", "smoke", "--work", str(work), "--variants", "transformer,txl,lamemo")
    result = json.loads((work / "reproduce_wt2_smoke.json").read_text())
    assert (work / "reproduce_wt2_smoke.png").is_file() and _finite_numbers(result)
    manifest = json.loads((work / "data" / "manifest.json").read_text())["splits"]
    assert [r["variant"] for r in result["table"]] == ["transformer", "txl", "lamemo"]
    for run in result["runs"]:
        # Equal steps and tokens for every variant; perplexity over every token of each split, once.
        assert run["steps"] == 3 and run["tokens_seen"] == result["runs"][0]["tokens_seen"]
        assert run["test_tokens"] == manifest["test"]["tokens"] and run["valid_tokens"] == manifest["valid"]["tokens"]
        evaluated = json.loads((ROOT / run["run_dir"] if not Path(run["run_dir"]).is_absolute()
                                else Path(run["run_dir"])).joinpath("eval", "test.json").read_text())
        assert abs(np.exp(evaluated["nll"]) - run["test_ppl"]) < 1e-6 * run["test_ppl"]
    for row in result["table"]:  # one seed: the mean is that seed's number, the spread zero
        assert row["test_ppl"] == row["test_ppl_per_seed"][0] and row["test_ppl_spread"] == 0

    _script("extrapolate.py", "--profile", "smoke", "--work", str(work), "--num-cpus", "1")
    extrapolation = json.loads((work / "reproduce_extrapolate_smoke.json").read_text())
    assert (work / "reproduce_extrapolate_smoke.png").is_file() and _finite_numbers(extrapolation)
    assert [r["m"] for r in extrapolation["table"]] == [1, 2]
    assert [r["mem_len"] for r in extrapolation["table"]] == [8, 16]
    for row in extrapolation["table"]:
        assert row["tokens"] == manifest["test"]["tokens"]
        assert abs(row["lamemo_minus_txl"] - (row["lamemo_ppl"] - row["txl_ppl"])) < 1e-9


def test_copy_reverse_smoke(tmp_path):
    work = tmp_path / "tasks"
    _script("copy_reverse.py", "--profile", "smoke", "--work", str(work), "--tasks", "reverse")
    result = json.loads((work / "reproduce_tasks_smoke.json").read_text())
    assert (work / "reproduce_tasks_smoke.png").is_file() and _finite_numbers(result)
    assert {(r["segments"], r["arch"]) for r in result["runs"]} == {
        (s, a) for s in (2, 4) for a in ("transformer", "txl", "rmt")} | {(4, "rmt_cur")}
    # The curriculum run starts from the weights of the plain RMT at 2 segments.
    (cur,) = [r for r in result["runs"] if r["arch"] == "rmt_cur"]
    assert cur["init_from"].endswith("reverse-S2-rmt")
    from data_pipeline.tasks import generate

    for run in result["runs"]:
        # Accuracy is over the answer tokens only: test samples x answer length.
        answers = sum(len(s.answer) for s in generate("reverse", "test", {"length": run["task_length"],
                                                                         "docs": "64,16,16", "seed": 0}))
        assert run["scored_tokens"] == answers and 0.0 <= run["accuracy"] <= 1.0
        assert run["segments_spanned"] == run["segments"]  # L was chosen so a sample spans exactly S segments


def _accuracy_reference(model, data: Path, split: str) -> tuple[int, int]:
    """(correct, scored): every document alone from an empty memory, one position at a time in Python."""
    from data_pipeline.shards import read_shard

    manifest = json.loads((data / "manifest.json").read_text())
    boundary = manifest["tokenizer"]["boundary_id"]
    n = model.cfg.tgt_len
    correct = scored = 0
    with torch.no_grad():
        for shard in manifest["splits"][split]["shards"]:
            for doc in read_shard(data / shard["path"]):
                ids = [int(t) for t in doc["tokens"]]
                mask = [int(m) for m in doc["mask"]]
                inputs = [boundary] + ids[:-1]
                memory = model.init_memory(batch_size=1)
                for start in range(0, len(ids), n):
                    chunk = inputs[start:start + n]
                    x = torch.tensor([chunk + [0] * (n - len(chunk))])
                    out = model(x, memory, reset=torch.tensor([start == 0]), return_logits=True)
                    memory = out.memory
                    for i in range(len(chunk)):
                        if mask[start + i]:
                            scored += 1
                            row = out.logits[0, i].tolist()
                            correct += int(max(range(len(row)), key=row.__getitem__) == ids[start + i])
    return correct, scored


def test_eval_accuracy_matches_a_per_position_reference(tmp_path):
    from data_pipeline.prepare import prepare
    from models import build_model
    from models.config import ModelConfig
    from trainer.evaluate import evaluate

    data = tmp_path / "reverse"
    prepare("task", None, data, task="reverse", task_options={"length": 5, "docs": "8,6,6", "seed": 3},
            workers=1, progress=False)
    torch.manual_seed(0)
    for arch, extra in (("txl", {"mem_len": 4}), ("rmt", {"mem_len": 0, "num_mem_tokens": 2})):
        cfg = ModelConfig(arch=arch, n_layer=2, n_head=2, d_model=32, d_head=16, d_inner=64, vocab_size=256,
                          tgt_len=4, **extra)
        model = build_model(cfg).eval()
        correct, scored = _accuracy_reference(model, data, "test")
        result = evaluate(model, data, "test", lanes=3, seg_len=4, accuracy=True)
        assert result["tokens"] == scored == 6 * 5 and correct > 0  # an untrained model still hits some letters
        assert result["accuracy"] == correct / scored, (arch, result["accuracy"], correct, scored)
        assert "accuracy" not in evaluate(model, data, "test", lanes=3, seg_len=4)
