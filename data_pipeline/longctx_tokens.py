"""Task samples in a backbone tokenizer's tokens: `memlm prepare --corpus task --tokenizer-from FOLDER`.

The bytes tokenizer's tasks are unchanged (tasks.task_documents: the sample's bytes are its ids). With a backbone's
tokenizer (data_pipeline/hf_tokenizer.py) a sample is three encodings put end to end, as the RMT and BABILong
authors feed a Hugging Face model a sample: the prompt's ids, SEP's, the answer's; the loss mask covers the answer's.
Each is the tokenizer's own encode of that text (no special tokens added), so a sample's ids are exactly what the
tokenizer gives its prompt, SEP and answer.

Long-context tasks (qa1-3, passkey): `length` counts these tokens. As in bytes (data_pipeline/longctx.py), the
prompt's length is fixed, not the sample's, so where the question sits says nothing about the answer: every prompt
is `length` - SEP's tokens - the longest answer's tokens (qa: the longest place in tokens; passkey: the most tokens
of a key of ten probes of repeated digits, and at least `digits`), so a sample falls short of `length` by its answer's
shortfall from that longest. A prompt's tokens are not its bytes over a constant, so the sample's story is drawn as
in bytes (the same seed draws the same stories) and its prompt is laid out at a byte size whose encoding is the
asked tokens, found by a search over byte sizes; each try lays the prompt out again from the same rng state, so
the sample depends only on the seed and the options. Tokens grow with bytes but not evenly: each size lays every
background piece out anew, a few tokens either way (measured: +-5 around the trend on qa1 with a WikiText BPE), so
the search may not hit the count within MAX_TRIES sizes; then the size with the most tokens below it is taken and
the sample is that many tokens shorter (the length report's minimum shows it; measured with a byte-level BPE of 8k
trained on WikiText-2, qa1 at 300 tokens: 91% of prompts exact, the rest 1-4 tokens short, 14 encodes a sample;
passkey at 1500: 98% exact, 5 encodes). The story's own floor (its facts and question with 2 bytes of background)
is in tokens too, so a `length` too short for a story is refused as that story is drawn, naming its tokens.

The RMT tasks (copy, reverse, retrieval, quadratic) keep their options (`length` counts symbols or pairs) and are
encoded the same three-part way.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from . import longctx
from .format import DataError
from .longctx_world import LOCATIONS, Story
from .tasks import SEP, generate, split_rng

BYTES_PER_TOKEN = 4.0  # the first guess of a prompt's bytes per token (English BPE: about 4); refined per sample
MAX_TRIES = 32  # byte sizes laid out per sample before the search settles for the closest below
SCAN = 64  # bytes each side of a step's goal within which the nearest size not yet tried is laid out


class PromptSizer:
    """The token budget of a task's prompts and the search that lays a story's prompt out to it."""

    def __init__(self, task: str, o: dict, tokenizer):
        self.task, self.o, self.tokenizer = task, o, tokenizer
        self.sep = tokenizer.encode(SEP)
        if task == "passkey":  # every key is `digits` long; tokenizers cut numbers differently
            probes = [str(d) * o["digits"] for d in range(10)]
            self.longest = max(o["digits"], *(len(tokenizer.encode(key)) for key in probes))
        else:
            self.longest = max(len(tokenizer.encode(place)) for place in LOCATIONS)
        self.prompt_tokens = o["length"] - len(self.sep) - self.longest
        if self.prompt_tokens < 1:
            raise DataError(f"{task}: --task-length {o['length']} tokens leaves no prompt after SEP "
                            f"({len(self.sep)} tokens) and the longest answer ({self.longest}): give a longer length")
        self.bytes_per_token = BYTES_PER_TOKEN

    def prompt(self, split: str, rng: np.random.Generator, made: Story) -> tuple[str, np.ndarray]:
        """(prompt, its ids) of exactly prompt_tokens tokens where a byte size gives them, else the closest below;
        the rng is left where laying out that prompt left it."""
        start = rng.bit_generator.state
        tried: dict[int, tuple[int, str, np.ndarray, dict]] = {}  # bytes -> (tokens, prompt, ids, rng state after)

        def tokens(size: int) -> int:
            if size not in tried:
                rng.bit_generator.state = start
                text = longctx.prompt_of(self.task, split, rng, self.o, made, size)
                ids = self.tokenizer.encode(text)
                tried[size] = (len(ids), text, ids, rng.bit_generator.state)
            return tried[size][0]

        target = self.prompt_tokens
        smallest = longctx.story_bytes(made) + 2  # a sample never has less than 2 bytes of background
        if tokens(smallest) > target:
            what, fewer = (("its key", "digits") if self.task == "passkey"
                           else (f"{len(made.facts)} facts", "facts"))
            raise DataError(f"{self.task}: --task-length {self.o['length']} tokens is too short for {what} and the "
                            f"question ({tokens(smallest)} tokens of prompt with 2 bytes of background, {target} left "
                            f"after SEP and the longest answer): give a longer length or fewer {fewer} "
                            f"(--task-option {fewer}=N)")
        size = self._search(tokens, tried, smallest, target)
        _, text, ids, after = tried[size]
        rng.bit_generator.state = after
        return text, ids

    def _search(self, tokens, tried: dict, smallest: int, target: int) -> int:
        """The byte size to lay the prompt out at: one whose tokens are `target`, else the one with the most tokens
        below it among the sizes tried. A prompt's tokens grow with its bytes but not evenly (each size lays every
        background piece out anew: a few tokens either way), so each step moves by the tokens still missing at the
        background's bytes per token seen so far, onto the nearest size not tried yet."""
        size = smallest
        for _ in range(MAX_TRIES):
            count = tokens(size)
            if count == target:
                return size
            if count > tokens(smallest) and size > smallest:  # the background's bytes per token, this sample's
                self.bytes_per_token = (size - smallest) / (count - tokens(smallest))
            goal = max(size + (round((target - count) * self.bytes_per_token) or (1 if count < target else -1)),
                       smallest)
            size = min((s for s in range(goal - SCAN, goal + SCAN + 1) if s >= smallest and s not in tried),
                       key=lambda s: (abs(s - goal), s), default=None)
            if size is None:
                break
        return max((s for s in tried if tokens(s) <= target), key=lambda s: (tokens(s), -s))


def _answer_ids(tokenizer, answer: str, task: str) -> np.ndarray:
    ids = tokenizer.encode(answer)
    if len(ids) == 0:
        raise DataError(f"{task}: the tokenizer encodes the answer {answer!r} to no tokens, so nothing would be "
                        "scored: use a tokenizer that reads it")
    return ids


def token_samples(task: str, split: str, o: dict, tokenizer) -> Iterator[tuple[str, str, np.ndarray, np.ndarray,
                                                                                   np.ndarray]]:
    """(prompt, answer, prompt ids, SEP ids, answer ids) of the split's samples, from resolved options (a
    long-context task's resolved with in_tokens=True)."""
    if task in longctx.LONGCTX_TASKS:
        sizer = PromptSizer(task, o, tokenizer)
        rng = split_rng(task, o["seed"], split)
        for _ in range(o["docs"][split]):
            made = longctx.draw_story(task, rng, o)
            prompt, prompt_ids = sizer.prompt(split, rng, made)
            yield prompt, made.answer, prompt_ids, sizer.sep, _answer_ids(tokenizer, made.answer, task)
        return
    sep = tokenizer.encode(SEP)
    for sample in generate(task, split, o):
        yield (sample.prompt, sample.answer, tokenizer.encode(sample.prompt), sep,
               _answer_ids(tokenizer, sample.answer, task))


def token_documents(task: str, split: str, o: dict, tokenizer) -> Iterator[tuple[np.ndarray, np.ndarray, str]]:
    """(ids, loss mask on the answer's ids, title) per sample, as `shards.write_split` takes them."""
    for i, (_, _, prompt_ids, sep_ids, answer_ids) in enumerate(token_samples(task, split, o, tokenizer)):
        ids = np.concatenate([prompt_ids, sep_ids, answer_ids]).astype(np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[len(ids) - len(answer_ids):] = 1
        yield ids, mask, f"{task}-{split}-{i}"
