"""Continuous lanes (the papers' setting): a split is one concatenated token stream cut into contiguous pieces.

Each epoch the split's documents are concatenated in the epoch's order (corpus order, or with shuffle the same
block-wise permutation doc_order.py gives a single reader) into a stream of T targets. The stream is cut into
P = readers x B pieces of nearly equal length, piece k = [k*T // P, (k+1)*T // P); lane b of reader q reads
piece q*B + b. This is Transformer-XL's batchify, so a one-document split (enwik8, text8) still fills every lane
of every rank, and evaluation's summed targets equal the manifest's tokens for any world size and B.

Inside a piece the stream runs on across documents: no reset and no padding; the input before a document's first
token is the previous document's last token (the boundary id at the start of a piece that starts a document,
else the token before the piece). A piece starts with reset true (the lane's memory would otherwise come from
another part of the stream) and its last segment is padded: in evaluation that is once per lane; in training
the lane takes its piece of the next epoch in the next segment.

Reading: the lanes read different parts of the stream at once, so shards are cached by id and evicted as soon as
no lane is inside a block that needs them: memory is at most B x window shards, shared where lanes overlap
(for a one-document corpus, one copy). Piece boundaries need every document's length up front: the stream takes
them from ShardSource.lengths() (one pass over the tar headers, which also verifies every shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .doc_order import ReaderPlan
from .format import DataError
from .lanes import IGNORE
from .shard_source import Doc, ShardSource


@dataclass
class PieceLane:
    epoch: int = 0  # whose epoch's piece the lane is reading
    token: int = -1  # next target position in that epoch's stream; -1 before the lane starts
    prev: int = 0  # the input preceding that target
    started: bool = False
    # Not state, a cache: the document under `token` and its [start, end) in the stream, so that looking a
    # document up (a search over the epoch's offsets) happens once per document, not once per segment.
    doc: Doc | None = field(default=None, repr=False)
    doc_start: int = 0
    doc_end: int = 0
    block: tuple[int, int] = (-1, -1)  # (epoch, block) of `doc`: the shards the lane may need next

    def state(self) -> dict:
        return {"epoch": self.epoch, "token": self.token, "prev": self.prev, "started": self.started}


class ContinuousLanes:
    """The pieces of one reader's B lanes, filled segment by segment."""

    def __init__(self, source: ShardSource, lengths: np.ndarray, reader: int, readers: int, lanes: int,
                 *, shuffle: bool, seed: int, window: int, endless: bool, boundary: int):
        self.source = source
        self.lengths = np.maximum(lengths, 0)  # documents of skipped shards take no room in the stream
        self.plan = ReaderPlan(source.spans, 0, 1, shuffle=shuffle, seed=seed, window=window, regime="shards")
        self.first_piece = reader * lanes
        self.pieces = readers * lanes
        self.endless = endless
        self.boundary = boundary
        self.lanes = [PieceLane(prev=boundary) for _ in range(lanes)]
        self.total = int(self.lengths.sum())
        if self.total == 0:
            raise DataError(f"split {source.split!r} of {source.data_dir} has no readable tokens")
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._shards: dict[int, dict[int, Doc]] = {}
        self._moved = False  # a lane looked up a document since the last evict()

    # -- the epoch's stream --------------------------------------------------------------------------------
    def epoch_stream(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token offsets: len(order) + 1) of the epoch's concatenated stream."""
        if epoch not in self._epochs:
            blocks, _ = self.plan.blocks(epoch)
            order = np.concatenate([self.plan.block_order(epoch, b) for b in range(len(blocks))])
            starts = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(self.lengths[order], out=starts[1:])
            if len(self._epochs) >= 3:  # lanes straddle at most two epochs at a time
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = (order, starts)
        return self._epochs[epoch]

    def piece(self, row: int) -> tuple[int, int]:
        """[start, end) of the row's piece in every epoch's stream (the stream length is the same every epoch)."""
        k = self.first_piece + row
        return k * self.total // self.pieces, (k + 1) * self.total // self.pieces

    def steps_needed(self, seg_len: int) -> int:
        """Segments the longest piece needs: every reader's evaluation length."""
        longest = max((k + 1) * self.total // self.pieces - k * self.total // self.pieces for k in range(self.pieces))
        return -(-longest // seg_len)

    # -- reading ------------------------------------------------------------------------------------------
    def _look_up(self, lane: PieceLane, epoch: int, token: int) -> None:
        """Point the lane's document cache at a target position; note when the lane enters another block."""
        lane.doc, lane.doc_start, lane.doc_end, block = self._doc_at(epoch, token)
        if block != lane.block:
            lane.block = block
            self._moved = True

    def _doc_at(self, epoch: int, token: int) -> tuple[Doc, int, int, tuple[int, int]]:
        """(document, its start, its end, its (epoch, block)) for a target position of the epoch's stream."""
        order, starts = self.epoch_stream(epoch)
        pos = int(np.searchsorted(starts, token, side="right")) - 1
        index = int(order[pos])
        shard_id = self.source.shard_of(index)
        if shard_id not in self._shards:
            docs = self.source.load(shard_id)
            if docs is None:
                raise DataError(f"shard {self.source.path(shard_id)} became unreadable after its documents were "
                                "counted; re-run `memlm prepare`")
            self._shards[shard_id] = docs
        block = (epoch, self.plan.locate(epoch, pos)[0])
        return self._shards[shard_id][index], int(starts[pos]), int(starts[pos + 1]), block

    def _start(self, lane: PieceLane, row: int, epoch: int) -> None:
        start, end = self.piece(row)
        lane.epoch, lane.token, lane.prev, lane.doc = epoch, start, self.boundary, None
        if start < end:
            self._look_up(lane, epoch, start)
            if start > lane.doc_start:  # the piece starts inside a document: its input is the token before the piece
                lane.prev = int(lane.doc.tokens[start - lane.doc_start - 1])

    def fill_row(self, row: int, inputs: np.ndarray, targets: np.ndarray) -> tuple[bool, bool]:
        """Write lane `row`'s next segment into inputs/targets (pre-filled with padding); return (reset, active)."""
        lane = self.lanes[row]
        end = self.piece(row)[1]
        reset = False
        if lane.token < 0 or (lane.token >= end and self.endless):
            self._start(lane, row, lane.epoch + 1 if lane.started else 0)
            reset = True
        lane.started = True
        pos, n_seg = 0, len(targets)
        while pos < n_seg and lane.token < end:
            if lane.doc is None or lane.token >= lane.doc_end:
                self._look_up(lane, lane.epoch, lane.token)
            doc, offset = lane.doc, lane.token - lane.doc_start
            n = min(n_seg - pos, lane.doc_end - lane.token, end - lane.token)
            tokens = doc.tokens
            inputs[pos] = lane.prev
            inputs[pos + 1:pos + n] = tokens[offset:offset + n - 1]
            targets[pos:pos + n] = tokens[offset:offset + n]
            if doc.mask is not None:
                targets[pos:pos + n][doc.mask[offset:offset + n] == 0] = IGNORE
            lane.prev = int(tokens[offset + n - 1])
            lane.token += n
            pos += n
        return reset and pos > 0, pos > 0

    def evict(self) -> None:
        """Drop the shards of blocks no lane is in any more (bounded memory); a lane reloads what it needs."""
        if not self._moved:  # no lane entered another block since the last call
            return
        self._moved = False
        needed: set[int] = set()
        for lane in self.lanes:
            if lane.block[0] >= 0:
                needed.update(self.plan.blocks(lane.block[0])[0][lane.block[1]].shard_ids)
        for shard_id in [s for s in self._shards if s not in needed]:
            del self._shards[shard_id]

    def load_lanes(self, states: list[dict]) -> None:
        self.lanes = [PieceLane(int(s["epoch"]), int(s["token"]), int(s["prev"]), bool(s["started"]))
                      for s in states]  # documents are looked up again on the first segment
        self._shards = {}
