"""A prepared data folder served over the network for the remote-data tests: over HTTP (ShardServer) or from S3
(moto's server behind a FaultProxy, which can break a transfer as ShardServer does), with its shards' faults armed."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from memlm.data_pipeline.shards import load_manifest
from support.http_shards import Fault, FaultProxy, ShardServer
from support.s3_server import S3Server

BUCKET, PREFIX = "memlm-ranks", "wikitext/data"


@contextmanager
def served(kind: str, data: Path):
    """(data.path, the environment a reader needs, the server whose `faults` and `requests` name the shards, the
    prefix of a shard's name there); kind "http" or "s3"."""
    if kind == "http":
        with ShardServer(data) as server:
            yield server.url, {}, server, ""
        return
    with S3Server() as s3:
        s3.upload(data, BUCKET, PREFIX)
        with FaultProxy(s3.endpoint) as proxy:
            yield f"s3://{BUCKET}/{PREFIX}", {**s3.env, "AWS_ENDPOINT_URL": proxy.url}, proxy, f"{BUCKET}/{PREFIX}/"


def arm(server, prefix: str, data: Path) -> None:
    """Every train shard breaks off halfway through on its next request (whichever reader reads it)."""
    for shard in load_manifest(data)["splits"]["train"]["shards"]:
        server.faults[prefix + shard["path"]] = Fault(reset_after=shard["bytes"] // 2)
