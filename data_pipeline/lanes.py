"""Document lanes: each batch row reads whole documents one after another, cut into segments of N targets.

Token accounting (format.py): a document of T tokens gives T predictions; its inputs are [boundary] + doc[:-1]
and its targets are doc (or, for a Doc with start 1, inputs doc[:-1] and targets doc[1:]: T - 1 predictions). A segment
never holds two documents: a document's last segment is padded (input = boundary id, target = -100) and reset is true
on its first segment. (Continuous lanes: continuous.py.)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .doc_order import ReaderPlan
from .format import DataError
from .shard_source import Doc, ShardSource

IGNORE = -100  # the loss's ignore index


class DocQueue:
    """A reader's documents in plan order, one block of shards in memory at a time; endless for training."""

    def __init__(self, plan: ReaderPlan, source: ShardSource, endless: bool):
        self.plan = plan
        self.source = source
        self.endless = endless
        self.epoch = 0
        self.position = 0  # documents of this epoch's order already handed to lanes (skipped ones included)
        self._block_key: tuple[int, int] | None = None
        self._order = np.zeros(0, dtype=np.int64)
        self._docs: dict[int, Doc] = {}

    def _load_block(self, epoch: int, block: int) -> None:
        self._docs = {}  # drop the previous block first: memory stays at one block
        for shard_id in self.plan.blocks(epoch)[0][block].shard_ids:
            docs = self.source.load(shard_id)
            if docs is None:
                continue
            if self.plan.regime == "documents":  # keep only this reader's share of the shard
                docs = {int(i): docs[int(i)] for i in self.plan.docs_in_shard(shard_id)}
            self._docs.update(docs)
        self._order = self.plan.block_order(epoch, block)
        self._block_key = (epoch, block)

    def next(self) -> Doc | None:
        """The next non-empty readable document; None at the end of an evaluation pass."""
        passed = 0  # guards against an endless loop over a share with nothing readable
        while True:
            total = self.plan.epoch_documents(self.epoch)
            if self.position >= total:
                if not self.endless:
                    return None
                if passed > total or total == 0:
                    raise DataError(f"reader {self.plan.reader} of {self.plan.readers} has no readable non-empty "
                                    f"document in split {self.source.split!r} of {self.source.data_dir}")
                self.epoch += 1
                self.position = 0
                continue
            block, offset = self.plan.locate(self.epoch, self.position)
            if self._block_key != (self.epoch, block):
                self._load_block(self.epoch, block)
            self.position += 1
            passed += 1
            doc = self._docs.get(int(self._order[offset]))
            if doc is not None and doc.length > doc.start:
                return doc

    def forget_block(self) -> None:
        self._block_key, self._docs = None, {}
        self._order = np.zeros(0, dtype=np.int64)

    def fetch(self, indices: list[int]) -> dict[int, Doc]:
        """Documents by index (restoring lanes from a cursor): from the loaded block, else from their shards."""
        found = {i: self._docs[i] for i in indices if i in self._docs}
        by_shard: dict[int, list[int]] = {}
        for i in indices:
            if i not in found:
                by_shard.setdefault(self.source.shard_of(i), []).append(i)
        for shard_id, wanted in by_shard.items():
            docs = self.source.load(shard_id) or {}
            found.update({i: docs[i] for i in wanted if i in docs})
        return found


@dataclass
class Lane:
    doc: Doc | None = None  # the document being read; None when the lane needs the next one
    offset: int = 0  # tokens of `doc` already emitted as targets

    def state(self) -> dict:
        return {"doc": None if self.doc is None else self.doc.index, "offset": self.offset}


def fill_row(lane: Lane, inputs: np.ndarray, targets: np.ndarray, next_doc: Callable[[], Doc | None],
             boundary: int) -> tuple[bool, bool]:
    """Write one lane's next segment into inputs/targets (pre-filled with padding); return (reset, active).

    `next_doc` returns the reader's next non-empty document, or None when there is none (evaluation's end).
    """
    reset = False
    if lane.doc is None:
        doc = next_doc()
        if doc is None:
            return False, False
        lane.doc, lane.offset, reset = doc, doc.start, True  # start 1: token 0 is the first input (Doc)
    doc, off = lane.doc, lane.offset
    tokens = doc.tokens
    n = min(len(targets), doc.length - off)
    inputs[0] = boundary if off == 0 else tokens[off - 1]
    inputs[1:n] = tokens[off:off + n - 1]
    targets[:n] = tokens[off:off + n]
    if doc.mask is not None:  # algorithmic tasks: only the answer tokens are scored
        targets[:n][doc.mask[off:off + n] == 0] = IGNORE
    lane.offset = off + n
    if lane.offset == doc.length:
        lane.doc, lane.offset = None, 0
    return reset, True


def eval_steps(lengths: np.ndarray, lanes: int, seg_len: int) -> int:
    """How many batches one reader's lanes need for its documents (in reading order), as fill_row schedules them.

    A document of T tokens holds its lane for ceil(T / N) segments; in every step the free lanes take the next
    documents in row order, so the lane with the smallest (busy-until step, row) takes the next document.
    """
    heap = [(0, row) for row in range(lanes)]  # (first free step, row)
    for length in lengths:
        if length <= 0:  # empty or skipped: never handed to a lane
            continue
        free, row = heapq.heappop(heap)
        heapq.heappush(heap, (free - (-int(length) // seg_len), row))
    return max(free for free, _ in heap)
