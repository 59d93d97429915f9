"""`memlm prepare` end to end through the real command line (a subprocess each, ~0.3-3 s)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memlm.data_pipeline.format import MANIFEST
from memlm.data_pipeline.shards import read_shard, verify_manifest
from memlm.data_pipeline.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WIKITEXT2 = ROOT.parent / "shared" / "data" / "wikitext-2"

TEXTS = {
    "train": ["the cat sat on the mat\nthe dog sat\n", "a b c\n\nd e f g\n", "the end of the train split\n"],
    "valid": ["the cat ran\n", "an unseen word zebra\n"],
    "test": ["the mat\nthe dog\n"],
}


def memlm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memlm", "prepare", *args], cwd=ROOT, capture_output=True, text=True)


def _textdir(root: Path, texts=TEXTS) -> Path:
    for split, docs in texts.items():
        (root / split).mkdir(parents=True)
        for i, text in enumerate(docs):
            (root / split / f"{i:03d}.txt").write_text(text)
    return root


def _jsonl(root: Path) -> Path:
    root.mkdir()
    for split, docs in TEXTS.items():
        lines = [json.dumps({"text": text, "title": f"{split} {i}"}) for i, text in enumerate(docs)]
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _documents(data_dir: Path, split: str) -> list[dict]:
    manifest = json.loads((data_dir / MANIFEST).read_text())
    return [doc for shard in manifest["splits"][split]["shards"]
            for doc in read_shard(data_dir / shard["path"], shard["sha256"])]


def _assert_failed(run: subprocess.CompletedProcess, *fragments: str) -> None:
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memlm: error: "), run.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("kind", ["textdir", "jsonl"])
def test_small_corpus_end_to_end_and_deterministic(tmp_path, kind):
    corpus = _textdir(tmp_path / "corpus") if kind == "textdir" else _jsonl(tmp_path / "corpus")
    run = memlm("--corpus", kind, "--input", str(corpus), "--out", str(tmp_path / "a"), "--shard-tokens", "8")
    assert run.returncode == 0, run.stderr
    manifest = verify_manifest(tmp_path / "a")
    assert manifest["corpus"] == {"kind": kind, "input": str(corpus)}
    tok = load_tokenizer(tmp_path / "a" / "tokenizer")
    assert manifest["tokenizer"] == {**tok.identity(), "path": "tokenizer"}
    for split, texts in TEXTS.items():
        docs = _documents(tmp_path / "a", split)
        expected = [tok.encode(text).tolist() for text in texts]  # the tokenizer, applied independently
        assert [d["tokens"].tolist() for d in docs] == expected
        entry = manifest["splits"][split]
        assert (entry["documents"], entry["tokens"]) == (len(texts), sum(map(len, expected)))
    assert len(manifest["splits"]["train"]["shards"]) > 1  # --shard-tokens 8 rolled over
    # the same input again, into another folder: every file identical
    assert memlm("--corpus", kind, "--input", str(corpus), "--out", str(tmp_path / "b"),
                 "--shard-tokens", "8").returncode == 0
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")


def test_failures_leave_no_folder_and_keep_an_earlier_one(tmp_path):
    empty = _textdir(tmp_path / "empty", {**TEXTS, "valid": []})
    run = memlm("--corpus", "textdir", "--input", str(empty), "--out", str(tmp_path / "new" / "folders" / "out"))
    _assert_failed(run, "no documents")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no out, no out.tmp-*, no parents made for it
    # Refused before anything is made (issue 32: a refused task left an empty parent folder behind)
    run = memlm("--corpus", "task", "--task", "passkey", "--task-length", "16", "--out", str(tmp_path / "new" / "out"))
    _assert_failed(run, "passkey: --task-length (the sample's bytes) must be >= ",
                   "for a 5-digit key and the question, got 16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]

    good = _textdir(tmp_path / "good")
    assert memlm("--corpus", "textdir", "--input", str(good), "--out", str(tmp_path / "out")).returncode == 0
    before = _hashes(tmp_path / "out")
    _assert_failed(memlm("--corpus", "textdir", "--input", str(good), "--out", str(tmp_path / "out")), "--overwrite")

    bad = _textdir(tmp_path / "bad")
    (bad / "test" / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    run = memlm("--corpus", "textdir", "--input", str(bad), "--out", str(tmp_path / "out"), "--overwrite")
    _assert_failed(run, "latin1.txt", "UTF-8")
    assert _hashes(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "empty", "good", "out"]

    # --overwrite with a good corpus replaces it
    assert memlm("--corpus", "textdir", "--input", str(bad / ".." / "good"), "--out", str(tmp_path / "out"),
                 "--overwrite").returncode == 0
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["corpus"]["input"] == str(bad / ".." / "good")


def test_argument_mistakes_are_one_line(tmp_path):
    _assert_failed(memlm("--corpus", "wikitext", "--input", str(tmp_path / "nope"), "--out", str(tmp_path / "o")),
                   "nope")
    _assert_failed(memlm("--corpus", "task", "--out", str(tmp_path / "o")), "--task")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    _assert_failed(memlm("--corpus", "task", "--task", "copy", "--out", str(tmp_path / "mine"), "--overwrite"),
                   "not a prepared data folder")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_wikitext2_published_token_counts(tmp_path):
    out = tmp_path / "wt2"
    run = memlm("--corpus", "wikitext", "--input", str(WIKITEXT2), "--out", str(out))
    assert run.returncode == 0, run.stderr
    splits = verify_manifest(out)["splits"]
    assert {s: (e["documents"], e["tokens"]) for s, e in splits.items()} == {
        "train": (600, 2_088_628), "valid": (60, 217_646), "test": (60, 245_569)}
    first = _documents(out, "valid")[0]
    assert first["title"] == "Homarus gammarus" and first["tokens"].dtype.itemsize == 2


def test_spm_bpe_and_tokenizer_reuse(tmp_path):
    corpus = _textdir(tmp_path / "corpus")
    args = ["--corpus", "textdir", "--input", str(corpus), "--tokenizer", "spm-bpe", "--vocab-size", "300"]
    assert memlm(*args, "--out", str(tmp_path / "one"), "--workers", "1").returncode == 0
    assert memlm(*args, "--out", str(tmp_path / "two"), "--workers", "2").returncode == 0
    assert _hashes(tmp_path / "one") == _hashes(tmp_path / "two")  # the process pool changes nothing
    manifest = verify_manifest(tmp_path / "one")
    assert manifest["tokenizer"]["kind"] == "spm-bpe" and manifest["tokenizer"]["vocab_size"] == 300
    assert (tmp_path / "one" / "tokenizer" / "spm.model").is_file()
    tok = load_tokenizer(tmp_path / "one" / "tokenizer")
    assert [tok.decode(d["tokens"]) for d in _documents(tmp_path / "one", "valid")] == TEXTS["valid"]

    run = memlm("--corpus", "jsonl", "--input", str(_jsonl(tmp_path / "j")), "--out", str(tmp_path / "three"),
                "--tokenizer-from", str(tmp_path / "one" / "tokenizer"))
    assert run.returncode == 0, run.stderr
    assert verify_manifest(tmp_path / "three")["tokenizer"] == manifest["tokenizer"]
