"""The long-context experiment's own baseline (bench/reproduce/longctx.py): the most a reader scores that knows only
where the question sits (the prompt's length), which a model without memory reads in its last segment. Samples of
exactly S x N bytes gave the answer's length away there; the generator now sizes every prompt for the longest
answer. Seconds: generated samples, no training."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"


def as_samples(texts: list[str]) -> list[tuple[np.ndarray, int]]:
    return [(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), len(t.rpartition(">")[2])) for t in texts]


def test_the_question_sits_in_one_place_whatever_the_answer():
    from memlm.bench.reproduce.longctx import question_place_known
    from memlm.data_pipeline.tasks import generate, resolve_options

    options = resolve_options("qa1", {"length": 256, "facts": 2, "background": str(WIKITEXT2), "docs": "1,1,300"})
    texts = [s.text for s in generate("qa1", "test", options)]
    answers = [t.rpartition(">")[2] for t in texts]
    assert {len(a) for a in answers} == {4, 6, 7, 8}  # every length of place comes up...
    assert {len(t.rpartition(">")[0]) for t in texts} == {256 - 1 - 8}  # ...behind a prompt of one length
    most_frequent = Counter(answers).most_common(1)[0][1] / len(texts)
    assert abs(question_place_known(as_samples(texts)) - most_frequent) < 1e-12
    assert most_frequent < 0.25  # 8 places: about 12.5%


def test_exact_sample_lengths_would_give_the_answer_away():
    """The rule, on samples laid out as before the fix (each exactly 256 bytes): where the question ends tells the
    answer's length, and the best answer for each place scores more than a guess among the places that long."""
    from memlm.bench.reproduce.longctx import question_place_known

    rng = np.random.default_rng(0)
    places = ("bathroom", "hallway", "garden", "office", "kitchen", "bedroom", "cellar", "park")
    answers = [places[i] for i in rng.integers(len(places), size=400)]
    texts = ["x" * (256 - 1 - len(a)) + ">" + a for a in answers]
    by_length = Counter(len(a) for a in answers)
    best = sum(max(n for a, n in Counter(answers).items() if len(a) == k) for k in by_length) / len(answers)
    assert abs(question_place_known(as_samples(texts)) - best) < 1e-12
    assert best > 0.4  # lengths 4, 6, 7 and 8 among 8 places: park alone is 4 letters
