"""`memlm train` with data.path at a loopback HTTP server (a shard reset mid-body on its first request) writes exactly
the losses of the same run from the local folder."""

from __future__ import annotations

import pytest

from memlm.data_pipeline.shards import load_manifest
from support.http_shards import Fault, ShardServer
from support.training import losses, make_data, subprocess_train


@pytest.mark.slow
def test_memlm_train_from_http_gives_the_local_losses(tmp_path):
    data = make_data(tmp_path, shard_tokens=1000)
    shards = load_manifest(data)["splits"]["train"]["shards"]
    common = {"train__steps": 6, "train__save_every": 0}
    local = subprocess_train("txl", data, tmp_path / "local", **common)
    with ShardServer(data) as server:
        for shard in shards:  # whichever shard the run reads first breaks once, halfway
            server.faults[shard["path"]] = Fault(reset_after=shard["bytes"] // 2)
        far = subprocess_train("txl", server.url, tmp_path / "remote", data__remote__backoff_s=0.01, **common)
    assert "retry 1 of 5" in far.stderr
    assert losses(tmp_path / "remote") == losses(tmp_path / "local")
    assert len(losses(tmp_path / "local")) == 6
    assert local.returncode == far.returncode == 0
