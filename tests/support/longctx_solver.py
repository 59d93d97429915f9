"""An independent reader of the long-context tasks' samples: it parses the prompt's sentences with its own patterns
and its own world model (bAbI's rules, written from the bAbI task descriptions, not from the generator) and says
which answers the facts allow.

It shares nothing with data_pipeline/longctx*.py but the text it reads: the cast is written out here, the verbs
are matched by their own patterns, and every rule is checked rather than assumed. Two readings of a pick-up are
replayed side by side, because a story that breaks the same-room rule can be read either way:
    "person wins":  the person is where the story last put them; the object comes to them there;
    "object wins":  the object is where the story last put it; the person must have gone there to take it.
A sound story never breaks a rule, so both readings give one answer, the same. `read` returns the set of answers
both readings give (None in it: a reading the facts leave undetermined) and the rules the story breaks.
"""

from __future__ import annotations

import re

CAST = ("Mary", "John", "Sandra", "Daniel", "Fred", "Bill", "Julie", "Emily")  # bAbI's people, written out here
WHO = "(" + "|".join(CAST) + ")"
PATTERNS = (  # (kind, pattern over one fact sentence)
    ("back", re.compile(WHO + r" went back to the (\w+)\.")),
    ("move", re.compile(WHO + r" (?:went|moved|journeyed|travelled) to the (\w+)\.")),
    ("get", re.compile(WHO + r" (?:picked up|got|grabbed|took) the (\w+)(?: there)?\.")),
    ("drop", re.compile(WHO + r" (?:dropped|put down|discarded|left) the (\w+)(?: there)?\.")),
)
QUESTIONS = (
    ("person", re.compile(r"Where is " + WHO + r"\?")),
    ("object", re.compile(r"Where is the (\w+)\?")),
    ("before", re.compile(r"Where was the (\w+) before the (\w+)\?")),
)


def facts(story: str) -> list[tuple[str, str, str]]:
    """(kind, person, place or object) of every fact, in text order; every mention of a person is in one."""
    found = sorted((m.start(), m.end(), kind, m.group(1), m.group(2))
                   for kind, pattern in PATTERNS for m in pattern.finditer(story))
    mentions = [m.start() for m in re.finditer(r"\b" + WHO + r"\b", story)]
    assert mentions == [start for start, *_ in found], "a sentence names a person but is no fact"
    return [(kind, who, what) for _, _, kind, who, what in found]


class Reading:
    """The world as one reading of the facts makes it: None where the facts do not say."""

    def __init__(self, object_wins: bool):
        self.object_wins = object_wins
        self.person: dict[str, str | None] = {}
        self.been: dict[str, set[str]] = {}
        self.holder: dict[str, str] = {}  # object -> person carrying it
        self.lying: dict[str, str | None] = {}  # object -> where it was put down (None: nobody knows)
        self.trail: dict[str, list[str | None]] = {}  # object -> its places in order, repeats squeezed
        self.broken: list[str] = []

    def where_object(self, thing: str) -> str | None:
        if thing in self.holder:
            return self.person.get(self.holder[thing])
        return self.lying.get(thing)

    def _moved(self, thing: str) -> None:
        place, trail = self.where_object(thing), self.trail.setdefault(thing, [])
        if not trail or trail[-1] != place or place is None:
            trail.append(place)

    def _go(self, who: str, place: str) -> None:
        self.person[who] = place
        self.been.setdefault(who, set()).add(place)
        for thing, carrier in self.holder.items():
            if carrier == who:
                self._moved(thing)

    def apply(self, kind: str, who: str, what: str) -> None:
        if kind in ("move", "back"):
            if self.person.get(who) == what:
                self.broken.append(f"{who} goes to the {what}, where they already are")
            if kind == "back" and what not in self.been.get(who, set()):
                self.broken.append(f"{who} goes back to the {what}, where they have not been")
            self._go(who, what)
        elif kind == "get":
            if thing_holder := self.holder.get(what):
                self.broken.append(f"{who} takes the {what} that {thing_holder} carries")
            here, there = self.person.get(who), self.where_object(what)
            if here is None:
                self.broken.append(f"{who} takes the {what} somewhere the story never said")
            if there is not None and here != there:
                self.broken.append(f"{who} takes the {what} in the {here}, but it is in the {there}")
                if self.object_wins:
                    self._go(who, there)
            self.holder[what] = who
            self.lying.pop(what, None)
            self._moved(what)
        else:
            if self.holder.get(what) != who:
                self.broken.append(f"{who} drops the {what} they do not carry")
            self.holder.pop(what, None)
            self.lying[what] = self.person.get(who)

    def answer(self, question: str) -> str | None:
        for kind, pattern in QUESTIONS:
            if m := pattern.fullmatch(question):
                break
        else:
            raise AssertionError(f"unknown question {question!r}")
        if kind == "person":
            return self.person.get(m.group(1))
        if kind == "object":
            return self.where_object(m.group(1))
        thing, later = m.groups()
        trail = self.trail.get(thing, [])
        if trail.count(later) != 1 or trail.index(later) == 0:
            return None  # never there, there more than once, or there first: "before" has no single answer
        return trail[trail.index(later) - 1]


def read(prompt: str) -> tuple[set[str | None], list[str]]:
    """(the answers the facts give under both readings, the rules the story breaks) for a QA prompt."""
    story, question = prompt.rsplit(" Q: ", 1)
    readings = [Reading(object_wins=False), Reading(object_wins=True)]
    for fact in facts(story):
        for reading in readings:
            reading.apply(*fact)
    return {r.answer(question) for r in readings}, readings[0].broken


def passkey(prompt: str) -> set[str]:
    """The keys the prompt states (one in a sound sample); every number in it is that key."""
    story, question = prompt.rsplit(" Q: ", 1)
    assert question == "What is the pass key?"
    stated = re.findall(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key\.", story)
    keys = {key for pair in stated for key in pair}
    assert len(stated) == 1 and set(re.findall(r"\d+", story)) == keys
    return keys
