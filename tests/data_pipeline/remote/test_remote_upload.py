"""`memlm prepare --out s3://...` against moto's S3 server on loopback (tests/support/s3_server.py): the uploaded
folder streams exactly the tokens of a local prepare and every object carries its sha256; an upload refused midway
(503s past the retry budget through tests/support/http_shards.py's FaultProxy) leaves no manifest, and the rerun
uploads only the files not yet there; a finished upload of other data is replaced only with --overwrite; no bucket,
no credentials, a denied write (403 through the proxy) and an http:// --out are one line without secrets."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from memlm import cli
from memlm.data_pipeline.config import DataConfig, RemoteConfig
from memlm.data_pipeline.format import DataError
from memlm.data_pipeline.prepare import prepare
from memlm.data_pipeline.remote import upload
from memlm.data_pipeline.remote.location import as_location
from memlm.data_pipeline.shards import load_manifest
from memlm.data_pipeline.stream import LaneStream
from support.http_shards import Fault, FaultProxy
from support.s3_server import S3Server
from support.training import make_data

BUCKET = "memlm-upload-bucket"  # "bucket" in its name: never read as a missing bucket
FAST = RemoteConfig(retries=1, stall_s=10.0, backoff_s=0.01, backoff_max_s=0.02, prefetch=0)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(the S3 server with BUCKET made, the local folder prepared from make_data's corpus in 1000-token shards)."""
    data = make_data(tmp_path_factory.mktemp("upload"), shard_tokens=1000)
    with S3Server() as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server, data


@pytest.fixture
def aws(s3, monkeypatch):
    server, data = s3
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    return server, data


def prepare_argv(data, out: str, *more: str) -> list[str]:
    return ["prepare", "--corpus", "textdir", "--input", str(data.parent / "corpus"), "--tokenizer", "bytes",
            "--workers", "1", "--shard-tokens", "1000", "--out", out, *more]


def epoch(where) -> list[np.ndarray]:
    stream = LaneStream(where, "train", rank=0, world_size=1, lanes=2, seg_len=32, seed=3, shuffle=False)
    return [next(stream)[0].numpy().copy() for _ in range(160)]


def local_files(data) -> dict[str, str]:
    """relative path -> sha256 of every file of the local folder (hashed here, not by memlm)."""
    return {p.relative_to(data).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(data.rglob("*")) if p.is_file()}


def test_prepare_to_s3_streams_the_local_tokens(aws, capsys):
    server, data = aws
    url = f"s3://{BUCKET}/first/data"
    assert cli.main(prepare_argv(data, url)) == 0
    assert f"uploaded {len(local_files(data))} file(s)" in capsys.readouterr().out
    client = server.client()
    for rel, digest in local_files(data).items():  # every object whole, its sha256 beside it
        head = client.head_object(Bucket=BUCKET, Key=f"first/data/{rel}")
        assert head["Metadata"]["sha256"] == digest and head["ContentLength"] == (data / rel).stat().st_size
    assert load_manifest(url) == load_manifest(data)
    far = as_location(url, DataConfig(remote=FAST))
    assert all(np.array_equal(a, b) for a, b in zip(epoch(far), epoch(data), strict=True))

    assert cli.main(prepare_argv(data, url)) == 0  # the same command again: nothing to send
    assert f"uploaded 0 file(s), 0.0 MB, to {url}, {len(local_files(data))} already there whole" in \
        capsys.readouterr().out

    other = prepare_argv(data, url)
    other[other.index("1000")] = "700"  # other shards: another manifest
    assert cli.main(other) == 2
    err = capsys.readouterr().err
    assert f"--out {url} already holds prepared data" in err and err.count("\n") == 1
    assert cli.main([*other, "--overwrite"]) == 0
    shards = len(load_manifest(data)["splits"]["train"]["shards"])
    assert len(load_manifest(url)["splits"]["train"]["shards"]) > shards  # the new manifest, smaller shards


def test_interrupted_upload_resumes_with_the_rest(aws, tmp_path):
    server, data = aws
    url = f"s3://{BUCKET}/resumed/data"
    staging = tmp_path / "staging"
    prepare("textdir", data.parent / "corpus", staging, tokenizer="bytes", workers=1, progress=False,
            shard_tokens=1000)
    names = list(local_files(staging))
    stuck = "train/train-00002.tar"
    with FaultProxy(server.endpoint) as proxy:
        proxy.faults[f"{BUCKET}/resumed/data/{stuck}"] = Fault(unavailable=FAST.retries + 1)  # past the budget
        with pytest.MonkeyPatch.context() as env:
            env.setenv("AWS_ENDPOINT_URL", proxy.url)
            with pytest.raises(DataError) as caught:
                upload.upload(staging, upload.check_destination(url, FAST), False)
            first = [key for method, key, status in proxy.writes if method == "PUT" and status == 200]
            proxy.writes.clear()
            done = upload.upload(staging, upload.check_destination(url, FAST), False)
            second = [key for method, key, status in proxy.writes if method == "PUT"]
    message = str(caught.value)
    assert f"cannot write {url}/{stuck}" in message and "rerun the same command" in message
    assert S3Server.SECRET not in message and "\n" not in message
    prefix = f"{BUCKET}/resumed/data/"
    manifest_at = names.index("manifest.json")
    order = [n for n in names if n != "manifest.json"] + [names[manifest_at]]  # the manifest last
    assert first == [prefix + n for n in order[:order.index(stuck)]]  # what went up before the refusal, no manifest
    assert second == [prefix + n for n in order[order.index(stuck):]]  # the rest only, the manifest last
    assert (done.sent, done.skipped) == (len(second), len(first))
    far = as_location(url, DataConfig(remote=FAST))
    assert all(np.array_equal(a, b) for a, b in zip(epoch(far), epoch(data), strict=True))


def test_no_bucket_is_one_line_without_keys(aws, capsys):
    _, data = aws
    assert cli.main(prepare_argv(data, "s3://no-such-bucket/data")) == 2
    err = capsys.readouterr().err
    assert err == ("memlm: error: s3://no-such-bucket: no such bucket (create it first, or check the --out URL and "
                   "AWS_ENDPOINT_URL)\n")


def test_a_denied_write_is_one_line_without_keys(aws, capsys):
    """The store refuses one object (403 AccessDenied through the proxy, as a bucket policy would): no retry, one
    line naming that object, no key in it, and no manifest written."""
    server, data = aws
    url = f"s3://{BUCKET}/denied/data"
    with FaultProxy(server.endpoint) as proxy, pytest.MonkeyPatch.context() as env:
        proxy.faults[f"{BUCKET}/denied/data/train/train-00001.tar"] = Fault(denied=10)
        env.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert cli.main(prepare_argv(data, url)) == 2
        refused = [status for _, key, status in proxy.writes if key.endswith("train-00001.tar")]
    err = capsys.readouterr().err
    assert err == (f"memlm: error: {url}/train/train-00001.tar: access denied to write it (check the AWS_* "
                   "credentials and the bucket's policy)\n")
    assert refused == [403]  # refused once, not retried
    listing = server.client().list_objects_v2(Bucket=BUCKET, Prefix="denied/data/").get("Contents", [])
    keys = {entry["Key"] for entry in listing}
    assert "denied/data/train/train-00000.tar" in keys and "denied/data/manifest.json" not in keys


def test_no_credentials_is_one_line(s3, monkeypatch, tmp_path, capsys):
    server, data = s3
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert cli.main(prepare_argv(data, f"s3://{BUCKET}/nokeys")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"memlm: error: no S3 credentials to reach s3://{BUCKET}: set AWS_ACCESS_KEY_ID") and \
        err.count("\n") == 1


def test_http_out_points_at_a_folder_and_a_web_server(tmp_path, capsys):
    assert cli.main(prepare_argv(tmp_path / "x", "http://user:pw@host/data")) == 2
    err = capsys.readouterr().err
    assert "python -m http.server" in err and "pw" not in err and err.count("\n") == 1
