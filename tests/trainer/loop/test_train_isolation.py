"""Memory never crosses a document boundary during training. Two corpora differ only in the content of the
document that precedes another in the same lane (same length, so the segment layout is identical). With one
lane, one rank, data shuffling off and a learning rate so small that the weights barely move, the trainer's
per-step losses on the later document's segments must be identical across the two corpora (any memory carried
over from the differing document would change them), while the steps on the differing document do differ
(the corpora really are different). Verified to fail with batch.reset ignored where the recurrence reads a batch
(trainer/loop/recurrence.py, `_read`).
"""

from __future__ import annotations

import os
import random

import pytest

from support.training import train_in_process

os.environ.setdefault("DEEPSPEED_TIMEOUT", "1")
SEG = 8


def make_corpus(root, first_seed: int):
    from memlm.data_pipeline.prepare import prepare

    rng = random.Random(first_seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    docs = {"0.txt": "".join(rng.choice(letters) for _ in range(37)),  # differs between corpora, same length
            "1.txt": "the cat sat on the mat and the dog ran far away with a ball"}
    for split in ("train", "valid", "test"):
        (root / "corpus" / split).mkdir(parents=True)
        for name, text in docs.items():
            (root / "corpus" / split / name).write_text(text)
    prepare("textdir", root / "corpus", root / "data", tokenizer="bytes", workers=1, progress=False)
    return root / "data"


def layout(data):
    """(tokens, reset) per training segment of the single lane, in the order the trainer reads them."""
    from memlm.data_pipeline.stream import LaneStream

    stream = LaneStream(data, "train", rank=0, world_size=1, lanes=1, seg_len=SEG, mode="train", shuffle=False)
    out = []
    for _ in range(24):
        b = next(stream)
        out.append((b.tokens[0].tolist(), bool(b.reset[0])))
    return out


@pytest.mark.parametrize("arch", ["txl", "lamemo"])
def test_memory_does_not_cross_documents(arch, tmp_path):
    a, b = make_corpus(tmp_path / "a", 1), make_corpus(tmp_path / "b", 2)
    la, lb = layout(a), layout(b)
    starts = [i for i, (_, reset) in enumerate(la) if reset]
    assert starts == [i for i, (_, reset) in enumerate(lb) if reset] and starts[0] == 0 and len(starts) >= 3
    first_doc, second_doc = range(0, starts[1]), range(starts[1], starts[2])
    assert all(la[i][0] != lb[i][0] for i in first_doc)  # the preceding documents differ ...
    assert all(la[i][0] == lb[i][0] for i in second_doc)  # ... the following ones do not
    assert len(second_doc) >= 2

    steps = starts[2]
    common = dict(data__batch_size=1, data__shuffle="false", train__steps=steps, train__lr="1e-12",
                  train__warmup_steps=0, train__schedule="constant", train__save_every=0, model__dropout=0.0)
    ra = {r["step"]: r["loss"] for r in train_in_process(arch, a, tmp_path / "run_a", **common)}
    rb = {r["step"]: r["loss"] for r in train_in_process(arch, b, tmp_path / "run_b", **common)}
    for i in first_doc:
        assert abs(ra[i + 1] - rb[i + 1]) > 1e-3, (i, ra, rb)
    for i in second_doc:  # step i+1 trains segment i; its first segment is where a leak would show
        assert ra[i + 1] == pytest.approx(rb[i + 1], rel=1e-6, abs=1e-6), (i, ra, rb)
