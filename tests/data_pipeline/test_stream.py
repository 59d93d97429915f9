"""Lane streams over real tar shards: every document exactly once, clean lanes, disjoint shares, exact resume.

Fixtures write small synthetic corpora with data_pipeline.shards.write_split. Document i starts with the marker
token 1 + i and its other tokens are above every marker, so any document can be recognised in a lane's output.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from memlm.data_pipeline.config import DataConfig
from memlm.data_pipeline.format import FORMAT_VERSION, MANIFEST, DataError
from memlm.data_pipeline.lanes import IGNORE
from memlm.data_pipeline.shards import write_split
from memlm.data_pipeline.stream import LaneStream

VOCAB = 4096
BOUNDARY = 0
SEG = 8  # N: long documents below span up to 9 segments


def make_docs(n: int, seed: int) -> list[np.ndarray]:
    """Documents of varied lengths: 1-token ones, short ones, and ones longer than several segments."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = 1 if i % 7 == 0 else int(rng.integers(30, 70)) if i % 5 == 0 else int(rng.integers(2, 20))
        body = rng.integers(n + 1, VOCAB, size=length - 1)
        docs.append(np.concatenate([[1 + i], body]).astype(np.int64))
    return docs


def write_data(root: Path, splits: dict[str, tuple[list[np.ndarray], int]], masks=None) -> Path:
    """A prepared DATA_DIR: shards via write_split, a manifest following format.py, an empty tokenizer folder."""
    root.mkdir(parents=True, exist_ok=True)
    entries = {}
    for split, (docs, shard_tokens) in splits.items():
        split_masks = (masks or {}).get(split, [None] * len(docs))
        entries[split] = write_split(root, split, ((d, m, f"doc {i}") for i, (d, m) in
                                                   enumerate(zip(docs, split_masks))), VOCAB, shard_tokens)
    (root / "tokenizer").mkdir(exist_ok=True)
    manifest = {"format": FORMAT_VERSION, "corpus": {"kind": "synthetic", "input": ""},
                "tokenizer": {"kind": "word", "vocab_size": VOCAB, "sha256": "0" * 64, "boundary_id": BOUNDARY,
                              "path": "tokenizer"},
                "splits": entries}
    (root / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2))
    return root


TRAIN_DOCS = make_docs(240, seed=1)
VALID_DOCS = make_docs(150, seed=2)
SMALL_DOCS = make_docs(40, seed=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Many shards (more than any reader count used here)."""
    return write_data(tmp_path_factory.mktemp("many"), {"train": (TRAIN_DOCS, 150), "valid": (VALID_DOCS, 120)})


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """Two shards: fewer than the readers of a 3-rank or 2x2 run (the document-split regime)."""
    return write_data(tmp_path_factory.mktemp("small"), {"train": (SMALL_DOCS, 300), "valid": (SMALL_DOCS, 300)})


def manifest_of(data_dir: Path) -> dict:
    return json.loads((data_dir / MANIFEST).read_text())


def collect(stream, steps=None) -> list:
    return [b for _, b in zip(range(steps), stream)] if steps is not None else list(stream)


# -- decoding a lane's output back into documents ------------------------------------------------------------------

def lane_documents(batches, lane: int) -> list[list[int]]:
    """Document mode: rebuild the lane's documents, checking every segment on the way.

    A segment's scored targets are a prefix (one document per segment, padding after it), reset starts a
    document, a row without reset continues the open one, and inputs are [boundary] + targets shifted by one.
    """
    docs, current, prev = [], None, None
    for batch in batches:
        targets, inputs = batch.targets[lane].tolist(), batch.tokens[lane].tolist()
        if not batch.lane_active[lane]:
            assert all(t == IGNORE for t in targets) and not batch.reset[lane]
            continue
        n = sum(t != IGNORE for t in targets)
        assert n > 0 and all(t != IGNORE for t in targets[:n]), "scored targets must be a prefix of the segment"
        if batch.reset[lane]:
            if current is not None:
                docs.append(current)
            current, prev = [], BOUNDARY
        assert current is not None, "a lane continued a document it never started"
        assert inputs[:n] == [prev] + targets[:n - 1]
        current += targets[:n]
        prev = targets[n - 1]
        if n < len(targets):  # padded: the document ended here
            docs.append(current)
            current = None
    if current is not None:
        docs.append(current)
    return docs


def lane_pieces(batches, lane: int) -> list[tuple[int, list[int]]]:
    """Continuous mode: the lane's pieces as (input before the piece's first target, targets).

    Checks that a piece starts with reset, runs on without padding (only its last segment is padded) and that
    every input is the previous target, across segments and documents.
    """
    pieces, prev, open_piece = [], None, False
    for batch in batches:
        if not batch.lane_active[lane]:
            assert all(t == IGNORE for t in batch.targets[lane].tolist()) and not batch.reset[lane]
            continue
        targets, inputs = batch.targets[lane].tolist(), batch.tokens[lane].tolist()
        n = sum(t != IGNORE for t in targets)
        assert n > 0 and all(t != IGNORE for t in targets[:n])
        if batch.reset[lane]:
            assert not open_piece, "a piece was cut before its end"
            pieces.append((inputs[0], []))
        else:
            assert open_piece, "a segment continued a piece without the piece's reset or after its padding"
            assert inputs[0] == prev
        assert inputs[1:n] == targets[:n - 1]
        pieces[-1][1].extend(targets[:n])
        prev = targets[n - 1]
        open_piece = n == len(targets)  # padding closes the piece
    return pieces


def split_on_markers(tokens: list[int], n_docs: int) -> list[list[int]]:
    docs = []
    for t in tokens:
        if t <= n_docs:  # a document's first token
            docs.append([])
        docs[-1].append(t)
    return docs


def check_documents(found: list[list[int]], originals: list[np.ndarray]) -> list[int]:
    """Every original exactly once, unchanged; returns the indices in the order found."""
    indices = [doc[0] - 1 for doc in found]
    assert sorted(indices) == list(range(len(originals))), "each document streamed exactly once"
    for index, doc in zip(indices, found):
        assert doc == originals[index].tolist(), f"document {index} changed on its way through the lanes"
    return indices


# -- evaluation ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_streams_every_document_once(data, world, lanes):
    per_rank = [collect(LaneStream(data, "valid", rank=r, world_size=world, lanes=lanes, seg_len=SEG, mode="eval"))
                for r in range(world)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, f"ranks yield different batch counts {counts}: collectives would deadlock"
    # The count is tight: some rank still has data in the last batch.
    assert any(bool(batches[-1].lane_active.any()) for batches in per_rank)

    found = []
    for rank, batches in enumerate(per_rank):
        for b in batches:
            assert b.tokens.shape == b.targets.shape == (lanes, SEG) and b.tokens.dtype == torch.long
            assert b.reset.dtype == b.lane_active.dtype == torch.bool
        for lane in range(lanes):
            docs = lane_documents(batches, lane)
            assert all((doc[0] - 1) % world == rank for doc in docs), "document i belongs to rank i % world_size"
            found += docs
    check_documents(found, VALID_DOCS)
    scored = sum(int((b.targets != IGNORE).sum()) for batches in per_rank for b in batches)
    assert scored == manifest_of(data)["splits"]["valid"]["tokens"] == sum(len(d) for d in VALID_DOCS)


def check_pieces(per_rank: list[list], lanes: int, docs: list[np.ndarray]) -> None:
    """Continuous eval: rank r lane b reads piece r*B + b; the pieces in order are the whole stream, each once."""
    assert len({len(batches) for batches in per_rank}) == 1, "every rank yields the same number of batches"
    assert any(bool(batches[-1].lane_active.any()) for batches in per_rank), "the batch count is tight"
    stream = np.concatenate(docs).tolist()
    doc_starts = set(np.cumsum([0] + [len(d) for d in docs]).tolist())
    joined, sizes = [], []
    for batches in per_rank:
        for lane in range(lanes):
            pieces = lane_pieces(batches, lane)
            assert len(pieces) <= 1, "an evaluation lane reads one piece"
            for before, targets in pieces:
                # The input before a piece: the boundary where a document starts, else the stream's previous token.
                assert before == (BOUNDARY if len(joined) in doc_starts else stream[len(joined) - 1])
                joined += targets
            sizes.append(len(pieces[0][1]) if pieces else 0)
    assert joined == stream
    assert max(sizes) - min(sizes) <= 1, "pieces are equal up to one token"
    scored = sum(int((b.targets != IGNORE).sum()) for batches in per_rank for b in batches)
    assert scored == len(stream)


@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_continuous_cuts_the_split_into_pieces(data, world, lanes):
    per_rank = [collect(LaneStream(data, "valid", rank=r, world_size=world, lanes=lanes, seg_len=SEG, mode="eval",
                                   continuous=True)) for r in range(world)]
    assert sum(len(d) for d in VALID_DOCS) == manifest_of(data)["splits"]["valid"]["tokens"]
    check_pieces(per_rank, lanes, VALID_DOCS)


def test_continuous_fills_every_lane_from_one_document(tmp_path):
    """enwik8/text8: a split is one document; continuous lanes still spread it over every lane of every rank."""
    doc = np.random.default_rng(0).integers(1, VOCAB, size=1001)
    root = write_data(tmp_path / "one", {"valid": ([doc], 10_000), "train": ([doc], 10_000)})
    per_rank = [collect(LaneStream(root, "valid", rank=r, world_size=2, lanes=4, seg_len=SEG, mode="eval",
                                   continuous=True)) for r in range(2)]
    assert all(bool(batches[0].lane_active.all()) for batches in per_rank)
    check_pieces(per_rank, 4, [doc])
    train = LaneStream(root, "train", rank=1, world_size=2, lanes=4, seg_len=SEG, continuous=True)
    assert all(bool(b.lane_active.all()) for b in collect(train, 40))


def test_eval_lanes_take_documents_in_order(data):
    """One rank, 4 lanes: documents are handed out in corpus order to whichever lane is free first."""
    batches = collect(LaneStream(data, "valid", lanes=4, seg_len=SEG, mode="eval"))
    starts = [(step, lane, int(b.targets[lane, 0]) - 1) for step, b in enumerate(batches)
              for lane in range(4) if b.reset[lane]]
    assert [index for _, _, index in sorted(starts)] == list(range(len(VALID_DOCS)))


def test_eval_with_loader_workers_splits_each_rank(data):
    """Rank r's documents (i % world == r) are split again over its loader workers, with equal batch counts."""
    found, counts = [], set()
    for rank in range(2):
        for worker in range(2):
            batches = collect(LaneStream(data, "valid", rank=rank, world_size=2, worker=worker, num_workers=2,
                                         lanes=2, seg_len=SEG, mode="eval"))
            counts.add(len(batches))
            for lane in range(2):
                docs = lane_documents(batches, lane)
                assert all((d[0] - 1) % 2 == rank for d in docs)
                found += docs
    assert len(counts) == 1
    check_documents(found, VALID_DOCS)


# -- training ------------------------------------------------------------------------------------------------------

def test_train_lanes_follow_the_epoch_order_across_epochs(small):
    stream = LaneStream(small, "train", lanes=3, seg_len=SEG, seed=7)
    batches = collect(stream, 100)  # several epochs of the 40-document split
    assert stream.epoch >= 2
    assert all(bool(b.lane_active.all()) for b in batches)
    started = []
    for lane in range(3):
        docs = lane_documents(batches, lane)
        steps = [step for step, b in enumerate(batches) if b.reset[lane]]
        assert len(steps) == len(docs)
        for i, doc in enumerate(docs):
            original = SMALL_DOCS[doc[0] - 1].tolist()
            assert doc == (original if i < len(docs) - 1 else original[:len(doc)])  # the last may be unfinished
        started += [(step, lane, doc[0] - 1) for step, doc in zip(steps, docs)]
    # Lanes take documents in the reader's epoch order: by step, then by lane.
    order = [index for _, _, index in sorted(started)]
    expected = np.concatenate([stream.document_order(e) for e in range(stream.epoch + 1)]).tolist()
    assert order == expected[:len(order)]


@pytest.mark.parametrize("world,workers", [(2, 1), (3, 1), (2, 2), (4, 2)])
def test_train_shard_shares_are_disjoint_and_complete(data, world, workers):
    n_shards = len(manifest_of(data)["splits"]["train"]["shards"])
    assert n_shards >= world * workers
    for epoch in range(3):
        shards, docs = [], []
        for rank in range(world):
            for worker in range(workers):
                s = LaneStream(data, "train", rank=rank, world_size=world, worker=worker, num_workers=workers,
                               lanes=2, seg_len=SEG, seed=3)
                assert s.plan.regime == "shards"
                mine = s.shards_read(epoch)
                order = s.document_order(epoch)
                assert {s.source.path(s.source.shard_of(int(i))).relative_to(data).as_posix() for i in order} \
                    <= set(mine), "a reader only reads documents of its own shards"
                shards += mine
                docs += order.tolist()
        assert len(shards) == len(set(shards)) == n_shards
        assert sorted(docs) == list(range(len(TRAIN_DOCS)))


@pytest.mark.parametrize("world,workers", [(3, 1), (2, 2)])
def test_train_small_corpus_splits_documents(small, world, workers):
    """Fewer shards than readers: every reader gets documents (no 'No samples found'), disjoint and complete."""
    readers = world * workers
    assert len(manifest_of(small)["splits"]["train"]["shards"]) < readers
    for epoch in range(2):
        docs = []
        for rank in range(world):
            for worker in range(workers):
                s = LaneStream(small, "train", rank=rank, world_size=world, worker=worker, num_workers=workers,
                               lanes=2, seg_len=SEG, seed=5)
                assert s.plan.regime == "documents"
                order = s.document_order(epoch).tolist()
                assert order and all(i % readers == rank * workers + worker for i in order)
                docs += order
                if epoch == 0:
                    assert len(collect(s, 30)) == 30
        assert sorted(docs) == list(range(len(SMALL_DOCS)))


def test_train_reshuffles_every_epoch_from_the_seed(data):
    a = LaneStream(data, "train", lanes=2, seg_len=SEG, seed=11)
    b = LaneStream(data, "train", lanes=2, seg_len=SEG, seed=11)
    c = LaneStream(data, "train", lanes=2, seg_len=SEG, seed=12)
    assert not np.array_equal(a.document_order(0), a.document_order(1))
    assert a.shards_read(0) != a.shards_read(1)
    for epoch in range(3):
        assert np.array_equal(a.document_order(epoch), b.document_order(epoch))
    assert not np.array_equal(a.document_order(0), c.document_order(0))
    for x, y in zip(collect(a, 20), collect(b, 20)):
        assert all(torch.equal(u, v) for u, v in zip(x, y))
    plain = LaneStream(data, "train", lanes=2, seg_len=SEG, shuffle=False)
    assert plain.document_order(0).tolist() == plain.document_order(1).tolist() == list(range(len(TRAIN_DOCS)))


@pytest.mark.parametrize("shuffle", [False, True])
def test_train_continuous_pieces_follow_the_epochs(small, shuffle):
    """Each epoch the reader's lanes read their pieces of that epoch's stream; a reset only where a piece starts."""
    lanes, world, rank = 3, 2, 1
    stream = LaneStream(small, "train", rank=rank, world_size=world, lanes=lanes, seg_len=SEG, continuous=True,
                        seed=1, shuffle=shuffle)
    batches = collect(stream, 120)
    total = sum(len(d) for d in SMALL_DOCS)
    assert 120 * SEG > 2 * total / (world * lanes), "the run crosses at least two epochs"
    assert bool(batches[0].reset.all())
    for lane in range(lanes):
        pieces = lane_pieces(batches, lane)  # resets only at piece starts, no padding inside a piece
        k = rank * lanes + lane
        start, end = k * total // (world * lanes), (k + 1) * total // (world * lanes)
        for epoch, (before, targets) in enumerate(pieces[:-1]):
            epoch_stream = np.concatenate([SMALL_DOCS[i] for i in stream.document_order(epoch)]).tolist()
            assert targets == epoch_stream[start:end]
            assert before == (epoch_stream[start - 1] if targets[0] > len(SMALL_DOCS) else BOUNDARY)
        assert len(pieces) >= 3
    orders = [stream.document_order(e).tolist() for e in range(3)]
    assert (orders[0] != orders[1]) == shuffle
    assert len(stream.cont._shards) <= lanes * stream.shuffle_window, "shards no lane needs are evicted"


def test_from_config_uses_the_data_section(data):
    config = DataConfig(path=str(data), batch_size=3, eval_batch_size=5, seed=4, continuous=True)
    train = LaneStream.from_config(config, "train", mode="train", seg_len=SEG, rank=1, world_size=2)
    assert (train.lanes, train.seed, train.continuous, train.rank, train.num_workers) == (3, 4, True, 1, 1)
    assert LaneStream.from_config(config, "valid", mode="eval", seg_len=SEG).lanes == 5


def test_train_warns_when_lanes_outnumber_documents(small):
    with pytest.warns(RuntimeWarning, match="continuous=True"):
        LaneStream(small, "train", rank=0, world_size=3, lanes=16, seg_len=SEG)


def test_masked_targets_are_ignored(tmp_path):
    docs = make_docs(30, seed=4)
    masks = [(np.arange(len(d)) % 3 == 0).astype(np.uint8) for d in docs]
    root = write_data(tmp_path / "task", {"valid": (docs, 100)}, masks={"valid": masks})
    batches = collect(LaneStream(root, "valid", lanes=2, seg_len=SEG, mode="eval"))
    scored = sorted(int(t) for b in batches for t in b.targets[b.targets != IGNORE])
    assert scored == sorted(int(t) for d, m in zip(docs, masks) for t in d[m == 1])


# -- cursor ------------------------------------------------------------------------------------------------------

def same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(u, v) for x, y in zip(xs, ys) for u, v in zip(x, y))


@pytest.mark.parametrize("mode,continuous,split", [("train", False, "train"), ("train", True, "train"),
                                                   ("eval", False, "valid"), ("eval", True, "valid")])
def test_resume_gives_identical_next_batches(data, mode, continuous, split):
    kwargs = dict(rank=1, world_size=2, lanes=3, seg_len=SEG, mode=mode, continuous=continuous, seed=9,
                  shuffle_window=2)
    stream = LaneStream(data, split, **kwargs)
    reference, epochs = [], []
    for batch in stream:
        reference.append(batch)
        epochs.append(stream.epoch)
        if len(reference) == 400:
            break
    points = [0, 1, 13, 100, len(reference) - 60]
    if mode == "train":  # resume just before, at and after the first epoch change
        assert epochs[-1] >= 1
        change = epochs.index(1)
        points += [change - 1, change, change + 1]
    for k in sorted({k for k in points if 0 <= k < len(reference)}):
        first = LaneStream(data, split, **kwargs)
        collect(first, k)
        cursor = json.loads(json.dumps(first.state_dict()))  # it survives JSON (checkpoints store it so)
        resumed = LaneStream(data, split, **kwargs)
        resumed.load_state_dict(cursor)
        assert same(collect(resumed, 25), reference[k:k + 25])
        # Resume the resumed stream: save after 25 more, restore into a third stream.
        again = LaneStream(data, split, **kwargs)
        again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
        assert same(collect(again, 30), reference[k + 25:k + 55])


@pytest.mark.parametrize("change", [{"world_size": 3}, {"rank": 0}, {"lanes": 4}, {"seg_len": 16},
                                    {"continuous": True}])
def test_mismatched_cursor_is_refused(data, change):
    base = dict(rank=1, world_size=2, lanes=3, seg_len=SEG)
    source = LaneStream(data, "train", **base)
    collect(source, 3)
    other = LaneStream(data, "train", **{**base, **change})
    with pytest.raises(ValueError, match=next(iter(change))):
        other.load_state_dict(source.state_dict())


def test_cursor_adopts_its_seed(data):
    a = LaneStream(data, "train", lanes=2, seg_len=SEG, seed=1)
    collect(a, 10)
    cursor = a.state_dict()
    reference = collect(a, 10)
    b = LaneStream(data, "train", lanes=2, seg_len=SEG, seed=2)
    with pytest.warns(RuntimeWarning, match="seed"):
        b.load_state_dict(cursor)
    assert same(collect(b, 10), reference)


# -- damaged data --------------------------------------------------------------------------------------------------

@pytest.fixture
def damaged(data, tmp_path) -> tuple[Path, dict]:
    """A copy of the data with one train and one valid shard corrupted (a flipped byte in a token payload)."""
    root = tmp_path / "damaged"
    shutil.copytree(data, root)
    manifest = manifest_of(root)
    for split in ("train", "valid"):
        shard = manifest["splits"][split]["shards"][2]
        path = root / shard["path"]
        raw = bytearray(path.read_bytes())
        raw[1536 + 3] ^= 0xFF  # inside the first sample's payloads, well before the end-of-archive blocks
        path.write_bytes(bytes(raw))
    return root, manifest


def test_corrupt_shard_raises_naming_the_file(damaged):
    root, manifest = damaged
    name = manifest["splits"]["train"]["shards"][2]["path"]
    stream = LaneStream(root, "train", lanes=2, seg_len=SEG, shuffle=False)
    with pytest.raises(DataError, match=name):
        collect(stream, 2000)
    with pytest.raises(DataError, match=manifest["splits"]["valid"]["shards"][2]["path"]):
        LaneStream(root, "valid", lanes=2, seg_len=SEG, mode="eval")
    with pytest.raises(DataError, match=name):  # continuous lanes verify every shard up front
        LaneStream(root, "train", lanes=2, seg_len=SEG, continuous=True)


def test_missing_shard_raises_naming_the_file(data, tmp_path):
    root = tmp_path / "missing"
    shutil.copytree(data, root)
    name = manifest_of(root)["splits"]["valid"]["shards"][0]["path"]
    (root / name).unlink()
    with pytest.raises(DataError, match=name):
        LaneStream(root, "valid", lanes=2, seg_len=SEG, mode="eval")


@pytest.mark.parametrize("world", [1, 2])
def test_skip_corrupt_counts_what_it_skips(damaged, world):
    root, manifest = damaged
    bad = manifest["splits"]["valid"]["shards"][2]
    per_rank, skipped = [], 0
    for rank in range(world):
        with pytest.warns(RuntimeWarning, match=bad["path"]):
            stream = LaneStream(root, "valid", rank=rank, world_size=world, lanes=3, seg_len=SEG, mode="eval",
                                skip_corrupt=True)
        per_rank.append(collect(stream))
        skipped += stream.skipped_documents
    assert skipped == bad["documents"]
    assert len({len(b) for b in per_rank}) == 1
    scored = sum(int((b.targets != IGNORE).sum()) for batches in per_rank for b in batches)
    assert scored == manifest["splits"]["valid"]["tokens"] - bad["tokens"]
    found = [d for batches in per_rank for lane in range(3) for d in lane_documents(batches, lane)]
    lost = set(range(bad["first_index"], bad["first_index"] + bad["documents"]))
    assert sorted(d[0] - 1 for d in found) == sorted(set(range(len(VALID_DOCS))) - lost)


def test_skip_corrupt_continuous_leaves_the_shard_out_of_the_stream(damaged):
    root, manifest = damaged
    bad = manifest["splits"]["valid"]["shards"][2]
    per_rank = []
    for rank in range(2):
        with pytest.warns(RuntimeWarning, match=bad["path"]):
            stream = LaneStream(root, "valid", rank=rank, world_size=2, lanes=3, seg_len=SEG, mode="eval",
                                continuous=True, skip_corrupt=True)
        assert stream.skipped_documents == bad["documents"]  # the split's total: every rank cuts one stream
        per_rank.append(collect(stream))
    lost = range(bad["first_index"], bad["first_index"] + bad["documents"])
    check_pieces(per_rank, 3, [d for i, d in enumerate(VALID_DOCS) if i not in lost])


def test_skip_corrupt_in_training(damaged):
    root, manifest = damaged
    bad = manifest["splits"]["train"]["shards"][2]
    stream = LaneStream(root, "train", lanes=2, seg_len=SEG, skip_corrupt=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = collect(stream, 400)  # more than an epoch
    assert stream.epoch >= 1
    assert sum(bad["path"] in str(w.message) for w in caught) == 1, "warned once per shard"
    assert stream.skipped_documents == bad["documents"]
    lost = range(bad["first_index"], bad["first_index"] + bad["documents"])
    seen = {int(b.targets[lane, 0]) - 1 for b in batches for lane in range(2) if b.reset[lane]}
    assert not seen & set(lost)
    # The count survives a resume.
    resumed = LaneStream(root, "train", lanes=2, seg_len=SEG, skip_corrupt=True)
    resumed.load_state_dict(stream.state_dict())
    assert resumed.skipped_documents == bad["documents"]
