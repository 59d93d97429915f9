"""A prepared data folder in an S3 bucket (moto's server on loopback, tests/support/s3_server.py) read through s3fs
gives the local folder's token streams exactly, across a resume, also through a proxy that resets, refuses or stalls
(tests/support/http_shards.py FaultProxy); a missing object is one line without the keys."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memlm.data_pipeline.config import DataConfig, RemoteConfig
from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.remote import transports
from memlm.data_pipeline.remote.location import as_location
from memlm.data_pipeline.remote.tokenizer_files import tokenizer_folder
from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.stream import LaneStream
from memlm.data_pipeline.tokenizers import load_tokenizer
from support.http_shards import Fault, FaultProxy
from support.s3_server import S3Server
from support.training import make_data

LANES, SEG, SEED = 2, 32, 7
# Quick waits between attempts; a stall is 10 s without a byte (a busy CI machine must not look like a stall)
FAST = RemoteConfig(retries=2, stall_s=10.0, backoff_s=0.01, backoff_max_s=0.04, prefetch=2)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(the S3 server, the local folder) with the folder uploaded to s3://memlm-data/wikitext/prepared."""
    data = make_data(tmp_path_factory.mktemp("remote-s3"), shard_tokens=1000)
    with S3Server() as server:
        server.upload(data, "memlm-data", "wikitext/prepared")
        yield server, data


@pytest.fixture
def bucket(s3, monkeypatch):
    """(the local folder, its s3:// URL) with the server's AWS_* variables set."""
    server, data = s3
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    return data, "s3://memlm-data/wikitext/prepared"


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


FAULTS = {
    "reset mid-body": lambda size: Fault(reset_after=size // 2),
    "503 twice": lambda size: Fault(unavailable=2),
    "stall": lambda size: Fault(stall_after=size // 3, stall_s=3.0),
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_s3_fault_recovers_from_the_broken_byte(s3, monkeypatch, kind):
    server, data = s3
    chunk = 8192
    monkeypatch.setattr(transports, "CHUNK", chunk)  # several ranged reads per shard: a retry resumes mid-file
    shard = load_manifest(data)["splits"]["train"]["shards"][1]
    key = f"memlm-data/wikitext/prepared/{shard['path']}"
    fault = FAULTS[kind](shard["bytes"])
    want = take(stream(data), 160)  # one epoch: every shard once
    with FaultProxy(server.endpoint) as proxy:
        for name, value in {**server.env, "AWS_ENDPOINT_URL": proxy.url}.items():
            monkeypatch.setenv(name, value)
        proxy.faults[key] = fault
        # 1 s without a byte is a stall here (the injected one lasts 3 s); the other kinds leave the default's margin
        options = {**FAST.__dict__, "stall_s": 1.0 if kind == "stall" else FAST.stall_s}
        far = stream(as_location("s3://memlm-data/wikitext/prepared", DataConfig(remote=RemoteConfig(**options))))
        got = take(far, 160)
        retries = far.source.remote.fetcher.stats.retries
        del far  # its prefetch stops with it, before the proxy does
    assert all(np.array_equal(x, y) for a, b in zip(got, want) for x, y in zip(a, b)) and len(got) == len(want)
    assert retries == (2 if kind == "503 twice" else 1), proxy.requests
    starts = [start for path, start, status in proxy.requests if path == key and status in (200, 206)]
    chunks = list(range(0, shard["bytes"], chunk))
    if kind == "503 twice":
        assert starts[:len(chunks)] == chunks
    else:  # the ranged read that broke is asked for again from its own first byte; the earlier ones are not
        broken = (fault.reset_after if fault.reset_after is not None else fault.stall_after) // chunk * chunk
        at = chunks.index(broken)
        assert starts[:len(chunks) + 1] == chunks[:at + 1] + chunks[at:]
