"""A local folder of fetched shards, keyed by sha256, with a size limit (data.remote.cache_dir, cache_gb).

A shard is stored under its manifest sha256 (`<sha256>.tar`), so a shard that changed upstream has another name and
is never served stale; it is written to a partial file and renamed only once fetched and checked, so a crash or a
concurrent writer (another rank sharing the folder) never leaves a half-written shard under a real name. Use is
recorded in the file's mtime; beyond the limit the least recently used shards are removed, never the one just
stored. A hit is hashed again before use (a disk can rot); a reader that finds its file gone (another process
evicted it) fetches it again (shard_files.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..shards import file_sha256


class ShardCache:
    def __init__(self, folder: str | os.PathLike, limit_bytes: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = limit_bytes
        self.hits = self.misses = 0

    def path(self, sha256: str) -> Path:
        return self.folder / f"{sha256}.tar"

    def get(self, sha256: str, size: int) -> Path | None:
        """The cached shard, marked as just used; None when absent or damaged since it was stored (wrong size or
        content: then removed, and the caller fetches it again)."""
        path = self.path(sha256)
        try:
            if path.stat().st_size != size or file_sha256(path) != sha256:
                path.unlink(missing_ok=True)
                raise FileNotFoundError
            os.utime(path)
        except FileNotFoundError:
            self.misses += 1
            return None
        self.hits += 1
        return path

    def put(self, sha256: str, write: Callable[[Path], None]) -> Path:
        """Store a shard: `write(dest)` writes it atomically (Fetcher.to_file); then evict beyond the limit."""
        path = self.path(sha256)
        write(path)
        self.evict(keep=path)
        return path

    def discard(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

    def evict(self, keep: Path | None = None) -> None:
        """Remove least recently used shards until the folder is within its limit."""
        entries = []
        for path in self.folder.glob("*.tar"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            entries.append((stat.st_mtime_ns, path, stat.st_size))
        total = sum(size for _, _, size in entries)
        for _, path, size in sorted(entries):
            if total <= self.limit_bytes:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            total -= size
