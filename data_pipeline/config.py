"""Data section of the run configuration: where the prepared shards are and how lanes read them.

Standard library only: data_pipeline must not import models, trainer or cluster (docs/design.md §1), so an impossible
value raises a plain ValueError whose message starts with the dotted key; the trainer's config loader turns it
into its ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    path: str = ""  # a prepared DATA_DIR (manifest.json, tokenizer, shards), as written by `memlm prepare`
    batch_size: int = 4  # lanes per rank: the global batch is batch_size x ranks x grad_accum
    num_workers: int = 0  # DataLoader workers per rank for LaneStream consumers; memlm train/eval need 0
    shuffle: bool = True  # reshuffle the training documents every epoch (from `seed`)
    continuous: bool = False  # the papers' mode: a split is one concatenated stream cut into B lanes
    seed: int = 1234  # shuffle seed; the stream cursor records it so a resumed run reads the same batches
    eval_batch_size: int = 0  # lanes per rank during evaluation; 0 means batch_size

    def validate(self) -> "DataConfig":
        """Raise ValueError naming the first impossible setting; return self when all is well."""
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1 (lanes per rank), got {self.batch_size}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if self.eval_batch_size < 0:
            raise ValueError(f"data.eval_batch_size must be >= 0 (0 means data.batch_size), got {self.eval_batch_size}")
        return self

    @property
    def eval_lanes(self) -> int:
        """Lanes per rank used by evaluation."""
        return self.eval_batch_size or self.batch_size
