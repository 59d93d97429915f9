"""A long-context sample laid out to the byte: the facts at depths inside the asked window, background text filling
every gap exactly, so a story part is exactly the bytes it is asked for (longctx.sample_text sizes the prompt).

Measure. The story part of a prompt is items joined by single spaces: background pieces and facts. Each item owns
the space after it (the last one the space of " Q: "). The background's bytes are its pieces with their spaces, G
in all; a fact's depth is the background bytes before it over G. The facts go at byte positions drawn in
[depth_min * G, depth_max * G], in story order; several may share a position (then only their spaces part them).

Background pieces are words of the background text, taken in order from a random sentence on: whole sentences
while they fit, then words, and the last few bytes of a piece from words a little further on whose lengths add up
exactly (a skipped word or two; failing that, one word of the missing length further on; failing that, as for a
1-byte piece of the passkey's filler, which has no one-letter word, a word's first letters). A background item is
never 1 byte (a word needs a byte and its space): a fact 1 byte from the one before it joins it, and no fact goes
1 byte from either end. A window that holds no usable position (narrower than a byte or so) takes the nearest one.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice

import numpy as np

LOOKAHEAD = 64  # words searched for an exact top-up
FAR = 2048  # words searched for one word of the missing length, when no top-up is near


class Words:
    """The background text as a stream of words, from one sentence on, round the end to the start."""

    def __init__(self, sentences, start: int):
        self.sentences, self.next_sentence = sentences, start
        self.queue: deque[str] = deque()  # the words of a sentence begun, then of sentences looked ahead at

    def next_piece(self, room: int) -> str | None:
        """The next word, or the next whole sentence when no word is pending and it fits; None if neither fits
        in `room` bytes."""
        if not self.queue:
            sentence = self.sentences[self.next_sentence % len(self.sentences)]
            self.next_sentence += 1
            if len(sentence) <= room:
                return sentence
            self.queue.extend(sentence.split(" "))
        return self.queue.popleft() if len(self.queue[0]) <= room else None

    def peek(self, count: int) -> list[str]:
        while len(self.queue) < count:
            self.queue.extend(self.sentences[self.next_sentence % len(self.sentences)].split(" "))
            self.next_sentence += 1
        return list(islice(self.queue, count))  # not queue[i] for each i: a deque indexes its middle in O(n)

    def take(self, count: int) -> list[str]:
        self.peek(count)
        return [self.queue.popleft() for _ in range(count)]


def _exact_top_up(words: list[str], target: int) -> list[int] | None:
    """Indices (increasing) of words whose lengths plus one space each add up to `target`; None if none do.

    Each word in turn extends every total reached with the words before it (each word used once); a total keeps
    the choice that reached it first, so the answer is the one of the earliest word that completes `target`, made
    of the earliest choices. The totals reached are the bits of an int: one shift and mask per word, and only a
    total new at word i is recorded (by the word and the total it came from, to walk the choice back).
    """
    reached, limit = 1, (1 << (target + 1)) - 1  # bit t: total t reached (0: no words)
    came_by: dict[int, tuple[int, int]] = {}  # total -> (word index, the total before that word)
    for i, word in enumerate(words):
        cost = len(word) + 1
        new = (reached << cost) & limit & ~reached
        if not new:
            continue
        reached |= new
        while new:
            total = new.bit_length() - 1
            new ^= 1 << total
            came_by[total] = (i, total - cost)
        if reached >> target & 1:
            chosen, total = [], target
            while total:
                i, total = came_by[total]
                chosen.append(i)
            return chosen[::-1]
    return None


def fill(words: Words, size: int) -> str:
    """Exactly `size` (>= 1) bytes of background words joined by spaces."""
    parts: list[str] = []
    used = 0  # bytes of " ".join(parts)
    while (piece := words.next_piece(size - used - bool(parts))) is not None:
        used += len(piece) + bool(parts)
        parts.append(piece)
    for _ in range(4):  # top up the last bytes exactly; if no words fit, give back the last word and try again
        missing = size - used
        if missing == 0:
            return " ".join(parts)
        ahead = words.peek(LOOKAHEAD)
        chosen = _exact_top_up(ahead, missing + (0 if parts else 1))  # the first word of an empty piece: no space
        if chosen is not None:
            taken = words.take(chosen[-1] + 1)
            parts += [taken[i] for i in chosen]
            return " ".join(parts)
        if not parts:
            break
        last = parts.pop()
        if " " in last:  # a whole sentence: give back its last word only
            parts.append(last.rpartition(" ")[0])
        used = len(" ".join(parts))
    # No words of the right lengths near: one word of the missing length further on, else (a text without such
    # words, as the passkey's filler has no one-letter word for a 1-byte piece) the start of a word.
    text = " ".join(parts)
    while text and len(text) + 1 >= size:  # keep a byte for the word after the space
        text = text.rpartition(" ")[0]
    missing = size - len(text) - bool(text)
    ahead = words.peek(FAR)
    lengths = list(map(len, ahead))
    index = lengths.index(missing) if missing in lengths else None
    word = words.take(index + 1)[-1] if index is not None else "".join(ahead)[:missing]
    return (text + " " if text else "") + word


def positions(rng: np.random.Generator, background: int, count: int, depth_min: float, depth_max: float) -> list[int]:
    """`count` byte positions in the background (sorted) for the facts, inside the depth window."""
    def usable(p: int) -> bool:  # pieces of 0 or >= 2 bytes on each side
        return p in (0, background) or 2 <= p <= background - 2

    low = math.ceil(depth_min * background - 1e-9)
    high = math.floor(depth_max * background + 1e-9)
    inside = [p for p in (low, low + 1, high - 1, high) if low <= p <= high and usable(p)]
    if not inside:
        middle = (depth_min + depth_max) / 2 * background
        near = {math.floor(middle), math.ceil(middle), 0, 2, background - 2, background}  # past 1 and G - 1
        nearest = min((p for p in near if 0 <= p <= background and usable(p)), key=lambda p: (abs(p - middle), p))
        return [nearest] * count
    drawn = []
    while len(drawn) < count:  # uniform over the window's usable positions (only 1 and G - 1 are not)
        p = int(rng.integers(low, high + 1))
        if usable(p):
            drawn.append(p)
    drawn.sort()
    for i in range(1, count):  # a 1-byte piece between two facts cannot be: put the later fact with the earlier
        if drawn[i] - drawn[i - 1] == 1:
            drawn[i] = drawn[i - 1]
    return drawn


def lay_out(rng: np.random.Generator, facts: list[str], words: Words, background: int, depth_min: float,
            depth_max: float) -> str:
    """The story part of a prompt: the facts in order at their depths, `background` bytes of background around
    them (every piece with its space); its length is background + the facts' bytes with their spaces, minus 1."""
    at = positions(rng, background, len(facts), depth_min, depth_max)
    items, done = [], 0
    for fact, position in zip(facts, at):
        if position > done:
            items.append(fill(words, position - done - 1))
        items.append(fact)
        done = position
    if background > done:
        items.append(fill(words, background - done - 1))
    return " ".join(items)
