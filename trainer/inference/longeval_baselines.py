"""What a reader that does not learn scores on the very samples a model is scored on: chance and cheap heuristics.

A model that learned only "answer with the place mentioned last" looks, beside chance alone, as if it had learned the
task (about 40% on qa1 against 12.5%), so `memlm longeval` sets these beside every accuracy. Each heuristic reads the
prompt text only (`<context> Q: <question>`), knows the task's possible answers (its labels: the story's locations,
BABILong's label set) and nothing else; labels the question names are never its guess (they are never the answer:
qa3's "before the kitchen"; BABILong's scoring ignores them too).

    chance               1 / the number of possible answers (an expectation, not a draw)
    last_mentioned       the label mentioned last in the context
    most_frequent        the label mentioned most often (a tie: the one of them mentioned last)
    before_object        qa2, qa3: the label mentioned last before the asked object's last mention (where its
                         holder was when it was last picked up or dropped, if nothing moved since)
    before_asked_place   qa3 ("before the kitchen?"): the label mentioned last before the asked place's first mention

Mentions are whole words, case-insensitive, anywhere in the context, background included: the reader cannot tell
story from background. passkey has chance only: its number is the only one in the filler, so reading the prompt
always finds it; what a model without memory cannot do there is see it, which the no-memory model's own line shows.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

from memlm.data_pipeline import longctx

QUESTION_MARK = " Q: "  # data_pipeline/longctx.py's, also BABILong's files as memlm renders them
Guess = Callable[[str, str, Sequence[str]], "str | None"]

DESCRIPTIONS = {
    "chance": "chance (1 / possible answers)",
    "last_mentioned": "last answer word mentioned",
    "most_frequent": "most frequent answer word",
    "before_object": "answer word before the object's last mention",
    "before_asked_place": "answer word before the asked place's first mention",
}


def split_prompt(prompt: str) -> tuple[str, str]:
    """(context, question) of a task prompt."""
    context, mark, question = prompt.rpartition(QUESTION_MARK)
    return (context, question) if mark else (prompt, "")


def mentions(text: str, labels: Sequence[str]) -> list[str]:
    """The labels `text` mentions, in order, as whole words (case-insensitive), each as the label is spelled."""
    if not labels:
        return []
    spelled = {label.lower(): label for label in labels}
    pattern = r"(?<!\w)(" + "|".join(re.escape(label) for label in sorted(labels, key=len, reverse=True)) + r")(?!\w)"
    return [spelled[m.group(1).lower()] for m in re.finditer(pattern, text, flags=re.IGNORECASE)]


def _candidates(text: str, question: str, labels: Sequence[str]) -> list[str]:
    asked = set(mentions(question, labels))
    return [label for label in mentions(text, labels) if label not in asked]


def last_mentioned(context: str, question: str, labels: Sequence[str]) -> str | None:
    found = _candidates(context, question, labels)
    return found[-1] if found else None


def most_frequent(context: str, question: str, labels: Sequence[str]) -> str | None:
    found = _candidates(context, question, labels)
    if not found:
        return None
    counts = Counter(found)
    top = max(counts.values())
    return next(label for label in reversed(found) if counts[label] == top)


def asked_object(question: str, labels: Sequence[str]) -> str | None:
    """The object a question asks about: the word after its first "the" that is not a label."""
    for word in re.findall(r"\bthe (\w+)", question, flags=re.IGNORECASE):
        if word.lower() not in {label.lower() for label in labels}:
            return word
    return None


def before_object(context: str, question: str, labels: Sequence[str]) -> str | None:
    thing = asked_object(question, labels)
    if thing is None:
        return None
    last = None
    for match in re.finditer(rf"\b{re.escape(thing)}\b", context, flags=re.IGNORECASE):
        last = match.start()
    return None if last is None else last_mentioned(context[:last], question, labels)


def before_asked_place(context: str, question: str, labels: Sequence[str]) -> str | None:
    asked = mentions(question, labels)
    if not asked:
        return None
    match = re.search(rf"(?<!\w){re.escape(asked[0])}(?!\w)", context, flags=re.IGNORECASE)
    return None if match is None else last_mentioned(context[:match.start()], question, labels)


HEURISTICS: dict[str, Guess] = {"last_mentioned": last_mentioned, "most_frequent": most_frequent,
                                "before_object": before_object, "before_asked_place": before_asked_place}
# Which heuristics a task's questions give a meaning to; other QA tasks (BABILong's qa4..qa20) get the first two.
TASK_HEURISTICS = {"qa1": ("last_mentioned", "most_frequent"),
                   "qa2": ("last_mentioned", "most_frequent", "before_object"),
                   "qa3": ("last_mentioned", "most_frequent", "before_object", "before_asked_place"),
                   "passkey": ()}


def heuristics_for(task: str) -> tuple[str, ...]:
    return TASK_HEURISTICS.get(task, ("last_mentioned", "most_frequent"))


def exact(answer: str, guess: str | None, question: str) -> bool:
    """memlm's own tasks: the guess is the answer (labels are compared case-insensitively)."""
    return guess is not None and guess.lower() == answer.strip().lower()


def baselines(task: str, samples: Sequence[tuple[str, str]], labels: Sequence[str], chance: float,
              judge: Callable[[str, str | None, str], bool] = exact) -> dict[str, float]:
    """{"chance": chance, heuristic: accuracy on `samples` ((prompt, answer) pairs)}. judge(answer, guess, question)
    says whether a guess counts: memlm's exact match, or BABILong's rule for its files."""
    out = {"chance": float(chance)}
    for name in heuristics_for(task):
        guess = HEURISTICS[name]
        hits = 0
        for prompt, answer in samples:
            context, question = split_prompt(prompt)
            hits += judge(answer, guess(context, question, labels), question)
        out[name] = hits / len(samples) if samples else 0.0
    return out


def task_labels_and_chance(task: str, options: dict) -> tuple[tuple[str, ...], float]:
    """memlm's generated tasks (data_pipeline/longctx.py): the possible answers and chance. passkey's keys are the
    numbers of `digits` digits without a leading zero (longctx.passkey_story): 9 * 10^(digits - 1) of them."""
    if task == "passkey":
        return (), 1.0 / (9 * 10 ** (int(options.get("digits", longctx.DEFAULTS["passkey"]["digits"])) - 1))
    return tuple(longctx.LOCATIONS), 1.0 / len(longctx.LOCATIONS)


def mean_by_samples(rows: Sequence[dict]) -> dict[str, float]:
    """The baselines of several cells (rows with "samples" and "baselines") as one, weighted by their samples."""
    total = sum(r["samples"] for r in rows)
    names = list(dict.fromkeys(name for r in rows for name in r["baselines"]))
    return {name: sum(r["baselines"][name] * r["samples"] for r in rows) / total for name in names} if total else {}
