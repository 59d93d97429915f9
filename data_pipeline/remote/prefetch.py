"""Fetching a reader's next shards in the background while the trainer reads the current one (data.remote.prefetch).

The reader says which shards come next (its ReaderPlan's order, through ShardSource.upcoming); at most `depth` of
them are fetched or held at a time, one after another in that order, by one thread that exists only while there is
work, and that holds its owner only weakly (so a dropped stream stops fetching after the current file and leaves no
thread behind). A fetch that failed raises its DataError when the reader takes
that shard, exactly as a fetch in the reader's own thread would. Only the order of network transfers changes: what
the reader receives, and so the cursor, is the same with or without prefetch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path


def _weak(function: Callable) -> Callable[[], Callable | None]:
    """A bound method held weakly; a plain function (nothing to keep alive) as it is."""
    if hasattr(function, "__self__"):
        return weakref.WeakMethod(function)
    return lambda: function


class Prefetcher:
    def __init__(self, fetch: Callable[[int], Path], release: Callable[[int, Path], None], depth: int):
        # Bound methods of the owner (shard_files.RemoteShards), held weakly: the worker thread must not keep it alive
        self._fetch_ref = _weak(fetch)  # shard id -> a local verified copy
        self._release_ref = _weak(release)  # for a copy fetched ahead and then not wanted any more
        self.depth = depth
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}  # shard id -> its fetch, queued, running or done
        self._queue: list[int] = []
        self._worker: threading.Thread | None = None

    def want(self, shard_ids: list[int]) -> None:
        """The shards to have ready next, in reading order; earlier wishes not in it are dropped."""
        wanted = list(dict.fromkeys(shard_ids))[:self.depth]
        dropped = []
        with self._lock:
            for shard_id in list(self._futures):
                if shard_id not in wanted:
                    future = self._futures.pop(shard_id)
                    if shard_id in self._queue:
                        self._queue.remove(shard_id)
                        future.cancel()
                    else:
                        dropped.append(future)  # running or done: its file is released once it exists
            for shard_id in wanted:
                if shard_id not in self._futures:
                    self._futures[shard_id] = Future()
                    self._queue.append(shard_id)
            if self._queue and self._worker is None:
                self._worker = threading.Thread(target=self._run, name="memlm-prefetch", daemon=True)
                self._worker.start()
        for future in dropped:
            future.add_done_callback(self._release_done)

    def take(self, shard_id: int) -> Path:
        """The shard's local copy: the prefetched one (waiting for it if it is on its way), else fetched now."""
        with self._lock:
            future = self._futures.pop(shard_id, None)
            if future is not None and shard_id in self._queue:  # not started: fetch it here, no waiting in line
                self._queue.remove(shard_id)
                future = None
        if future is None:
            return self._fetch_ref()(shard_id)  # the caller is the owner: it is alive
        return future.result()

    def _release_done(self, future: Future) -> None:
        release = self._release_ref()
        if release is not None and not future.cancelled() and future.exception() is None:
            release(*future.result_pair)

    def _run(self) -> None:
        while True:
            fetch = self._fetch_ref()
            with self._lock:
                if not self._queue or fetch is None:  # nothing to do, or nobody left to read it
                    self._worker = None
                    return
                shard_id = self._queue.pop(0)  # a queued shard always has its future (want and take keep both)
                future = self._futures[shard_id]
                future.set_running_or_notify_cancel()  # under the lock: take() now waits for it, never re-queues
            try:
                path = fetch(shard_id)
            except BaseException as err:  # handed to the reader when it takes the shard
                future.set_exception(err)
            else:
                future.result_pair = (shard_id, path)
                future.set_result(path)
            del fetch  # between files the owner may go
