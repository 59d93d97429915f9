"""A prepared data folder in an S3 bucket (moto's server on loopback, tests/support/s3_server.py) read through s3fs
gives the local folder's token streams exactly, across a resume; a missing object is one line without the keys."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memlm.data_pipeline.config import DataConfig, RemoteConfig
from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.remote.location import as_location
from memlm.data_pipeline.remote.tokenizer_files import tokenizer_folder
from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.stream import LaneStream
from memlm.data_pipeline.tokenizers import load_tokenizer
from support.s3_server import S3Server
from support.training import make_data

LANES, SEG, SEED = 2, 32, 7
FAST = RemoteConfig(retries=2, stall_s=5.0, backoff_s=0.01, backoff_max_s=0.04, prefetch=2)


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """(the local folder, its s3:// URL) with the server's AWS_* variables set for the module's tests."""
    data = make_data(tmp_path_factory.mktemp("remote-s3"), shard_tokens=1000)
    with S3Server() as s3, pytest.MonkeyPatch.context() as env:
        s3.upload(data, "memlm-data", "wikitext/prepared")
        for name, value in s3.env.items():
            env.setenv(name, value)
        yield data, "s3://memlm-data/wikitext/prepared"


def take(stream: LaneStream, n: int) -> list[tuple[np.ndarray, ...]]:
    return [tuple(t.numpy().copy() for t in next(stream)) for _ in range(n)]


def stream(where, rank=0, world=1) -> LaneStream:
    return LaneStream(where, "train", rank=rank, world_size=world, lanes=LANES, seg_len=SEG, seed=SEED)


@pytest.mark.parametrize("world", [1, 2])
def test_s3_stream_equals_local_across_a_resume(bucket, world):
    data, url = bucket
    far = as_location(url, DataConfig(remote=FAST))
    for rank in range(world):
        want = take(stream(data, rank, world), 300)
        first = stream(far, rank, world)
        head = take(first, 140)
        state = json.loads(json.dumps(first.state_dict()))
        second = stream(far, rank, world)
        second.load_state_dict(state)
        got = head + take(second, 160)
        assert all(np.array_equal(x, y) for a, b in zip(got, want) for x, y in zip(a, b)) and len(got) == len(want)
        assert first.source.remote.fetcher.stats.files > 0  # read through s3fs, not from the local folder


def test_s3_manifest_and_tokenizer(bucket):
    data, url = bucket
    manifest = load_manifest(url)
    assert manifest == load_manifest(data)
    text = "a big red ball\n"
    assert np.array_equal(load_tokenizer(tokenizer_folder(url, manifest)).encode(text),
                          load_tokenizer(data / "tokenizer").encode(text))


def test_s3_missing_object_is_one_line_without_keys(bucket):
    _, url = bucket
    with pytest.raises(DataError) as caught:
        load_manifest(url.replace("prepared", "elsewhere"))
    message = str(caught.value)
    assert "s3://memlm-data/wikitext/elsewhere/manifest.json does not exist" in message and "\n" not in message
    assert S3Server.SECRET not in message and S3Server.KEY_ID not in message


def test_s3_url_with_credentials_is_refused_without_showing_them():
    with pytest.raises(DataError) as caught:
        as_location("s3://AKIAXX:secretvalue@bucket/prefix")
    assert "secretvalue" not in str(caught.value) and "AWS_*" in str(caught.value)
