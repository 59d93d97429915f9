"""Long-context tasks (BABILong-style QA, passkey): every answer checked by an independent solver that reads the
story back out of the sample's text; lengths, depths, background hygiene, errors, prepare."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.shards import read_shard, verify_manifest
from memlm.data_pipeline.tasks import SEP, resolve_options, task_documents

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"
NAMES = ("Mary", "John", "Sandra", "Daniel", "Fred", "Bill", "Julie", "Emily")  # the bAbI-like cast, written out
MOVE = re.compile(r"(\w+) (?:went|moved|journeyed|travelled) to the (\w+)\.")
GET = re.compile(r"(\w+) (?:picked up|got|grabbed) the (\w+)\.")
DROP = re.compile(r"(\w+) (?:dropped|put down|discarded) the (\w+)\.")


def samples(task: str, split: str = "test", docs: str = "60,30,40", **options):
    """(prompt, answer, mask) of every document, decoded from the byte ids."""
    extra = {"background": str(WIKITEXT2)} if task.startswith("qa") else {}
    out = []
    for tokens, mask, _ in task_documents(task, split, resolve_options(task, {"docs": docs, **extra, **options})):
        text = bytes(tokens.astype(np.uint8)).decode("ascii")
        prompt, answer = text.split(SEP, 1)
        out.append((prompt, answer, mask))
    return out


def events(story: str) -> list[tuple[str, str, str]]:
    """(kind, person, thing or place) of every fact, in text order."""
    found = [(m.start(), "move", m.group(1), m.group(2)) for m in MOVE.finditer(story)]
    found += [(m.start(), "get", m.group(1), m.group(2)) for m in GET.finditer(story)]
    found += [(m.start(), "drop", m.group(1), m.group(2)) for m in DROP.finditer(story)]
    return [(kind, who, what) for _, kind, who, what in sorted(found)]


def solve(prompt: str) -> str:
    """Answer the question by replaying the facts: the location of every object after every event."""
    story, question = prompt.rsplit(" Q: ", 1)
    place, holder, lying = {}, {}, {}
    timeline = []  # after each event: {object: its location or None}
    for kind, who, what in events(story):
        if kind == "move":
            place[who] = what
        elif kind == "get":
            holder[what] = who
            lying.pop(what, None)
        else:
            holder.pop(what, None)
            lying[what] = place.get(who)
        objects = set(holder) | set(lying)
        timeline.append({o: place.get(holder[o]) if o in holder else lying.get(o) for o in objects})
    if m := re.fullmatch(r"Where is (\w+)\?", question):
        return place[m.group(1)]
    if m := re.fullmatch(r"Where is the (\w+)\?", question):
        return timeline[-1][m.group(1)]
    m = re.fullmatch(r"Where was the (\w+) before the (\w+)\?", question)
    thing, later = m.groups()
    visited = [t[thing] for t in timeline if t.get(thing) is not None]
    distinct = [p for i, p in enumerate(visited) if i == 0 or visited[i - 1] != p]
    assert distinct.count(later) == 1, (distinct, later)
    return distinct[distinct.index(later) - 1]


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
def test_every_answer_is_what_the_story_says(task):
    found = samples(task, length=1500)
    for prompt, answer, mask in found:
        assert solve(prompt) == answer, prompt
        assert mask.tolist() == [0] * (len(prompt) + len(SEP)) + [1] * len(answer)
    # The questions are not all about one thing, and the answers vary.
    assert len({a for _, a, _ in found}) >= 4 and len({p.rsplit(" Q: ", 1)[1] for p, _, _ in found}) >= 6


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
def test_only_the_facts_name_the_cast(task):
    """Background sentences that name a person are left out: every sentence naming one is a fact."""
    for prompt, _, _ in samples(task, docs="20,5,10", length=3000):
        story = prompt.rsplit(" Q: ", 1)[0]
        naming = [s for s in re.split(r"(?<=\.) ", story) if any(re.search(rf"\b{n}\b", s) for n in NAMES)]
        assert naming and all(MOVE.fullmatch(s) or GET.fullmatch(s) or DROP.fullmatch(s) for s in naming), naming


@pytest.mark.parametrize("length", [300, 2000, 8000])
@pytest.mark.parametrize("window", [(0.0, 0.2), (0.4, 0.6), (0.8, 1.0)])
def test_lengths_and_fact_depths(length, window):
    for prompt, answer, _ in samples("qa1", docs="5,5,10", length=length, depth_min=window[0],
                                     depth_max=window[1]):
        total = len(prompt) + len(SEP) + len(answer)
        assert length - 400 < total <= length
        story = prompt.rsplit(" Q: ", 1)[0]
        facts = [m.span() for m in MOVE.finditer(story)]
        fact_bytes = sum(end - start + 1 for start, end in facts)
        background = len(story) + 1 - fact_bytes
        before = 0
        cursor = 0
        for start, end in facts:  # background bytes before each fact, as a fraction of all the background
            before += start - cursor
            cursor = end + 1
            if background > 200:  # a window is only as fine as the sentences
                depth = before / background
                assert window[0] - 0.02 <= depth <= window[1] + 0.02, (depth, window)


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
    ({"background": "x", "length": 10}, "qa1: --task-length (the sample's bytes) must be >= 64"),
])
def test_bad_options_are_one_line(options, message):
    with pytest.raises(DataError, match=re.escape(message)):
        list(task_documents("qa1", "test", resolve_options("qa1", {"docs": 1, **options})))


def test_prepare_writes_qa_shards(tmp_path):
    out = tmp_path / "qa1"
    cmd = [sys.executable, "-m", "memlm", "prepare", "--corpus", "task", "--task", "qa1", "--out", str(out),
           "--task-docs", "20,4,6", "--task-length", "700", "--task-option", f"background={WIKITEXT2}"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    manifest = verify_manifest(out)
    assert {s: e["documents"] for s, e in manifest["splits"].items()} == {"train": 20, "valid": 4, "test": 6}
    shard = manifest["splits"]["test"]["shards"][0]
    for doc in read_shard(out / shard["path"], shard["sha256"]):
        text = bytes(doc["tokens"]).decode("ascii")
        prompt, answer = text.split(SEP, 1)
        assert solve(prompt) == answer and int(doc["mask"].sum()) == len(answer)


def test_the_command_line_lists_every_task():
    from memlm.cli import TASK_NAMES
    from memlm.data_pipeline.tasks import TASKS

    assert TASK_NAMES == list(TASKS)
