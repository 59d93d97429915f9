"""Which documents a reader (one rank, or one loader worker of a rank) reads, and in what order, per epoch.

Pure index arithmetic over the manifest's shard list (each shard covers the contiguous document indices
[first_index, first_index + documents)), so a cursor can jump to any position without reading a byte of data.

Readers: R = world_size x num_workers; reader q = rank x num_workers + worker (train), or rank + world_size x
worker (eval, so that document i belongs to rank i % world_size as docs/design.md §2 asks).

Regimes:
- "shards": at least as many shards as readers. Each epoch the shard list is permuted from (seed, epoch) and
  reader q takes the shards at positions q, q + R, ... of that permutation: disjoint, complete, no shard read twice.
- "documents": fewer shards than readers (a small corpus). Reader q takes the documents with index % R == q from
  every shard. Every reader opens every shard, which is fine because this regime only happens for small corpora,
  and it avoids webdataset's "No samples found" for the ranks that would get no shard.

Shuffling with bounded memory: the reader's shards are grouped into blocks of `window` consecutive shards (in the
epoch's shard order) and the reader's documents inside one block are permuted from (seed, epoch, block). Only one
block is held in memory, so memory is bounded by `window` shards whatever the corpus size, and the order is a pure
function of (seed, epoch, position), which is what makes the cursor small and resumption exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardSpan:
    """The document indices one shard holds."""

    first_index: int
    documents: int


@dataclass(frozen=True)
class Block:
    """A group of shards read together; `count` = how many of its documents belong to this reader."""

    shard_ids: tuple[int, ...]
    count: int


def _count_below(x: int, q: int, readers: int) -> int:
    """How many i in [0, x) have i % readers == q."""
    return max(0, (x - q + readers - 1) // readers)


class ReaderPlan:
    """The per-epoch document order of one reader."""

    def __init__(self, spans: list[ShardSpan], reader: int, readers: int, *, shuffle: bool, seed: int,
                 window: int, regime: str | None = None):
        if not 0 <= reader < readers:
            raise ValueError(f"reader {reader} is outside 0..{readers - 1}")
        if window < 1:
            raise ValueError(f"shuffle window must be >= 1 shard, got {window}")
        self.spans = spans
        self.reader = reader
        self.readers = readers
        self.shuffle = shuffle
        self.seed = seed
        self.window = window
        self.regime = regime or ("shards" if len(spans) >= readers else "documents")
        self._blocks_cache: dict[int, tuple[list[Block], np.ndarray]] = {}

    def reseed(self, seed: int) -> None:
        self.seed = seed
        self._blocks_cache = {}

    # -- which shards, in which order ------------------------------------------------------------------------
    def shard_order(self, epoch: int) -> np.ndarray:
        """All shard ids in this epoch's order (the same permutation for every reader)."""
        order = np.arange(len(self.spans))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        return order

    def my_shards(self, epoch: int) -> np.ndarray:
        order = self.shard_order(epoch)
        return order[self.reader::self.readers] if self.regime == "shards" else order

    def docs_in_shard(self, shard_id: int) -> np.ndarray:
        """This reader's document indices in one shard, in corpus order."""
        span = self.spans[shard_id]
        if self.regime == "shards":
            return np.arange(span.first_index, span.first_index + span.documents, dtype=np.int64)
        start = span.first_index + (self.reader - span.first_index) % self.readers
        return np.arange(start, span.first_index + span.documents, self.readers, dtype=np.int64)

    def count_in_shard(self, shard_id: int) -> int:
        span = self.spans[shard_id]
        if self.regime == "shards":
            return span.documents
        end = span.first_index + span.documents
        return _count_below(end, self.reader, self.readers) - _count_below(span.first_index, self.reader, self.readers)

    # -- blocks and positions -------------------------------------------------------------------------------
    def blocks(self, epoch: int) -> tuple[list[Block], np.ndarray]:
        """This epoch's blocks and the cumulative document count before each block (length len(blocks) + 1)."""
        if epoch in self._blocks_cache:
            return self._blocks_cache[epoch]
        mine = [int(s) for s in self.my_shards(epoch)]
        blocks = []
        for start in range(0, len(mine), self.window):
            ids = tuple(mine[start:start + self.window])
            blocks.append(Block(ids, sum(self.count_in_shard(s) for s in ids)))
        starts = np.zeros(len(blocks) + 1, dtype=np.int64)
        np.cumsum([b.count for b in blocks], out=starts[1:])
        if len(self._blocks_cache) >= 3:  # readers straddle at most two epochs at a time
            del self._blocks_cache[min(self._blocks_cache)]
        self._blocks_cache[epoch] = (blocks, starts)
        return blocks, starts

    def epoch_documents(self, epoch: int) -> int:
        """How many documents this reader reads in one epoch (the same for every epoch)."""
        return int(self.blocks(epoch)[1][-1])

    def locate(self, epoch: int, position: int) -> tuple[int, int]:
        """(block index, offset inside the block) of the position-th document of the epoch."""
        _, starts = self.blocks(epoch)
        block = int(np.searchsorted(starts, position, side="right")) - 1
        return block, position - int(starts[block])

    def block_order(self, epoch: int, block_index: int) -> np.ndarray:
        """The document indices of one block, in this epoch's reading order."""
        blocks, _ = self.blocks(epoch)
        block = blocks[block_index]
        docs = [self.docs_in_shard(s) for s in block.shard_ids]
        order = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 1 + block_index]).permutation(order)
        return order
