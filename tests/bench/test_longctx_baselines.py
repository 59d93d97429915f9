"""The long-context experiment's own baseline (bench/reproduce/longctx.py): what a reader scores that knows only the
answer's length, which a sample of exactly S x N bytes gives away by where its question sits. Seconds: generated
samples, no training."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"
PLACES = ("bathroom", "hallway", "garden", "office", "kitchen", "bedroom", "cellar", "park")  # bAbI's, as generated


def test_answer_length_known_is_one_over_the_places_that_long():
    from bench.reproduce.longctx import length_known
    from memlm.data_pipeline import longctx
    from memlm.data_pipeline.tasks import generate, resolve_options

    options = resolve_options("qa1", {"length": 256, "facts": 2, "background": str(WIKITEXT2), "docs": "1,1,300"})
    texts = [s.text for s in generate("qa1", "test", options)]
    # The question ends at the same byte whatever the story: only the answer's length moves it.
    assert {len(t) for t in texts} == {256}
    samples = [(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), len(t.rpartition(">")[2])) for t in texts]
    expected = np.mean([1 / sum(len(p) == len(t.rpartition(">")[2]) for p in PLACES) for t in texts])
    assert abs(length_known(samples, longctx.LOCATIONS) - expected) < 1e-12
    assert 0.4 < expected < 0.65  # 4 lengths among 8 places: 50% for uniform answers
