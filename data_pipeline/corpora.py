"""Corpus readers: a corpus folder or file -> a stream of `Document`s for one split.

A Document is the unit that memory never crosses (docs/design.md §2). Readers stream: they hold one document
(one WikiText article, one text file, one JSON record, one enwik8 page or one byte-corpus split) at a time.

Kinds and what one document is:
    wikitext  INPUT/wiki.{split}.tokens; one article. An article starts at a title line ` = Title = ` (exactly one
              '=' each side, so not ` = = Sub = = `) with a blank line before it (the start of the file counts as
              blank) and a blank line after it. Every line of the file belongs to exactly one article, in file order:
              lines before the first title (the file's leading blank line) open the first article, and the blank
              line before a title closes the previous one. Document.text is the article's lines exactly as in the
              file, each ending in "\n", so the articles' texts concatenated give back the file.
    textdir   INPUT/{split}/*.txt in sorted name order; one file (title = file name).
    jsonl     INPUT/{split}.jsonl; one record `{"text": ..., "title"?: ..., "id"?: ...}` per line (blank lines
              skipped); title = `title`, else `id`, else "line N".
    enwik8    the raw file; bytes [0, 90M) train, [90M, 95M) valid, [95M, 100M) test, as the papers split it. One
    text8     document per split (Document.data), or, for enwik8 with split_pages=True, one per `<page>` (title
              from its <title>), the bytes before a split's first `<page>` being one more document.

Text corpora must be UTF-8; byte corpora (enwik8, text8) are bytes and carry `data` instead of `text`.
Every problem raises DataError naming the file (and line, article or byte offset) and the fix: a missing input or
a bad argument when read_corpus is called, a bad document or an empty split while iterating.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .format import SPLITS, DataError

CORPUS_KINDS = ("wikitext", "enwik8", "text8", "textdir", "jsonl")

# The papers' enwik8/text8 split: the first 100M bytes as 90M train, 5M valid, 5M test.
BYTE_SPLITS = (90_000_000, 5_000_000, 5_000_000)


@dataclass
class Document:
    title: str
    text: str | None = None  # text corpora
    data: bytes | None = None  # byte corpora (enwik8, text8)


def read_corpus(
    kind: str,
    input_path: str | Path,
    split: str,
    split_pages: bool = False,
    *,
    byte_splits: tuple[int, int, int] = BYTE_SPLITS,
) -> Iterator[Document]:
    """Yield the documents of one split, in corpus order. `byte_splits` exists so tests can use a small file."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    if kind not in CORPUS_KINDS:
        raise DataError(f"unknown corpus kind {kind!r}: use one of {', '.join(CORPUS_KINDS)}")
    if split_pages and kind != "enwik8":
        raise DataError(f"split_pages applies to enwik8 only (its <page> elements), not to {kind}")
    path = Path(input_path)
    if kind == "wikitext":
        documents = _read_wikitext(path, split)
    elif kind == "textdir":
        documents = _read_textdir(path, split)
    elif kind == "jsonl":
        documents = _read_jsonl(path, split)
    else:
        documents = _read_bytes_corpus(kind, path, split, split_pages, byte_splits)
    return _nonempty(documents, f"{kind} corpus {path}, split {split!r}")


def _nonempty(documents: Iterator[Document], what: str) -> Iterator[Document]:
    """Pass documents through; an empty split is an error (a typo'd folder should not give an empty dataset)."""
    count = 0
    for document in documents:
        count += 1
        yield document
    if count == 0:
        raise DataError(f"{what} has no documents: check the path and that the split holds data")


# ---------------------------------------------------------------- text helpers


def _decode(raw: bytes, path: Path, offset: int) -> str:
    """Strict UTF-8 decoding; `offset` is where `raw` starts in the file, so the error names the exact byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: byte offset {offset + e.start} is not valid UTF-8 ({raw[e.start:e.start + 4]!r}): "
            "re-encode the file as UTF-8 (e.g. iconv -t UTF-8), or use a byte-level corpus kind"
        ) from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line including its "\n") for a UTF-8 file, one line in memory at a time.

    Lines end at "\n" only (not at the other characters str.splitlines() treats as breaks), which is how the
    WikiText line counts are defined."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            yield number, _decode(raw, path, offset)
            offset += len(raw)


def _require_file(path: Path, fix: str) -> None:
    if not path.is_file():
        raise DataError(f"{path} does not exist or is not a file: {fix}")


# ---------------------------------------------------------------- wikitext


def _is_blank(line: str) -> bool:
    return not line.strip()


def _title_of(line: str) -> str | None:
    """The title if `line` looks like ` = Title = ` (one '=' each side), else None. Blank lines around it are
    checked by the caller: equation and table lines can look like titles too."""
    s = line.strip()
    if len(s) < 5 or not (s.startswith("= ") and s.endswith(" =")):
        return None
    inner = s[2:-2].strip()
    if not inner or inner.startswith("=") or inner.endswith("="):
        return None  # ` = = Sub = = ` and deeper headings
    return inner


def _read_wikitext(folder: Path, split: str) -> Iterator[Document]:
    if not folder.is_dir():
        raise DataError(
            f"WikiText folder {folder} does not exist: pass the folder holding wiki.{{train,valid,test}}.tokens"
        )
    path = folder / f"wiki.{split}.tokens"
    _require_file(path, f"the WikiText folder must hold wiki.{split}.tokens (from the wikitext-*-v1.zip release)")
    return _wikitext_articles(path)


def _wikitext_articles(path: Path) -> Iterator[Document]:
    lines = _lines(path)
    title: str | None = None  # title of the article being collected; None before the first title
    collected: list[str] = []
    previous_blank = True  # the start of the file counts as a blank line before a title
    current = next(lines, None)
    while current is not None:
        following = next(lines, None)
        _, line = current
        candidate = _title_of(line) if previous_blank else None
        if candidate is not None and following is not None and _is_blank(following[1]):
            if title is not None:
                yield Document(title=title, text="".join(collected))
                collected = []
            title = candidate  # lines before the first title (the leading blank) stay in `collected`
        collected.append(line)
        previous_blank = _is_blank(line)
        current = following
    if title is not None:
        yield Document(title=title, text="".join(collected))
    elif collected:
        raise DataError(
            f"{path} has no article title line (' = Title = ' between blank lines): it is not WikiText; "
            "use --corpus textdir or jsonl for plain text"
        )


# ---------------------------------------------------------------- textdir and jsonl


def _read_textdir(root: Path, split: str) -> Iterator[Document]:
    folder = root / split
    if not folder.is_dir():
        raise DataError(
            f"text folder {folder} does not exist: --input must hold train/, valid/ and test/ folders of .txt files"
        )
    return _text_files(folder)


def _text_files(folder: Path) -> Iterator[Document]:
    for path in sorted(folder.glob("*.txt")):
        if not path.is_file():
            continue
        text = _decode(path.read_bytes(), path, 0)
        if not text:
            raise DataError(f"{path} is empty: a document needs at least one character; delete the file or fill it")
        yield Document(title=path.name, text=text)


def _read_jsonl(root: Path, split: str) -> Iterator[Document]:
    if not root.is_dir():
        raise DataError(
            f"JSONL folder {root} does not exist: --input must hold train.jsonl, valid.jsonl and test.jsonl"
        )
    path = root / f"{split}.jsonl"
    _require_file(path, f"the JSONL folder must hold {split}.jsonl, one JSON object with a 'text' field per line")
    return _jsonl_records(path)


def _jsonl_records(path: Path) -> Iterator[Document]:
    for number, line in _lines(path):
        if _is_blank(line):
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg}, column {e.colno}): fix or remove the line") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: a record must be a JSON object with a 'text' field, got {type(record).__name__}")
        if "text" not in record:
            raise DataError(f"{where}: the record has no 'text' field: add one (keys present: {sorted(record)})")
        text = record["text"]
        if not isinstance(text, str):
            raise DataError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        if not text:
            raise DataError(f"{where}: 'text' is empty: a document needs at least one character; drop the record")
        if record.get("title") is not None:
            title = str(record["title"])
        elif record.get("id") is not None:
            title = str(record["id"])
        else:
            title = f"line {number}"
        yield Document(title=title, text=text)


# ---------------------------------------------------------------- enwik8 and text8


def _read_bytes_corpus(
    kind: str, path: Path, split: str, split_pages: bool, byte_splits: tuple[int, int, int]
) -> Iterator[Document]:
    _require_file(
        path, f"pass the raw {kind} file (unzipped from mattmahoney.net/dc/{kind}.zip; see data_pipeline.download)"
    )
    needed = sum(byte_splits)
    size = path.stat().st_size
    if size < needed:
        raise DataError(
            f"{path} has {size:,} bytes but the {kind} splits need the first {needed:,}: the file is truncated; "
            f"download {kind}.zip again"
        )
    index = SPLITS.index(split)
    start = sum(byte_splits[:index])
    return _byte_documents(path, split, start, start + byte_splits[index], split_pages)


def _byte_documents(path: Path, split: str, start: int, end: int, split_pages: bool) -> Iterator[Document]:
    if not split_pages:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        yield Document(title=f"{path.name}:{split}", data=data)
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for k, (a, b) in enumerate(_page_bounds(mm, start, end)):
            data = mm[a:b]
            yield Document(title=_page_title(data) or f"{path.name}:{split}:{k}", data=data)


def _page_bounds(mm: mmap.mmap | bytes, start: int, end: int) -> Iterator[tuple[int, int]]:
    """Cut [start, end) before each `<page>` (and the indentation before it on its line). Every byte belongs to
    one piece, so a split's total is unchanged. The bytes before the first `<page>` (the file's <siteinfo> header,
    or the tail of a page cut by the split boundary) are a piece of their own."""
    cut = start
    position = mm.find(b"<page>", start, end)
    while position != -1:
        boundary = position
        while boundary > cut and mm[boundary - 1:boundary] in (b" ", b"\t"):
            boundary -= 1
        if boundary > cut:
            yield cut, boundary
            cut = boundary
        position = mm.find(b"<page>", position + 1, end)
    if end > cut:
        yield cut, end


def _page_title(data: bytes) -> str | None:
    a = data.find(b"<title>")
    if a == -1:
        return None
    b = data.find(b"</title>", a)
    if b == -1:
        return None
    return data[a + len(b"<title>"):b].decode("utf-8", errors="replace")
