"""Reading one whole file from a URL, with retries that lose and repeat nothing.

A transfer that breaks (a reset, a stall of data.remote.stall_s seconds without a byte, a 5xx, a failed command) is
retried from the byte where it broke: an HTTP Range request, an S3 ranged read, or for pipe: the command run again
with the bytes already received skipped. The bytes reach the sink and the running sha256 exactly once, in order.
Between attempts the wait doubles from data.remote.backoff_s up to backoff_max_s; after data.remote.retries failed
attempts the file is given up with one DataError line that names the URL (credentials redacted), the byte reached
and the last failure. With the manifest's size and sha256 the file is checked before anyone uses it: a truncated or
corrupted shard is refused by its checksum, never parsed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path

from ..config import RemoteConfig
from ..format import DataError
from .location import redact
from .transports import Broken, read_from


class FetchFailed(DataError):
    """A file given up after data.remote.retries failed attempts: the source is away, not the data wrong (the trainer
    adds the checkpoint a --resume continues from)."""


class FetchStats:
    """Counts for tests, logs and the benchmark: files fetched, bytes received, retries made (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.files = self.bytes = self.retries = 0

    def add(self, *, files: int = 0, nbytes: int = 0, retries: int = 0) -> None:
        with self._lock:
            self.files += files
            self.bytes += nbytes
            self.retries += retries


class Fetcher:
    """Reads whole files by URL with the retry, stall and check policy of `options` (data.remote)."""

    def __init__(self, options: RemoteConfig | None = None, stats: FetchStats | None = None, quiet: bool = False):
        self.options = options or RemoteConfig()
        self.stats = stats or FetchStats()
        self.quiet = quiet

    def read_bytes(self, url: str, *, size: int | None = None, sha256: str | None = None) -> bytes:
        """The file's bytes (the manifest, a tokenizer file), checked against `size` and `sha256` when given."""
        parts: list[bytes] = []
        self._transfer(url, parts.append, size, sha256)
        return b"".join(parts)

    def to_file(self, url: str, dest: Path, *, size: int | None = None, sha256: str | None = None) -> None:
        """The file written to `dest` atomically (a partial file beside it, renamed once complete and checked)."""
        dest = Path(dest)
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            with open(partial, "wb") as f:
                self._transfer(url, f.write, size, sha256)
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)

    def _transfer(self, url: str, write, size: int | None, sha256: str | None) -> None:
        opts = self.options
        digest = hashlib.sha256()
        received = 0
        failures = 0
        while True:
            try:
                for chunk in read_from(url, received, size, opts.stall_s):
                    if size is not None and received + len(chunk) > size:
                        raise DataError(f"{redact(url)} has more than the {size} bytes the manifest says: the file "
                                        "was replaced after `memlm prepare` (upload the data folder again)")
                    write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                if size is not None and received < size:
                    raise Broken(f"the transfer ended at byte {received}")
                break
            except Broken as err:
                failures += 1
                self.stats.add(retries=1)
                where = f"byte {received:,}" + (f" of {size:,}" if size is not None else "")
                if failures > opts.retries:
                    raise FetchFailed(f"cannot read {redact(url)}: {redact(str(err))} at {where}, {failures} "
                                      f"attempts (data.remote.retries={opts.retries}); check the server or the "
                                      "network") from None
                wait = min(opts.backoff_max_s, opts.backoff_s * 2 ** (failures - 1))
                if not self.quiet:
                    print(f"memlm: data: {redact(url)}: {redact(str(err))} at {where}; retry {failures} of "
                          f"{opts.retries} in {wait:g} s", file=sys.stderr, flush=True)
                time.sleep(wait)
        self.stats.add(files=1, nbytes=received)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise DataError(f"{redact(url)} has sha256 {digest.hexdigest()[:12]}..., the manifest says "
                            f"{sha256[:12]}...: the file is corrupt or from another prepare (upload the data folder "
                            "again)")
