"""Long-context tasks: BABILong-style question answering and passkey retrieval, generated from a seed.

"BABILong-style", not BABILong: the facts are bAbI's kind (Weston et al., 2015), written here from a small world
simulation under bAbI's rules (data_pipeline/longctx_world.py), and the background they are scattered through is
WikiText (a local folder with wiki.{split}.tokens, e.g. ../shared/data/wikitext-2), not PG-19 as in Kuratov et al.
(2024). Unlike bAbI's tasks: 8 people, 8 places and 6 objects (bAbI: 4 / 6 / 3 in a story), sizes in bytes.

A sample is one document, `prompt + SEP + answer` as every task's (data_pipeline/tasks.py): the prompt is background
text with the story's facts inserted, in order, then " Q: <question>"; the answer is one word (a location) or the
passkey's digits, and the loss mask covers the answer only.

    qa1       single supporting fact: people move between locations; "Where is Mary?" -> her last location.
    qa2       two supporting facts: people also take and drop objects (only in their own room); "Where is the
              apple?" -> where its carrier is, or where it was dropped.
    qa3       three supporting facts: "Where was the apple before the kitchen?" -> the place the apple was carried
              to the kitchen from (it came to the kitchen once, from a place the story gave).
    passkey   a number hidden in repeated filler text (Mohtashami & Jaggi, 2023); "What is the pass key?" -> it.

Every story's answer follows from its sentences alone: the generator reads each story back from its text
(data_pipeline/longctx_reader.py) and draws another when the sentences break a rule or do not give that one answer.

Lengths hold to a few bytes: a sample's prompt is exactly `length` - 1 - the task's longest answer bytes, the
tokens of the `bytes` tokenizer every task is prepared with (`memlm prepare --corpus task` takes no other
tokenizer), so a sample is `length` bytes less its answer's shortfall from the longest (passkey: none; qa: 0-4,
"park" against "bathroom"), and every fact lies inside the depth window, at any length
(data_pipeline/longctx_layout.py says how depth is measured and how the background is cut to fit). The prompt's
length is fixed, not the sample's, because a model sees where its question sits: with samples of exactly `length`
bytes, the question's place told the answer's length (52-53% on qa1 for a reader of nothing else, against 12.5%
chance; found by the long-context experiment, bench/reproduce/longctx.py).

Options: `length` (the sample's bytes; at least `min_length`: the longest story these options can draw, its
question and answer, and 2 bytes of background), `depth_min`, `depth_max` (where in the background the facts go,
as fractions of it), `facts` (story sentences, distractors included), `background` (the WikiText folder; qa tasks
only), `digits` (passkey). The generated facts' sentences never occur in the background: background sentences that
name one of the story's people are left out.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

from . import longctx_reader
from .format import DataError
from .longctx_layout import Words, lay_out
from .longctx_world import LOCATIONS, OBJECTS, PEOPLE, Story, longest_story, passkey_story, simulate

__all__ = ["LOCATIONS", "OBJECTS", "PEOPLE", "Story", "check", "min_length", "sample_text", "story"]

LONGCTX_TASKS = ("qa1", "qa2", "qa3", "passkey")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION_MARK = " Q: "
MIN_LENGTH = 64  # bytes: no task's sample is shorter (each task's own floor, min_length, is higher)
TOLERANCE = max(map(len, LOCATIONS)) - min(map(len, LOCATIONS))  # bytes a sample may fall short of `length`: the
# answer's shortfall from the longest (the prompt's length is exact; passkey's answers are all `digits` long)

DEFAULTS = {
    "qa1": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "facts": 6, "background": ""},
    "qa2": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "facts": 8, "background": ""},
    "qa3": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "facts": 10, "background": ""},
    "passkey": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "digits": 5},
}


def min_length(task: str, o: dict) -> int:
    """The shortest `length` these options can make every sample at: the longest story, question and answer, and
    2 bytes of background (a word and its space; a sample never has 1 byte of background)."""
    return longest_story(task, o.get("facts", 1), o.get("digits", 1)) + 2


def check(task: str, o: dict, in_tokens: bool = False) -> None:
    """One readable error for options that cannot make a sample. in_tokens: `length` counts a backbone tokenizer's
    tokens (data_pipeline/longctx_tokens.py), whose floor each sample's story sets: checked as each is made."""
    if not 0.0 <= o["depth_min"] <= o["depth_max"] <= 1.0:
        raise DataError(f"{task}: need 0 <= depth_min <= depth_max <= 1, got {o['depth_min']} and {o['depth_max']}")
    if task == "passkey":
        if not 1 <= o["digits"] <= 18:
            raise DataError(f"passkey: digits must be in 1..18, got {o['digits']}")
    elif o["facts"] < {"qa1": 1, "qa2": 2, "qa3": 3}[task]:
        raise DataError(f"{task}: facts must be >= {task[-1]} (its supporting facts), got {o['facts']}")
    shortest = min_length(task, o)
    if in_tokens and o["length"] < 1:
        raise DataError(f"{task}: --task-length (the sample's tokens) must be >= 1, got {o['length']}")
    if not in_tokens and o["length"] < shortest:
        what = f"a {o['digits']}-digit key" if task == "passkey" else f"{o['facts']} facts"
        fewer = "digits" if task == "passkey" else "facts"
        raise DataError(f"{task}: --task-length (the sample's bytes) must be >= {shortest} for {what} and the "
                        f"question, got {o['length']}: give a longer length or fewer {fewer} "
                        f"(--task-option {fewer}=N)")
    if task != "passkey" and not o["background"]:
        raise DataError(f"{task}: give the background text's folder: --task-option background=PATH (a WikiText "
                        "folder with wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens, e.g. "
                        "../shared/data/wikitext-2)")


@functools.lru_cache(maxsize=8)
def background_sentences(folder: str, split: str) -> tuple[str, ...]:
    """The split's WikiText text as printable-ASCII sentences, without the story's names, SEP or newlines."""
    path = Path(folder) / f"wiki.{split}.tokens"
    if not path.is_file():
        raise DataError(f"background text {path} not found: --task-option background= must name a WikiText folder "
                        "with wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    text = " ".join(line for line in lines if not re.fullmatch(r"\s*=.*=\s*", line))  # headings out
    text = re.sub(r"[^ -~]", " ", text.replace("<unk>", "unk").replace(">", " "))  # printable ASCII; ">" is SEP
    text = re.sub(r"\s+", " ", re.sub(r" @(.)@ ", r"\1", text))  # WikiText's " @-@ ", " @,@ ", " @.@ "
    names = re.compile(r"\b(" + "|".join(PEOPLE) + r")\b")
    sentences = [s.strip() + "." for s in text.split(" . ") if len(s.strip()) > 20 and not names.search(s)]
    if len(sentences) < 10:
        raise DataError(f"background text {path} has too few sentences ({len(sentences)})")
    return tuple(sentences)


def story(task: str, rng: np.random.Generator, n_facts: int) -> Story:
    """A bAbI-like story of n_facts sentences and its question, drawn until the sentences give its one answer."""
    while True:
        made = simulate(task, rng, n_facts)
        if made is not None and longctx_reader.answer(task, made.facts, made.question) == made.answer:
            return made


def longest_answer(task: str, o: dict) -> int:
    """The task's longest answer in bytes: every prompt is sized for it, so the prompt's length says nothing."""
    return o["digits"] if task == "passkey" else max(map(len, LOCATIONS))


def sample_text(task: str, split: str, rng: np.random.Generator, o: dict) -> tuple[str, str]:
    """(prompt, answer) of one sample: a prompt of exactly o["length"] - 1 - longest_answer bytes, then SEP and an
    answer of at most longest_answer bytes."""
    made = draw_story(task, rng, o)
    prompt_length = o["length"] - 1 - longest_answer(task, o)
    prompt = prompt_of(task, split, rng, o, made, prompt_length)
    assert len(prompt) == prompt_length and len(made.answer) <= longest_answer(task, o), (len(prompt), made.answer)
    return prompt, made.answer


def draw_story(task: str, rng: np.random.Generator, o: dict) -> Story:
    """A sample's story (facts, question, answer): the first draws of its rng."""
    return passkey_story(rng, o["digits"]) if task == "passkey" else story(task, rng, o["facts"])


def story_bytes(made: Story) -> int:
    """The bytes of a prompt that are not background: the facts with their spaces and " Q: <question>"."""
    return sum(len(f) + 1 for f in made.facts) + len(QUESTION_MARK + made.question) - 1


def prompt_of(task: str, split: str, rng: np.random.Generator, o: dict, made: Story, prompt_length: int) -> str:
    """The prompt of `made` in exactly `prompt_length` bytes (at least story_bytes + 2): background, the facts at
    their depths, then the question; the rng draws the background's first sentence and the facts' places."""
    background = prompt_length - story_bytes(made)
    if task == "passkey":
        words = Words(tuple(s if s.endswith(".") else s + "." for s in FILLER.split(". ")), 0)
    else:
        sentences = background_sentences(o["background"], split)
        words = Words(sentences, int(rng.integers(len(sentences))))
    return lay_out(rng, made.facts, words, background, o["depth_min"], o["depth_max"]) + QUESTION_MARK + made.question
