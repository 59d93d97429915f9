"""Corpus readers (published WikiText article counts, small corpora of every kind, every error message) and the
download helpers that lay corpora out for them (extraction and checksums on small zips; no network)."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest

import memlm.data_pipeline.download as download_module
from memlm.data_pipeline.corpora import BYTE_SPLITS, Document, read_corpus
from memlm.data_pipeline.download import SOURCES, Member, Source, download, extract, file_matches
from memlm.data_pipeline.format import DataError

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
WIKITEXT2 = DATA / "wikitext-2"
WIKITEXT103_EVAL = DATA / "wikitext-103-eval"


# ---------------------------------------------------------------- WikiText: the real files


@pytest.mark.parametrize(
    "folder, split, articles",
    [(WIKITEXT2, "train", 600), (WIKITEXT2, "valid", 60), (WIKITEXT2, "test", 60),
     (WIKITEXT103_EVAL, "valid", 60), (WIKITEXT103_EVAL, "test", 60)],
)
def test_wikitext_articles_match_published_counts_and_cover_the_file(folder, split, articles):
    documents = list(read_corpus("wikitext", folder, split))
    assert len(documents) == articles
    # Every line belongs to exactly one article, in order: the texts concatenated are the file.
    assert "".join(d.text for d in documents).encode("utf-8") == (folder / f"wiki.{split}.tokens").read_bytes()
    assert all(d.data is None for d in documents)


def test_wikitext_titles_and_article_boundaries_on_the_real_file():
    documents = list(read_corpus("wikitext", WIKITEXT2, "valid"))
    assert documents[0].title == "Homarus gammarus"
    # The file's leading blank line opens the first article; later articles start at their title line and
    # the blank line before a title closes the previous article.
    assert documents[0].text.startswith(" \n = Homarus gammarus = \n \n")
    assert all(d.text.startswith(f" = {d.title} = \n") for d in documents[1:])
    assert all(d.text.endswith(" \n") for d in documents)


# ---------------------------------------------------------------- WikiText: the article rule on small files


def write_wikitext(folder: Path, split: str, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"wiki.{split}.tokens"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_wikitext_subheadings_and_title_lookalikes_do_not_start_articles(tmp_path):
    lines = [
        " = First = ",  # first line of the file: counts as preceded by a blank
        " ",
        " text one ",
        " ",
        " = = Sub heading = = ",  # two '=' each side: a section, not an article
        " ",
        " more text ",
        " = x = ",  # looks like a title but has text right before it
        " ",
        " ",
        " = y = ",  # blank before, but text right after it
        " after y ",
        " ",
        " = Second = ",
        " ",
        " body ",
    ]
    write_wikitext(tmp_path, "train", lines)
    documents = list(read_corpus("wikitext", tmp_path, "train"))
    assert [d.title for d in documents] == ["First", "Second"]
    assert documents[1].text == " = Second = \n \n body \n"
    assert "".join(d.text for d in documents) == "".join(line + "\n" for line in lines)


def test_wikitext_title_needs_a_real_blank_line_after_it(tmp_path):
    # A title as the last line of the file has no blank line after it: it stays in the previous article.
    write_wikitext(tmp_path, "train", [" = A = ", " ", " a ", " ", " = B = "])
    assert [d.title for d in read_corpus("wikitext", tmp_path, "train")] == ["A"]


def test_wikitext_without_a_final_newline_keeps_the_last_line(tmp_path):
    (tmp_path / "wiki.train.tokens").write_text(" = A = \n \n last", encoding="utf-8")
    [document] = read_corpus("wikitext", tmp_path, "train")
    assert document.text == " = A = \n \n last"


# ---------------------------------------------------------------- textdir and jsonl


def test_textdir_reads_txt_files_in_sorted_order(tmp_path):
    split = tmp_path / "train"
    split.mkdir()
    (split / "b.txt").write_text("second\n", encoding="utf-8")
    (split / "a.txt").write_text("first é\nline two", encoding="utf-8")
    (split / "notes.md").write_text("not a document", encoding="utf-8")
    documents = list(read_corpus("textdir", tmp_path, "train"))
    assert documents == [Document("a.txt", "first é\nline two"), Document("b.txt", "second\n")]


def test_jsonl_titles_come_from_title_then_id_then_line_number(tmp_path):
    records = [{"text": "one", "title": "T"}, {"text": "two", "id": 7}, {"text": "three"}]
    lines = [json.dumps(records[0]), "", json.dumps(records[1]), "   ", json.dumps(records[2])]
    (tmp_path / "valid.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    documents = list(read_corpus("jsonl", tmp_path, "valid"))
    assert documents == [Document("T", "one"), Document("7", "two"), Document("line 5", "three")]


# ---------------------------------------------------------------- enwik8 and text8

SMALL_SPLITS = (900, 50, 50)  # the 90/5/5 proportions of the real 100M-byte split, on a 1,000-byte file


def test_byte_corpus_split_arithmetic(tmp_path):
    raw = bytes(range(256)) * 4 + b"tail beyond the first 1,000 bytes"
    path = tmp_path / "text8"
    path.write_bytes(raw)
    parts = {split: list(read_corpus("text8", path, split, byte_splits=SMALL_SPLITS))
             for split in ("train", "valid", "test")}
    assert [len(p) for p in parts.values()] == [1, 1, 1]  # one stream per split, as the papers treat it
    assert parts["train"][0] == Document("text8:train", data=raw[:900])
    assert parts["valid"][0].data == raw[900:950]
    assert parts["test"][0].data == raw[950:1000]
    assert parts["train"][0].text is None


def test_default_split_is_90_5_5_million_bytes():
    assert BYTE_SPLITS == (90_000_000, 5_000_000, 5_000_000)


def fake_enwik8() -> bytes:
    pages = "".join(
        f"  <page>\n    <title>Page {k}</title>\n    <text>body {k} \u00e9</text>\n  </page>\n" for k in range(12)
    )
    return ('<mediawiki xml:lang="en">\n  <siteinfo>site</siteinfo>\n' + pages).encode("utf-8")


def test_enwik8_split_pages_cuts_before_each_page_and_keeps_every_byte(tmp_path):
    raw = fake_enwik8()
    splits = (len(raw) - 200, 100, 100)
    path = tmp_path / "enwik8"
    path.write_bytes(raw)
    start = 0
    for split, size in zip(("train", "valid", "test"), splits):
        documents = list(read_corpus("enwik8", path, split, split_pages=True, byte_splits=splits))
        assert b"".join(d.data for d in documents) == raw[start:start + size]
        # Pieces after the first begin at the indentation of a <page> line.
        assert all(d.data.startswith(b"  <page>") for d in documents[1:])
        start += size
    train = list(read_corpus("enwik8", path, "train", split_pages=True, byte_splits=splits))
    # The <siteinfo> header before the first page is a document of its own, titled by its position.
    assert train[0] == Document("enwik8:train:0", data=raw[:raw.index(b"  <page>")])
    assert [d.title for d in train[1:4]] == ["Page 0", "Page 1", "Page 2"]
    valid = list(read_corpus("enwik8", path, "valid", split_pages=True, byte_splits=splits))
    assert not valid[0].data.startswith(b"  <page>")  # the tail of a page cut by the 90M-style boundary


# ---------------------------------------------------------------- errors: each names the file and the fix


def assert_data_error(documents_call, *fragments: str) -> str:
    with pytest.raises(DataError) as info:
        list(documents_call())
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_inputs(tmp_path):
    missing = tmp_path / "nowhere"
    assert_data_error(lambda: read_corpus("wikitext", missing, "train"), str(missing))
    tmp_path.joinpath("wt").mkdir()
    assert_data_error(lambda: read_corpus("wikitext", tmp_path / "wt", "valid"), "wiki.valid.tokens")
    assert_data_error(lambda: read_corpus("textdir", tmp_path, "test"), str(tmp_path / "test"))
    assert_data_error(lambda: read_corpus("jsonl", tmp_path, "train"), "train.jsonl")
    assert_data_error(lambda: read_corpus("enwik8", missing / "enwik8", "train"), "enwik8")


def test_errors_are_raised_when_called_not_when_first_iterated(tmp_path):
    # prepare.py can check every split's input up front, before spending time on the train split.
    with pytest.raises(DataError):
        read_corpus("jsonl", tmp_path, "train")


def test_empty_split(tmp_path):
    (tmp_path / "train").mkdir()
    assert_data_error(lambda: read_corpus("textdir", tmp_path, "train"), str(tmp_path), "no documents")
    (tmp_path / "wiki.train.tokens").write_bytes(b"")
    assert_data_error(lambda: read_corpus("wikitext", tmp_path, "train"), str(tmp_path), "no documents")
    (tmp_path / "train.jsonl").write_text("\n\n", encoding="utf-8")
    assert_data_error(lambda: read_corpus("jsonl", tmp_path, "train"), str(tmp_path), "no documents")


def test_empty_documents(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.txt").write_text("x", encoding="utf-8")
    (tmp_path / "train" / "empty.txt").write_bytes(b"")
    assert_data_error(lambda: read_corpus("textdir", tmp_path, "train"), str(tmp_path / "train" / "empty.txt"), "empty")
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n{"text": ""}\n', encoding="utf-8")
    assert_data_error(lambda: read_corpus("jsonl", tmp_path, "train"), f"{tmp_path / 'train.jsonl'}:2", "empty")


def test_wikitext_without_titles_is_not_wikitext(tmp_path):
    write_wikitext(tmp_path, "train", ["plain text", "more"])
    assert_data_error(lambda: read_corpus("wikitext", tmp_path, "train"), "wiki.train.tokens", "title")


@pytest.mark.parametrize("kind", ["wikitext", "textdir", "jsonl"])
def test_non_utf8_bytes_name_the_file_and_byte_offset(tmp_path, kind):
    good = {"wikitext": b" = A = \n \n", "textdir": b"abc\n", "jsonl": b'{"text": "ok"}\n'}[kind]
    bad = good + b"caf\xe9\n"  # Latin-1 e-acute
    offset = len(good) + 3
    if kind == "wikitext":
        path = tmp_path / "wiki.train.tokens"
    elif kind == "textdir":
        (tmp_path / "train").mkdir()
        path = tmp_path / "train" / "doc.txt"
    else:
        path = tmp_path / "train.jsonl"
    path.write_bytes(bad)
    assert_data_error(lambda: read_corpus(kind, tmp_path, "train"), str(path), f"byte offset {offset}", "UTF-8")


def test_malformed_json_and_missing_text(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "unterminated\n', encoding="utf-8")
    assert_data_error(lambda: read_corpus("jsonl", tmp_path, "train"), f"{path}:2", "malformed JSON")
    path.write_text('{"text": "fine"}\n\n{"body": "no text"}\n', encoding="utf-8")
    assert_data_error(lambda: read_corpus("jsonl", tmp_path, "train"), f"{path}:3", "'text'")
    path.write_text('["a list"]\n', encoding="utf-8")
    assert_data_error(lambda: read_corpus("jsonl", tmp_path, "train"), f"{path}:1", "object")


def test_truncated_byte_corpus(tmp_path):
    path = tmp_path / "enwik8"
    path.write_bytes(b"x" * 999)
    assert_data_error(lambda: read_corpus("enwik8", path, "test", byte_splits=SMALL_SPLITS), str(path), "999", "1,000")
    with pytest.raises(DataError, match="100,000,000"):
        read_corpus("enwik8", path, "train")  # the real split needs the full file


def test_bad_arguments(tmp_path):
    with pytest.raises(DataError, match="split"):
        read_corpus("wikitext", WIKITEXT2, "dev")
    with pytest.raises(DataError, match="corpus kind"):
        read_corpus("ptb", WIKITEXT2, "train")
    with pytest.raises(DataError, match="enwik8 only"):
        read_corpus("text8", tmp_path / "text8", "train", split_pages=True)


# ---------------------------------------------------------------- download: extraction, checksums, layout (no network)

SMALL_WIKITEXT = {split: f" \n = {split} article = \n \n words of {split} \n".encode()
                  for split in ("train", "valid", "test")}


def small_wikitext_source(checksums: dict[str, str] | None = None) -> Source:
    members = tuple(
        Member(f"wikitext-x/wiki.{split}.tokens", f"wiki.{split}.tokens",
               (checksums or {}).get(split, "sha256:" + hashlib.sha256(content).hexdigest()), len(content))
        for split, content in SMALL_WIKITEXT.items()
    )
    return Source(url="https://example.invalid/wikitext-x.zip", members=members, corpus="wikitext")


def make_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, content in members.items():
            zf.writestr(name, content)
    return path


def small_wikitext_zip(tmp_path: Path) -> Path:
    members = {f"wikitext-x/wiki.{split}.tokens": content for split, content in SMALL_WIKITEXT.items()}
    members["../escape.txt"] = b"an archive must not write outside dest"
    return make_zip(tmp_path / "wikitext-x.zip", members)


def test_extract_lays_out_a_folder_read_corpus_reads(tmp_path):
    dest = tmp_path / "out"
    input_path = extract(small_wikitext_zip(tmp_path), small_wikitext_source(), dest)
    assert input_path == dest
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "wiki.test.tokens", "wiki.train.tokens", "wiki.valid.tokens", "wikitext-x.zip"]  # nothing else, no escape
    [document] = read_corpus("wikitext", input_path, "valid")
    assert document.title == "valid article"


def test_extract_byte_corpus_gives_the_raw_file(tmp_path):
    raw = bytes(range(256)) * 4
    source = Source(url="http://example.invalid/enwik8.zip",
                    members=(Member("enwik8", "enwik8", "md5:" + hashlib.md5(raw).hexdigest(), 1024),),
                    input_name="enwik8", corpus="enwik8")
    input_path = extract(make_zip(tmp_path / "enwik8.zip", {"enwik8": raw}), source, tmp_path / "out")
    assert input_path == tmp_path / "out" / "enwik8"
    [document] = read_corpus("enwik8", input_path, "valid", byte_splits=SMALL_SPLITS)
    assert document.data == raw[900:950]


def test_extract_rejects_a_bad_checksum_and_leaves_no_file(tmp_path):
    dest = tmp_path / "out"
    source = small_wikitext_source({"valid": "sha1:" + "0" * 40})
    with pytest.raises(DataError, match=r"wikitext-x\.zip.*wiki\.valid\.tokens.*sha1"):
        extract(small_wikitext_zip(tmp_path), source, dest)
    assert not (dest / "wiki.valid.tokens").exists() and not list(dest.glob("*.partial"))


def test_extract_rejects_wrong_size_missing_member_and_non_zip(tmp_path):
    archive = small_wikitext_zip(tmp_path)
    wrong_size = Source(url="https://example.invalid/x.zip", members=(
        Member("wikitext-x/wiki.test.tokens", "wiki.test.tokens", "sha256:" + "0" * 64, 1),))
    with pytest.raises(DataError, match="bytes, expected 1"):
        extract(archive, wrong_size, tmp_path / "out")
    missing = Source(url="https://example.invalid/x.zip",
                     members=(Member("nope/wiki.train.tokens", "wiki.train.tokens", "md5:0"),))
    with pytest.raises(DataError, match="no member 'nope/wiki.train.tokens'"):
        extract(archive, missing, tmp_path / "out")
    not_zip = tmp_path / "broken.zip"
    not_zip.write_bytes(b"<html>an error page, not a zip</html>")
    with pytest.raises(DataError, match="broken.zip"):
        extract(not_zip, missing, tmp_path / "out")


def test_source_table_layout():
    for name, source in SOURCES.items():
        assert source.url.startswith(("http://", "https://")) and source.archive.endswith(".zip"), name
        for member in source.members:
            algorithm, _, digest = member.checksum.partition(":")
            assert len(digest) == hashlib.new(algorithm).digest_size * 2, name
        if source.corpus == "wikitext":
            names = sorted(m.name for m in source.members)
            assert names == ["wiki.test.tokens", "wiki.train.tokens", "wiki.valid.tokens"]
            assert source.input_path(Path("d")) == Path("d")
        else:
            assert source.input_path(Path("d")) == Path("d") / name
            assert [m.size for m in source.members] == [100_000_000]


@pytest.mark.parametrize("name, folder, split", [
    ("wikitext-2", WIKITEXT2, "train"), ("wikitext-2", WIKITEXT2, "valid"), ("wikitext-2", WIKITEXT2, "test"),
    ("wikitext-103", WIKITEXT103_EVAL, "valid"), ("wikitext-103", WIKITEXT103_EVAL, "test")])
def test_source_table_checksums_match_the_shared_copies(name, folder, split):
    # The table's WikiText checksums verify against the real files (WikiText-103's against the eval copies).
    [member] = [m for m in SOURCES[name].members if m.name == f"wiki.{split}.tokens"]
    assert file_matches(folder / member.name, member)


def test_download_skips_verified_files_and_fetches_otherwise(tmp_path, monkeypatch):
    dest = tmp_path / "wikitext-2"
    dest.mkdir()
    for split in ("train", "valid", "test"):
        shutil.copyfile(WIKITEXT2 / f"wiki.{split}.tokens", dest / f"wiki.{split}.tokens")

    def no_network(url, path, timeout=60.0):
        raise AssertionError(f"fetched {url}")

    monkeypatch.setattr(download_module, "fetch", no_network)
    assert download("wikitext-2", dest) == dest  # everything verified: nothing fetched

    # A fresh destination fetches the archive (here: a local copy standing in for the network) and extracts it.
    monkeypatch.setitem(SOURCES, "wikitext-x", small_wikitext_source())
    zip_path = small_wikitext_zip(tmp_path)
    monkeypatch.setattr(download_module, "fetch", lambda url, path, timeout=60.0: shutil.copyfile(zip_path, path))
    fresh = tmp_path / "fresh"
    assert download("wikitext-x", fresh) == fresh
    assert sorted(p.name for p in fresh.iterdir()) == ["wiki.test.tokens", "wiki.train.tokens", "wiki.valid.tokens"]
    with pytest.raises(DataError, match="unknown corpus"):
        download("ptb", fresh)
