"""`memlm train` with data.path at a loopback HTTP server whose URL carries a password and a token, each shard reset
mid-body on its first request: exactly the losses and validation of the same run on the local folder, and the
credentials never reach the console. (MLflow's side: tests/trainer/tracking/test_tracking_credentials.py.)"""

from __future__ import annotations

import json

import pytest

from memlm.data_pipeline.shards import load_manifest
from support.http_shards import Fault, ShardServer
from support.training import losses, make_data, subprocess_train


@pytest.mark.slow
def test_memlm_train_from_http_gives_the_local_losses(tmp_path):
    secret, token = "pw-0f9e8d7c6b5a", "tok-a1b2c3d4e5f6"
    data = make_data(tmp_path, shard_tokens=1000)
    common = {"train__steps": 6, "train__save_every": 0, "train__eval_every": 3, "train__eval_batches": 2}
    subprocess_train("txl", data, tmp_path / "local", **common)
    with ShardServer(data, auth=("trainer", secret)) as server:
        for split in ("train", "valid"):
            for shard in load_manifest(data)["splits"][split]["shards"]:  # whichever shard is read first breaks once
                server.faults[shard["path"]] = Fault(reset_after=shard["bytes"] // 2)
        url = f"http://trainer:{secret}@{server.url[len('http://'):]}/?token={token}"
        far = subprocess_train("txl", url, tmp_path / "remote", data__remote__backoff_s=0.01, **common)
    assert "retry 1 of 5" in far.stderr
    assert losses(tmp_path / "remote") == losses(tmp_path / "local") and len(losses(tmp_path / "local")) == 6
    for step in (3, 6):  # validation read the valid split over HTTP too
        remote, local = (json.loads((tmp_path / run / "eval" / f"step{step}.json").read_text())
                         for run in ("remote", "local"))
        assert remote == local
    for text in (far.stdout, far.stderr):
        assert secret not in text and token not in text
