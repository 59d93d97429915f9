"""Reading one split of a prepared DATA_DIR for the lane streams: the manifest, verified shards, document lengths.

Every shard is checked against the manifest's sha256 before its documents are used (read_shard does the check
when given expected_sha256). A missing or corrupt shard raises DataError naming the file; with skip_corrupt=True
its documents are skipped instead, counted and warned about: documents are never dropped silently.

The folder may be a URL (data_pipeline/remote/): then each shard is fetched to a verified local copy first (with
retries, a cache and prefetch of the reader's next shards) and read from there exactly as a local shard; messages
name the URL with its credentials redacted. Nothing that decides the order of documents depends on where they are.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import tarfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .doc_order import ShardSpan
from .format import MANIFEST, DataError, token_dtype
from .remote.fetch import FetchFailed
from .remote.location import Location, as_location
from .remote.shard_files import RemoteShards
from .shards import load_manifest, read_shard


@dataclass
class Doc:
    """One document as a lane sees it: token ids in the on-disk dtype and the optional 0/1 loss mask.

    start: the first token that is a target. 0: the boundary id is the input before token 0 (every corpus by
    default); 1: token 0 is an input only, as the RMT authors' loader cuts a sample (`src[:-1]` -> `tgt[1:]`), so a
    document of T tokens gives T - 1 predictions (a task prepared with predict_first false).
    """

    index: int
    tokens: np.ndarray
    mask: np.ndarray | None = None
    start: int = 0
    length: int = field(init=False)  # len(tokens), read on every segment

    def __post_init__(self) -> None:
        self.length = len(self.tokens)


class ShardSource:
    """The shards of one split, read with verification; remembers the shards it had to skip."""

    def __init__(self, data_dir: str | os.PathLike | Location, split: str, *, skip_corrupt: bool = False):
        self.location = as_location(data_dir)
        # A local folder as a Path, as always; a URL as its Location (str() is its display form, no credentials).
        self.data_dir: Path | Location = Path(self.location.root) if self.location.is_local else self.location
        self.split = split
        self.skip_corrupt = skip_corrupt
        manifest = load_manifest(self.location)
        splits = manifest.get("splits", {})
        if split not in splits:
            where = self.data_dir / MANIFEST if self.location.is_local else self.location.display(MANIFEST)
            raise DataError(f"{where} has no split {split!r} (it has {sorted(splits)})")
        self.entry = splits[split]
        self.shards: list[dict] = list(self.entry["shards"])
        self.remote = None  # the fetcher of shards at a URL (or listed in data.shards); None for a local folder
        if not self.location.is_local or self.location.shard_lists.get(split):
            self.remote = RemoteShards(self.location, split, self.shards)
        tokenizer = manifest["tokenizer"]
        self.vocab_size = int(tokenizer["vocab_size"])
        self.boundary_id = int(tokenizer["boundary_id"])
        self.first_target = int(manifest.get("corpus", {}).get("first_target", 0))  # Doc.start of every document
        self.dtype = token_dtype(self.vocab_size)
        self.documents = int(self.entry["documents"])
        self.tokens = int(self.entry["tokens"])
        self.spans = [ShardSpan(int(s["first_index"]), int(s["documents"])) for s in self.shards]
        self._firsts = np.array([s.first_index for s in self.spans], dtype=np.int64)
        # Identity of the data a cursor refers to: positions mean nothing on other shards.
        self.fingerprint = hashlib.sha256("".join(s["sha256"] for s in self.shards).encode()).hexdigest()[:16]
        self.skipped_shards: set[int] = set()
        # How many of a shard's documents belong to the reader (set by the stream), for the skip warning.
        self.share_of: Callable[[int], int] = lambda shard_id: self.spans[shard_id].documents
        # The reader's next shards after one it opens (set by the stream from its plan): what remote reads prefetch.
        self.upcoming: Callable[[int], list[int]] = lambda shard_id: []

    def path(self, shard_id: int) -> Path | str:
        """Where the shard is, as messages name it: a local Path, or the URL with its credentials redacted."""
        if self.remote is not None:
            return self.remote.display(shard_id)
        return self.data_dir / self.shards[shard_id]["path"]

    def shard_of(self, index: int) -> int:
        """The shard holding document `index`."""
        shard_id = int(np.searchsorted(self._firsts, index, side="right")) - 1
        span = self.spans[shard_id] if shard_id >= 0 else None
        if span is None or not span.first_index <= index < span.first_index + span.documents:
            raise DataError(f"document {index} is not in any shard of split {self.split!r} ({self.data_dir})")
        return shard_id

    def _corrupt(self, shard_id: int, err: Exception) -> None:
        """Raise DataError naming the file, or (skip_corrupt) remember the shard and warn with the count."""
        path = self.path(shard_id)
        if isinstance(err, FetchFailed):  # the source is away, the shard is not known to be bad: never skipped
            raise err
        if not self.skip_corrupt:
            if isinstance(err, DataError) and str(path) in str(err):
                raise err
            raise DataError(f"shard {path} is missing or corrupt ({err}); re-run `memlm prepare` "
                            "or pass skip_corrupt=True to skip it") from err
        if shard_id not in self.skipped_shards:
            self.skipped_shards.add(shard_id)
            warnings.warn(f"skipping corrupt shard {path} ({err}): {self.share_of(shard_id)} documents of this "
                          "reader skipped",
                          RuntimeWarning, stacklevel=3)

    def load(self, shard_id: int) -> dict[int, Doc] | None:
        """All documents of a shard by index, verified against the manifest; None when skipped as corrupt."""

        path = self.path(shard_id)
        entry = self.shards[shard_id]
        local = None
        try:
            if self.remote is not None:  # a verified local copy (DataError naming the URL past the retry budget)
                local = self.remote.open(shard_id, self.upcoming(shard_id))
            elif not path.is_file():
                raise DataError(f"shard {path} is missing")
            docs = {}
            for sample in read_shard(local or path, expected_sha256=entry["sha256"]):
                tokens = np.asarray(sample["tokens"])
                mask = sample.get("mask")
                docs[int(sample["index"])] = Doc(int(sample["index"]), tokens,
                                                 None if mask is None else np.asarray(mask), self.first_target)
            expected = range(entry["first_index"], entry["first_index"] + entry["documents"])
            if len(docs) != len(expected) or any(i not in docs for i in (expected[0], expected[-1])):
                raise DataError(f"shard {path} holds documents {sorted(docs)[:3]}... but the manifest says "
                                f"{entry['documents']} documents from {entry['first_index']}")
        except (DataError, OSError, tarfile.TarError, ValueError, KeyError) as err:
            if local is not None:
                self.remote.forget_cached(shard_id)  # a damaged cached copy is fetched anew next time
            self._corrupt(shard_id, err)
            return None
        finally:
            if local is not None:
                self.remote.close(shard_id, local)
        return docs

    def lengths(self) -> np.ndarray:
        """Predictions of every document of the split (index order): its token count less `first_target`; -1 for
        documents of skipped shards.

        A cheap pre-pass: each shard is hashed (so every rank sees the same set of corrupt shards and computes
        the same number of evaluation batches) and its tar headers are read; the token payloads are not parsed.
        """
        out = np.full(self.documents, -1, dtype=np.int64)
        for shard_id, entry in enumerate(self.shards):
            path = self.path(shard_id)
            try:
                if self.remote is not None:
                    indices, counts = self._remote_lengths(shard_id)
                    out[indices] = np.maximum(counts - self.first_target, 0)
                    continue
                if not path.is_file():
                    raise DataError(f"shard {path} is missing")
                stat = path.stat()
                indices, counts = _scan_lengths(str(path), entry["sha256"], stat.st_size, stat.st_mtime_ns,
                                                self.dtype.itemsize)
                if len(indices) != entry["documents"]:
                    raise DataError(f"shard {path} holds {len(indices)} documents, the manifest says "
                                    f"{entry['documents']}")
            except (DataError, OSError, tarfile.TarError, ValueError) as err:
                self._corrupt(shard_id, err)
                continue
            out[indices] = np.maximum(counts - self.first_target, 0)
        return out

    def _remote_lengths(self, shard_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(indices, token counts) of a shard at a URL: fetched (verified) once per process, then remembered by
        its sha256, so evaluation's repeated pre-passes do not fetch the split again."""
        entry = self.shards[shard_id]
        key = (entry["sha256"], self.dtype.itemsize)
        if key not in _REMOTE_LENGTHS:
            # The pass reads the shards in order: the next unscanned ones are fetched meanwhile
            ahead = list(itertools.islice((s for s in range(shard_id + 1, len(self.shards))
                                           if (self.shards[s]["sha256"], self.dtype.itemsize) not in _REMOTE_LENGTHS),
                                          8))
            local = self.remote.open(shard_id, ahead)
            try:
                stat = local.stat()
                found = _scan_lengths(str(local), entry["sha256"], stat.st_size, stat.st_mtime_ns,
                                      self.dtype.itemsize)
            finally:
                self.remote.close(shard_id, local)
            if len(found[0]) != entry["documents"]:
                raise DataError(f"shard {self.path(shard_id)} holds {len(found[0])} documents, the manifest says "
                                f"{entry['documents']}")
            _REMOTE_LENGTHS[key] = found
        return _REMOTE_LENGTHS[key]


_REMOTE_LENGTHS: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}  # (sha256, itemsize) -> lengths


@functools.lru_cache(maxsize=4096)
def _scan_lengths(path: str, sha256: str, size: int, mtime_ns: int, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """(document indices, token counts) of one shard from its tar headers, after checking its sha256.

    Cached on (path, sha256, size, mtime) because evaluation builds a fresh stream every time it runs.
    """
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != sha256:
        raise DataError(f"shard {path} has sha256 {digest[:12]}..., the manifest says {sha256[:12]}...")
    indices, counts = [], []
    with tarfile.open(path, "r:") as tar:
        for member in tar:  # header-only: tarfile seeks over the payloads
            if member.name.endswith(".tokens.bin"):
                indices.append(int(member.name.split(".", 1)[0]))
                counts.append(member.size // itemsize)
    return np.array(indices, dtype=np.int64), np.array(counts, dtype=np.int64)
