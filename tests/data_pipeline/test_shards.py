"""Shard writer and reader: the on-disk contract of format.py, determinism, and every corruption named by file."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from memlm.data_pipeline.format import FORMAT_VERSION, MANIFEST, DataError, token_dtype
from memlm.data_pipeline.shards import read_shard, verify_manifest, write_split


def _documents(n: int, vocab_size: int, masked: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(0, vocab_size, size=int(rng.integers(1, 40)))
        tokens[0] = vocab_size - 1  # the largest id must survive the dtype
        mask = (rng.random(len(tokens)) < 0.5).astype(np.uint8) if masked and i % 3 else None
        out.append((tokens, mask, f"doc {i} \u00e9"))
    return out


def _read_split(root: Path, entry: dict) -> list[dict]:
    return [doc for shard in entry["shards"] for doc in read_shard(root / shard["path"], shard["sha256"])]


def _data_dir(tmp_path: Path, n: int = 30, shard_tokens: int = 100) -> Path:
    """A minimal finished DATA_DIR (manifest + tokenizer folder + shards) for verify_manifest."""
    root = tmp_path / "data"
    splits = {split: write_split(root, split, _documents(n, 300, seed=k), 300, shard_tokens)
              for k, split in enumerate(("train", "valid"))}
    (root / "tokenizer").mkdir()
    manifest = {"format": FORMAT_VERSION, "corpus": {"kind": "test", "input": "x"},
                "tokenizer": {"kind": "word", "vocab_size": 300, "path": "tokenizer"}, "splits": splits}
    (root / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2))
    return root


@pytest.mark.parametrize("vocab_size", [256, 257, 65536, 65537])
def test_round_trip_with_masks_and_dtype(tmp_path, vocab_size):
    docs = _documents(25, vocab_size, masked=True)
    entry = write_split(tmp_path, "train", docs, vocab_size)
    assert entry["documents"] == 25 and entry["tokens"] == sum(len(t) for t, _, _ in docs)
    read = _read_split(tmp_path, entry)
    assert [d["index"] for d in read] == list(range(25))
    for (tokens, mask, title), doc in zip(docs, read):
        assert doc["tokens"].dtype == token_dtype(vocab_size)
        np.testing.assert_array_equal(doc["tokens"], tokens)
        assert doc["title"] == title
        if mask is None:
            assert doc["mask"] is None
        else:
            assert doc["mask"].dtype == np.uint8
            np.testing.assert_array_equal(doc["mask"], mask)


def test_members_follow_the_contract(tmp_path):
    entry = write_split(tmp_path, "valid", _documents(3, 300, masked=True), 300)
    with tarfile.open(tmp_path / entry["shards"][0]["path"]) as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:4]] == ["000000000.meta.json", "000000000.tokens.bin",
                                             "000000001.mask.bin", "000000001.meta.json"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    with tarfile.open(tmp_path / entry["shards"][0]["path"]) as tar:
        meta = tar.extractfile("000000001.meta.json").read()
    assert meta == b'{"index":1,"title":"doc 1 \\u00e9","tokens":%d}' % json.loads(meta)["tokens"]


def test_shard_rollover_by_tokens(tmp_path):
    docs = [(np.full(n, 7), None, f"d{i}") for i, n in enumerate([60, 50, 10, 100, 1, 1, 5])]
    entry = write_split(tmp_path, "train", docs, 300, shard_tokens=100)
    # closed as soon as a shard reaches 100 tokens: [60, 50] [10, 100] [1, 1, 5]
    assert [(s["documents"], s["tokens"], s["first_index"]) for s in entry["shards"]] == [(2, 110, 0), (2, 110, 2),
                                                                                        (3, 7, 4)]
    assert [s["path"] for s in entry["shards"]] == [f"train/train-{k:05d}.tar" for k in range(3)]
    assert len(_read_split(tmp_path, entry)) == 7


def test_two_writes_are_byte_identical_and_hashes_match(tmp_path):
    docs = _documents(40, 1000, masked=True)
    a = write_split(tmp_path / "a", "train", docs, 1000, shard_tokens=200)
    b = write_split(tmp_path / "b", "train", docs, 1000, shard_tokens=200)
    assert a == b and len(a["shards"]) > 2
    for shard in a["shards"]:
        data = (tmp_path / "a" / shard["path"]).read_bytes()
        assert data == (tmp_path / "b" / shard["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["bytes"]


def test_zero_token_document_is_rejected_by_title(tmp_path):
    docs = [(np.array([1, 2]), None, "fine"), (np.array([], dtype=np.int64), None, "Empty Article")]
    with pytest.raises(DataError, match="Empty Article"):
        write_split(tmp_path, "train", docs, 300)


def test_bad_documents_are_rejected(tmp_path):
    with pytest.raises(DataError, match="outside the vocabulary"):
        write_split(tmp_path / "a", "train", [(np.array([300]), None, "t")], 300)
    with pytest.raises(DataError, match="mask of 1 entries for 2 tokens"):
        write_split(tmp_path / "b", "train", [(np.array([1, 2]), np.array([1], np.uint8), "t")], 300)
    with pytest.raises(DataError, match="no documents"):
        write_split(tmp_path / "c", "train", [], 300)


def test_verify_manifest_accepts_a_good_folder(tmp_path):
    root = _data_dir(tmp_path)
    manifest = verify_manifest(root)
    assert len(manifest["splits"]["train"]["shards"]) > 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "extra", "no_manifest"])
def test_damage_is_named(tmp_path, damage):
    root = _data_dir(tmp_path)
    shard = root / "train" / "train-00001.tar"
    data = shard.read_bytes()
    named = shard
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:700] + bytes([data[700] ^ 1]) + data[701:])
    elif damage == "missing":
        shard.unlink()
    elif damage == "extra":
        named = root / "valid" / "valid-00099.tar"
        shutil.copy(shard, named)
    else:
        named = root / MANIFEST
        named.unlink()
    with pytest.raises(DataError, match=str(named)):
        verify_manifest(root)
    if damage in ("truncate", "flip", "missing"):
        sha = json.loads((root / MANIFEST).read_text())["splits"]["train"]["shards"][1]["sha256"]
        with pytest.raises(DataError, match=str(shard)):
            list(read_shard(shard, expected_sha256=sha))


@pytest.mark.parametrize("cut", ["mid_member", "member_boundary", "before_end_marker"])
def test_truncated_shard_is_caught_without_a_hash(tmp_path, cut):
    entry = write_split(tmp_path, "train", _documents(10, 300), 300)
    path = tmp_path / entry["shards"][0]["path"]
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    end = members[-1].offset_data + (members[-1].size + 511) // 512 * 512
    size = {"mid_member": members[5].offset_data + 3, "member_boundary": members[6].offset,
            "before_end_marker": end}[cut]
    path.write_bytes(data[:size])
    with pytest.raises(DataError, match=str(path)):
        list(read_shard(path))


def test_damaged_header_is_not_a_short_valid_shard(tmp_path):
    # tarfile quietly stops at a header with a bad checksum; the reader must not return the documents before it.
    entry = write_split(tmp_path, "train", _documents(10, 300), 300)
    path = tmp_path / entry["shards"][0]["path"]
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[9].offset
    data = bytearray(path.read_bytes())
    data[offset + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=str(path)):
        list(read_shard(path))


def test_missing_member_is_named(tmp_path):
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("000000000.tokens.bin")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"\x01\x02\x03\x04"))
    with pytest.raises(DataError, match=r"bad\.tar.*no meta\.json"):
        list(read_shard(path))


def test_vocab_size_mismatch_is_refused_with_both_sizes():
    from memlm.data_pipeline.shards import check_vocab_size

    manifest = {"tokenizer": {"kind": "word", "vocab_size": 33278}}
    check_vocab_size(manifest, 33278)
    with pytest.raises(DataError) as err:
        check_vocab_size(manifest, 267735)
    assert "model.vocab_size=267735" in str(err.value) and "33278" in str(err.value)
