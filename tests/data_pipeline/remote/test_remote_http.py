"""A prepared data folder read over HTTP (a real loopback server, tests/support/http_shards.py) gives the local
folder's token streams exactly, across a resume, also while the server resets, stalls or refuses; past the retry
budget, or for a damaged shard, one DataError line that names the URL without its credentials."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from memlm.data_pipeline.config import DataConfig, RemoteConfig, ShardLists
from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.remote.location import as_location
from memlm.data_pipeline.remote.tokenizer_files import tokenizer_folder
from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.stream import LaneStream
from memlm.data_pipeline.tokenizers import load_tokenizer
from support.http_shards import Fault, ShardServer
from support.training import make_data

LANES, SEG, SEED = 2, 32, 7
# Quick waits between attempts (10-40 ms); a stall is 10 s without a byte, so a busy CI machine never looks like one,
# except in the stall test (1 s, against a 3 s stall).
FAST = RemoteConfig(retries=3, stall_s=10.0, backoff_s=0.01, backoff_max_s=0.04, prefetch=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The training tests' corpus (bytes tokenizer), cut into ~9 train shards so readers and prefetch have work."""
    return make_data(tmp_path_factory.mktemp("remote-http"), shard_tokens=1000)


@pytest.fixture
def server(data):
    with ShardServer(data) as running:
        yield running


def remote(url: str, **options) -> object:
    fields = {**FAST.__dict__, **options}
    return as_location(url, DataConfig(remote=RemoteConfig(**fields)))


def take(stream: LaneStream, n: int) -> list[tuple[np.ndarray, ...]]:
    return [tuple(t.numpy().copy() for t in next(stream)) for _ in range(n)]


def stream(where, rank=0, world=1) -> LaneStream:
    return LaneStream(where, "train", rank=rank, world_size=world, lanes=LANES, seg_len=SEG, seed=SEED)


def resumed(where, rank: int, world: int, before: int, after: int) -> tuple[list, list, dict]:
    """`before` batches, the cursor through JSON, a fresh stream loaded from it, `after` more batches."""
    first = stream(where, rank, world)
    head = take(first, before)
    state = json.loads(json.dumps(first.state_dict()))
    second = stream(where, rank, world)
    second.load_state_dict(state)
    return head, take(second, after), state


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a, b):
            assert np.array_equal(x, y), f"batch {step} differs"


def shard_paths(data: Path, split: str = "train") -> list[str]:
    return [s["path"] for s in load_manifest(data)["splits"][split]["shards"]]


@pytest.mark.parametrize("world", [1, 2])
def test_http_stream_equals_local_across_a_resume(data, server, world):
    assert len(shard_paths(data)) >= 6
    for rank in range(world):
        want = take(stream(data, rank, world), 300)  # past an epoch of a rank's share: epoch 2's reshuffle too
        head, tail, state = resumed(remote(server.url), rank, world, 140, 160)
        assert_same(head + tail, want)
        local = stream(data, rank, world)
        take(local, 140)
        assert state == json.loads(json.dumps(local.state_dict()))  # the cursor itself is the local one


def test_http_evaluation_stream_equals_local(data, server):
    local = LaneStream(data, "valid", lanes=3, seg_len=SEG, mode="eval")
    far = LaneStream(remote(server.url), "valid", lanes=3, seg_len=SEG, mode="eval")
    assert far.num_batches == local.num_batches  # the lengths pre-pass over fetched shards
    assert_same(list(map(lambda b: tuple(t.numpy() for t in b), far)),
                list(map(lambda b: tuple(t.numpy() for t in b), local)))


FAULTS = {
    "reset mid-body": lambda size: Fault(reset_after=size // 2),
    "503 twice": lambda size: Fault(unavailable=2),
    "stall": lambda size: Fault(stall_after=size // 3, stall_s=3.0),
}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_fault_recovers_with_the_same_tokens(data, server, kind):
    target = shard_paths(data)[1]
    size = (data / target).stat().st_size
    server.faults[target] = FAULTS[kind](size)
    server.faults["manifest.json"] = Fault(unavailable=1)
    want = take(stream(data), 300)
    far = stream(remote(server.url, stall_s=1.0 if kind == "stall" else FAST.stall_s))
    assert_same(take(far, 300), want)
    retries = far.source.remote.fetcher.stats.retries
    assert retries == (2 if kind == "503 twice" else 1), server.requests
    if kind != "503 twice":  # the retry asked for the rest of the file only, from the byte where it broke
        resumed_at = [start for path, start, status in server.requests if path == target and status == 206]
        assert resumed_at and 0 < resumed_at[0] <= size // 2


def test_past_the_budget_one_line_without_credentials(data, capfd):
    secret, token = "pa55word-not-for-logs", "tok-9c1e77aa-secret"
    with ShardServer(data, auth=("reader", secret)) as server:
        host = server.url[len("http://"):]
        url = f"http://reader:{secret}@{host}/?token={token}"
        target = shard_paths(data)[0]
        server.faults[target] = Fault(unavailable=100)
        far = stream(remote(url, retries=2))  # the manifest is read with the Basic credentials of the URL
        with pytest.raises(DataError) as caught:
            take(far, 300)
    message = str(caught.value)
    assert "\n" not in message
    assert f"http://***@{host}/{target}?token=***" in message and "3 attempts" in message
    printed = capfd.readouterr()
    for text in (message, printed.out, printed.err):
        assert secret not in text and token not in text and "reader:" not in text
    assert "retry 2 of 2" in printed.err  # each retry said so, credentials redacted


def test_a_corrupted_or_truncated_shard_is_refused(data, tmp_path):
    served = tmp_path / "served"
    shutil.copytree(data, served)
    first, second = shard_paths(data)[:2]
    raw = bytearray((served / first).read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte changed inside a document's tokens or a header
    (served / first).write_bytes(bytes(raw))
    with ShardServer(served) as server:
        far = LaneStream(remote(server.url), "train", lanes=LANES, seg_len=SEG, shuffle=False)
        with pytest.raises(DataError, match=r"train-00000\.tar has sha256 .* the manifest says"):
            take(far, 300)
        (served / first).write_bytes((data / first).read_bytes())
        (served / second).write_bytes((data / second).read_bytes()[:1000])  # a short upload
        far = LaneStream(remote(server.url), "train", lanes=LANES, seg_len=SEG, shuffle=False)
        with pytest.raises(DataError, match=r"train-00001\.tar has 1000 bytes, the manifest says"):
            take(far, 300)
        assert far.source.remote.fetcher.stats.retries == 0  # no retry can mend a short file


def test_pipe_reads_the_folder_and_reruns_a_failed_command(data, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "serve.sh"
    # The first run per file sends 700 bytes and fails; the second sends the whole file (the first 700 skipped).
    script.write_text('m="$2/$(echo "$1" | tr / _)"\n'
                      'if [ ! -e "$m" ]; then touch "$m"; head -c 700 "$3/$1"; exit 3; fi\n'
                      'cat "$3/$1"\n')
    far = stream(remote(f"pipe:sh {script} {{}} {marks} {data}"))
    assert_same(take(far, 300), take(stream(data), 300))
    assert far.source.remote.fetcher.stats.retries == len(shard_paths(data))  # one per shard (prefetched too)


def test_shard_lists_in_brace_notation(data, server):
    count = len(shard_paths(data))
    listed = f"{server.url}/train/train-{{00000..{count - 1:05d}}}.tar"
    config = DataConfig(path=server.url, remote=FAST, shards=ShardLists(train=listed))
    assert_same(take(LaneStream.from_config(config, "train", mode="train", seg_len=SEG), 200),
                take(LaneStream.from_config(DataConfig(path=str(data)), "train", mode="train", seg_len=SEG), 200))
    # a local folder whose shards are listed elsewhere (here: the same files by absolute path) reads them the same way
    elsewhere = DataConfig(path=str(data), remote=FAST,
                           shards=ShardLists(train=f"{data}/train/train-{{00000..{count - 1:05d}}}.tar"))
    listed_stream = LaneStream.from_config(elsewhere, "train", mode="train", seg_len=SEG)
    assert listed_stream.source.remote is not None
    assert_same(take(listed_stream, 200),
                take(LaneStream.from_config(DataConfig(path=str(data)), "train", mode="train", seg_len=SEG), 200))
    short = DataConfig(path=server.url, shards=ShardLists(train=f"{server.url}/train/train-{{00000..00001}}.tar"))
    with pytest.raises(DataError, match=rf"data.shards.train names 2 shards .* lists {count} for split 'train'"):
        LaneStream.from_config(short, "train", mode="train", seg_len=SEG)


def test_cache_serves_the_second_stream_without_the_network(data, server, tmp_path):
    where = remote(server.url, cache_dir=str(tmp_path / "cache"))
    want = take(stream(data), 300)
    assert_same(take(stream(where), 300), want)
    shard_requests = sum(1 for path, _, _ in server.requests if path.endswith(".tar"))
    assert shard_requests == len(shard_paths(data))
    assert_same(take(stream(where), 300), want)
    assert sum(1 for path, _, _ in server.requests if path.endswith(".tar")) == shard_requests


def test_tokenizer_comes_from_the_url_and_is_checked(data, server, tmp_path):
    manifest = load_manifest(server.url)
    folder = tokenizer_folder(server.url, manifest)
    text = "the cat sat on a mat\n"
    assert np.array_equal(load_tokenizer(folder).encode(text), load_tokenizer(data / "tokenizer").encode(text))
    served = tmp_path / "served"
    shutil.copytree(data, served)
    (served / "tokenizer" / "tokenizer.json").write_text(
        (data / "tokenizer" / "tokenizer.json").read_text().replace("256", "257", 1))
    with ShardServer(served) as other, pytest.raises(DataError, match="from another prepare"):
        tokenizer_folder(other.url, load_manifest(other.url))
