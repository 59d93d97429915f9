"""The long-context tasks' stories: a small bAbI world (Weston et al., 2015) of people, places and objects,
simulated under bAbI's rules, and the passkey's sentence.

The rules, so that a reader can answer one way only:
    - a person moves somewhere other than where they are; "went back to" only to a place they have been;
    - a person takes or drops things only once the story has said where they are;
    - a person takes only an object nobody carries that is in their own room: one the story put down there, or one
      the story has not placed yet (it was there all along; where it lay before is never asked);
    - a person drops only what they carry, and it stays where they drop it; a carried object goes where its
      carrier goes.
So every place an object is ever in follows from the sentences, and every change of its place is a carry: its
carrier walking from one room to another (qa3 asks about those moves only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PEOPLE = ("Mary", "John", "Sandra", "Daniel", "Fred", "Bill", "Julie", "Emily")
LOCATIONS = ("bathroom", "hallway", "garden", "office", "kitchen", "bedroom", "cellar", "park")
OBJECTS = ("football", "apple", "milk", "book", "key", "box")
MOVES = ("{p} went to the {x}.", "{p} moved to the {x}.", "{p} journeyed to the {x}.", "{p} travelled to the {x}.")
BACK = "{p} went back to the {x}."  # bAbI's return: only to a place the person has been
GETS = ("{p} picked up the {x}.", "{p} got the {x}.", "{p} grabbed the {x}.", "{p} took the {x}.",
        "{p} got the {x} there.", "{p} took the {x} there.")
DROPS = ("{p} dropped the {x}.", "{p} put down the {x}.", "{p} discarded the {x}.", "{p} left the {x}.",
         "{p} dropped the {x} there.", "{p} left the {x} there.")
QUESTIONS = {"qa1": "Where is {p}?", "qa2": "Where is the {x}?", "qa3": "Where was the {x} before the {y}?"}
PASSKEY = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
CAST = 4  # people in one story
THINGS = 3  # objects in one qa2 / qa3 story


@dataclass(frozen=True)
class Story:
    facts: list[str]  # the story's sentences in order, distractors included
    question: str
    answer: str


def pick(rng: np.random.Generator, items):
    return items[int(rng.integers(len(items)))]


def new_place(rng: np.random.Generator, current: str | None) -> str:
    """A location other than `current` (a move goes somewhere else, as in bAbI)."""
    return pick(rng, [place for place in LOCATIONS if place != current])


class World:
    """Where everyone and everything is, as the story's sentences so far have told it."""

    def __init__(self, people: list[str], things: list[str]):
        self.people, self.things = people, things
        self.where: dict[str, str] = {}  # person -> place
        self.been: dict[str, set[str]] = {p: set() for p in people}
        self.holder: dict[str, str] = {}  # object -> the person carrying it
        self.lies: dict[str, str] = {}  # object -> the place it was put down
        self.trail: dict[str, list[str]] = {t: [] for t in things}  # object -> its places in order, no repeats
        self.facts: list[str] = []

    def place_of(self, thing: str) -> str | None:
        return self.where[self.holder[thing]] if thing in self.holder else self.lies.get(thing)

    def _seen_at(self, thing: str) -> None:
        place = self.place_of(thing)
        if not self.trail[thing] or self.trail[thing][-1] != place:
            self.trail[thing].append(place)

    def move(self, rng: np.random.Generator, person: str) -> None:
        place = new_place(rng, self.where.get(person))
        back = place in self.been[person] and rng.random() < 0.5
        self.facts.append((BACK if back else pick(rng, MOVES)).format(p=person, x=place))
        self.where[person] = place
        self.been[person].add(place)
        for thing, carrier in self.holder.items():
            if carrier == person:
                self._seen_at(thing)

    def takeable(self, person: str) -> list[str]:
        """Objects nobody carries that are in the person's room, or not placed yet (then they were there)."""
        if person not in self.where:
            return []
        return [t for t in self.things if t not in self.holder and self.lies.get(t, self.where[person])
                == self.where[person]]

    def take(self, rng: np.random.Generator, person: str, thing: str) -> None:
        self.facts.append(pick(rng, GETS).format(p=person, x=thing))
        self.holder[thing] = person
        self.lies.pop(thing, None)
        self._seen_at(thing)

    def drop(self, rng: np.random.Generator, person: str, thing: str) -> None:
        self.facts.append(pick(rng, DROPS).format(p=person, x=thing))
        del self.holder[thing]
        self.lies[thing] = self.where[person]  # a carrier's place is always known: they took it somewhere known


def simulate(task: str, rng: np.random.Generator, n_facts: int) -> Story | None:
    """One story of n_facts sentences and its question; None when nothing in it can be asked."""
    people = [PEOPLE[i] for i in rng.choice(len(PEOPLE), size=CAST, replace=False)]
    things = [OBJECTS[i] for i in rng.choice(len(OBJECTS), size=THINGS, replace=False)] if task != "qa1" else []
    world = World(people, things)
    for _ in range(n_facts):
        person = pick(rng, people)
        held = [t for t in things if world.holder.get(t) == person]
        free = world.takeable(person)
        kind = rng.random()
        if kind < 0.5 or not (held or free):
            world.move(rng, person)
        elif held and (kind < 0.75 or not free):
            world.drop(rng, person, pick(rng, held))
        else:
            world.take(rng, person, pick(rng, free))
    if task == "qa1":
        asked = pick(rng, sorted(world.where)) if world.where else None
        return Story(world.facts, QUESTIONS[task].format(p=asked), world.where[asked]) if asked else None
    if task == "qa2":
        placed = [t for t in things if world.trail[t]]
        if not placed:
            return None
        thing = pick(rng, placed)
        return Story(world.facts, QUESTIONS[task].format(x=thing), world.place_of(thing))
    # qa3: "before the Y" names a place the object came to once, by a carry, from an earlier place it was in.
    asks = [(t, i) for t in things for i in range(1, len(world.trail[t]))
            if world.trail[t].count(world.trail[t][i]) == 1]
    if not asks:
        return None
    thing, i = pick(rng, asks)
    return Story(world.facts, QUESTIONS[task].format(x=thing, y=world.trail[thing][i]), world.trail[thing][i - 1])


def passkey_story(rng: np.random.Generator, digits: int) -> Story:
    key = str(int(rng.integers(10 ** (digits - 1), 10**digits)))
    return Story([PASSKEY.format(key=key)], PASSKEY_QUESTION, key)


def longest_story(task: str, facts: int, digits: int) -> int:
    """The most bytes a story's facts (each with its joining space), "Q: " + question, SEP and answer can take."""
    if task == "passkey":
        return len(PASSKEY.format(key="0" * digits)) + 1 + len("Q: " + PASSKEY_QUESTION) + 1 + digits
    people, places, things = (max(len(w) for w in words) for words in (PEOPLE, LOCATIONS, OBJECTS))
    sentences = MOVES + (BACK,) + (GETS + DROPS if task != "qa1" else ())
    fact = max(len(s.format(p="p" * people, x="x" * (places if s in MOVES + (BACK,) else things)))
               for s in sentences)
    question = len(QUESTIONS[task].format(p="p" * people, x="x" * things, y="y" * places))
    return facts * (fact + 1) + len("Q: ") + question + 1 + places
