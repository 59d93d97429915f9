"""Local, verified copies of one split's shards read from a URL: what ShardSource opens instead of DATA_DIR/x.tar.

A shard is fetched (fetch.py: retries from the broken byte, size and sha256 checked) into the cache folder when
data.remote.cache_dir is set, else into a private staging folder of this process where it lives only until the
reader has parsed it (at most 1 + data.remote.prefetch shards on disk). The next shards of the reader's plan are
fetched in the background (prefetch.py).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from .cache import ShardCache
from .fetch import Fetcher
from .location import Location, redact
from .prefetch import Prefetcher


class RemoteShards:
    def __init__(self, location: Location, split: str, shards: list[dict], fetcher: Fetcher | None = None):
        self.location = location
        self.shards = shards
        self.urls = location.shard_urls(split, [s["path"] for s in shards])  # DataError when a list's count is off
        options = location.options
        self.fetcher = fetcher or Fetcher(options)
        self.cache = (ShardCache(Path(options.cache_dir).expanduser(), int(options.cache_gb * 1e9))
                      if options.cache_dir else None)
        self._staging: Path | None = None
        self.prefetcher = Prefetcher(self._fetch, self._release, options.prefetch) if options.prefetch else None

    def display(self, shard_id: int) -> str:
        return redact(self.urls[shard_id])

    @property
    def staging(self) -> Path:
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="memlm-shards-"))
            weakref.finalize(self, shutil.rmtree, self._staging, True)
        return self._staging

    def _fetch(self, shard_id: int) -> Path:
        entry = self.shards[shard_id]
        url, size, sha256 = self.urls[shard_id], int(entry["bytes"]), entry["sha256"]
        if self.cache is not None:
            cached = self.cache.get(sha256, size)
            if cached is not None:
                return cached
            return self.cache.put(sha256, lambda dest: self.fetcher.to_file(url, dest, size=size, sha256=sha256))
        dest = self.staging / f"{shard_id:06d}-{sha256[:16]}.tar"
        self.fetcher.to_file(url, dest, size=size, sha256=sha256)
        return dest

    def _release(self, shard_id: int, path: Path) -> None:
        """A copy that is read (or no longer wanted): the staging folder drops it; the cache keeps it."""
        if self.cache is None or path.parent != self.cache.folder:
            path.unlink(missing_ok=True)

    def open(self, shard_id: int, upcoming: list[int]) -> Path:
        """A verified local copy of the shard; the fetch of `upcoming` (the reader's next shards) starts."""
        path = self.prefetcher.take(shard_id) if self.prefetcher is not None else self._fetch(shard_id)
        if not path.is_file():  # evicted from a shared cache between fetch and use: fetch it again
            path = self._fetch(shard_id)
        if self.prefetcher is not None:
            self.prefetcher.want([s for s in upcoming if s != shard_id])
        return path

    def close(self, shard_id: int, path: Path) -> None:
        """The reader has parsed the shard."""
        self._release(shard_id, path)

    def forget_cached(self, shard_id: int) -> None:
        """A cached copy that failed to parse or verify is removed, so the next attempt fetches it again."""
        if self.cache is not None:
            self.cache.discard(self.shards[shard_id]["sha256"])
