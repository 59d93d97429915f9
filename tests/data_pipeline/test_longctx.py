"""Long-context tasks (BABILong-style QA, passkey): lengths exact and fact depths inside the window at every length,
background hygiene, determinism, errors, prepare. That every answer follows from the facts alone:
test_longctx_solver.py."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memlm.data_pipeline.format import SPLITS, DataError
from memlm.data_pipeline.longctx import TOLERANCE, min_length
from memlm.data_pipeline.shards import read_shard, verify_manifest
from memlm.data_pipeline.tasks import SEP, resolve_options, task_documents
from support.longctx_solver import PATTERNS, facts, read

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"
PASSKEY_SENTENCE = re.compile(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.")


def samples(task: str, split: str = "test", docs: str = "60,30,40", **options):
    """(prompt, answer, mask) of every document, decoded from the byte ids."""
    extra = {"background": str(WIKITEXT2)} if task.startswith("qa") else {}
    out = []
    for tokens, mask, _ in task_documents(task, split, resolve_options(task, {"docs": docs, **extra, **options})):
        text = bytes(tokens.astype(np.uint8)).decode("ascii")
        prompt, answer = text.split(SEP, 1)
        out.append((prompt, answer, mask))
    return out


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3", "passkey"])
def test_the_loss_covers_the_answer_and_the_questions_vary(task):
    found = samples(task, length=1500)
    for prompt, answer, mask in found:
        assert mask.tolist() == [0] * (len(prompt) + len(SEP)) + [1] * len(answer)
    # The questions are not all about one thing, and the answers vary.
    assert len({a for _, a, _ in found}) >= 4
    assert task == "passkey" or len({p.rsplit(" Q: ", 1)[1] for p, _, _ in found}) >= 6


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
def test_only_the_facts_name_the_cast(task):
    """Background sentences that name a person are left out: every mention of one is in a fact (the solver's
    `facts` asserts it), and the background's pieces are words: no double spaces, no SEP, no newline."""
    for prompt, _, _ in samples(task, docs="20,5,10", length=3000):
        story = prompt.rsplit(" Q: ", 1)[0]
        assert facts(story) and "  " not in prompt and not {">", "\n"} & set(prompt) and prompt.isascii()


def fact_spans(task: str, story: str) -> list[tuple[int, int]]:
    """(start, end) of every fact sentence in the story part of a prompt, in order."""
    if task == "passkey":
        return [m.span() for m in PASSKEY_SENTENCE.finditer(story)]
    return sorted(m.span() for _, pattern in PATTERNS for m in pattern.finditer(story))


def depths(task: str, story: str) -> tuple[list[int], int]:
    """(background bytes before each fact, all background bytes): the story is items joined by single spaces, each
    item owning the space after it; the background is every item that is not a fact."""
    spans = fact_spans(task, story)
    background = len(story) + 1 - sum(end - start + 1 for start, end in spans)
    before, facts_so_far = [], 0
    for start, end in spans:
        before.append(start - facts_so_far)
        facts_so_far += end - start + 1
    return before, background


def short(task: str) -> dict:
    """Options that make short samples: one fact (qa1: 64 bytes), a one-digit key; qa3's 3 facts would do, but
    few draws of 3 facts make a question (it takes a move, a take and a move by one person)."""
    return {"qa1": {"facts": 1}, "qa2": {"facts": 2}, "qa3": {"facts": 4}, "passkey": {"digits": 1}}[task]


WINDOWS = [(0.0, 1.0), (0.0, 0.2), (0.4, 0.6), (0.8, 1.0), (0.5, 0.5), (0.0, 0.0), (1.0, 1.0), (0.3, 0.31)]


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3", "passkey"])
@pytest.mark.parametrize("short_story", [True, False])
def test_lengths_are_exact_and_facts_lie_in_the_depth_window(task, short_story):
    """Every prompt is sized for the longest answer, so a sample is --task-length bytes less its answer's shortfall,
    from the task's shortest (64 bytes for one qa1 fact) to thousands; each fact's depth is inside the window, or, for a
    window narrower than the 3 bytes that surely hold a place the background can break at, within 2 bytes of it."""
    extra = short(task) if short_story else {}
    background = {"background": str(WIKITEXT2)} if task != "passkey" else {}
    shortest = min_length(task, resolve_options(task, {"docs": 1, "length": 10_000, **background, **extra}))
    if task == "qa1" and short_story:
        assert shortest == 64
    checked = 0
    for length in sorted({shortest, shortest + 1, shortest + 3, 300, 1000, 4000} - set(range(shortest))):
        for low, high in WINDOWS:
            for prompt, answer, _ in samples(task, docs="1,1,6", length=length, depth_min=low, depth_max=high,
                                             seed=length, **extra):
                total = len(prompt) + len(SEP) + len(answer)
                assert length - TOLERANCE <= total <= length and TOLERANCE == 4  # "park" against "bathroom"
                longest_answer = extra.get("digits", 5) if task == "passkey" else 8
                assert len(prompt) == length - 1 - longest_answer
                assert "  " not in prompt and not prompt.startswith(" ")  # every background piece is words
                before, g = depths(task, prompt.rsplit(" Q: ", 1)[0])
                assert len(before) == (1 if task == "passkey" else extra.get("facts", {"qa1": 6, "qa2": 8,
                                                                                         "qa3": 10}[task]))
                slack = 0 if (high - low) * g >= 3 else 2
                assert all(low * g - slack <= b <= high * g + slack for b in before), (before, g, low, high)
                checked += 1
    assert checked >= 5 * len(WINDOWS) * 6


def test_a_length_below_the_longest_story_is_refused_and_names_the_fix():
    options = {"docs": 1, "background": str(WIKITEXT2), "facts": 4}
    shortest = min_length("qa1", resolve_options("qa1", {**options, "length": 10_000}))
    resolve_options("qa1", {**options, "length": shortest})
    with pytest.raises(DataError, match=re.escape(f"qa1: --task-length (the sample's bytes) must be >= {shortest} "
                                                  f"for 4 facts and the question, got {shortest - 1}: give a longer "
                                                  "length or fewer facts (--task-option facts=N)")):
        resolve_options("qa1", {**options, "length": shortest - 1})
    # The floor covers the longest stories: long names, places and sentences, nothing shorter.
    assert shortest >= len("Daniel journeyed to the bathroom. " * 4 + "Q: Where is Sandra?>bathroom")
    longest = "Daniel journeyed to the bathroom. " * 3 + "Sandra picked up the football there. "
    assert min_length("qa2", resolve_options("qa2", {**options, "length": 10_000})) >= len(
        longest + "Q: Where is the football?>bathroom")


def test_passkey_hides_the_answer_in_filler():
    for prompt, answer, _ in samples("passkey", length=4000, depth_min=0.5, depth_max=0.5):
        assert re.fullmatch(r"\d{5}", answer)
        assert prompt.count(f"The pass key is {answer}.") == 1 and prompt.endswith(" Q: What is the pass key?")
        middle = prompt.index("The pass key") / len(prompt)
        assert 0.4 < middle < 0.6
        assert set(re.findall(r"\d+", prompt)) == {answer}


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3", "passkey"])
def test_same_seed_same_samples_and_splits_differ(task):
    def texts(split, seed):
        return [p + a for p, a, _ in samples(task, split, docs="5,5,5", seed=seed, length=800)]

    assert texts("test", 3) == texts("test", 3)
    assert texts("test", 3) != texts("test", 4)
    assert texts("train", 3) != texts("test", 3)


@pytest.mark.parametrize("options,message", [
    ({}, "qa1: give the background text's folder: --task-option background=PATH"),
    ({"background": "/nonexistent"}, "background text /nonexistent/wiki.test.tokens not found"),
    ({"background": "x", "depth_min": 0.7, "depth_max": 0.2}, "qa1: need 0 <= depth_min <= depth_max <= 1"),
    ({"background": "x", "length": 10}, "qa1: --task-length (the sample's bytes) must be >= 2"),
    ({"background": "x", "facts": 0}, "qa1: facts must be >= 1 (its supporting facts), got 0"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(DataError, match="^" + re.escape(message)):
        list(task_documents("qa1", "test", resolve_options("qa1", {"docs": 1, **options})))


def test_prepare_writes_qa_shards_and_prints_the_lengths_it_made(tmp_path):
    out = tmp_path / "qa1"
    cmd = [sys.executable, "-m", "memlm", "prepare", "--corpus", "task", "--task", "qa1", "--out", str(out),
           "--task-docs", "20,4,6", "--task-length", "700", "--task-option", f"background={WIKITEXT2}"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    manifest = verify_manifest(out)
    assert {s: e["documents"] for s, e in manifest["splits"].items()} == {"train": 20, "valid": 4, "test": 6}
    made = {}
    for split in SPLITS:
        made[split] = []
        for shard in manifest["splits"][split]["shards"]:
            for doc in read_shard(out / shard["path"], shard["sha256"]):
                prompt, answer = bytes(doc["tokens"]).decode("ascii").split(SEP, 1)
                assert read(prompt) == ({answer}, []) and int(doc["mask"].sum()) == len(answer)
                made[split].append(len(doc["tokens"]))
    rows = ", ".join(f"{split} {min(n)} / {statistics.median(n):g} / {max(n)}" for split, n in made.items())
    assert all(700 - 4 <= k <= 700 for n in made.values() for k in n)
    assert (f"qa1: sample lengths in bytes (the bytes tokenizer's tokens), asked 700 (tolerance 4), min / median / "
            f"max: {rows}") in run.stdout.splitlines()


def test_the_command_line_lists_every_task():
    from memlm.cli import TASK_NAMES
    from memlm.data_pipeline.tasks import TASKS

    assert TASK_NAMES == list(TASKS)
