"""Long-context tasks: BABILong-style question answering and passkey retrieval, generated from a seed.

"BABILong-style", not BABILong: the facts are bAbI's kind (Weston et al., 2015), written here from a small world
simulation, and the background they are scattered through is WikiText (a local folder with wiki.{split}.tokens,
e.g. ../shared/data/wikitext-2), not PG-19 as in Kuratov et al. (2024).

A sample is one document, `prompt + SEP + answer` as every task's (data_pipeline/tasks.py): the prompt is background
sentences with the story's facts inserted, in order, at sentence boundaries, then " Q: <question>"; the answer is one
word (a location) or the passkey's digits, and the loss mask covers the answer only. Sizes are in bytes, which are
the tokens of the `bytes` tokenizer every task uses.

    qa1       single supporting fact: people move between locations; "Where is Mary?" -> her last location.
    qa2       two supporting facts: people also pick up and drop objects; "Where is the apple?" -> where its holder
              is (or where it was dropped).
    qa3       three supporting facts: "Where was the apple before the kitchen?" -> the place the apple was in just
              before it came to the kitchen (the kitchen appears once in the apple's history).
    passkey   a number hidden in repeated filler text (Mohtashami & Jaggi, 2023); "What is the pass key?" -> it.

Options: `length` (the sample's bytes, about: background is added a sentence at a time), `depth_min`, `depth_max`
(where in the background the facts may go, as fractions of it), `facts` (story sentences, distractors included),
`background` (the WikiText folder; qa tasks only), `digits` (passkey). The generated facts' sentences never occur in
the background: background sentences that name one of the story's people are left out.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .format import DataError

LONGCTX_TASKS = ("qa1", "qa2", "qa3", "passkey")
PEOPLE = ("Mary", "John", "Sandra", "Daniel", "Fred", "Bill", "Julie", "Emily")
LOCATIONS = ("bathroom", "hallway", "garden", "office", "kitchen", "bedroom", "cellar", "park")
OBJECTS = ("football", "apple", "milk", "book", "key", "box")
MOVES = ("{p} went to the {x}.", "{p} moved to the {x}.", "{p} journeyed to the {x}.", "{p} travelled to the {x}.")
GETS = ("{p} picked up the {x}.", "{p} got the {x}.", "{p} grabbed the {x}.")
DROPS = ("{p} dropped the {x}.", "{p} put down the {x}.", "{p} discarded the {x}.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION_MARK = " Q: "
MIN_LENGTH = 64  # bytes: room for the facts or the passkey, the question and the answer

DEFAULTS = {
    "qa1": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "facts": 6, "background": ""},
    "qa2": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "facts": 8, "background": ""},
    "qa3": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "facts": 10, "background": ""},
    "passkey": {"length": 1000, "depth_min": 0.0, "depth_max": 1.0, "digits": 5},
}


@dataclass(frozen=True)
class Story:
    facts: list[str]  # the story's sentences in order, distractors included
    question: str
    answer: str


def check(task: str, o: dict) -> None:
    """One readable error for options that cannot make a sample."""
    if not 0.0 <= o["depth_min"] <= o["depth_max"] <= 1.0:
        raise DataError(f"{task}: need 0 <= depth_min <= depth_max <= 1, got {o['depth_min']} and {o['depth_max']}")
    if o["length"] < MIN_LENGTH:
        raise DataError(f"{task}: --task-length (the sample's bytes) must be >= {MIN_LENGTH}, got {o['length']}")
    if task == "passkey":
        if not 1 <= o["digits"] <= 18:
            raise DataError(f"passkey: digits must be in 1..18, got {o['digits']}")
        return
    if o["facts"] < {"qa1": 1, "qa2": 2, "qa3": 3}[task]:
        raise DataError(f"{task}: facts must be >= {task[-1]} (its supporting facts), got {o['facts']}")
    if not o["background"]:
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
    """A bAbI-like story of n_facts sentences and its question, drawn until the question has an answer."""
    while True:
        people = [PEOPLE[i] for i in rng.choice(len(PEOPLE), size=4, replace=False)]
        made = _qa1(rng, people, n_facts) if task == "qa1" else _objects(task, rng, people, n_facts)
        if made is not None:
            return made


def new_place(rng: np.random.Generator, current: str | None) -> str:
    """A location other than `current` (a move goes somewhere else, as in bAbI)."""
    choices = [place for place in LOCATIONS if place != current]
    return choices[int(rng.integers(len(choices)))]


def _qa1(rng: np.random.Generator, people: list[str], n_facts: int) -> Story | None:
    where: dict[str, str] = {}
    facts = []
    for _ in range(n_facts):
        person = people[int(rng.integers(len(people)))]
        place = new_place(rng, where.get(person))
        facts.append(MOVES[int(rng.integers(len(MOVES)))].format(p=person, x=place))
        where[person] = place
    asked = sorted(where)[int(rng.integers(len(where)))]
    return Story(facts, f"Where is {asked}?", where[asked])


def _objects(task: str, rng: np.random.Generator, people: list[str], n_facts: int) -> Story | None:
    """qa2 / qa3: moves, pick-ups and drops. An object is where its holder is; a dropped one stays put."""
    things = [OBJECTS[i] for i in rng.choice(len(OBJECTS), size=3, replace=False)]
    where: dict[str, str] = {}  # person -> location
    holder: dict[str, str] = {}  # object -> person
    lies: dict[str, str] = {}  # object -> location (dropped)
    history: dict[str, list[str]] = {t: [] for t in things}  # object -> the places it has been, in order
    facts = []

    def place_of(thing: str) -> str | None:
        return where.get(holder[thing]) if thing in holder else lies.get(thing)

    def note(thing: str) -> None:
        place = place_of(thing)
        if place is not None and (not history[thing] or history[thing][-1] != place):
            history[thing].append(place)

    for _ in range(n_facts):
        person = people[int(rng.integers(len(people)))]
        held = [t for t in things if holder.get(t) == person]
        free = [t for t in things if t not in holder]
        kind = rng.random()
        if kind < 0.5 or (not free and not held):
            place = new_place(rng, where.get(person))
            facts.append(MOVES[int(rng.integers(len(MOVES)))].format(p=person, x=place))
            where[person] = place
            for thing in held:
                note(thing)
        elif held and (kind < 0.75 or not free):
            thing = held[int(rng.integers(len(held)))]
            facts.append(DROPS[int(rng.integers(len(DROPS)))].format(p=person, x=thing))
            del holder[thing]
            if person in where:
                lies[thing] = where[person]
            else:
                lies.pop(thing, None)
        else:
            thing = free[int(rng.integers(len(free)))]
            facts.append(GETS[int(rng.integers(len(GETS)))].format(p=person, x=thing))
            holder[thing] = person
            lies.pop(thing, None)
            note(thing)
    if task == "qa2":
        known = [t for t in things if place_of(t) is not None and t in history and history[t]]
        if not known:
            return None
        thing = known[int(rng.integers(len(known)))]
        return Story(facts, f"Where is the {thing}?", place_of(thing))
    asks = [(t, i) for t in things for i in range(1, len(history[t])) if history[t].count(history[t][i]) == 1]
    if not asks:
        return None
    thing, i = asks[int(rng.integers(len(asks)))]
    return Story(facts, f"Where was the {thing} before the {history[thing][i]}?", history[thing][i - 1])


def passkey_story(rng: np.random.Generator, digits: int) -> Story:
    key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
    return Story([f"The pass key is {key}. Remember it. {key} is the pass key."], "What is the pass key?", key)


def sample_text(task: str, split: str, rng: np.random.Generator, o: dict) -> tuple[str, str]:
    """(prompt, answer) of one sample."""
    made = passkey_story(rng, o["digits"]) if task == "passkey" else story(task, rng, o["facts"])
    tail = QUESTION_MARK + made.question
    room = o["length"] - len(tail) - 1 - len(made.answer) - sum(len(f) + 1 for f in made.facts)
    if task == "passkey":
        filler = FILLER.split(". ")
        background = [(s if s.endswith(".") else s + ".") for s in filler]
        start = 0
    else:
        background = list(background_sentences(o["background"], split))
        start = int(rng.integers(len(background)))
    chosen, size, i = [], 0, start
    while True:
        sentence = background[i % len(background)]
        if size + len(sentence) + 1 > room:
            break
        chosen.append(sentence)
        size += len(sentence) + 1
        i += 1
    # The facts go at sentence boundaries whose depth (bytes of background before them / all of it) lies in the
    # window, in order; several may share a boundary.
    ends = np.cumsum([0] + [len(s) + 1 for s in chosen]) / max(size, 1)  # depth of each boundary
    slots = [k for k, d in enumerate(ends) if o["depth_min"] <= d <= o["depth_max"]]
    if not slots:  # a window narrower than one sentence: the boundary nearest to it
        middle = (o["depth_min"] + o["depth_max"]) / 2
        slots = [int(np.argmin(np.abs(ends - middle)))]
    at = sorted(int(slots[j]) for j in rng.integers(0, len(slots), size=len(made.facts)))
    pieces, fact = [], 0
    for k in range(len(chosen) + 1):
        while fact < len(at) and at[fact] == k:
            pieces.append(made.facts[fact])
            fact += 1
        if k < len(chosen):
            pieces.append(chosen[k])
    return " ".join(pieces) + tail, made.answer
