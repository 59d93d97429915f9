"""One attempt at reading a URL from a given byte: an iterator of chunks, for http(s)://, s3://, pipe: and local paths.

Each transport raises Broken for a failure worth retrying (a reset, a timeout, a 5xx, a command that failed) and
DataError for one that a retry cannot mend (a 404, a refused credential, a file of another size than the manifest
says). fetch.py owns the retry loop; a transport never retries by itself, so every retry is counted there.
"""

from __future__ import annotations

import base64
import http.client
import os
import select
import subprocess
import tempfile
from collections.abc import Iterator
from urllib.error import HTTPError, URLError
from urllib.parse import unquote, urlsplit, urlunsplit
from urllib.request import Request, urlopen

from ..format import DataError
from .location import redact

CHUNK = 1 << 20
# HTTP statuses a later attempt may not get: overload, throttling, timeouts, a gateway between.
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


class Broken(Exception):
    """A transfer that broke off; the message says how (never with credentials: it passes through redact)."""


def read_from(url: str, start: int, size: int | None, stall_s: float) -> Iterator[bytes]:
    """The bytes of `url` from byte `start` on, in chunks. `size`: the whole file's bytes when known (the manifest's),
    checked against what the server says before any byte is used."""
    if url.startswith(("http://", "https://")):
        return _http(url, start, size, stall_s)
    if url.startswith("s3://"):
        return _s3(url, start, size, stall_s)
    if url.startswith("pipe:"):
        return _pipe(url[len("pipe:"):], start, stall_s)
    return _local(url, start)


def _wrong_size(url: str, got: int, size: int) -> DataError:
    return DataError(f"{redact(url)} has {got} bytes, the manifest says {size}: the file was truncated or replaced "
                     "after `memlm prepare` (upload the data folder again)")


# ---------------------------------------------------------------------------------------------------------------- http


def _http(url: str, start: int, size: int | None, stall_s: float) -> Iterator[bytes]:
    parts = urlsplit(url)
    headers = {"Accept-Encoding": "identity"}
    if parts.username is not None:  # urllib does not send userinfo itself: Basic auth, the URL without it
        user_pass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(user_pass.encode()).decode()
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    if start:
        headers["Range"] = f"bytes={start}-"
    try:
        response = urlopen(Request(url, headers=headers), timeout=stall_s)  # the timeout bounds every read too
    except HTTPError as err:
        err.close()
        if err.code in RETRY_STATUS:
            raise Broken(f"HTTP {err.code} {err.reason}") from None
        if err.code == 416:
            raise DataError(f"{redact(url)} ends before byte {start}, the manifest says {size} bytes: the file was "
                            "truncated after `memlm prepare` (upload the data folder again)") from None
        raise DataError(f"{redact(url)}: HTTP {err.code} {err.reason} (check data.path and the server)") from None
    except (URLError, OSError, http.client.HTTPException) as err:
        raise Broken(f"cannot connect ({getattr(err, 'reason', err)})") from None
    with response:
        skip = 0
        if start and response.status != 206:
            skip = start  # the server ignored the Range header: read past what was already received
        total = _total_size(response, start if response.status == 206 else 0)
        if size is not None and total is not None and total != size:
            raise _wrong_size(url, total, size)
        while True:
            try:
                data = response.read1(CHUNK)
            except TimeoutError:
                raise Broken(f"no byte for {stall_s:g} s") from None
            except (OSError, http.client.HTTPException) as err:
                raise Broken(f"connection broke ({type(err).__name__}: {err})") from None
            if not data:
                if response.length:  # http.client counts down Content-Length: bytes promised, never sent
                    raise Broken(f"connection closed {response.length} bytes early")
                return
            if skip:
                if len(data) <= skip:
                    skip -= len(data)
                    continue
                data, skip = data[skip:], 0
            yield data


def _total_size(response, start: int) -> int | None:
    """The whole file's size as the server states it (Content-Range's total, else start + Content-Length)."""
    content_range = response.headers.get("Content-Range", "")
    if "/" in content_range and content_range.rsplit("/", 1)[1].strip().isdigit():
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return start + int(length) if length and length.isdigit() else None


# ---------------------------------------------------------------------------------------------------------------- s3


def _s3_filesystem(stall_s: float):
    """An s3fs filesystem for the AWS_* environment (endpoint, keys, region); its own retries off: fetch.py counts."""
    import s3fs

    # total_max_attempts 1: botocore makes one attempt (its max_attempts counts retries in the legacy mode)
    timeouts = {"connect_timeout": stall_s, "read_timeout": stall_s,
                "retries": {"total_max_attempts": 1, "mode": "standard"}}
    fs = s3fs.S3FileSystem(config_kwargs=timeouts, skip_instance_cache=True)
    fs.retries = 1  # s3fs's own retry loop (a class attribute): one attempt, fetch.py decides about the next
    return fs


_FILESYSTEMS: dict[tuple, object] = {}
_AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION")


def s3_filesystem(stall_s: float):
    """One filesystem per process, stall timeout and AWS_* environment (it holds a connection pool and an event
    loop thread); never printed, the key stays in this dict."""
    key = (os.getpid(), stall_s, *(os.environ.get(name) for name in _AWS_ENV))
    if key not in _FILESYSTEMS:
        _FILESYSTEMS[key] = _s3_filesystem(stall_s)
    return _FILESYSTEMS[key]


def _s3_failure(url: str, err: Exception) -> Exception:
    """A refusal (missing object, denied access) as DataError; a network or service failure as Broken; anything
    else (a bug, not the network) as it is."""
    from aiohttp import ClientError as ConnectionFailure  # s3fs's transport: a reset body, a refused connection
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(err, FileNotFoundError):
        return DataError(f"{redact(url)} does not exist (check data.path and the bucket)")
    if isinstance(err, PermissionError):
        return DataError(f"{redact(url)}: access denied (check the AWS_* credentials in the environment)")
    if isinstance(err, (OSError, TimeoutError, BotoCoreError, ClientError, ConnectionFailure)):
        return Broken(f"{type(err).__name__}: {err}")
    return err


def _s3(url: str, start: int, size: int | None, stall_s: float) -> Iterator[bytes]:
    fs = s3_filesystem(stall_s)
    key = url[len("s3://"):]
    try:
        total = int(fs.info(key)["size"])
    except Exception as err:  # s3fs/botocore raise many types; each is sorted into retry or refuse
        raise _s3_failure(url, err) from None
    if size is not None and total != size:
        raise _wrong_size(url, total, size)
    position = start
    while position < total:
        try:  # ranged reads: a broken one costs at most one chunk, and the next resumes at `position`
            data = fs.cat_file(key, start=position, end=min(total, position + CHUNK))
        except Exception as err:
            raise _s3_failure(url, err) from None
        if not data:
            raise Broken(f"an empty read at byte {position}")
        position += len(data)
        yield data


# ---------------------------------------------------------------------------------------------------------------- pipe


def _pipe(command: str, start: int, stall_s: float) -> Iterator[bytes]:
    """The command's stdout from byte `start`: a command cannot seek, so it runs again and the first bytes are
    skipped."""
    with tempfile.TemporaryFile() as errors:
        # A pipe: is a shell command line of the user's own config, run as webdataset runs its pipe: URLs (sh -c)
        process = subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE, stderr=errors,
                                   stdin=subprocess.DEVNULL)
        try:
            fd = process.stdout.fileno()
            skip = start
            while True:
                ready, _, _ = select.select([fd], [], [], stall_s)
                if not ready:
                    raise Broken(f"no byte for {stall_s:g} s")
                data = os.read(fd, CHUNK)
                if not data:
                    break
                if skip:
                    if len(data) <= skip:
                        skip -= len(data)
                        continue
                    data, skip = data[skip:], 0
                yield data
            try:
                code = process.wait(timeout=stall_s)
            except subprocess.TimeoutExpired:  # stdout closed but the command lingers
                raise Broken(f"the command did not exit {stall_s:g} s after its output ended") from None
            if code != 0:
                errors.seek(0)
                last = errors.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
                raise Broken(f"the command exited with status {code}" + (f": {last[0]}" if last[0] else ""))
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()


# ---------------------------------------------------------------------------------------------------------------- local


def _local(path: str, start: int) -> Iterator[bytes]:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path} is missing") from None
    except OSError as err:
        raise Broken(f"cannot open ({err})") from None
    with f:
        f.seek(start)
        while data := f.read(CHUNK):
            yield data
