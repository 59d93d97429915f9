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
from memlm.data_pipeline.tasks import SEP, TASKS, generate, resolve_options, task_documents

ROOT = Path(__file__).resolve().parents[2]
DOCS = "200,50,50"
# The long-context tasks (their own tests: tests/data_pipeline/test_longctx.py): small samples, and the QA's background
WIKITEXT2 = str(ROOT.parent / "shared" / "data" / "wikitext-2")
# (450 bytes: qa3's 10 facts need 407, data_pipeline/longctx.min_length)
LONGCTX = {"passkey": {"length": 300}, **{qa: {"length": 450, "background": WIKITEXT2} for qa in ("qa1", "qa2", "qa3")}}


def task_options(task: str, **options) -> dict:
    return {"docs": DOCS, **LONGCTX.get(task, {}), **options}


def _samples(task: str, split: str = "train", **options):
    """(prompt, answer, mask) of every document, decoded back from the byte ids."""
    out = []
    for tokens, mask, _ in task_documents(task, split, resolve_options(task, task_options(task, **options))):
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
        docs = task_documents(task, split, resolve_options(task, task_options(task, seed=seed)))
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


def _lane_view(data, split: str, seg_len: int, lanes: int) -> tuple[list[list[tuple[int, int]]], int]:
    """Every document's (input, target) pairs as evaluation's lanes deliver them, and the batches it took.

    Lane bookkeeping written out here: a lane that starts a document (reset) opens a new list; the pairs of
    padding (target -100) are dropped; unscored targets (masked) stay, as their -100, so the count is checked too."""
    from memlm.data_pipeline.stream import LaneStream

    stream = LaneStream(data, split, lanes=lanes, seg_len=seg_len, mode="eval")
    open_docs: dict[int, list] = {}
    docs, batches = [], 0
    for batch in stream:
        batches += 1
        for row in range(lanes):
            if not batch.lane_active[row]:
                continue
            if batch.reset[row]:
                open_docs[row] = []
                docs.append(open_docs[row])
            pairs = list(zip(batch.tokens[row].tolist(), batch.targets[row].tolist()))
            open_docs[row].extend(pairs)
    assert batches == stream.num_batches
    return docs, batches


@pytest.mark.parametrize("predict_first", [True, False])
def test_predict_first_false_cuts_samples_as_the_rmt_authors(tmp_path, predict_first):
    """predict_first false: a sample of T tokens is T - 1 predictions, inputs tokens[:-1] and targets tokens[1:]
    (the authors' src[:-1] -> tgt[1:]), so copy 24 -> 48 is the paper's 72 and splits into exactly S segments of
    72 / S; true (the default) keeps the boundary id as the input before the first token."""
    from memlm.data_pipeline.prepare import prepare

    options = {"docs": "6,3,5", "length": 24, "alphabet": "0123456789", "predict_first": predict_first}
    prepare("task", None, tmp_path / "copy", task="copy", task_options=options, workers=1, progress=False)
    samples = [s.text for s in generate("copy", "test", options)]
    boundary = ord("\n")
    for seg_len, lanes in ((72 // 9, 2), (72 // 4, 3), (72, 1)):
        docs, batches = _lane_view(tmp_path / "copy", "test", seg_len, lanes)
        assert len(docs) == len(samples) == 5
        for text, pairs in zip(samples, docs):
            ids = [ord(c) for c in text]
            inputs = ids[:-1] if not predict_first else [boundary] + ids[:-1]
            targets = ids[1:] if not predict_first else ids
            answer_from = text.index(SEP) + 1  # the first scored target
            scored = [t if i >= answer_from else -100 for i, t in zip(range(len(ids)), ids)]
            scored = scored[1:] if not predict_first else scored
            real = pairs[:len(inputs)]
            assert [i for i, _ in real] == inputs and [t for _, t in real] == scored
            assert all(t == -100 for _, t in pairs[len(inputs):])  # only padding after the sample
            assert len(targets) == (72 if not predict_first else 73)
            spans = -(-len(targets) // seg_len)
            assert len(pairs) == spans * seg_len
            if not predict_first:
                assert spans == 72 // seg_len  # exactly the paper's segment count
        predictions = len(samples[0]) - (0 if predict_first else 1)  # every copy sample has the same length
        assert batches == -(-len(samples) // lanes) * -(-predictions // seg_len)


def test_predict_first_false_is_refused_in_continuous_lanes(tmp_path):
    from memlm.data_pipeline.prepare import prepare
    from memlm.data_pipeline.stream import LaneStream

    prepare("task", None, tmp_path / "rev", task="reverse",
            task_options={"docs": "4,2,2", "length": 5, "predict_first": "false"}, workers=1, progress=False)
    with pytest.raises(DataError, match="data.continuous false"):
        LaneStream(tmp_path / "rev", "train", lanes=2, seg_len=4, continuous=True)


def test_retrieval_without_query_marker_is_the_authors_ten_and_one():
    """query "" + predict_first false: 4 pairs, the key, '>' and the value: 10 predictions, 1 scored (paper: 10/1)."""
    options = resolve_options("retrieval", {"docs": "20,2,2", "query": "", "predict_first": False})
    for tokens, mask, _ in task_documents("retrieval", "train", options):
        text = bytes(tokens.astype(np.uint8)).decode()
        assert len(tokens) - 1 == 10 and int(mask.sum()) == 1 and "?" not in text
        pairs = dict(zip(text[0:8:2], text[1:8:2]))
        assert len(pairs) == 4 and text[10] == pairs[text[8]]


def test_typed_task_options():
    assert resolve_options("copy", {"predict_first": "no"})["predict_first"] is False
    assert resolve_options("copy", {"copies": "3"})["copies"] == 3
    with pytest.raises(DataError, match="true or false"):
        resolve_options("copy", {"predict_first": "perhaps"})
    with pytest.raises(DataError, match="wants a int"):
        resolve_options("copy", {"copies": "two"})
    with pytest.raises(DataError, match="query marker"):
        resolve_options("retrieval", {"query": "k"})


def test_task_option_flag(tmp_path):
    """--task-option KEY=VALUE reaches the generator; a malformed one is one line and exit 2."""
    out = tmp_path / "ret"
    base = [sys.executable, "-m", "memlm", "prepare", "--corpus", "task", "--task", "retrieval", "--out", str(out),
            "--task-docs", "8,2,2", "--workers", "1"]
    run = subprocess.run(base + ["--task-option", "query=", "--task-option", "predict_first=false"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    corpus = verify_manifest(out)["corpus"]
    assert corpus["options"]["query"] == "" and corpus["first_target"] == 1
    bad = subprocess.run(base + ["--overwrite", "--task-option", "predict_first"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "KEY=VALUE" in bad.stderr
