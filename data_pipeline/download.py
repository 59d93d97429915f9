"""Fetch the standard corpora and lay them out the way `read_corpus` reads them.

    download("wikitext-103", Path("data/wikitext-103"))  -> data/wikitext-103           (--corpus wikitext --input it)
    download("enwik8", Path("data/enwik8"))              -> data/enwik8/enwik8          (--corpus enwik8 --input it)

The network part is `fetch` (a few lines of urllib); everything else (the source table, extraction, checksum
verification) is pure and tested on small zip files. Extraction writes only the members named in the table, to
names the table chooses, so a hostile archive cannot write outside `dest`.

Checksums are of the extracted files, as published: enwik8's md5 by its author (mattmahoney.net/dc/textdata.html);
WikiText's sha1 as listed by GluonNLP (which match the WikiText-2 files and the WikiText-103 valid/test files in
../shared/data byte for byte), WikiText-2's sha256 from ../shared/data/README.md; text8's sha1 as listed by GluonNLP.
"""

from __future__ import annotations

import hashlib
import shutil
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .format import DataError


@dataclass(frozen=True)
class Member:
    """One file to take from the archive: its name inside the zip, its name in `dest`, and "algo:hexdigest"."""

    archive_name: str
    name: str
    checksum: str
    size: int | None = None


@dataclass(frozen=True)
class Source:
    url: str
    members: tuple[Member, ...]
    input_name: str = ""  # what --input is, relative to dest: "" = dest itself (a folder corpus), else a file
    corpus: str = ""  # the --corpus kind that reads it

    @property
    def archive(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    def input_path(self, dest: Path) -> Path:
        return Path(dest) / self.input_name if self.input_name else Path(dest)


_WIKITEXT = "https://s3.amazonaws.com/research.metamind.io/wikitext"

SOURCES: dict[str, Source] = {
    "wikitext-103": Source(
        url=f"{_WIKITEXT}/wikitext-103-v1.zip",
        members=(
            Member("wikitext-103/wiki.train.tokens", "wiki.train.tokens",
                   "sha1:b7497e2dfe77e72cfef5e3dbc61b7b53712ac211"),
            Member("wikitext-103/wiki.valid.tokens", "wiki.valid.tokens",
                   "sha1:c326ac59dc587676d58c422eb8a03e119582f92b"),
            Member("wikitext-103/wiki.test.tokens", "wiki.test.tokens",
                   "sha1:8a5befc548865cec54ed4273cf87dbbad60d1e47"),
        ),
        corpus="wikitext",
    ),
    "wikitext-2": Source(
        url=f"{_WIKITEXT}/wikitext-2-v1.zip",
        members=(
            Member("wikitext-2/wiki.train.tokens", "wiki.train.tokens",
                   "sha256:9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f", 10_797_148),
            Member("wikitext-2/wiki.valid.tokens", "wiki.valid.tokens",
                   "sha256:f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8", 1_121_681),
            Member("wikitext-2/wiki.test.tokens", "wiki.test.tokens",
                   "sha256:d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0", 1_256_449),
        ),
        corpus="wikitext",
    ),
    "enwik8": Source(
        url="http://mattmahoney.net/dc/enwik8.zip",
        members=(Member("enwik8", "enwik8", "md5:a1fa5ffddb56f4953e226637dabbb36a", 100_000_000),),
        input_name="enwik8",
        corpus="enwik8",
    ),
    "text8": Source(
        url="http://mattmahoney.net/dc/text8.zip",
        members=(Member("text8", "text8", "sha1:0dc3edebc970dcc96137e7deda4d9995af9d93de", 100_000_000),),
        input_name="text8",
        corpus="text8",
    ),
}


def _hasher(checksum: str):
    algorithm, _, expected = checksum.partition(":")
    if algorithm not in ("md5", "sha1", "sha256") or not expected:
        raise ValueError(f"checksum {checksum!r} is not 'md5|sha1|sha256:hexdigest'")
    return hashlib.new(algorithm), expected.lower()


def file_matches(path: Path, member: Member) -> bool:
    """Whether `path` already holds the member's verified content (lets a re-run skip the download)."""
    if not path.is_file() or (member.size is not None and path.stat().st_size != member.size):
        return False
    digest, expected = _hasher(member.checksum)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest() == expected


def extract(archive: Path, source: Source, dest: Path) -> Path:
    """Copy the source's members out of `archive` into `dest`, verifying size and checksum while copying.
    Returns the path to pass to `read_corpus`. A bad member leaves no file under its final name."""
    archive, dest = Path(archive), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        zf = zipfile.ZipFile(archive)
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{archive} is not a readable zip file ({e}): delete it and download again") from None
    with zf:
        names = set(zf.namelist())
        for member in source.members:
            if member.archive_name not in names:
                raise DataError(f"{archive} has no member {member.archive_name!r}: delete it and download again "
                                f"from {source.url}")
            target = dest / member.name
            partial = dest / (member.name + ".partial")
            digest, expected = _hasher(member.checksum)
            size = 0
            with zf.open(member.archive_name) as src, open(partial, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            problem = None
            if member.size is not None and size != member.size:
                problem = f"{size:,} bytes, expected {member.size:,}"
            elif digest.hexdigest() != expected:
                problem = f"{digest.name} {digest.hexdigest()}, expected {expected}"
            if problem:
                partial.unlink()
                raise DataError(f"{archive}: member {member.archive_name} has {problem}: the download is corrupt "
                                f"or the source changed; delete {archive} and download again from {source.url}")
            partial.replace(target)
    return source.input_path(dest)


def fetch(url: str, path: Path, timeout: float = 60.0) -> None:
    """Download `url` to `path` (through a .partial file, so an interrupted download is never mistaken for one)."""
    partial = Path(str(path) + ".partial")
    with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
        shutil.copyfileobj(response, out, 1 << 20)
    partial.replace(path)


def download(name: str, dest: Path, keep_archive: bool = False) -> Path:
    """Fetch, verify and lay out corpus `name` under `dest`; returns the `--input` path. Files already present
    and verified are not fetched again."""
    if name not in SOURCES:
        raise DataError(f"unknown corpus {name!r} to download: use one of {', '.join(SOURCES)}")
    source = SOURCES[name]
    dest = Path(dest)
    if all(file_matches(dest / member.name, member) for member in source.members):
        return source.input_path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / source.archive
    if not archive.is_file():
        fetch(source.url, archive)
    result = extract(archive, source, dest)
    if not keep_archive:
        archive.unlink()
    return result
