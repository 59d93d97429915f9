"""LaneStream: prepared shards -> batches of B lanes x N-token segments with per-lane document resets (docs/design.md
§2).

    stream = LaneStream(data_dir, "train", rank=r, world_size=w, lanes=B, seg_len=N, seed=s)
    for batch in stream:   # Batch(tokens [B,N] long, targets [B,N] long (-100 = ignore), reset [B], lane_active [B])
        ...
        checkpoint["data"] = stream.state_dict()      # small, JSON-serialisable
    stream.load_state_dict(checkpoint["data"])        # the same next batches, exactly

Document lanes (continuous=False, lanes.py): a lane reads whole documents one after another, a segment never
holds two documents, reset is true on a document's first segment and its last segment is padded.
  train: endless; the reader's documents (a disjoint share of the shards, see doc_order.py) are reshuffled every
  epoch from the seed, with one block of `shuffle_window` shards in memory; every lane's row is active.
  eval: document i goes to rank i % world_size and to the next free lane of that rank, in corpus order, no shuffle.
Continuous lanes (continuous=True, the papers' setting, continuous.py): each epoch the split is one concatenated
stream cut into world_size x num_workers x B contiguous pieces, one per lane (Transformer-XL's batchify), so a
one-document split (enwik8) fills every lane; no resets or padding inside a piece.
In eval, exhausted lanes yield all-ignored rows with lane_active False, and every rank yields the same number of
batches (`num_batches`, computed from every document's length: one pass over the shards' tar headers, cached),
so collective evaluation loops stay in step; summed over ranks the scored targets equal the manifest's tokens.

Batches are built inside the process that iterates: with a DataLoader, each worker owns whole batches of its own B
lanes (pass worker/num_workers), and the consumer must keep recurrent memory per (worker, lane), because the
DataLoader hands out the workers' batches in turn. Reading in the training process (num_workers=0) needs neither.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import NamedTuple

import numpy as np
import torch

from .config import DataConfig
from .continuous import ContinuousLanes
from .cursor import CURSOR_VERSION, check_cursor
from .doc_order import ReaderPlan
from .format import DataError
from .lanes import IGNORE, DocQueue, Lane, eval_steps, fill_row
from .shard_source import ShardSource

MODES = ("train", "eval")


class Batch(NamedTuple):
    tokens: torch.Tensor  # [B, N] long: inputs
    targets: torch.Tensor  # [B, N] long: next-token targets, -100 on padding (and unscored task tokens)
    reset: torch.Tensor  # [B] bool: the lane starts a new document in this segment (clear its memory)
    lane_active: torch.Tensor  # [B] bool: the lane holds data (false only for exhausted lanes at evaluation's end)


class LaneStream:
    """Batches of `lanes` segments of `seg_len` targets for one rank (and loader worker); see the module doc."""

    def __init__(self, data_dir: str | os.PathLike, split: str, rank: int = 0, world_size: int = 1, lanes: int = 4,
                 seg_len: int = 512, mode: str = "train", seed: int = 0, shuffle: bool = True,
                 continuous: bool = False, worker: int = 0, num_workers: int = 1, skip_corrupt: bool = False,
                 shuffle_window: int = 2):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if lanes < 1 or seg_len < 1:
            raise ValueError(f"lanes and seg_len must be >= 1, got lanes={lanes} seg_len={seg_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (world_size={world_size})")
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} is outside 0..{num_workers - 1} (num_workers={num_workers})")
        self.data_dir, self.split, self.mode = str(data_dir), split, mode
        self.rank, self.world_size, self.worker, self.num_workers = rank, world_size, worker, num_workers
        self.lanes, self.seg_len, self.continuous = lanes, seg_len, continuous
        self.shuffle = shuffle and mode == "train"  # evaluation reads in corpus order
        self.shuffle_window = shuffle_window
        self.seed = seed
        self.source = ShardSource(data_dir, split, skip_corrupt=skip_corrupt)
        self.boundary_id = self.source.boundary_id
        self.step = 0
        readers = world_size * num_workers
        if mode == "train":
            reader = rank * num_workers + worker
        else:  # document i -> rank i % world_size; the rank's k-th document -> worker k % num_workers
            reader = rank + world_size * worker
        if continuous and self.source.first_target:
            raise DataError(f"{data_dir} holds samples whose first token is an input only (a task prepared with "
                            "predict_first=false): they are read in document lanes, set data.continuous false")
        if continuous:
            # Every reader cuts the same stream, so each needs every length; this pass also verifies every shard.
            self.cont = ContinuousLanes(self.source, self.source.lengths(), reader, readers, lanes,
                                        shuffle=self.shuffle, seed=seed, window=shuffle_window,
                                        endless=mode == "train", boundary=self.boundary_id)
            self.plan = self.cont.plan
            self.source.upcoming = self._weak_upcoming()
            self.num_batches = self.cont.steps_needed(seg_len) if mode == "eval" else None
            return
        self.cont = None
        if mode == "train":
            self.plan = ReaderPlan(self.source.spans, reader, readers, shuffle=self.shuffle, seed=seed,
                                   window=shuffle_window)
            share = self.plan.epoch_documents(0)
            if share == 0:
                raise DataError(f"split {split!r} of {data_dir} has {self.source.documents} documents, too few for "
                                f"{readers} readers (world_size x num_workers); a single-stream corpus wants "
                                "continuous=True")
            if share < lanes:
                warnings.warn(f"reader {reader} has {share} documents for {lanes} lanes: lanes will read the same "
                              "documents at nearly the same time; a single-stream corpus wants continuous=True",
                              RuntimeWarning, stacklevel=2)
        else:
            self.plan = ReaderPlan(self.source.spans, reader, readers, shuffle=False, seed=seed, window=1,
                                   regime="documents")
        self.source.share_of = self.plan.count_in_shard
        self.source.upcoming = self._weak_upcoming()
        self.queue = DocQueue(self.plan, self.source, endless=mode == "train")
        self.lane_states = [Lane() for _ in range(lanes)]
        self.num_batches = self._count_eval_batches() if mode == "eval" else None

    @classmethod
    def from_config(cls, config: DataConfig, split: str, *, mode: str, seg_len: int, rank: int = 0,
                    world_size: int = 1, worker: int = 0, **kwargs) -> "LaneStream":
        """The stream a run's `data` section asks for (eval uses data.eval_batch_size lanes when set)."""
        from .remote.location import location_of  # data.shards and data.remote travel with the path

        return cls(location_of(config), split, rank=rank, world_size=world_size, seg_len=seg_len, mode=mode,
                   lanes=config.eval_lanes if mode == "eval" else config.batch_size, seed=config.seed,
                   shuffle=config.shuffle, continuous=config.continuous, worker=worker,
                   num_workers=max(1, config.num_workers), **kwargs)

    def _weak_upcoming(self):
        """_upcoming for the source without a reference cycle: a dropped stream is freed at once, and its remote
        reader's prefetch stops."""
        method = weakref.WeakMethod(self._upcoming)
        return lambda shard_id: method()(shard_id) if method() is not None else []

    def _upcoming(self, shard_id: int, ahead: int = 8) -> list[int]:
        """The shards this reader opens after `shard_id` in its plan (the next epoch's too, when endless): what a
        reader of a URL fetches ahead. A guess only ever costs a transfer: reading order is the plan's alone."""
        epoch = max(0, self.epoch)
        epochs = (epoch, epoch + 1) if self.mode == "train" else (epoch,)
        order = [int(s) for e in epochs for s in self.plan.my_shards(e)]
        if shard_id not in order:
            return []
        at = order.index(shard_id)
        return order[at + 1:at + 1 + ahead]

    def _count_eval_batches(self) -> int:
        """The batch count every rank yields: the most any reader's lanes need (the same on every rank)."""
        lengths = self.source.lengths()  # hashes every shard: all ranks agree on what is corrupt
        readers = self.plan.readers
        return max(eval_steps(lengths[q::readers], self.lanes, self.seg_len) for q in range(readers))

    # -- facts -----------------------------------------------------------------------------------------------
    @property
    def skipped_documents(self) -> int:
        """Documents lost to skipped (corrupt or missing) shards: this reader's share in document mode (summed over
        ranks = the total); in continuous mode the split's total (every rank reads the same stream)."""
        if self.cont is not None:
            return sum(self.source.spans[s].documents for s in self.source.skipped_shards)
        return sum(self.plan.count_in_shard(s) for s in self.source.skipped_shards)

    @property
    def epoch(self) -> int:
        """The epoch the reader is in (continuous: the oldest epoch any lane is still reading)."""
        if self.cont is not None:
            return min(max(lane.epoch, 0) for lane in self.cont.lanes)
        return self.queue.epoch

    def document_order(self, epoch: int) -> np.ndarray:
        """The document indices this reader hands to its lanes in `epoch`, in order (continuous: the whole
        split's stream order, which every reader cuts into pieces). From the manifest alone."""
        blocks, _ = self.plan.blocks(epoch)
        parts = [self.plan.block_order(epoch, b) for b in range(len(blocks))]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def shards_read(self, epoch: int) -> list[str]:
        """The shard files this reader opens in `epoch` (relative to the data folder), in order."""
        return [self.source.shards[int(s)]["path"] for s in self.plan.my_shards(epoch)]

    # -- iteration -------------------------------------------------------------------------------------------
    def __iter__(self) -> "LaneStream":
        return self

    def __next__(self) -> Batch:
        if self.num_batches is not None and self.step >= self.num_batches:
            raise StopIteration
        n_lanes, n_seg = self.lanes, self.seg_len
        tokens = np.full((n_lanes, n_seg), self.boundary_id, dtype=np.int64)
        targets = np.full((n_lanes, n_seg), IGNORE, dtype=np.int64)
        reset = np.zeros(n_lanes, dtype=bool)
        active = np.zeros(n_lanes, dtype=bool)
        if self.cont is not None:
            for row in range(n_lanes):
                reset[row], active[row] = self.cont.fill_row(row, tokens[row], targets[row])
            self.cont.evict()
        else:
            for row, lane in enumerate(self.lane_states):
                reset[row], active[row] = fill_row(lane, tokens[row], targets[row], self.queue.next,
                                                   self.boundary_id)
        self.step += 1
        return Batch(torch.from_numpy(tokens), torch.from_numpy(targets), torch.from_numpy(reset),
                     torch.from_numpy(active))

    # -- cursor ----------------------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"split": self.split, "mode": self.mode, "world_size": self.world_size, "rank": self.rank,
                "num_workers": self.num_workers, "worker": self.worker, "lanes": self.lanes,
                "seg_len": self.seg_len, "continuous": self.continuous, "shuffle": self.shuffle,
                "shuffle_window": self.shuffle_window, "data": self.source.fingerprint}

    def state_dict(self) -> dict:
        """Everything that decides the next batches, as plain ints, bools and strings (JSON-serialisable)."""
        state = {"version": CURSOR_VERSION, **self._layout(), "seed": self.seed, "step": self.step,
                 "skipped_shards": sorted(self.source.skipped_shards)}
        if self.cont is not None:
            return {**state, "epoch": self.epoch, "lanes_state": [lane.state() for lane in self.cont.lanes]}
        return {**state, "epoch": self.queue.epoch, "position": self.queue.position,
                "lanes_state": [lane.state() for lane in self.lane_states]}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the stream that saved `state` stopped; refuses a cursor of another layout."""
        check_cursor(state, self._layout())
        if state["seed"] != self.seed:
            # The cursor is authoritative: the run it continues shuffled with its seed.
            warnings.warn(f"stream cursor was saved with seed {state['seed']}, this stream has {self.seed}; "
                          "continuing with the cursor's seed", RuntimeWarning, stacklevel=2)
            self.seed = int(state["seed"])
            self.plan.reseed(self.seed)
            if self.cont is not None:
                self.cont._epochs.clear()
        self.source.skipped_shards.update(int(s) for s in state.get("skipped_shards", ()))
        self.step = int(state["step"])
        if self.cont is not None:
            self.cont.load_lanes(state["lanes_state"])
            return
        self.queue.epoch, self.queue.position = int(state["epoch"]), int(state["position"])
        self.queue.forget_block()
        wanted = [s["doc"] for s in state["lanes_state"] if s["doc"] is not None]
        docs = self.queue.fetch(wanted)
        lanes = []
        for saved in state["lanes_state"]:
            doc = None if saved["doc"] is None else docs.get(int(saved["doc"]))
            if saved["doc"] is not None and doc is None and not self.source.skip_corrupt:
                raise DataError(f"document {saved['doc']} of the stream cursor is not readable in {self.data_dir}")
            lanes.append(Lane(doc=doc, offset=int(saved["offset"]) if doc is not None else 0))
        self.lane_states = lanes
