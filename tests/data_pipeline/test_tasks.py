"""Algorithmic tasks: every sample checked by an independent solver, masks, determinism, split independence."""

from __future__ import annotations

import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.shards import read_shard, verify_manifest
from memlm.data_pipeline.tasks import SEP, TASKS, resolve_options, task_documents

ROOT = Path(__file__).resolve().parents[2]
DOCS = "200,50,50"


def _samples(task: str, split: str = "train", **options):
    """(prompt, answer, mask) of every document, decoded back from the byte ids."""
    out = []
    for tokens, mask, _ in task_documents(task, split, resolve_options(task, {"docs": DOCS, **options})):
        text = bytes(tokens.astype(np.uint8)).decode("ascii")
        prompt, answer = text.split(SEP, 1)
        out.append((prompt, answer, mask))
    return out


@pytest.mark.parametrize("task", TASKS)
def test_mask_covers_exactly_the_answer(task):
    for prompt, answer, mask in _samples(task):
        assert mask.dtype == np.uint8
        assert mask.tolist() == [0] * (len(prompt) + len(SEP)) + [1] * len(answer)
        assert answer and "\n" not in prompt + answer


def test_copy_answer_is_the_input_twice():
    samples = _samples("copy", length=37)
    for prompt, answer, _ in samples:
        assert len(prompt) == 37 and prompt.isalpha() and answer == prompt + prompt
    assert len({p for p, _, _ in samples}) == len(samples)


def test_copy_copies_option():
    for prompt, answer, _ in _samples("copy", length=5, copies=3):
        assert answer == prompt * 3


def test_reverse_answer_is_the_input_reversed():
    for prompt, answer, _ in _samples("reverse", length=120):
        assert len(prompt) == 120 and answer == "".join(reversed(prompt))


@pytest.mark.parametrize("pairs", [4, 30])
def test_retrieval_answer_is_the_queried_value(pairs):
    for prompt, answer, _ in _samples("retrieval", length=pairs):
        body, query = prompt.split("??")
        table = dict(re.findall(r"([a-z]+)(\d)", body))
        assert len(table) == pairs  # keys are distinct
        assert "".join(f"{k}{v}" for k, v in table.items()) == body
        assert answer == table[query]


def _solve(a: int, b: int, c: int):
    """Integer roots of a*x^2+b*x+c (by search over the generator's root range), or None: independent of tasks.py."""
    roots = sorted(x for x in range(-100, 101) if a * x * x + b * x + c == 0)
    if not roots:
        return None
    return roots * 2 if len(roots) == 1 else roots


def _coefficients(equation: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(-?\d*)\*?x\^2(?:([+-]\d*)\*?x)?([+-]\d+)?=0", equation)
    assert m, equation
    a, b, c = m.groups()
    to_int = lambda s, default: default if s is None else int(s + "1") if s in ("", "+", "-") else int(s)  # noqa: E731
    return to_int(a, 1), to_int(b, 0), to_int(c, 0)


def test_quadratic_roots_and_discriminant():
    samples = _samples("quadratic")
    no_roots = 0
    for equation, answer, _ in samples:
        a, b, c = _coefficients(equation)
        steps = answer.split(";")
        monic = _coefficients(steps[0])
        assert monic[0] == 1 and Fraction(b, a) == monic[1] and Fraction(c, a) == monic[2]
        p, q = monic[1], monic[2]
        d = p * p - 4 * q
        assert steps[1].startswith(f"D={abs(p)}^2-4*1*") and f"={d}" in steps[1]
        roots = _solve(a, b, c)
        if roots is None:
            no_roots += 1
            assert d < 0 and steps[1].endswith("<0") and steps[-1] == "none"
        else:
            assert steps[1].endswith(f"={d}={int(d ** 0.5)}^2")
            assert steps[-1] == f"{roots[0]},{roots[1]}"
            assert all(a * x * x + b * x + c == 0 for x in roots)
            assert [s.rsplit("=", 1)[1] for s in steps[2:4]] == [str(roots[0]), str(roots[1])]
    assert 0.1 < no_roots / len(samples) < 0.3  # the paper's 20% without real roots


def test_quadratic_matches_the_papers_example():
    from memlm.data_pipeline.tasks import polynomial, quadratic_solution

    assert polynomial(-4, 392, -2208) == "-4*x^2+392*x-2208=0"
    assert quadratic_solution(-98, 552) == ("x^2-98*x+552=0;D=98^2-4*1*552=7396=86^2;x=(98-86)/2=6;x=(98+86)/2=92",
                                            "6,92")


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_bytes_and_splits_differ(task):
    def raw(split, seed):
        docs = task_documents(task, split, resolve_options(task, {"docs": DOCS, "seed": seed}))
        return b"".join(t.astype(np.uint8).tobytes() + b"\n" for t, _, _ in docs)

    assert raw("train", 3) == raw("train", 3)
    assert raw("train", 3) != raw("train", 4)
    assert len({raw(split, 3)[:2000] for split in ("train", "valid", "test")}) == 3


def test_bad_options():
    with pytest.raises(DataError, match="quadratic"):
        resolve_options("quadratic", {"length": 5})
    with pytest.raises(DataError, match="unknown task"):
        resolve_options("sort", {})
    with pytest.raises(DataError, match="at least one sample"):
        resolve_options("copy", {"docs": "10,0,1"})
    assert resolve_options("copy", {"docs": 50})["docs"] == {"train": 50, "valid": 5, "test": 5}


def test_prepare_task_writes_masked_shards(tmp_path):
    out = tmp_path / "copy"
    cmd = [sys.executable, "-m", "memlm", "prepare", "--corpus", "task", "--task", "copy", "--out", str(out),
           "--task-docs", "300,20,30", "--task-length", "40", "--seed", "7"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    manifest = verify_manifest(out)
    assert manifest["tokenizer"]["kind"] == "bytes" and manifest["corpus"]["task"] == "copy"
    assert {s: e["documents"] for s, e in manifest["splits"].items()} == {"train": 300, "valid": 20, "test": 30}
    assert manifest["splits"]["test"]["tokens"] == 30 * (40 + 1 + 80)
    shard = manifest["splits"]["valid"]["shards"][0]
    docs = list(read_shard(out / shard["path"], shard["sha256"]))
    assert all(d["mask"] is not None and int(d["mask"].sum()) == 80 for d in docs)
    text = bytes(docs[0]["tokens"]).decode()
    assert text[41:] == text[:40] * 2


def test_evaluation_that_scores_no_token_is_an_error_not_a_nan(tmp_path):
    """Copy-task answers start after the prompt: one batch of 8-token segments scores nothing. That is an error
    naming the split and train.eval_batches, never a NaN result; the whole split does score."""
    from memlm.data_pipeline.format import DataError
    from memlm.data_pipeline.prepare import prepare
    from memlm.models import ModelConfig, build_model
    from memlm.trainer.inference.evaluate import evaluate

    prepare("task", None, tmp_path / "copy", task="copy", task_options={"docs": "20,4,4", "length": 24},
            workers=1, progress=False)
    model = build_model(ModelConfig(arch="txl", n_layer=1, n_head=2, d_model=16, d_head=8, d_inner=32, vocab_size=256,
                                    tgt_len=8, mem_len=8))
    with pytest.raises(DataError, match=r"split 'valid'.*train\.eval_batches"):
        evaluate(model, tmp_path / "copy", "valid", lanes=2, seg_len=8, max_batches=1)
    whole = evaluate(model, tmp_path / "copy", "valid", lanes=2, seg_len=8)
    assert whole["tokens"] == 4 * 48 and whole["nll"] == whole["nll"]  # every answer token, a real number


def test_a_nan_trial_is_never_the_best():
    from memlm.cluster.sweep import best_row

    rows = [{"trial_id": "a", "valid_ppl": float("nan")}, {"trial_id": "b", "valid_ppl": 30.0},
            {"trial_id": "c", "valid_ppl": float("inf")}, {"trial_id": "d", "valid_ppl": None},
            {"trial_id": "e", "valid_ppl": 12.5}]
    assert best_row(rows, "valid_ppl", "min")["trial_id"] == "e"
    assert best_row(rows, "valid_ppl", "max")["trial_id"] == "b"
    assert best_row(rows[:1] + rows[2:4], "valid_ppl", "min") is None
