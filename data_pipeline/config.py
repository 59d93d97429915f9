"""Data section of the run configuration: where the prepared shards are and how lanes read them.

Standard library only: data_pipeline must not import models, trainer or cluster (docs/design.md §1), so an impossible
value raises a plain ValueError whose message starts with the dotted key; the trainer's config loader turns it
into its ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ShardLists:
    """Explicit shard URLs per split, replacing the manifest's relative paths in order (webdataset's brace notation:
    `https://cdn/x/train-{00000..00009}.tar`; several patterns separated by spaces). Empty: the manifest's paths
    under data.path."""

    train: str = ""
    valid: str = ""
    test: str = ""


@dataclass
class RemoteConfig:
    """How a data.path that is a URL (http(s)://, s3://, pipe:) is read: data_pipeline/remote/."""

    cache_dir: str = ""  # a folder that keeps fetched shards (keyed by sha256) across streams and runs; "" = no cache
    cache_gb: float = 20.0  # the cache's size limit: least recently used shards are evicted beyond it
    prefetch: int = 2  # shards of this reader fetched ahead in the background (0 = none)
    retries: int = 5  # failed attempts allowed per file (each retry resumes from the byte where the last broke)
    stall_s: float = 60.0  # a transfer that delivers no byte for this long is broken off and retried
    backoff_s: float = 1.0  # wait before the first retry; doubles per retry up to backoff_max_s
    backoff_max_s: float = 30.0


@dataclass
class DataConfig:
    path: str = ""  # a prepared DATA_DIR (manifest.json, tokenizer, shards), as written by `memlm prepare`, or its URL
    batch_size: int = 4  # lanes per rank: the global batch is batch_size x ranks x grad_accum
    num_workers: int = 0  # DataLoader workers per rank for LaneStream consumers; memlm train/eval need 0
    shuffle: bool = True  # reshuffle the training documents every epoch (from `seed`)
    continuous: bool = False  # the papers' mode: a split is one concatenated stream cut into B lanes
    seed: int = 1234  # shuffle seed; the stream cursor records it so a resumed run reads the same batches
    eval_batch_size: int = 0  # lanes per rank during evaluation; 0 means batch_size
    shards: ShardLists = field(default_factory=ShardLists)  # explicit shard URLs per split (brace notation)
    remote: RemoteConfig = field(default_factory=RemoteConfig)  # retries, stall timeout, cache and prefetch of URLs

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
        remote = self.remote
        if remote.cache_gb <= 0:
            raise ValueError(f"data.remote.cache_gb must be > 0, got {remote.cache_gb}")
        if remote.prefetch < 0:
            raise ValueError(f"data.remote.prefetch must be >= 0 (0 = no prefetch), got {remote.prefetch}")
        if remote.retries < 0:
            raise ValueError(f"data.remote.retries must be >= 0, got {remote.retries}")
        for key in ("stall_s", "backoff_s", "backoff_max_s"):
            if getattr(remote, key) <= 0:
                raise ValueError(f"data.remote.{key} must be > 0 seconds, got {getattr(remote, key)}")
        return self

    @property
    def eval_lanes(self) -> int:
        """Lanes per rank used by evaluation."""
        return self.eval_batch_size or self.batch_size
