"""The random generators a training step draws from, as one piece of checkpointed state.

Dropout masks and the data order come from Python's, NumPy's and torch's generators (and, on a GPU, CUDA's: without
them a resumed run drew other masks from its first step, seen on an H100). `state_dict` holds tensors and plain
values only, so a checkpoint that carries it still loads weights-only.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


class RNGState:
    """state_dict / load_state_dict over the process-wide generators (there is nothing to hold between calls)."""

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {"torch": torch.get_rng_state(),
                 "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                           "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                 "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        saved = state["numpy"]
        np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                             saved["has_gauss"], saved["cached_gaussian"]))
        python = state["python"]  # a weights-only load gives the inner tuple back as a list
        random.setstate((python[0], tuple(python[1]), python[2]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Whatever the block draws, the generators are where they were when it started (validation inside training:
    a run with validation takes the same training steps as one without)."""
    rng = RNGState()
    saved = rng.state_dict()
    try:
        yield
    finally:
        rng.load_state_dict(saved)
