"""`memlm prepare --out s3://BUCKET/PREFIX`: a prepared folder uploaded, manifest.json last, resumable.

prepare builds the folder locally (a staging folder) exactly as for a local --out; then every file goes up with its
sha256 stored as the object's metadata (`x-amz-meta-sha256`), each upload checked by reading the object's size and
that metadata back. manifest.json goes up last: it is the commit point, so a reader never sees a manifest whose
shards are not all there. A rerun of the same command after an interruption finds the files already uploaded whole
(an S3 object exists only once its upload completed; size and sha256 equal to the new local file) and uploads the
rest; prepare is deterministic, so the staging folder of the rerun holds the same bytes.

Failures a retry may mend (a reset, a 5xx) are retried per file with data.remote's backoff; the rest (no
credentials, no bucket, a denied write) are one DataError line naming the URL without credentials.
An http(s):// --out is refused: memlm writes a plain folder, and any static web server serves it as data.path.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import RemoteConfig
from ..format import MANIFEST, DataError
from ..shards import file_sha256
from .location import Location, as_location, redact
from .transports import Broken, s3_filesystem

SHA_KEY = "sha256"  # the object metadata key (S3 sends it as x-amz-meta-sha256)


@dataclass
class Uploaded:
    """What one upload did: files sent, files found already there whole, bytes sent."""

    sent: int = 0
    skipped: int = 0
    nbytes: int = 0


def check_out_url(out: str) -> Location:
    """The Location of a URL --out; DataError for a kind memlm cannot write."""
    where = as_location(out)
    if where.kind == "http":
        raise DataError(f"--out {where.display()}: memlm does not write over HTTP; prepare into a folder "
                        "(--out DATA_DIR) and serve that folder with any static web server "
                        "(e.g. `python -m http.server -d DATA_DIR`), then train with data.path=http://HOST:PORT")
    if where.kind != "s3":
        raise DataError(f"--out {where.display()}: memlm writes a local folder or s3://BUCKET/PREFIX")
    return where


class S3Folder:
    """The objects under s3://BUCKET/PREFIX, through the s3fs filesystem that the reader uses (AWS_* environment)."""

    def __init__(self, where: Location, options: RemoteConfig):
        self.where = where
        self.options = options
        self.bucket, _, prefix = where.root[len("s3://"):].partition("/")
        self.prefix = prefix.strip("/")
        self.fs = s3_filesystem(options.stall_s)

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _call(self, what: str, url: str, method: str, **kwargs):
        """One S3 call, its failure sorted: DataError for what a retry cannot mend, Broken for the rest."""
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, **kwargs)
        except Exception as err:  # s3fs and botocore raise many types; each is sorted here
            raise _write_failure(what, url, err) from None

    def check_bucket(self) -> None:
        """The bucket exists and these credentials reach it (before minutes of prepare)."""
        self._retrying(f"s3://{self.bucket}", lambda: self._call("reach", f"s3://{self.bucket}", "head_bucket"))

    def head(self, rel: str) -> dict | None:
        """The object's size and stored sha256, or None when there is none."""
        url = self.where.url(rel)
        try:
            answer = self._retrying(url, lambda: self._call("read", url, "head_object", Key=self.key(rel)))
        except _Missing:
            return None
        return {"bytes": int(answer["ContentLength"]), SHA_KEY: answer.get("Metadata", {}).get(SHA_KEY)}

    def read(self, rel: str) -> bytes:
        url = self.where.url(rel)
        full = f"{self.bucket}/{self.key(rel)}"

        def get():
            try:
                return self.fs.cat_file(full)
            except Exception as err:
                raise _write_failure("read", url, err) from None

        return self._retrying(url, get)

    def delete(self, rel: str) -> None:
        url = self.where.url(rel)
        self._retrying(url, lambda: self._call("delete", url, "delete_object", Key=self.key(rel)))

    def put(self, path: Path, rel: str, sha256: str) -> None:
        """`path` uploaded as `rel` with its sha256 as metadata; read back and compared (size and sha256)."""
        url = self.where.url(rel)
        full = f"{self.bucket}/{self.key(rel)}"

        def send():
            try:  # s3fs's put_file: one PUT, or a multipart upload for a large shard; metadata on either
                self.fs.put_file(str(path), full, Metadata={SHA_KEY: sha256})
            except Exception as err:
                raise _write_failure("write", url, err) from None

        self._retrying(url, send)
        self.fs.invalidate_cache(full)
        there = self.head(rel)
        size = path.stat().st_size
        if there is None or there["bytes"] != size or there[SHA_KEY] != sha256:
            got = "nothing" if there is None else f"{there['bytes']} bytes, sha256 {str(there[SHA_KEY])[:12]}..."
            raise DataError(f"{redact(url)} reads back as {got} after its upload of {size} bytes (sha256 "
                            f"{sha256[:12]}...): the store did not keep what was sent; rerun the same command")

    def _retrying(self, url: str, call):
        opts = self.options
        failures = 0
        while True:
            try:
                return call()
            except Broken as err:
                failures += 1
                if failures > opts.retries:
                    raise DataError(f"cannot write {redact(url)}: {redact(str(err))}, {failures} attempts; rerun "
                                    "the same command: it skips the files already uploaded") from None
                wait = min(opts.backoff_max_s, opts.backoff_s * 2 ** (failures - 1))
                print(f"memlm: upload: {redact(url)}: {redact(str(err))}; retry {failures} of {opts.retries} in "
                      f"{wait:g} s", file=sys.stderr, flush=True)
                time.sleep(wait)


class _Missing(DataError):
    """A head or get of an object that is not there (a normal answer when checking what is uploaded)."""


def _write_failure(what: str, url: str, err: Exception) -> Exception:
    """A refusal as DataError (one line, no credentials), a network or service failure as Broken."""
    from aiohttp import ClientError as ConnectionFailure
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    shown = redact(url)
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return DataError(f"no S3 credentials to {what} {shown}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                         "(or AWS_PROFILE), and AWS_ENDPOINT_URL for a store other than AWS")
    if isinstance(err, FileNotFoundError):
        if what == "read":  # an object not (yet) uploaded; the bucket was there at check_bucket
            return _Missing(f"{shown} does not exist")
        # (never judged from the message's text: it holds the bucket's name, which may say "bucket" itself)
        return DataError(f"{shown}: no such bucket (create it first, or check the --out URL and "
                         "AWS_ENDPOINT_URL)")
    if isinstance(err, PermissionError):
        return DataError(f"{shown}: access denied to {what} it (check the AWS_* credentials and the bucket's "
                         "policy)")
    if isinstance(err, (OSError, TimeoutError, BotoCoreError, ClientError, ConnectionFailure)):
        return Broken(redact(f"{type(err).__name__}: {err}"))
    return err


def check_destination(out: str, options: RemoteConfig | None = None) -> S3Folder:
    """Before prepare runs: the bucket is reachable, and a finished upload there is replaced only with --overwrite
    (a rerun of the same command passes: its manifest is byte-identical, checked once the staging folder is made)."""
    folder = S3Folder(check_out_url(out), options or RemoteConfig())
    folder.check_bucket()
    return folder


def upload(staging: Path, folder: S3Folder, overwrite: bool) -> Uploaded:
    """Every file of `staging` to `folder`, manifest.json last; files already there whole are skipped."""
    staging = Path(staging)
    manifest = (staging / MANIFEST).read_bytes()
    there = folder.head(MANIFEST)
    if there is not None:
        if folder.read(MANIFEST) != manifest:
            if not overwrite:
                raise DataError(f"--out {folder.where.display()} already holds prepared data (another "
                                f"{MANIFEST}): pass --overwrite to replace it, or choose another --out")
            folder.delete(MANIFEST)  # uncommitted first: no reader takes the old manifest with new shards
    files = sorted(p for p in staging.rglob("*") if p.is_file() and p.relative_to(staging).as_posix() != MANIFEST)
    done = Uploaded()
    for path in [*files, staging / MANIFEST]:
        rel = path.relative_to(staging).as_posix()
        sha256 = file_sha256(path)
        found = folder.head(rel)
        if found is not None and found["bytes"] == path.stat().st_size and found[SHA_KEY] == sha256:
            done.skipped += 1
            continue
        folder.put(path, rel, sha256)
        done.sent += 1
        done.nbytes += path.stat().st_size
    return done
