"""Where a prepared data folder lives, and how to name its files in messages without their credentials.

data.path is one of
    /some/folder                    a local folder (read as it always was: nothing here touches it)
    http://host/prefix, https://... a folder served over HTTP; user:password@ and ?query=tokens are allowed
    s3://bucket/prefix              an S3 (or S3-compatible) prefix through fsspec/s3fs; the endpoint and credentials
                                    come from the usual AWS_* environment variables (AWS_ENDPOINT_URL, ...)
    pipe:COMMAND                    a command that writes one file to stdout; `{}` in it is replaced by the file's
                                    path relative to the data folder (`pipe:curl -sf http://host/data/{}`)
Every file of the folder (manifest.json, tokenizer/..., the shards) is addressed by its path relative to the folder.
data.shards.SPLIT may list a split's shard URLs explicitly in webdataset's brace notation
(`https://cdn/x/train-{00000..00009}.tar`); they replace the manifest's paths in order, so their count must match.

`redact` is applied to every message that names a URL: credentials never reach a log, an error or MLflow.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from ..config import DataConfig, RemoteConfig, ShardLists
from ..format import DataError

SCHEMES = ("http://", "https://", "s3://", "pipe:")
HIDDEN = "***"
# Environment variables whose values are secrets wherever they appear in a message (a pipe: command may carry one).
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECURITY_TOKEN")
_SECRET_NAME = re.compile(r"(SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s'\"]+@")
_QUERY_VALUE = re.compile(r"(?P<key>[?&][^=&\s#'\"]+=)[^&\s#'\"]*")


def is_remote(path) -> bool:
    """Whether data.path (a string, Path or Location) names a URL rather than a local folder."""
    if isinstance(path, Location):
        return not path.is_local
    return isinstance(path, str) and path.startswith(SCHEMES)


def path_or_url(path) -> Path | str:
    """A local folder as a Path, a URL as the string it is: Path("https://h/x") would collapse the "//"."""
    return str(path) if is_remote(path) else Path(path)


def _secret_values() -> list[str]:
    names = set(SECRET_ENV) | {name for name in os.environ if _SECRET_NAME.search(name)}
    # Short values ("1", "true") would blank out ordinary text; no credential is that short.
    return sorted((v for n in names if len(v := os.environ.get(n, "")) >= 8), key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with URL userinfo, query values and the values of secret environment variables replaced by ***."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{HIDDEN}@", str(text))
    text = _QUERY_VALUE.sub(lambda m: f"{m['key']}{HIDDEN}", text)
    for value in _secret_values():
        text = text.replace(value, HIDDEN)
    return text


def expand_shards(text: str) -> list[str]:
    """The URLs of a brace list: whitespace-separated patterns, each expanded as webdataset does."""
    from braceexpand import braceexpand  # webdataset's own dependency

    return [url for pattern in text.split() for url in braceexpand(pattern)]


@dataclass(eq=False)
class Location:
    """A data folder: its kind ("local", "http", "s3", "pipe"), its root as given, how its URLs are read."""

    root: str
    kind: str
    options: RemoteConfig = field(default_factory=RemoteConfig)
    shard_lists: dict[str, list[str]] = field(default_factory=dict)  # split -> explicit shard URLs

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    def url(self, rel: str) -> str:
        """The URL (or local path) of the folder's file `rel` (a relative path with "/" separators)."""
        if self.kind == "local":
            return str(Path(self.root) / rel)
        if self.kind == "pipe":
            return "pipe:" + self.root[len("pipe:"):].replace("{}", shlex.quote(rel))
        scheme, netloc, path, query, _ = urlsplit(self.root)
        # A query on the prefix (a signed URL's token) stays on every file's URL.
        return urlunsplit((scheme, netloc, path.rstrip("/") + "/" + quote(rel), query, ""))

    def shard_urls(self, split: str, rel_paths: list[str]) -> list[str]:
        """The URLs of a split's shards: data.shards.SPLIT when given (its count checked), else under the root."""
        explicit = self.shard_lists.get(split)
        if not explicit:
            return [self.url(rel) for rel in rel_paths]
        if len(explicit) != len(rel_paths):
            raise DataError(f"data.shards.{split} names {len(explicit)} shards ({redact(explicit[0])} ...), but "
                            f"{self.display('manifest.json')} lists {len(rel_paths)} for split {split!r}: give one "
                            "URL per shard, in the manifest's order")
        return list(explicit)

    def display(self, rel: str = "") -> str:
        """The folder (or its file `rel`) as messages show it: credentials replaced by ***."""
        return redact(self.url(rel) if rel else self.root)

    def __str__(self) -> str:
        return self.display()


def _check_root(path: str) -> str:
    """The location's kind; DataError naming the malformed URL and the expected form."""
    if path.startswith("pipe:"):
        if "{}" not in path:
            raise DataError(f"data.path {redact(path)} has no {{}} where the file's path goes: write e.g. "
                            "pipe:curl -sf http://host/data/{}")
        return "pipe"
    parts = urlsplit(path)
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise DataError(f"data.path {redact(path)} has no host: write http(s)://HOST/PREFIX")
        return "http"
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.username:
            raise DataError(f"data.path {redact(path)} is not s3://BUCKET/PREFIX (credentials belong in the "
                            "AWS_* environment variables, never in the URL)")
        return "s3"
    raise DataError(f"data.path {redact(path)} is not a folder or a URL memlm reads (http://, https://, s3://, pipe:)")


def _shard_lists(shards: ShardLists) -> dict[str, list[str]]:
    lists = {}
    for f in fields(shards):
        text = getattr(shards, f.name).strip()
        if not text:
            continue
        urls = expand_shards(text)
        for url in urls:  # a pipe: entry is a whole command (no {}); a local path is read as it is
            if url.startswith(("http://", "https://", "s3://")):
                _check_root(url)
        lists[f.name] = urls
    return lists


def as_location(data, config: DataConfig | None = None) -> Location:
    """data.path (a string, a Path or already a Location) as a Location; `config` supplies data.shards and
    data.remote (defaults without it)."""
    if isinstance(data, Location):
        return data
    config = config or DataConfig()
    text = str(data)
    kind = _check_root(text) if is_remote(text) else "local"
    return Location(text, kind, config.remote, _shard_lists(config.shards))


def location_of(config: DataConfig) -> Location:
    """The Location of a run's `data` section."""
    return as_location(config.path, config)
