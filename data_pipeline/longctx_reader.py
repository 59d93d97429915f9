"""The generator's own check that a story's answer follows from its sentences alone.

It reads the facts back from their text (not from the simulation that wrote them), replays them under bAbI's
rules (data_pipeline/longctx_world.py's docstring) and answers the question. A story whose sentences break a rule,
or leave the question without one answer, or give another answer than the simulation's, is not used
(longctx.story draws another). The tests read every task's samples with a solver of their own as well.
"""

from __future__ import annotations

import re

from .longctx_world import BACK, DROPS, GETS, MOVES, QUESTIONS


def _pattern(templates) -> re.Pattern:
    alternatives = "|".join(re.escape(t).replace(r"\{p\}", r"(\w+)").replace(r"\{x\}", r"(\w+)") for t in templates)
    return re.compile(alternatives)


SENTENCES = {"back": _pattern([BACK]), "move": _pattern(MOVES), "get": _pattern(GETS), "drop": _pattern(DROPS)}
ASKED = {task: _pattern([q.replace("{y}", "{x}")]) for task, q in QUESTIONS.items()}


def _parse(fact: str) -> tuple[str, str, str] | None:
    for kind, pattern in SENTENCES.items():
        if m := pattern.fullmatch(fact):
            who, what = [g for g in m.groups() if g is not None]
            return kind, who, what
    return None


def answer(task: str, facts: list[str], question: str) -> str | None:
    """The one answer the sentences give, or None (a rule broken, a sentence not understood, no single answer)."""
    where: dict[str, str] = {}
    been: dict[str, set[str]] = {}
    holder: dict[str, str] = {}
    lies: dict[str, str] = {}
    trail: dict[str, list[str]] = {}

    def place(thing: str) -> str | None:
        return where.get(holder[thing]) if thing in holder else lies.get(thing)

    def seen(thing: str) -> None:
        if trail.setdefault(thing, [])[-1:] != [place(thing)]:
            trail[thing].append(place(thing))

    for fact in facts:
        parsed = _parse(fact)
        if parsed is None:
            return None
        kind, who, what = parsed
        if kind in ("move", "back"):
            if where.get(who) == what or (kind == "back" and what not in been.get(who, ())):
                return None
            where[who] = what
            been.setdefault(who, set()).add(what)
            for thing in [t for t, carrier in holder.items() if carrier == who]:
                seen(thing)
        elif kind == "get":
            if who not in where or what in holder or lies.get(what, where[who]) != where[who]:
                return None
            holder[what] = who
            lies.pop(what, None)
            seen(what)
        else:
            if holder.get(what) != who:
                return None
            del holder[what]
            lies[what] = where[who]
    m = ASKED[task].fullmatch(question)
    if m is None:
        return None
    if task == "qa1":
        return where.get(m.group(1))
    if task == "qa2":
        return place(m.group(1))
    thing, later = m.groups()
    places = trail.get(thing, [])
    if places.count(later) != 1 or places.index(later) == 0:
        return None
    return places[places.index(later) - 1]
