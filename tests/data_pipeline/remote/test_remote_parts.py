"""The parts of data_pipeline/remote/ on their own: data.path forms and their redaction, the config keys, the cache's
sha256 keys and LRU limit, the prefetcher's bound and its errors."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from memlm.data_pipeline.config import DataConfig, RemoteConfig, ShardLists
from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.remote.cache import ShardCache
from memlm.data_pipeline.remote.location import as_location, is_remote, path_or_url, redact
from memlm.data_pipeline.remote.prefetch import Prefetcher
from memlm.models.config import ConfigError
from memlm.trainer.config.run_config import load_config


def test_url_forms_name_their_files():
    http = as_location("https://user:pw@cdn.example/data/wt103?sig=abc123&exp=9")
    assert http.kind == "http" and is_remote("https://cdn.example/x") and not is_remote("/data/wt103")
    assert http.url("train/train-00000.tar") == \
        "https://user:pw@cdn.example/data/wt103/train/train-00000.tar?sig=abc123&exp=9"
    assert http.display("train/train-00000.tar") == \
        "https://***@cdn.example/data/wt103/train/train-00000.tar?sig=***&exp=***"
    assert as_location("s3://bucket/a/b/").url("manifest.json") == "s3://bucket/a/b/manifest.json"
    pipe = as_location("pipe:aws s3 cp s3://b/p/{} -")
    assert pipe.url("tokenizer/tokenizer.json") == "pipe:aws s3 cp s3://b/p/tokenizer/tokenizer.json -"
    assert as_location("/data/x").is_local and as_location("/data/x").url("manifest.json") == "/data/x/manifest.json"
    assert path_or_url("https://h/x") == "https://h/x" and path_or_url("rel/x") == Path("rel/x")


def test_a_file_name_with_shell_characters_is_quoted_in_a_pipe():
    assert as_location("pipe:cat /d/{}").url("a b/x;y.tar") == "pipe:cat /d/'a b/x;y.tar'"


@pytest.mark.parametrize("path, says", [
    ("pipe:cat /data/manifest.json", "has no {} where the file's path goes"),
    ("https:///nohost/x", "has no host"),
    ("s3://KEY:SECRETVALUE@bucket/x", "credentials belong in the AWS_* environment"),
    ("s3://bucket/x?token=SECRETVALUE", "is not s3://BUCKET/PREFIX"),
])
def test_malformed_urls_are_one_line_without_secrets(path, says):
    with pytest.raises(DataError, match=re.escape(says)) as caught:
        as_location(path)
    assert "SECRETVALUE" not in str(caught.value)


def test_secret_environment_values_are_redacted(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMIK7MDENGbPxRfiCY")
    monkeypatch.setenv("MY_API_TOKEN", "tok_5d41402abc4b2a76")
    monkeypatch.setenv("DEBUG_LEVEL", "1")  # short, not a secret: "1" must stay in text
    line = "pipe:curl -H 'Authorization: tok_5d41402abc4b2a76' -u k:wJalrXUtnFEMIK7MDENGbPxRfiCY http://h/{} 1"
    shown = redact(line)
    assert "tok_5d41402abc4b2a76" not in shown and "wJalrXUtnFEMIK7MDENGbPxRfiCY" not in shown
    assert shown.endswith(" 1")


def test_brace_lists_expand_in_order():
    location = as_location("https://h/x", DataConfig(shards=ShardLists(
        valid="https://cdn/v/valid-{0..1}.tar s3://b/extra-{a,b}.tar")))
    assert location.shard_urls("valid", ["p0", "p1", "p2", "p3"]) == [
        "https://cdn/v/valid-0.tar", "https://cdn/v/valid-1.tar", "s3://b/extra-a.tar", "s3://b/extra-b.tar"]
    assert location.shard_urls("train", ["train/t.tar"]) == ["https://h/x/train/t.tar"]


def test_config_keys_are_typed_and_checked(tmp_path):
    cfg = load_config("tiny/txl", ["data.path=s3://b/p", "data.remote.prefetch=4", "data.remote.cache_dir=/c",
                                   "data.shards.train=s3://b/p/train-{0..3}.tar"])
    assert (cfg.data.remote.prefetch, cfg.data.remote.cache_dir, cfg.data.shards.train) == \
        (4, "/c", "s3://b/p/train-{0..3}.tar")
    with pytest.raises(ConfigError, match="data.remote.prefech"):
        load_config("tiny/txl", ["data.remote.prefech=4"])
    with pytest.raises(ConfigError, match="data.remote.stall_s must be > 0"):
        load_config("tiny/txl", ["data.remote.stall_s=0"])
    with pytest.raises(ConfigError, match="data.shards.training"):  # splits are train, valid, test
        load_config("tiny/txl", ["data.shards.training=s3://b/p/x.tar"])


def test_cache_is_keyed_by_sha256_and_evicts_the_least_recently_used(tmp_path):
    import hashlib

    cache = ShardCache(tmp_path / "cache", limit_bytes=2500)
    blobs = {name: bytes([i]) * 1000 for i, name in enumerate("abc")}
    digests = {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}
    for age, name in enumerate("ab"):
        cache.put(digests[name], lambda dest, name=name: dest.write_bytes(blobs[name]))
        os.utime(cache.path(digests[name]), ns=(age * 10**9, age * 10**9))  # a used before b
    assert cache.get(digests["a"], 1000) is not None  # a is now the most recently used
    cache.put(digests["c"], lambda dest: dest.write_bytes(blobs["c"]))  # 3000 bytes > 2500: one must go
    assert cache.get(digests["b"], 1000) is None
    assert cache.get(digests["a"], 1000) is not None and cache.get(digests["c"], 1000) is not None
    cache.path(digests["a"]).write_bytes(blobs["b"])  # rotted on disk, same size: not served
    assert cache.get(digests["a"], 1000) is None and not cache.path(digests["a"]).exists()
    assert cache.get(hashlib.sha256(b"changed upstream").hexdigest(), 1000) is None


def test_prefetch_is_bounded_ordered_and_hands_over_its_errors(tmp_path):
    started: list[int] = []
    released: list[int] = []
    gate = threading.Event()

    def fetch(shard_id: int) -> Path:
        started.append(shard_id)
        gate.wait(5)
        if shard_id == 4:
            raise DataError("shard 4 failed")
        path = tmp_path / f"{shard_id}.tar"
        path.write_text(str(shard_id))
        return path

    prefetcher = Prefetcher(fetch, lambda shard_id, path: released.append(shard_id), depth=2)
    prefetcher.want([1, 2, 3, 4])
    time.sleep(0.2)
    assert started == [1]  # one transfer at a time, in reading order, at most `depth` wanted
    gate.set()
    assert prefetcher.take(1).read_text() == "1" and prefetcher.take(2).read_text() == "2"
    assert started == [1, 2]
    prefetcher.want([4, 5])
    with pytest.raises(DataError, match="shard 4 failed"):
        prefetcher.take(4)
    prefetcher.want([7])  # 5 dropped: its copy, once fetched, is released
    deadline = time.monotonic() + 5
    while 5 in started and 5 not in released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 5 not in started or 5 in released
    assert prefetcher.take(7).read_text() == "7"


def test_default_options_are_documented_values():
    assert RemoteConfig().prefetch == 2 and RemoteConfig().cache_dir == ""


def test_a_local_folders_tokenizer_is_the_folder_beside_its_manifest(tmp_path):
    """A local data folder, given as a relative or absolute Path, a str or a Location, names its own tokenizer
    folder (a Path's .root, "/" or "", is not the data folder: that mistake sent `memlm export` to ./tokenizer)."""
    from memlm.data_pipeline.remote.tokenizer_files import tokenizer_folder

    manifest = {"tokenizer": {"path": "tokenizer"}}
    absolute = tmp_path / "data"
    for given in (absolute, str(absolute), as_location(str(absolute))):
        assert tokenizer_folder(given, manifest) == absolute / "tokenizer"
    assert tokenizer_folder(Path("data/wt2"), manifest) == Path("data/wt2/tokenizer")
